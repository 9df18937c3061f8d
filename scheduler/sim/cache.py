"""Byte accounting of the simulated caches: an instance's HBM prefix cache and the KV pool's
DRAM and SSD tiers, each a capacity in blocks ordered by the pool's own eviction strategy
(:mod:`kvstore.eviction`: lru, lfu, fifo, s3fifo), every copy recorded in the one real
:class:`kvstore.index.prefix_index.PrefixIndex` the scheduler reads.

The rules are the pool's (DESIGN.md §4): the strategy picks the victim; a chain is admitted
and touched tail-first so its tail goes before its head; evicting from a tier demotes the
block to the next tier when there is one. No payloads move: a block is its key and its size
(``block_bytes``), so the simulator does not drive :class:`kvstore.pool.KVPool` itself,
whose commit checks real bytes.
"""
from __future__ import annotations

from typing import Sequence

from kvstore.eviction import make_policy
from kvstore.index.prefix_index import PrefixIndex


def _any(_: bytes) -> bool:
    return True


class BlockCache:
    """One (node, tier) of the simulated cluster. ``capacity_blocks`` None: unbounded.

    Invariant: a key is in ``self`` iff the index records a copy of it on (node, tier), and
    iff the eviction strategy holds it; ``len(self) <= capacity_blocks``."""

    def __init__(self, index: PrefixIndex, node: str, tier: str, capacity_blocks: int | None,
                 block_bytes: int, lower: "BlockCache | None" = None, eviction: str = "lru") -> None:
        self.index, self.node, self.tier = index, node, tier
        self.capacity = capacity_blocks
        self.block_bytes = block_bytes
        self.lower = lower
        self.policy = make_policy(eviction)
        self._keys: set[bytes] = set()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    @property
    def used_bytes(self) -> int:
        return len(self._keys) * self.block_bytes

    def insert_chain(self, keys: Sequence[bytes]) -> None:
        """Hold every block of a prefix chain (head first); the head is admitted last."""
        if self.capacity == 0:
            return
        held, policy, index = self._keys, self.policy, self.index
        keys = keys if self.capacity is None else keys[:self.capacity]
        for key in reversed(keys):
            if key in held:
                policy.access(key)
                continue
            if self.capacity is not None and len(held) >= self.capacity:
                self._evict()
            held.add(key)
            policy.admit(key)
            index.add(key, self.node, self.tier, self.block_bytes)

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """A read of the held blocks of a chain, tail first (the head read last)."""
        held, access = self._keys, self.policy.access
        for key in reversed(keys):
            if key in held:
                access(key)

    def _evict(self) -> None:
        key = self.policy.victim(_any)
        self.policy.forget(key, evicted=True)
        self._keys.discard(key)
        self.index.remove(key, self.node, self.tier)
        self.evictions += 1
        if self.lower is not None:
            self.lower.insert_chain((key,))
