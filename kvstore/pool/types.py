"""The small frozen types the pool meets the rest of kvstore through: its settings, a lookup's
answer, a put's per-block result and a tier's figures."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.pool.eviction import POLICIES


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """How a pool evicts, leases and reserves. Times in seconds.

    ``high_watermark`` / ``low_watermark``: fractions of a tier's capacity; a put that would
    take a tier above the high mark first evicts down to the low mark (1.0 / 1.0: evict only
    what the put needs). ``policy``: the eviction policy of every tier at start (``lru``,
    ``lfu``, ``fifo``, ``s3fifo``). ``lease_ttl_s``: a read's lease when the caller names
    none. ``reservation_timeout_s``: a reservation older than this is aborted and its space
    freed. ``soft_pin_ttl_s``: a soft pin's TTL when the caller names none.
    ``promote_on_hit``: a hit in a lower tier copies the block to the top tier.
    """

    policy: str = "lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    lease_ttl_s: float = 5.0
    reservation_timeout_s: float = 30.0
    soft_pin_ttl_s: float = 600.0
    promote_on_hit: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        for name in ("low_watermark", "high_watermark", "lease_ttl_s", "reservation_timeout_s", "soft_pin_ttl_s"):
            v = getattr(self, name)   # a settings file can hold a string or a boolean here
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name} must be a number, got {v!r}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1, got "
                             f"low={self.low_watermark}, high={self.high_watermark}")
        for name in ("lease_ttl_s", "reservation_timeout_s", "soft_pin_ttl_s"):
            if not 0 < getattr(self, name) < math.inf:   # NaN or inf: a lease that never ends
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {getattr(self, name)}")


class LookupResult(NamedTuple):
    """A lookup's answer, the one shape every layer hands on (the pool, the control channels,
    the wires, StoreClient, ClusterClient): ``blocks``: longest prefix of a key chain held;
    ``tiers``: the tier of each of those blocks."""

    blocks: int
    tiers: tuple[str, ...]


class PutResult(NamedTuple):
    """One block's put. ``ok``: stored now or already present; ``existed``: already
    present (puts are idempotent); ``error``: why ``ok`` is false. (A NamedTuple: one is
    made per block on the hot path.)"""

    key: bytes
    ok: bool
    existed: bool = False
    error: str = ""


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's figures; bytes and block counts. Bytes are what blocks take of the tier
    (:meth:`kvstore.tiers.base.Tier.footprint`: a slab's whole pages). ``used_bytes``
    includes ``reserved_bytes`` (puts in flight); ``leased_bytes`` / ``pinned_bytes``:
    committed blocks under an unexpired lease / an active pin. ``quarantines``: times the tier found
    its storage damaged (an SSD file truncated or corrupt) and replaced it with an empty one;
    the blocks lost then count in ``integrity_failures``. ``hits``/``misses`` count block
    reads (their ratio is the read success); ``lookup_hits``/``lookup_misses`` count the
    blocks of reuse lookups (their ratio is the reuse), as reads do: found here, or reached
    this tier and not here (a block past the held prefix misses in every tier); the node's
    lookup hit ratio is the sum of ``lookup_hits`` over its tiers / the first tier's hits and
    misses (:func:`lookup_hit_ratio`, docs/metrics.md)."""

    name: str
    device: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    integrity_failures: int = 0
    leased_bytes: int = 0
    pinned_bytes: int = 0
    reserved_bytes: int = 0
    policy: str = ""
    quarantines: int = 0      # times the tier found its storage damaged and replaced it
    lookup_hits: int = 0      # reuse lookups: blocks found with their fastest copy here
    lookup_misses: int = 0    # reuse lookups: blocks that reached this tier and were not here
    handoff_lookups: int = 0  # hand-off lookups: blocks found with their fastest copy here


def lookup_hit_ratio(tiers: list[TierStats]) -> float | None:
    """A node's block hit ratio of reuse lookups: blocks found / blocks looked up (every
    block looked up counts once in its fastest tier's hits and misses). None: no lookup."""
    asked = tiers[0].lookup_hits + tiers[0].lookup_misses if tiers else 0
    return sum(t.lookup_hits for t in tiers) / asked if asked else None


def read_success_ratio(tiers: list[TierStats]) -> float | None:
    """A node's success ratio of block reads: reads served / reads (likewise counted once
    in the first tier). None: no read."""
    asked = tiers[0].hits + tiers[0].misses if tiers else 0
    return sum(t.hits for t in tiers) / asked if asked else None
