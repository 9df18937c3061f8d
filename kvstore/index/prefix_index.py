"""The prefix index: block key → where the block lives (node, tier) and its metadata.

The index is the truth about what can be read: the pool adds a location only after a block
is completely written in a tier, and removes it before the bytes are freed.

Layout (about 200 bytes per indexed block, keys included; ``benchmarks/bench_index.py``
measures it): one dict ``key → slot``; per slot, the key (a list of references to the same
key objects), a bitmask of locations (a list of ints, one bit per interned (node, tier)
pair; a bitmask under 257 is a cached small int and costs only its reference) and the
metadata in preallocated numpy arrays (size, checksum, last access, hits). Freed slots are
reused through a free list.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.tiers import registry

# Tiers by speed, fastest first (kvstore/tiers/registry.py); a tier not registered ranks
# after these, in order of appearance.
TIER_ORDER = tuple(registry.names())


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """A read-only view of one indexed block. ``locations``: node id → its tiers, fastest
    first; ``size`` in bytes; ``last_access`` in ``time.monotonic()`` seconds."""

    size: int
    checksum: int
    last_access: float
    hits: int
    locations: dict[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The answer to a chain lookup.

    ``blocks``: longest prefix of the chain held anywhere (blocks).
    ``per_node``: node id → tier of each block of that node's longest prefix, head first
    (the fastest tier where the node holds several copies).
    """

    blocks: int
    per_node: dict[str, tuple[str, ...]]

    def node_blocks(self, node: str) -> int:
        return len(self.per_node.get(node, ()))


class PrefixIndex:
    """Maps block keys to locations. Not thread-safe: the owner holds its lock. Keys are
    opaque ``bytes``: those of :func:`kvstore.index.keys.block_keys` or any a client chose.

    Invariants (checked by :meth:`check_integrity`): a key is indexed iff at least one
    (node, tier) copy of it exists; ``node_blocks(n)`` counts the keys ``n`` holds a copy
    of; a free slot holds no key and no location.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._slots: dict[bytes, int] = {}
        self._keys: list[bytes | None] = []
        self._locs: list[int] = []
        self._free: list[int] = []
        cap = max(16, capacity)
        self._size = np.zeros(cap, dtype=np.int64)
        self._checksum = np.zeros(cap, dtype=np.uint64)
        self._last = np.zeros(cap, dtype=np.float64)
        self._hits = np.zeros(cap, dtype=np.uint32)
        # Interned (node, tier) pairs: one bit each.
        self._bit: dict[tuple[str, str], int] = {}
        self._bit_owner: list[tuple[int, str]] = []      # bit → (node index, tier)
        self._node_ids: dict[str, int] = {}
        self._node_names: list[str] = []
        self._node_mask: list[int] = []                  # node index → its bits
        self._node_count: list[int] = []                 # node index → keys it holds
        self._fastest: list[dict[int, str]] = []         # node index → {its bits of a key: tier}

    # -- size and membership -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def nodes(self) -> list[str]:
        """Nodes holding at least one block."""
        return [n for i, n in enumerate(self._node_names) if self._node_count[i]]

    def node_blocks(self, node: str) -> int:
        """Blocks ``node`` holds a copy of (in any tier)."""
        i = self._node_ids.get(node)
        return 0 if i is None else self._node_count[i]

    # -- writes ------------------------------------------------------------------------------
    def add(self, key: bytes, node: str, tier: str, size: int = 0, checksum: int = 0) -> bool:
        """Record a copy of ``key`` on (node, tier). ``size`` (bytes) and ``checksum`` are
        set when the key is new. Returns True if the copy was not already recorded."""
        bit = self._bit.get((node, tier))
        if bit is None:
            bit = self._intern(node, tier)
        flag = 1 << bit
        slot = self._slots.get(key)
        if slot is None:
            slot = self._new_slot(key)
            self._size[slot] = size
            self._checksum[slot] = checksum
            self._last[slot] = time.monotonic()
            self._locs[slot] = flag
            self._node_count[self._bit_owner[bit][0]] += 1
            return True
        bits = self._locs[slot]
        if bits & flag:
            return False
        node_index = self._bit_owner[bit][0]
        if not bits & self._node_mask[node_index]:
            self._node_count[node_index] += 1
        self._locs[slot] = bits | flag
        return True

    def remove(self, key: bytes, node: str, tier: str) -> bool:
        """Drop one copy; the key stays visible while another copy exists. True if dropped."""
        bit = self._bit.get((node, tier))
        slot = self._slots.get(key)
        if bit is None or slot is None:
            return False
        bits = self._locs[slot]
        flag = 1 << bit
        if not bits & flag:
            return False
        bits ^= flag
        node_index = self._bit_owner[bit][0]
        if not bits & self._node_mask[node_index]:
            self._node_count[node_index] -= 1
        if bits:
            self._locs[slot] = bits
        else:
            self._free_slot(key, slot)
        return True

    def clear_node(self, node: str) -> int:
        """Drop every copy held by ``node``; returns the number of blocks it held."""
        i = self._node_ids.get(node)
        if i is None or not self._node_count[i]:
            return 0
        mask = self._node_mask[i]
        keep = ~mask
        locs, keys = self._locs, self._keys
        dropped = 0
        for slot, bits in enumerate(locs):
            if bits & mask:
                dropped += 1
                bits &= keep
                if bits:
                    locs[slot] = bits
                else:
                    self._free_slot(keys[slot], slot)  # type: ignore[arg-type]
        self._node_count[i] = 0
        return dropped

    def touch(self, keys: Iterable[bytes]) -> None:
        """Record a hit on each key (metadata only)."""
        get = self._slots.get
        slots = [s for s in map(get, keys) if s is not None]
        if slots:
            idx = np.fromiter(slots, dtype=np.intp, count=len(slots))
            np.add.at(self._hits, idx, 1)
            self._last[idx] = time.monotonic()

    # -- reads -------------------------------------------------------------------------------
    def entry(self, key: bytes) -> BlockEntry | None:
        """A view of the block's metadata and locations, or None if it is not indexed."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        locations: dict[str, list[str]] = {}
        for bit in _bits(self._locs[slot]):
            node_index, tier = self._bit_owner[bit]
            locations.setdefault(self._node_names[node_index], []).append(tier)
        return BlockEntry(int(self._size[slot]), int(self._checksum[slot]), float(self._last[slot]),
                          int(self._hits[slot]),
                          {n: tuple(sorted(t, key=_tier_rank)) for n, t in locations.items()})

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """Blocks of the longest prefix of ``keys`` held anywhere. Does not touch metadata."""
        slots = self._slots
        n = 0
        for key in keys:
            if key not in slots:
                return n
            n += 1
        return n

    def match(self, keys: Sequence[bytes], nodes: Iterable[str] | None = None) -> PrefixMatch:
        """Longest prefix anywhere, and per node the longest prefix with each block's tier
        (the fastest tier when a node holds several copies). ``nodes`` limits ``per_node``
        to those nodes; ``blocks`` is always over every node. Does not touch metadata."""
        get, locs = self._slots.get, self._locs
        chain: list[int] = []
        for key in keys:
            slot = get(key)
            if slot is None:
                break
            chain.append(locs[slot])
        if not chain:
            return PrefixMatch(0, {})
        wanted = None if nodes is None else set(nodes)
        holders = {self._bit_owner[b][0] for b in _bits(chain[0])}
        per_node: dict[str, tuple[str, ...]] = {}
        for i in holders:
            name = self._node_names[i]
            if wanted is not None and name not in wanted:
                continue
            mask, fastest = self._node_mask[i], self._fastest[i]
            tiers: list[str] = []
            for bits in chain:
                mine = bits & mask
                if not mine:
                    break
                tier = fastest.get(mine)
                if tier is None:
                    tier = fastest[mine] = self._fastest_tier(mine)
                tiers.append(tier)
            per_node[name] = tuple(tiers)
        return PrefixMatch(len(chain), per_node)

    def node_entries(self, node: str) -> list[tuple[bytes, str, int]]:
        """(key, tier, size) of every copy ``node`` holds, in slot order."""
        i = self._node_ids.get(node)
        if i is None or not self._node_count[i]:
            return []
        mask, owner, keys, size = self._node_mask[i], self._bit_owner, self._keys, self._size
        out = []
        for slot, bits in enumerate(self._locs):
            mine = bits & mask
            if mine:
                for bit in _bits(mine):
                    out.append((keys[slot], owner[bit][1], int(size[slot])))
        return out  # type: ignore[return-value]

    def check_integrity(self) -> None:
        """Raise AssertionError if an invariant of the class docstring does not hold."""
        assert len(self._keys) == len(self._locs) <= len(self._size)
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is free twice"
        counts = [0] * len(self._node_names)
        for slot, (key, bits) in enumerate(zip(self._keys, self._locs)):
            if slot in free:
                assert key is None and bits == 0, f"free slot {slot} holds a key"
                continue
            assert key is not None and bits, f"slot {slot} is live but empty"
            assert self._slots.get(key) == slot, f"slot {slot}: key maps elsewhere"
            for i, mask in enumerate(self._node_mask):
                counts[i] += bool(bits & mask)
        assert len(self._slots) + len(free) == len(self._keys)
        assert counts == self._node_count, f"node counts {self._node_count} != {counts}"

    # -- internals ---------------------------------------------------------------------------
    def _intern(self, node: str, tier: str) -> int:
        i = self._node_ids.get(node)
        if i is None:
            i = self._node_ids[node] = len(self._node_names)
            self._node_names.append(node)
            self._node_mask.append(0)
            self._node_count.append(0)
            self._fastest.append({})
        bit = self._bit[(node, tier)] = len(self._bit_owner)
        self._bit_owner.append((i, tier))
        self._node_mask[i] |= 1 << bit
        self._fastest[i] = {}
        return bit

    def _fastest_tier(self, bits: int) -> str:
        return min((self._bit_owner[b][1] for b in _bits(bits)), key=_tier_rank)

    def _new_slot(self, key: bytes) -> int:
        if self._free:
            slot = self._free.pop()
            self._keys[slot] = key
        else:
            slot = len(self._keys)
            if slot == len(self._size):
                self._grow()
            self._keys.append(key)
            self._locs.append(0)
        self._slots[key] = slot
        return slot

    def _free_slot(self, key: bytes, slot: int) -> None:
        self._free.append(self._slots.pop(key))  # reuse the dict's int object
        self._keys[slot] = None
        self._locs[slot] = 0
        self._hits[slot] = 0

    def _grow(self) -> None:
        cap = len(self._size) + (len(self._size) >> 1)  # x1.5
        for name in ("_size", "_checksum", "_last", "_hits"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)


_RANKS = {t: i for i, t in enumerate(TIER_ORDER)}
_UNKNOWN_TIERS: dict[str, int] = {}


def _tier_rank(tier: str) -> int:
    rank = _RANKS.get(tier)
    if rank is None:
        rank = _UNKNOWN_TIERS.setdefault(tier, len(TIER_ORDER) + len(_UNKNOWN_TIERS))
    return rank


def _bits(x: int) -> Iterable[int]:
    """Positions of the set bits of ``x``, lowest first."""
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low
