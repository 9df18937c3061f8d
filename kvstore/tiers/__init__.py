"""Byte storage per tier, picked by name from a registry: ``dram`` (shared-memory slab),
``ssd`` (LMDB). A tier stores and returns bytes by key; recency, eviction, demotion and the
index are the pool's business."""
from kvstore.tiers.base import TIERS, Tier, register_tier
from kvstore.tiers import dram, ssd  # noqa: F401  (registers the tiers)

__all__ = ["TIERS", "Tier", "register_tier"]
