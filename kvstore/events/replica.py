"""The scheduler side of KV events: a replica of the store nodes' indexes kept current by
their events (docs/architecture.md §3.5).

:class:`IndexReplica` reads events from a channel in a background thread and applies them to
its own :class:`PrefixIndex`. It tracks, per node, the epoch and the last sequence number
applied. An event that is not the next one of its node — a gap (a lost event, a reader that
fell behind the stream's bound) or the middle of an epoch it has not seen (it started late)
— makes it fetch a snapshot of that node's index from ``snapshot_source`` and continue from
the snapshot's seq. ``NodeCleared`` drops the node's hits at once.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.events.channel import EventChannel
from kvstore.events.event import EventKind, KVEvent, NodeSnapshot
from kvstore.index.prefix_index import PrefixIndex, PrefixMatch

log = logging.getLogger(__name__)
SnapshotSource = Callable[[str], NodeSnapshot]


@dataclass(frozen=True, slots=True)
class NodeState:
    """Where the replica stands for one node: the epoch and the last seq it reflects."""

    epoch: int
    seq: int


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    events: int          # events applied
    stale: int           # events skipped as already reflected (older seq or epoch)
    gaps: int            # sequence gaps detected
    resyncs: int         # snapshots applied
    resync_failures: int


class IndexReplica:
    """A replica of the nodes' indexes fed by ``channel``.

    Args:
        channel: where the nodes publish (``make_channel(redis_url)``).
        snapshot_source: node id → :class:`NodeSnapshot` (e.g. ``StoreClient.snapshot``);
            without one a gap is logged and the replica carries on from the next event.
        from_start: read the channel from its oldest kept event (default) or only new ones.

    Thread-safe: :meth:`match`, :meth:`longest_prefix` and :meth:`hits` take the replica's
    lock; ``index`` itself must only be read under ``replica.lock``.
    """

    def __init__(self, channel: EventChannel, snapshot_source: SnapshotSource | None = None, *,
                 from_start: bool = True, lag_window: int = 100_000) -> None:
        self.channel = channel
        self.snapshot_source = snapshot_source
        self.index = PrefixIndex()
        self.lock = threading.RLock()
        self._nodes: dict[str, NodeState] = {}
        self._retry_at: dict[str, float] = {}       # node → no snapshot attempt before this
        self.retry_s = 1.0
        self._cursor = channel.start_cursor(from_start)
        self._lags: deque[float] = deque(maxlen=lag_window)
        self._counts = dict(events=0, stale=0, gaps=0, resyncs=0, resync_failures=0)
        self._applied = threading.Condition(self.lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> IndexReplica:
        """Consume events in a background thread until :meth:`stop`."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="kv-index-replica", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> IndexReplica:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(block_s=0.1)
            except Exception as exc:  # noqa: BLE001 - keep consuming whatever one read raised
                log.warning("KV event replica: reading %s failed: %s", self.channel.description, exc)
                self._stop.wait(0.5)

    def poll(self, block_s: float = 0.0, count: int = 1000) -> int:
        """Read and apply the events available now (waiting up to ``block_s`` for the first).
        Returns how many were read. For callers that drive the replica without a thread."""
        self._cursor, events = self.channel.read(self._cursor, count, block_s)
        for event in events:
            self.apply(event)
        return len(events)

    # -- queries (locked) --------------------------------------------------------------------
    def match(self, keys: Sequence[bytes], nodes: Iterable[str] | None = None) -> PrefixMatch:
        """:meth:`PrefixIndex.match` over the replicated nodes."""
        with self.lock:
            return self.index.match(keys, nodes)

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        with self.lock:
            return self.index.longest_prefix(keys)

    def hits(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Node id → blocks of the longest prefix of ``keys`` it holds (absent: 0)."""
        with self.lock:
            return {n: len(t) for n, t in self.index.match(keys).per_node.items()}

    def node_state(self, node: str) -> NodeState | None:
        with self.lock:
            return self._nodes.get(node)

    def stats(self) -> ReplicaStats:
        with self.lock:
            return ReplicaStats(**self._counts)

    def lags_s(self) -> list[float]:
        """Seconds from each applied event's index change to its application, oldest first."""
        with self.lock:
            return list(self._lags)

    def wait_for(self, node: str, seq: int, timeout_s: float = 5.0, epoch: int | None = None) -> bool:
        """Wait until the replica reflects ``node`` at least up to ``seq`` (of ``epoch``, or of
        any epoch when None; a later epoch counts as past). False on timeout."""
        def reached(st: NodeState | None) -> bool:
            if st is None:
                return False
            if epoch is None or st.epoch == epoch:
                return st.seq >= seq
            return st.epoch > epoch

        with self._applied:
            return self._applied.wait_for(lambda: reached(self._nodes.get(node)), timeout_s)

    # -- changes -----------------------------------------------------------------------------
    def drop_node(self, node: str) -> int:
        """Forget ``node`` (it left or its membership expired); its hits drop at once.
        Returns the blocks it held. A later event from it resynchronises it."""
        with self.lock:
            self._nodes.pop(node, None)
            return self.index.clear_node(node)

    def sync(self, node: str) -> bool:
        """Replace ``node``'s entries with a snapshot from ``snapshot_source``. False when
        there is no source (nothing changes) or the snapshot fails (the node is dropped, so
        it gives no stale hits, and not asked again for ``retry_s`` seconds)."""
        if self.snapshot_source is None:
            return False
        try:
            snap = self.snapshot_source(node)
        except Exception as exc:  # noqa: BLE001 - an unreachable node: drop it, retry later
            log.warning("KV event replica: snapshot of node %s failed, dropping it: %s", node, exc)
            with self.lock:
                self._counts["resync_failures"] += 1
                self._retry_at[node] = time.monotonic() + self.retry_s
                self._nodes.pop(node, None)
                self.index.clear_node(node)
            return False
        with self._applied:
            st = self._nodes.get(node)
            if st is not None and (st.epoch, st.seq) >= (snap.epoch, snap.seq):
                return True  # events already took the replica past this snapshot
            self.index.clear_node(node)
            for key, tier, size in snap.entries:
                self.index.add(key, node, tier, size)
            self._nodes[node] = NodeState(snap.epoch, snap.seq)
            self._retry_at.pop(node, None)
            self._counts["resyncs"] += 1
            self._applied.notify_all()
        log.info("KV event replica: node %s resynchronised from a snapshot at seq %d (%d copies)",
                 node, snap.seq, len(snap.entries))
        return True

    def apply(self, event: KVEvent) -> None:
        """Apply one event in its node's order; on a gap, resynchronise the node from a
        snapshot (fetched outside the lock) and go on from there."""
        if not self._apply_locked(event):
            return
        with self.lock:
            if time.monotonic() < self._retry_at.get(event.node, 0.0):
                return  # a snapshot of this node failed just now: no hits from it until one works
            self._counts["gaps"] += 1
        log.info("KV event replica: node %s at %s, got seq %d of epoch %d: resynchronising",
                 event.node, self.node_state(event.node), event.seq, event.epoch)
        if self.sync(event.node):
            self._apply_locked(event)  # now stale (the snapshot covers it) or the next one
        elif self.snapshot_source is None:  # best effort: carry on from here
            log.warning("KV event replica: no snapshot source; node %s may be stale", event.node)
            with self.lock:
                self._nodes[event.node] = NodeState(event.epoch, event.seq - 1)
            self._apply_locked(event)

    def _apply_locked(self, event: KVEvent) -> bool:
        """Apply ``event`` if it is its node's next one. Returns True when it reveals a gap."""
        with self._applied:
            st = self._nodes.get(event.node)
            if st is not None and event.epoch < st.epoch:
                self._counts["stale"] += 1
                return False
            if st is None or event.epoch > st.epoch:
                if event.seq != 1:  # joined an epoch in its middle: its start is not here
                    return True
                st = NodeState(event.epoch, 0)  # seq 1 is NodeCleared: the node starts empty
            if event.seq <= st.seq:
                self._counts["stale"] += 1
                return False
            if event.seq > st.seq + 1:
                return True
            if event.kind is EventKind.BLOCK_STORED:
                self.index.add(event.key, event.node, event.tier, event.size)
            elif event.kind is EventKind.BLOCK_REMOVED:
                self.index.remove(event.key, event.node, event.tier)
            else:
                self.index.clear_node(event.node)
            self._nodes[event.node] = NodeState(event.epoch, event.seq)
            self._counts["events"] += 1
            self._lags.append(time.time() - event.ts)
            self._applied.notify_all()
            return False


def store_snapshot_source(addresses: Mapping[str, str], auth_token: str | None = None,
                          timeout_s: float = 10.0) -> SnapshotSource:
    """A snapshot source over store nodes' gRPC APIs (``StoreClient.snapshot``), given
    node id → ``host:port``. Raises KeyError for a node with no address."""
    from kvstore.client import StoreClient  # gRPC only where snapshots are fetched

    clients: dict[str, StoreClient] = {}

    def fetch(node: str) -> NodeSnapshot:
        if node not in addresses:
            raise KeyError(f"no address known for store node {node!r}")
        client = clients.get(node)
        if client is None:
            client = clients[node] = StoreClient(addresses[node], auth_token=auth_token, timeout_s=timeout_s)
        return client.snapshot()
    return fetch
