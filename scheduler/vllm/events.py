"""vLLM instances' own prefix caches in the router: vLLM's KV events, translated into kvstore's
and applied to the router's :class:`~kvstore.events.replica.IndexReplica`.

A vLLM instance started with ``--kv-events-config`` (``enable_kv_cache_events``, publisher
``zmq``) publishes every change of its prefix cache on a ZeroMQ PUB socket: frames
``(topic, seq, payload)``, ``seq`` an 8-byte big-endian batch number from 0, ``payload`` a
msgpack ``KVEventBatch`` ``[ts, events, dp_rank]`` whose events are maps tagged by ``type``:
``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
``medium``, ``lora_name``, ``extra_keys``: per block, the untagged extras — the first block's
holds the request's ``cache_salt``), ``BlockRemoved`` (``block_hashes``, ``medium``) and
``AllBlocksCleared``; a ROUTER socket (``replay_endpoint``) re-sends buffered batches from a
seq on request (vLLM 0.32, ``vllm/distributed/kv_events.py``).

vLLM's block hashes are its own (seeded per process), so :class:`VLLMEventBridge` keys each
stored block as the kvstore connector does (:meth:`engines.vllm.layout.PagedLayout.keys`:
the tokens, the tenant's ``cache_salt``, chained from the parent block's key, which it
remembers per vLLM hash) and applies ``BlockStored``/``BlockRemoved``/``NodeCleared`` for
the instance (node = its engine id; tier ``hbm`` for vLLM's ``GPU`` medium — its paged
cache, wherever vLLM runs — and ``dram`` for ``CPU``, its offload tier). Blocks it cannot key
as the connector does are skipped, never guessed: a LoRA adapter, multimodal or prompt-
embedding extras, a block size other than the layout's, a partial block, a parent it never
saw (stored before it subscribed, or forgotten after a gap).

vLLM's offloading events (medium ``CPU``) carry no extras, hence no salt: they only add the
``dram`` tier to a block the GPU events keyed, never key one.

The kvstore connector's events (``ownership`` ``kvstore``: engines/vllm/connector_events.py)
ride the same stream and say what the pool holds for the instance; their block hashes are
the pool's keys already. They go to the instance's pool node (scheduler/vllm/pool_events.py).

Lost batches. A gap in ``seq`` is asked of the replay socket; what the replay cannot cover
(the batches left vLLM's buffer, or no replay endpoint) clears the instance's hits (one
``NodeCleared``; then the part of the gap the replay did return, up to the batch at hand,
is applied): a missed ``BlockRemoved`` would leave a hit vLLM no longer has, so the bridge
drops them all rather than route by a stale one. So do a ``seq`` that goes back, the
publisher's socket disconnecting (a stopped or restarted instance: what it publishes
before the subscriber reconnects is lost, and its numbers may run past ours), a batch that
cannot be read or applied whole, and more than ``max_blocks`` blocks held. Hits then come
back as vLLM stores blocks and re-announces the prefixes it reuses (``BlockStored`` with no
parent). A wrong hit costs a slower prefill (the instance recomputes or loads from the
pool), never wrong KV: the engine checks what it loads.

The events carry prompt tokens: the instance should publish on an ``ipc://`` endpoint in a
directory only its user can open (``kvstore up --engine vllm --vllm-prefix-caching`` does),
not on a TCP port (vLLM binds it on every interface, without authentication; the bridge
logs a warning for one).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from engines.vllm.layout import PagedLayout
from kvstore.errors import InvalidArgument
from kvstore.events.event import EventKind, KVEvent
from kvstore.events.replica import IndexReplica
from kvstore.index.keys import block_bytes
from scheduler.routing.engine_link import DTYPE_BYTES
from scheduler.vllm.event_socket import EventSubscriber
from scheduler.vllm.pool_events import OWNERSHIP, PoolNode

log = logging.getLogger(__name__)

TIER_OF_MEDIUM = {None: "hbm", "GPU": "hbm", "CPU": "dram"}


@dataclass(slots=True)
class BridgeStats:
    """Counts since the bridge started: ``batches`` applied, ``stored``/``removed`` blocks
    applied, ``skipped`` blocks it could not key (see the module docstring), ``bad``
    messages it could not parse, ``gaps`` in vLLM's seq, ``replayed`` batches recovered
    from the replay socket, ``clears`` of the instance's hits (AllBlocksCleared, a gap the
    replay could not cover, a restart)."""

    batches: int = 0
    stored: int = 0
    removed: int = 0
    skipped: int = 0
    bad: int = 0
    gaps: int = 0
    replayed: int = 0
    clears: int = 0


class VLLMEventBridge(EventSubscriber):
    """One vLLM instance's KV events into ``replica`` as node ``engine_id``.

    Args:
        engine_id: the instance's engine id in the router (``vllm-prefill-0``, ...).
        endpoint: its PUB endpoint (``ipc:///...`` or ``tcp://host:port``).
        layout: the connector's key layout (:attr:`scheduler.vllm.instances.VLLMModel.paged`).
        replica: the router's replica; the bridge numbers its own events (a new epoch, opened
            by ``NodeCleared`` at seq 1, when the bridge is made and whenever it drops the
            instance's hits).
        replay_endpoint: its replay (ROUTER) endpoint, None: gaps are never replayed.
        replay_timeout_s: how long one replay may take before the gap counts as unhealed.
        max_blocks: more blocks than this held at once is not a vLLM instance's cache (a
            hostile publisher): the hits are dropped.

    :meth:`receive` is the whole translation (safe beside the replica's readers);
    :meth:`start` runs a thread that subscribes and feeds it until :meth:`stop`, and drops
    the instance's hits whenever the publisher disconnects (a restarted instance's first
    batches are lost before the socket reconnects, and its numbers may run past ours).
    """

    def __init__(self, engine_id: str, endpoint: str, layout: PagedLayout, replica: IndexReplica, *,
                 replay_endpoint: str | None = None, replay_timeout_s: float = 2.0,
                 max_blocks: int = 1 << 22) -> None:
        self.engine_id = engine_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.max_blocks = max_blocks
        self.layout = layout
        self.replica = replica
        self.stats = BridgeStats()
        kv = layout.layout
        self._block_bytes = block_bytes(kv, kv.block_size, DTYPE_BYTES.get(kv.dtype, 4))
        # vLLM hash -> (our key, the tenant's cache_salt, tiers holding it)
        self._blocks: dict[Any, tuple[bytes, str | None, set[str]]] = {}
        self._last: int | None = None          # vLLM seq of the last batch applied
        self._epoch = 0
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pool = PoolNode(engine_id, replica, self._block_bytes)   # its connector's events
        self._new_epoch()

    @property
    def last_seq(self) -> int | None:
        """vLLM's seq of the last batch applied (None: none yet, or since a restart)."""
        return self._last

    # -- our side: events for the replica -------------------------------------------------
    def _emit(self, kind: EventKind, key: bytes = b"", tier: str = "") -> None:
        self._seq += 1
        self.replica.apply(KVEvent(self.engine_id, self._epoch, self._seq, kind, key, tier,
                                   self._block_bytes if key else 0, time.time()))

    def _new_epoch(self) -> None:
        """Forget everything the instance held (a fresh epoch opens with NodeCleared)."""
        self._epoch = max(time.time_ns(), self._epoch + 1)
        self._seq = 0
        self._blocks.clear()
        self._emit(EventKind.NODE_CLEARED)
        if self.pool.held:
            self.pool.clear()

    def _clear(self, why: str) -> None:
        self.stats.clears += 1
        log.info("vLLM KV events of %s: dropping its hits (%s)", self.engine_id, why)
        self._new_epoch()

    # -- vLLM's side ----------------------------------------------------------------------
    def receive(self, seq: int, payload: bytes) -> None:
        """One published batch (``seq``: vLLM's batch number). Not thread-safe: the
        subscriber thread calls it (call it yourself only while the bridge is stopped). A gap
        is replayed, else the instance's hits are dropped and what the replay kept of the gap
        is applied from there; a seq that goes back (a restarted instance) drops them too."""
        if self._last is not None and seq <= self._last:
            self._clear(f"its event seq went back from {self._last} to {seq}: restarted")
            self._last = None
        start = 0 if self._last is None else self._last + 1
        if seq > start:
            if self._last is not None:
                self.stats.gaps += 1
            got = self._replay(start, seq)
            whole = [s for s, _ in got] == list(range(start, seq))
            if not whole:
                if self._last is not None:
                    self._clear(f"batches {start}..{seq - 1} lost and not replayed")
                got = _contiguous_tail(got, seq)   # safe on an empty state: nothing removed is missed
            for _, body in got:
                self._apply(body)
            self.stats.replayed += len(got)
        self._apply(payload)
        self._last = seq

    def _apply(self, payload: bytes) -> None:
        """Apply one batch. A batch that cannot be read or applied whole (it may have held a
        removal) drops the instance's hits: never a stale one."""
        import msgspec
        try:
            batch = msgspec.msgpack.decode(payload)
            events = batch[1] if isinstance(batch, list) and len(batch) >= 2 else None
            if not isinstance(events, list):
                raise ValueError("not a batch [ts, events, ...]")
            for event in events:
                kind = event.get("type") if isinstance(event, dict) else None
                if kind == "BlockStored":
                    self._stored(event)
                elif kind == "BlockRemoved":
                    self._removed(event)
                elif kind == "AllBlocksCleared":
                    self._clear("AllBlocksCleared")
                else:                       # a kind this bridge does not know: not a removal
                    self.stats.bad += 1
        except Exception as exc:   # noqa: BLE001 - anything a publisher sends: hits dropped, bridge goes on
            self.stats.bad += 1
            log.warning("vLLM KV events of %s: a batch that cannot be applied (%s: %.200s)",
                        self.engine_id, type(exc).__name__, exc)
            self._clear("a batch that cannot be applied")
            return
        self.stats.batches += 1
        if len(self._blocks) + len(self.pool.held) > self.max_blocks:
            self._clear(f"more than {self.max_blocks} blocks held: not a vLLM instance's cache")

    def _stored(self, ev: dict) -> None:
        if ev.get("ownership") == OWNERSHIP:     # the connector's: the pool holds them
            applied, skipped = self.pool.stored(ev)
            self.stats.stored += applied
            self.stats.skipped += skipped
            return
        hashes = _hash_list(ev.get("block_hashes"))
        if not hashes:
            return
        tier = TIER_OF_MEDIUM.get(ev.get("medium"), None)
        if (tier is None or ev.get("lora_name") or ev.get("lora_id") is not None
                or ev.get("group_idx") not in (None, 0)):
            self.stats.skipped += len(hashes)
            return
        if tier != "hbm":
            # vLLM's offloading (CPU) events carry no extras, so no salt: they never key a
            # block, they only add a tier to one the GPU events keyed.
            for h in hashes:
                entry = self._blocks.get(h)
                if entry is None:
                    self.stats.skipped += 1
                else:
                    self._hold(entry, tier)
            return
        tokens = ev.get("token_ids")
        bs = self.layout.block_size
        extras = ev.get("extra_keys") or [None] * len(hashes)
        parent = ev.get("parent_block_hash")
        if (ev.get("block_size") != bs or not isinstance(tokens, list) or len(tokens) != len(hashes) * bs
                or not isinstance(extras, list) or len(extras) != len(hashes)):
            self.stats.skipped += len(hashes)   # another block size, a masked or partial block
            return
        salt: str | None
        prev: bytes | None
        if parent is None:
            ok, salt = _salt(extras[0])
            prev = None
            if not ok:
                self.stats.skipped += len(hashes)
                return
        else:
            known = self._blocks.get(parent)   # an unhashable parent raises: the batch is dropped
            if known is None:           # its parent was stored before we listened, or forgotten
                self.stats.skipped += len(hashes)
                return
            prev, salt = known[0], known[1]
        n = len(hashes)      # blocks up to the first with extras the connector's keys lack
        for i, extra in enumerate(extras):
            if extra and (i > 0 or parent is not None):
                n = i
                break
        try:
            keys = self.layout.keys(tokens[:n * bs], salt, prev) if n else []
        except InvalidArgument:         # token ids out of range: nothing the connector keys
            self.stats.skipped += len(hashes)
            return
        for h, key in zip(hashes, keys):
            entry = self._blocks.get(h)
            if entry is not None and entry[0] != key:   # the hash now names other tokens
                for old in entry[2]:
                    self._emit(EventKind.BLOCK_REMOVED, entry[0], old)
                entry = None
            if entry is None:
                entry = (key, salt, set())
                self._blocks[h] = entry
            self._hold(entry, tier)
        self.stats.skipped += len(hashes) - n

    def _hold(self, entry: tuple[bytes, str | None, set[str]], tier: str) -> None:
        """The instance holds ``entry``'s block in ``tier`` (news to the replica once)."""
        if tier not in entry[2]:
            entry[2].add(tier)
            self._emit(EventKind.BLOCK_STORED, entry[0], tier)
            self.stats.stored += 1

    def _removed(self, ev: dict) -> None:
        if ev.get("ownership") == OWNERSHIP:
            self.stats.removed += self.pool.removed(ev)
            return
        tier = TIER_OF_MEDIUM.get(ev.get("medium"), None)
        if tier is None or ev.get("group_idx") not in (None, 0):
            return
        for h in _hash_list(ev.get("block_hashes")):
            entry = self._blocks.get(h)
            if entry is None or tier not in entry[2]:
                continue
            entry[2].discard(tier)
            if not entry[2]:
                del self._blocks[h]
            self._emit(EventKind.BLOCK_REMOVED, entry[0], tier)
            self.stats.removed += 1

def _hash_list(hashes: Any) -> list[int | bytes]:
    """vLLM's block hashes (ints or bytes). Raises ValueError for anything else."""
    if hashes is None:
        return []
    if not isinstance(hashes, list) or not all(type(h) in (int, bytes) for h in hashes):
        raise ValueError("block_hashes must be a list of ints or bytes")
    return hashes


def _contiguous_tail(got: list[tuple[int, bytes]], upto: int) -> list[tuple[int, bytes]]:
    """The batches of ``got`` (ascending seqs) that run without a hole up to ``upto - 1``."""
    tail: list[tuple[int, bytes]] = []
    expect = upto - 1
    for seq, body in reversed(got):
        if seq != expect:
            break
        tail.append((seq, body))
        expect -= 1
    return tail[::-1]


def _salt(extra: Any) -> tuple[bool, str | None]:
    """(keyable, cache_salt) from the first block's extras: no extras (True, None), one
    string (True, it), anything else — LoRA, multimodal or embedding extras, which the
    connector's keys do not cover — (False, None)."""
    if not extra:
        return True, None
    if isinstance(extra, (list, tuple)) and len(extra) == 1 and isinstance(extra[0], str):
        return True, extra[0] or None
    return False, None


def start_bridges(endpoints: dict[str, tuple[str, str | None]], layout: PagedLayout,
                  replica: IndexReplica) -> list[VLLMEventBridge]:
    """A running bridge per instance: ``endpoints`` maps engine id → (PUB endpoint, replay
    endpoint or None)."""
    return [VLLMEventBridge(engine_id, pub, layout, replica, replay_endpoint=replay).start()
            for engine_id, (pub, replay) in endpoints.items()]


def stop_bridges(bridges: Iterable[VLLMEventBridge]) -> None:
    for bridge in bridges:
        bridge.stop()
