"""The scheduler's replica of the prefill instances' own (``hbm``) prefix caches.

The engines do not (yet) publish KV events for their local caches, so the scheduler mirrors
what it knows: after a prefill on instance ``i`` every full block of the prompt sits in
``i``'s cache (the engine keeps loaded and computed blocks alike), and each cache is LRU with
a known block capacity. KV events from the registry (DESIGN.md §5) replace this guess later.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from kvstore.index.prefix_index import PrefixIndex

HBM = "hbm"


class LocalCacheReplica:
    """A :class:`PrefixIndex` of (engine id, ``hbm``) locations, trimmed per engine to
    ``capacity_blocks`` in least-recently-used order (tails of a chain before heads, as the
    engines' ``LocalBlockCache`` does). Not thread-safe: used from one event loop."""

    def __init__(self, capacity_blocks: int = 4096) -> None:
        self.capacity_blocks = capacity_blocks
        self.index = PrefixIndex()
        self._lru: dict[str, OrderedDict[bytes, None]] = {}

    def hits(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Engine id → blocks of the longest prefix of ``keys`` it holds (absent: 0)."""
        match = self.index.match(keys)
        return {node: len(tiers) for node, tiers in match.per_node.items()}

    def add_chain(self, engine_id: str, keys: Sequence[bytes]) -> None:
        """Record that ``engine_id`` now holds ``keys`` (a chain, head first)."""
        if self.capacity_blocks <= 0:
            return
        lru = self._lru.setdefault(engine_id, OrderedDict())
        for key in reversed(keys):
            if key not in lru:
                self.index.add(key, engine_id, HBM)
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.capacity_blocks:
            old, _ = lru.popitem(last=False)
            self.index.remove(old, engine_id, HBM)

    def clear(self, engine_id: str) -> None:
        """Forget everything ``engine_id`` held (it restarted or left)."""
        self._lru.pop(engine_id, None)
        self.index.clear_node(engine_id)

    def blocks(self, engine_id: str) -> int:
        return len(self._lru.get(engine_id, ()))
