"""The pool's books for one tier: its committed blocks and their lease counts, the eviction
policy over them, the prefix-chain links among them, and the tier's counters."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from kvstore.pool.eviction import EvictionPolicy
from kvstore.tiers.base import Tier


class BlockMeta:
    """One committed copy of a block. ``refs``: unreleased leases on it; ``lease_until``:
    the latest deadline among them (0 when none); ``moves``: copies of it to another tier
    in flight (kvstore/pool/moves.py), each a hold without a deadline. Invariant: ``refs >= 0``
    and ``moves >= 0``."""

    __slots__ = ("size", "checksum", "refs", "lease_until", "moves")

    def __init__(self, size: int, checksum: int) -> None:
        self.size = size
        self.checksum = checksum
        self.refs = 0
        self.lease_until = 0.0
        self.moves = 0

    def leased(self, now: float) -> bool:
        return self.moves > 0 or (self.refs > 0 and now <= self.lease_until)

    def hold(self, deadline: float) -> None:
        """One more lease on this copy, until ``deadline`` (monotonic s); never shortens
        another lease's hold."""
        self.refs += 1
        if self.lease_until < deadline:
            self.lease_until = deadline

    def unhold(self) -> None:
        """One lease fewer; with none left the copy is free to go."""
        self.refs -= 1
        if self.refs == 0:
            self.lease_until = 0.0


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    integrity_failures: int = 0
    lookup_hits: int = 0          # reuse lookups: blocks whose fastest copy is here
    lookup_misses: int = 0        # reuse lookups: blocks that reached this tier, not here
    handoff_lookups: int = 0      # hand-off lookups: blocks whose fastest copy is here

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TierLedger:
    """Books of one tier. Not thread-safe: the pool holds its lock.

    Invariants: ``blocks`` and ``policy.keys()`` hold the same keys, those the tier has
    committed; ``kids[p]`` is the set of keys in ``blocks`` whose chain parent is ``p``.
    ``parents`` (child → parent key) is shared by every ledger of the pool.
    """

    def __init__(self, tier: Tier, policy: EvictionPolicy, parents: dict[bytes, bytes]) -> None:
        self.tier = tier
        self.policy = policy
        self.parents = parents
        self.blocks: dict[bytes, BlockMeta] = {}
        self.kids: dict[bytes, set[bytes]] = {}
        self.counters = TierCounters()

    def add(self, key: bytes, meta: BlockMeta) -> None:
        self.blocks[key] = meta
        self.policy.admit(key)
        parent = self.parents.get(key)
        if parent is not None:
            self.kids.setdefault(parent, set()).add(key)

    def drop(self, key: bytes, evicted: bool) -> BlockMeta | None:
        meta = self.blocks.pop(key, None)
        if meta is None:
            return None
        self.policy.forget(key, evicted)
        parent = self.parents.get(key)
        if parent is not None:
            kids = self.kids.get(parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self.kids[parent]
        return meta

    def link(self, child: bytes, parent: bytes, old: bytes | None = None) -> None:
        """Record that ``child`` extends ``parent`` instead of ``old`` (call after
        ``parents`` is updated)."""
        if child not in self.blocks:
            return
        if old is not None and old in self.kids:
            self.kids[old].discard(child)
            if not self.kids[old]:
                del self.kids[old]
        self.kids.setdefault(parent, set()).add(child)

    def set_policy(self, policy: EvictionPolicy) -> str:
        """Switch policies, carrying the block order over; returns the old policy's name."""
        old, self.policy = self.policy, policy
        for key in old.keys():
            policy.admit(key)
        return old.name

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The next block to evict: the policy's choice among eligible blocks, moved down its
        prefix chain to an evictable tail (within one chain, tails go before heads). A block
        whose descendants in this tier are all held (leased, pinned) is not eligible."""
        leaves: dict[bytes, bytes] = {}

        def eligible(key: bytes) -> bool:
            if not evictable(key):
                return False
            leaf = self._leaf_below(key, evictable)
            if leaf is None:
                return False
            leaves[key] = leaf
            return True

        key = self.policy.victim(eligible)
        return None if key is None else leaves[key]

    def _leaf_below(self, key: bytes, evictable: Callable[[bytes], bool]) -> bytes | None:
        stack = [key]
        while stack:
            node = stack.pop()
            kids = self.kids.get(node)
            if not kids:
                return node
            stack.extend(k for k in kids if evictable(k))
        return None

    def check(self) -> None:
        """Assert the invariants (tests call this after mutations)."""
        assert set(self.policy.keys()) == set(self.blocks), "policy and blocks disagree"
        for key, meta in self.blocks.items():
            assert meta.refs >= 0 and meta.moves >= 0, f"negative hold count on {key.hex()[:16]}"
            parent = self.parents.get(key)
            if parent is not None:
                assert key in self.kids.get(parent, ()), "missing chain link"
        for parent, kids in self.kids.items():
            assert kids and all(k in self.blocks and self.parents.get(k) == parent for k in kids)
        usage = self.tier.usage()
        assert usage.blocks == len(self.blocks), (usage.blocks, len(self.blocks))
        assert usage.used_bytes - usage.reserved_bytes == sum(self.tier.footprint(m.size) for m in self.blocks.values())
