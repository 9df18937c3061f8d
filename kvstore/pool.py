"""The KV pool: tiers in order (fastest first), the prefix index, LRU eviction with demotion
to the next tier, and promotion on a lower-tier hit.

Invariants (DESIGN.md §4):
- a key is in the index for (node, tier) iff the tier holds its complete bytes;
- within one prefix chain, tails are evicted before heads (chains are touched tail-first);
- a put of an existing key is success and changes nothing.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import xxhash

from kvstore.errors import CapacityError, IntegrityError, InvalidArgument
from kvstore.index.prefix_index import PrefixIndex
from kvstore.tiers.base import Tier


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    integrity_failures: int = 0


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's figures; bytes and block counts."""

    name: str
    device: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    demotions: int
    promotions: int
    integrity_failures: int


@dataclass(frozen=True, slots=True)
class PutResult:
    key: bytes
    ok: bool
    existed: bool = False
    error: str = ""


def checksum_of(data: bytes | memoryview) -> int:
    """xxh3_64 of a block's bytes: the checksum taken at put and verified on reads."""
    return xxhash.xxh3_64_intdigest(data)


class KVPool:
    """Tiers + index + eviction for one store node. Thread-safe (one lock)."""

    def __init__(self, tiers: Sequence[Tier], node_id: str = "node-0",
                 index: PrefixIndex | None = None, promote_on_hit: bool = True) -> None:
        if not tiers:
            raise InvalidArgument("a pool needs at least one tier")
        self.tiers = list(tiers)
        self.node_id = node_id
        self.index = index if index is not None else PrefixIndex()
        self.promote_on_hit = promote_on_hit
        self._lock = threading.RLock()
        self._lru: dict[str, OrderedDict[bytes, int]] = {t.name: OrderedDict() for t in self.tiers}
        self._counters = {t.name: TierCounters() for t in self.tiers}
        for tier in self.tiers:  # blocks a persistent tier kept across a restart
            for key, size in tier.keys():
                self._lru[tier.name][key] = size
                self.index.add(key, node_id, tier.name, size)

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise InvalidArgument(f"no tier {name!r} on this node; tiers: {[t.name for t in self.tiers]}")

    # -- writes ---------------------------------------------------------------------------
    def put(self, key: bytes, data: bytes | memoryview, checksum: int | None = None) -> PutResult:
        """Store a block in the top tier (evicting/demoting as needed).

        Raises IntegrityError when ``checksum`` is given and does not match ``data``.
        """
        if isinstance(data, memoryview) and data.itemsize != 1:
            data = data.cast("B")
        if checksum is None:
            checksum = checksum_of(data)
        elif checksum_of(data) != checksum:
            raise IntegrityError(f"block {key.hex()[:16]}: bytes do not match the sent checksum")
        with self._lock:
            if key in self.index and self._holds(key):
                return PutResult(key, True, existed=True)
            try:
                self._store(0, key, data, checksum)
            except (CapacityError, OSError) as exc:
                return PutResult(key, False, error=str(exc))
            return PutResult(key, True)

    def put_chain(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[PutResult]:
        """Put a prefix chain (head first); results per block. Recency is set tail-first so
        eviction takes the chain's tail before its head."""
        results = [self.put(key, data) for key, data in items]
        self._touch_chain([key for key, _ in items])
        return results

    def _holds(self, key: bytes) -> bool:
        return any(key in self._lru[t.name] for t in self.tiers)

    def _store(self, level: int, key: bytes, data: bytes | memoryview, checksum: int) -> None:
        tier = self.tiers[level]
        if len(data) > tier.capacity_bytes:
            raise CapacityError(f"{tier.name}: a {len(data)}-byte block exceeds its capacity "
                                f"of {tier.capacity_bytes} bytes")
        self._make_room(level, len(data))
        tier.put(key, data, checksum)
        self._lru[tier.name][key] = len(data)
        self.index.add(key, self.node_id, tier.name, len(data), checksum)

    def _make_room(self, level: int, size: int) -> None:
        tier = self.tiers[level]
        lru = self._lru[tier.name]
        while not tier.fits(size):
            if not lru:
                raise CapacityError(f"{tier.name}: cannot free {size} bytes")
            victim, _ = lru.popitem(last=False)
            self._evict_one(level, victim)

    def _evict_one(self, level: int, key: bytes) -> int:
        """Drop ``key`` from tier ``level``, demoting it to the next tier if there is one."""
        tier = self.tiers[level]
        self._lru[tier.name].pop(key, None)
        counters = self._counters[tier.name]
        if level + 1 < len(self.tiers) and key not in self._lru[self.tiers[level + 1].name]:
            data = tier.get(key)
            entry = self.index.entry(key)
            if data is not None and entry is not None:
                try:  # the checksum taken at put travels with the block
                    self._store(level + 1, key, data, entry.checksum)
                    counters.demotions += 1
                except (CapacityError, OSError):
                    pass
        self.index.remove(key, self.node_id, tier.name)
        freed = tier.remove(key)
        counters.evictions += 1
        return freed

    # -- reads ----------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        """The block's bytes from the fastest tier holding it, or None on a miss (a block
        failing its checksum is dropped, counted and reported as a miss)."""
        with self._lock:
            for level, tier in enumerate(self.tiers):
                counters = self._counters[tier.name]
                if key not in self._lru[tier.name]:
                    counters.misses += 1
                    continue
                try:
                    data = tier.get(key)
                except IntegrityError:
                    counters.integrity_failures += 1
                    self._lru[tier.name].pop(key, None)
                    self.index.remove(key, self.node_id, tier.name)
                    continue
                if data is None:
                    counters.misses += 1
                    continue
                counters.hits += 1
                self._lru[tier.name].move_to_end(key)
                if level > 0 and self.promote_on_hit:
                    self._promote(level, key, data)
                return data
            return None

    def get_chain(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Get each key (None for misses); recency is set tail-first, as for put_chain."""
        out = [self.get(k) for k in keys]
        self._touch_chain([k for k, d in zip(keys, out) if d is not None])
        return out

    def _promote(self, level: int, key: bytes, data: bytes) -> None:
        entry = self.index.entry(key)
        try:
            self._store(0, key, data, entry.checksum if entry else checksum_of(data))
            self._counters[self.tiers[level].name].promotions += 1
        except (CapacityError, OSError):
            pass

    def _touch_chain(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in reversed(list(keys)):
                for tier in self.tiers:
                    lru = self._lru[tier.name]
                    if key in lru:
                        lru.move_to_end(key)

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str]]:
        """Longest prefix of ``keys`` this node holds, and the fastest tier of each of those
        blocks. Changes no recency, renews nothing."""
        with self._lock:
            match = self.index.match(keys, nodes=[self.node_id])
            tiers = list(match.per_node.get(self.node_id, ()))
            return len(tiers), tiers

    # -- admin ----------------------------------------------------------------------------
    def evict(self, tier_name: str, nbytes: int) -> tuple[int, int]:
        """Evict at least ``nbytes`` from ``tier_name``, least recently used first (demoting
        to the next tier). Returns (bytes, blocks) evicted."""
        with self._lock:
            level = self.tiers.index(self.tier(tier_name))
            lru = self._lru[tier_name]
            freed = blocks = 0
            while freed < nbytes and lru:
                victim = next(iter(lru))
                freed += self._evict_one(level, victim)
                blocks += 1
            return freed, blocks

    def remove(self, key: bytes) -> int:
        """Drop every copy of ``key`` on this node; returns bytes freed."""
        with self._lock:
            freed = 0
            for tier in self.tiers:
                if self._lru[tier.name].pop(key, None) is not None:
                    self.index.remove(key, self.node_id, tier.name)
                    freed += tier.remove(key)
            return freed

    def stats(self) -> list[TierStats]:
        with self._lock:
            return [TierStats(t.name, t.device, t.capacity_bytes, t.used_bytes, len(self._lru[t.name]),
                              **vars_of(self._counters[t.name])) for t in self.tiers]

    def close(self) -> None:
        with self._lock:
            for tier in self.tiers:
                tier.close()


def vars_of(counters: TierCounters) -> dict[str, int]:
    return {f: getattr(counters, f) for f in TierCounters.__dataclass_fields__}
