"""The kvstore connector's KV events in the router: what the pool holds for one vLLM
instance, from the events its connector publishes on the instance's own stream
(engines/vllm/connector_events.py: ``ownership`` ``kvstore``, ``block_hashes`` the pool's
block keys, ``medium`` the pool tier in vLLM's names).

They are applied as node ``<engine id>/pool`` of the router's replica: a node of the pool,
not the instance (:func:`scheduler.routing.cache_index.split_hits` counts every node that is
not an engine as the pool), because the pool is shared: every instance can load what one
instance's connector stored, and a hit there is a fetch, booked as a pool hit by tier. The
keys need no re-keying (they are the keys the router computes), so a block stored by another
instance needs no parent this instance announced. The node has its own epoch and sequence,
and is cleared with the instance's hits (a gap, a restart, ``AllBlocksCleared``).
"""
from __future__ import annotations

import time
from typing import Any

from kvstore.events.event import EventKind, KVEvent
from kvstore.events.replica import IndexReplica

OWNERSHIP = "kvstore"                                      # engines/vllm/connector_events.py OWNERSHIP
POOL_TIER_OF_MEDIUM = {"GPU": "hbm", "CPU": "dram", "STORAGE": "ssd"}   # its MEDIUM_OF_TIER, inverted


def pool_node(engine_id: str) -> str:
    """The replica node of what the pool holds for instance ``engine_id``."""
    return f"{engine_id}/pool"


class PoolNode:
    """One instance's connector events into ``replica`` as node :func:`pool_node`."""

    def __init__(self, engine_id: str, replica: IndexReplica, block_bytes: int) -> None:
        self.node = pool_node(engine_id)
        self.replica = replica
        self.block_bytes = block_bytes
        self.held: dict[bytes, set[str]] = {}
        self._epoch = 0
        self._seq = 0
        self.clear()

    def _emit(self, kind: EventKind, key: bytes = b"", tier: str = "") -> None:
        self._seq += 1
        self.replica.apply(KVEvent(self.node, self._epoch, self._seq, kind, key, tier,
                                   self.block_bytes if key else 0, time.time()))

    def clear(self) -> None:
        """Forget every block (a fresh epoch opens with NodeCleared)."""
        self._epoch = max(time.time_ns(), self._epoch + 1)
        self._seq = 0
        self.held.clear()
        self._emit(EventKind.NODE_CLEARED)

    def stored(self, ev: dict) -> tuple[int, int]:
        """A connector ``BlockStored``: (blocks applied, blocks skipped: not keys, unknown medium)."""
        tier = POOL_TIER_OF_MEDIUM.get(ev.get("medium"))  # type: ignore[arg-type]
        keys = _keys(ev)
        if tier is None:
            return 0, len(keys)
        applied = 0
        for key in keys:
            tiers = self.held.setdefault(key, set())
            if tier not in tiers:
                tiers.add(tier)
                self._emit(EventKind.BLOCK_STORED, key, tier)
                applied += 1
        return applied, 0

    def removed(self, ev: dict) -> int:
        """A connector ``BlockRemoved``: blocks applied."""
        tier = POOL_TIER_OF_MEDIUM.get(ev.get("medium"))  # type: ignore[arg-type]
        applied = 0
        for key in _keys(ev):
            tiers = self.held.get(key)
            if tier is None or tiers is None or tier not in tiers:
                continue
            tiers.discard(tier)
            if not tiers:
                del self.held[key]
            self._emit(EventKind.BLOCK_REMOVED, key, tier)
            applied += 1
        return applied


def _keys(ev: dict) -> list[bytes]:
    """The event's block keys. Raises ValueError for anything but a list of bytes (the
    batch is then dropped whole, as any batch that cannot be applied)."""
    hashes: Any = ev.get("block_hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, bytes) for h in hashes):
        raise ValueError("a kvstore connector event's block_hashes must be a list of block keys (bytes)")
    return hashes
