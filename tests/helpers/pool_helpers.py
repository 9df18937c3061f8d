"""Shared pieces of the pool tests (tests/test_pool*.py): block keys and bytes, settings
that evict only what a put needs; the fixtures are tests/helpers/pool_fixtures.py."""
from __future__ import annotations

import numpy as np

from kvstore.pool.pool import KVPool, PoolSettings, TierStats
from kvstore.tiers.dram import PAGE_BYTES

BS = PAGE_BYTES  # one block fills one DRAM page exactly
EXACT = PoolSettings(high_watermark=1.0, low_watermark=1.0)  # evict only what a put needs


def key_of(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like a SHA-256 key


def block_of(i: int, size: int = BS) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size=size, dtype=np.uint8).tobytes()


def stats_of(pool: KVPool) -> dict[str, TierStats]:
    return {s.name: s for s in pool.stats()}
