"""Byte storage per tier, picked by name from a registry: ``hbm`` (a torch tensor on a
device), ``dram`` (a shared-memory slab), ``ssd`` (LMDB). A tier stores and returns bytes by
key through a two-phase put; recency, eviction, leases, pins and the index are the pool's."""
from kvstore.tiers.base import TIERS, Slot, Tier, TierUsage, register_tier
from kvstore.tiers import accounting, dram, hbm, ssd  # noqa: F401  (registers the tiers)

__all__ = ["TIERS", "Slot", "Tier", "TierUsage", "register_tier"]
