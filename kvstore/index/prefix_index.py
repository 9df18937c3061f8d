"""The prefix index: block key → where the block lives (node, tier) and its metadata.

The index is the truth about what can be read: the pool adds a location only after a block
is completely written in a tier, and removes it before the bytes are freed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from kvstore.index.keys import BlockKey


class BlockEntry:
    """One indexed block: its copies and metadata. ``locations`` maps node id → tiers."""

    __slots__ = ("locations", "size", "checksum", "last_access", "hits")

    def __init__(self, size: int, checksum: int) -> None:
        self.locations: dict[str, set[str]] = {}
        self.size = size
        self.checksum = checksum
        self.last_access = time.monotonic()
        self.hits = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The answer to a chain lookup.

    ``blocks``: longest prefix of the chain held anywhere (blocks).
    ``per_node``: node id → tier of each block of that node's longest prefix, head first.
    """

    blocks: int
    per_node: dict[str, tuple[str, ...]]

    def node_blocks(self, node: str) -> int:
        return len(self.per_node.get(node, ()))


class PrefixIndex:
    """Maps block keys to locations. Not thread-safe: the owner holds its lock.

    Invariant: an entry exists iff at least one (node, tier) copy of the block exists.
    """

    def __init__(self) -> None:
        self._blocks: dict[bytes, BlockEntry] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def add(self, key: BlockKey, node: str, tier: str, size: int = 0, checksum: int = 0) -> None:
        entry = self._blocks.get(key)
        if entry is None:
            entry = self._blocks[key] = BlockEntry(size, checksum)
        entry.locations.setdefault(node, set()).add(tier)

    def remove(self, key: BlockKey, node: str, tier: str) -> bool:
        """Drop one copy; the key stays visible while another copy exists. True if dropped."""
        entry = self._blocks.get(key)
        if entry is None or tier not in entry.locations.get(node, ()):
            return False
        tiers = entry.locations[node]
        tiers.discard(tier)
        if not tiers:
            del entry.locations[node]
        if not entry.locations:
            del self._blocks[key]
        return True

    def clear_node(self, node: str) -> int:
        """Drop every copy held by ``node``; returns the number of blocks it held."""
        dropped = 0
        for key in [k for k, e in self._blocks.items() if node in e.locations]:
            entry = self._blocks[key]
            del entry.locations[node]
            dropped += 1
            if not entry.locations:
                del self._blocks[key]
        return dropped

    def entry(self, key: BlockKey) -> BlockEntry | None:
        return self._blocks.get(key)

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """Blocks of the longest prefix of ``keys`` held anywhere. Does not touch metadata."""
        blocks = self._blocks
        n = 0
        for key in keys:
            if key not in blocks:
                break
            n += 1
        return n

    def match(self, keys: Sequence[bytes], nodes: Iterable[str] | None = None) -> PrefixMatch:
        """Longest prefix anywhere, and per node the longest prefix with each block's tier
        (the fastest tier when a node holds several copies)."""
        order = ("hbm", "dram", "ssd")
        per_node: dict[str, list[str]] = {}
        alive: set[str] | None = None
        total = 0
        for i, key in enumerate(keys):
            entry = self._blocks.get(key)
            if entry is None:
                break
            total += 1
            holders = set(entry.locations) if alive is None else alive & set(entry.locations)
            for node in holders:
                tiers = entry.locations[node]
                best = min(tiers, key=lambda t: order.index(t) if t in order else len(order))
                per_node.setdefault(node, []).append(best)
            alive = holders
            if not alive:
                # Per-node chains have all ended; keep counting the global prefix only.
                total += self.longest_prefix(keys[i + 1:])
                break
        wanted = set(nodes) if nodes is not None else None
        return PrefixMatch(total, {n: tuple(t) for n, t in per_node.items()
                                   if wanted is None or n in wanted})

    def touch(self, keys: Iterable[bytes]) -> None:
        """Record a hit on each key (metadata only)."""
        now = time.monotonic()
        for key in keys:
            entry = self._blocks.get(key)
            if entry is not None:
                entry.hits += 1
                entry.last_access = now
