"""Byte storage per tier. The kinds a node can run (``hbm``: a torch tensor on a device,
``dram``: a shared-memory slab, ``ssd``: LMDB) are data in :mod:`kvstore.tiers.registry`
(name, rank, default bandwidth, persistent, factory); their classes register in ``TIERS``.
A tier stores and returns bytes by key through a two-phase put; recency, eviction, leases,
pins and the index are the pool's."""
from kvstore.tiers import accounting, dram, hbm, ssd  # noqa: F401  (registers the tiers)
from kvstore.tiers.base import TIERS, Slot, Tier, TierUsage, register_tier

__all__ = ["TIERS", "Slot", "Tier", "TierUsage", "register_tier"]
