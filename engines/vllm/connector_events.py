"""KV events from the connector: what the pool holds for this instance, on vLLM's own KV-event
stream (``--kv-events-config``), beside the events of vLLM's own prefix cache.

Events (vLLM 0.32's ``BlockStored`` / ``BlockRemoved``, ``vllm/distributed/kv_events.py``):

* ``BlockStored`` when a save of this instance's lands in the pool, and when a lookup finds
  blocks this instance had not announced (another instance stored them; this one can load
  them): ``block_hashes`` are the pool's block keys (32 bytes, the key spec:
  docs/key-spec.md), ``parent_block_hash`` the key before them, ``token_ids`` the blocks'
  tokens, ``extra_keys`` the request's ``cache_salt`` on the chain's first block (as vLLM
  puts it), ``lora_name`` the adapter.
* ``BlockRemoved`` when the connector learns the pool lost a block it announced: a lookup
  that stops before it, or a load that misses it (gone, failed checksum, another sequence's
  KV under the key). The connector never sees the store's own evictions as they happen:
  the loss is told when the next request of that prefix asks.

Every event has ``medium`` = the pool tier in vLLM's medium names (:data:`MEDIUM_OF_TIER`:
``CPU`` for ``dram``, ``STORAGE`` for ``ssd``, ``GPU`` for a store node's ``hbm``), so
routers that know vLLM's mediums (llm-d, Dynamo) weigh them as host and disk hits;
``ownership`` = ``kvstore`` and ``locality`` = ``REMOTE`` tell them apart from the
instance's own blocks. An announced block is remembered (:class:`PoolEventBook`, at most
``max_keys``) so that it is announced once per tier, and its loss once.

Tensor parallelism: each rank reports the saves it made (:class:`KVStoreKVEvents`); a
``BlockStored`` is published once every rank reported it, a ``BlockRemoved`` once any did.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

MEDIUM_OF_TIER = {"hbm": "GPU", "dram": "CPU", "ssd": "STORAGE"}
TIER_OF_MEDIUM = {m: t for t, m in MEDIUM_OF_TIER.items()}
OWNERSHIP = "kvstore"
LOCALITY = "REMOTE"
MAX_STEPS_WAITING = 64     # a save not every rank reported in this many steps is dropped


def saved(keys: Sequence[bytes], block_size: int) -> BlockStored:
    """A worker's report that the pool now holds ``keys`` (tokens and tier are the
    scheduler's to fill in: :meth:`PoolEventBook.take`)."""
    return BlockStored(block_hashes=list[bytes | int](keys), parent_block_hash=None, token_ids=[],
                       block_size=block_size, lora_id=None, medium=None, lora_name=None,
                       ownership=OWNERSHIP, locality=LOCALITY)


def lost(keys: Sequence[bytes]) -> BlockRemoved:
    """A worker's report that ``keys`` did not load (the pool no longer holds them whole)."""
    return BlockRemoved(block_hashes=list[bytes | int](keys), medium=None, ownership=OWNERSHIP, locality=LOCALITY)


class KVStoreKVEvents(KVConnectorKVEvents):
    """One step's reports of the ranks (vLLM sums them across ranks with
    :meth:`add_events` / :meth:`increment_workers`); the scheduler side keeps one across
    steps and pops those every rank agrees on (:meth:`pop_common_events`)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._counts: Counter[KVCacheEvent] = Counter()
        self._age: dict[KVCacheEvent, int] = {}
        self._num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._counts.update(events)
        for e in events:
            self._age.setdefault(e, 0)

    def aggregate(self) -> KVStoreKVEvents:
        common = self.pop_common_events()
        self._counts.clear()
        self._age.clear()
        self.add_events(common)
        self._num_workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._counts.elements())

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._counts.clear()
        self._age.clear()
        self._num_workers = 1

    def merge(self, other: KVConnectorKVEvents) -> KVStoreKVEvents:
        """Another step's reports (the scheduler side's running book)."""
        self._num_workers = max(self._num_workers, other.get_number_of_workers())
        self.add_events(other.get_all_events())
        return self

    def pop_common_events(self) -> list[KVCacheEvent]:
        """Saves every rank reported and losses any rank reported; saves still waiting for
        a rank grow a step older and are dropped after :data:`MAX_STEPS_WAITING` (that
        rank's save failed: the pool does not hold the block whole)."""
        out = []
        for e, n in list(self._counts.items()):
            if isinstance(e, BlockRemoved) or n >= self._num_workers:
                out.append(e)
            elif self._age[e] < MAX_STEPS_WAITING:
                self._age[e] += 1
                continue
            del self._counts[e]
            del self._age[e]
        return out

    def has_events(self) -> bool:
        return bool(self._counts)


class PoolEventBook:
    """The scheduler side's book of what it announced: key → tier, oldest first, at most
    ``max_keys`` (the oldest are forgotten: announced again if seen again); the blocks of
    saves in flight (key → its tokens, parent key, extras); the events ready to publish."""

    def __init__(self, block_size: int, put_tier: str = "dram", max_keys: int = 1 << 17) -> None:
        self.block_size = block_size
        self.put_tier = put_tier
        self.max_keys = max_keys
        self._announced: OrderedDict[bytes, str] = OrderedDict()
        self._saving: OrderedDict[bytes, tuple[list[int], bytes | None, str | None, str | None]] = OrderedDict()
        self._ready: list[KVCacheEvent] = []
        self._reports = KVStoreKVEvents()

    def looked_up(self, keys: Sequence[bytes], tiers: Sequence[str], tokens: Sequence[int],
                  salt: str | None, lora: str | None) -> None:
        """A lookup of a prompt's ``keys`` found ``len(tiers)`` blocks (in those tiers):
        announce the found ones not yet announced in that tier, and the loss of the first
        one past them when it was announced (a lookup stops at the first block missing: it
        tells nothing of the ones after it)."""
        found = len(tiers)
        news = [i for i in range(found) if self._announced.get(keys[i]) != tiers[i]]
        for tier in dict.fromkeys(tiers[i] for i in news):
            idx = [i for i in news if tiers[i] == tier]
            for run in _runs(idx):
                self._store([keys[i] for i in run], run[0], keys, tokens, tier, salt, lora)
        if found < len(keys):
            self._lose(keys[found:found + 1])

    def saving(self, keys: Sequence[bytes], first: int, tokens: Sequence[int], parent: bytes | None,
               salt: str | None, lora: str | None) -> None:
        """Blocks ``first ..`` of a prompt sent to the pool: what to announce once the
        workers report them saved."""
        bs = self.block_size
        for i, key in enumerate(keys):
            j = first + i
            self._saving[key] = (list(tokens[j * bs:(j + 1) * bs]), parent if i == 0 else keys[i - 1],
                                 salt if j == 0 else None, lora)
            self._saving.move_to_end(key)
        while len(self._saving) > self.max_keys:
            self._saving.popitem(last=False)

    def reported(self, events: KVConnectorKVEvents | None) -> None:
        """The workers' reports of one step (``KVConnectorOutput.kv_cache_events``)."""
        if isinstance(events, KVStoreKVEvents):
            self._reports.merge(events)

    def take(self) -> list[KVCacheEvent]:
        """The events to publish now (vLLM's ``take_events``)."""
        for e in self._reports.pop_common_events():
            if isinstance(e, BlockRemoved):
                self._lose([k for k in e.block_hashes if isinstance(k, bytes)])
                continue
            assert isinstance(e, BlockStored)
            run: list[bytes] = []
            tokens: list[int] = []
            head: tuple = (None, None, None)     # the run's (parent, salt, lora)
            for key in e.block_hashes:
                if not isinstance(key, bytes):
                    continue
                entry = self._saving.pop(key, None)
                if entry is None or self._announced.get(key) == self.put_tier:
                    continue
                if run and (entry[1] != run[-1] or entry[2] or entry[3] != head[2]):
                    self._emit_stored(run, head[0], tokens, self.put_tier, head[1], head[2])
                    run, tokens = [], []
                if not run:
                    head = (entry[1], entry[2], entry[3])
                run.append(key)
                tokens.extend(entry[0])
            if run:
                self._emit_stored(run, head[0], tokens, self.put_tier, head[1], head[2])
        ready, self._ready = self._ready, []
        return ready

    def reset(self) -> None:
        """Forget everything (vLLM's ``reset_cache``): blocks are announced anew."""
        self._announced.clear()
        self._saving.clear()
        self._ready.clear()
        self._reports.clear_events()

    # -- internals ----------------------------------------------------------------------
    def _store(self, keys: list[bytes], first: int, chain: Sequence[bytes], tokens: Sequence[int], tier: str,
               salt: str | None, lora: str | None) -> None:
        bs = self.block_size
        self._emit_stored(keys, chain[first - 1] if first else None, list(tokens[first * bs:(first + len(keys)) * bs]),
                          tier, salt if first == 0 else None, lora)

    def _emit_stored(self, keys: list[bytes], parent: bytes | None, tokens: list[int], tier: str,
                     salt: str | None, lora: str | None) -> None:
        extra: list[tuple | None] | None = None
        if salt:
            extra = [(salt,)] + [None] * (len(keys) - 1)
        self._ready.append(BlockStored(block_hashes=list[bytes | int](keys), parent_block_hash=parent, token_ids=tokens,
                                       block_size=self.block_size, lora_id=None, medium=MEDIUM_OF_TIER.get(tier, tier),
                                       lora_name=lora, extra_keys=extra, ownership=OWNERSHIP, locality=LOCALITY))
        for key in keys:
            self._announced[key] = tier
            self._announced.move_to_end(key)
        while len(self._announced) > self.max_keys:
            self._announced.popitem(last=False)

    def _lose(self, keys: Iterable[bytes]) -> None:
        by_tier: dict[str, list[bytes]] = {}
        for key in keys:
            tier = self._announced.pop(key, None)
            if tier is not None:
                by_tier.setdefault(tier, []).append(key)
        for tier, gone in by_tier.items():
            self._ready.append(BlockRemoved(block_hashes=list[bytes | int](gone), medium=MEDIUM_OF_TIER.get(tier, tier),
                                            ownership=OWNERSHIP, locality=LOCALITY))


def _runs(idx: list[int]) -> list[list[int]]:
    """Consecutive runs of sorted indexes: [0, 1, 3] → [[0, 1], [3]]."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
