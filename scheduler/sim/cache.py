"""The simulated cluster's caches are real :class:`kvstore.pool.pool.KVPool` objects over
:class:`kvstore.tiers.accounting.AccountingTier` tiers: an instance's HBM prefix cache, and
the KV pool's DRAM and SSD tiers. The pool's own ledger, placement, eviction strategies
(:mod:`kvstore.pool.eviction`: lru, lfu, fifo, s3fifo), chain order (tails before heads),
demotion to the next tier and its index updates do the accounting; only the payload bytes
are missing. Every copy lands in the one real
:class:`kvstore.index.prefix_index.PrefixIndex` the scheduler reads.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvstore.index.prefix_index import PrefixIndex
from kvstore.pool.pool import KVPool, PoolSettings
from kvstore.tiers.accounting import UNBOUNDED, AccountingTier


def accounting_pool(index: PrefixIndex, node: str, tiers: Sequence[tuple[str, int | None]],
                    block_bytes: int, eviction: str = "lru") -> KVPool | None:
    """A pool for ``node`` with ``tiers`` (``(name, capacity in blocks)``, fastest first;
    None: unbounded; 0: no such tier). Evicts only what a put needs (watermarks 1.0) and
    does not promote on a hit, as a prefix cache does. None when every tier is empty."""
    made = [AccountingTier(UNBOUNDED if cap is None else cap * block_bytes, name=name)
            for name, cap in tiers if cap is None or cap > 0]
    if not made:
        return None
    settings = PoolSettings(policy=eviction, high_watermark=1.0, low_watermark=1.0, promote_on_hit=False)
    return KVPool(made, node_id=node, index=index, settings=settings)


def hold_chain(pool: KVPool | None, keys: Sequence[bytes], block_bytes: int) -> None:
    """Keep a prompt's blocks (head first) in the pool's top tier; a chain longer than the
    tier keeps its head."""
    if pool is None or not keys:
        return
    fit = pool.tiers[0].capacity_bytes // block_bytes
    pool.account_chain(keys if len(keys) <= fit else keys[:fit], block_bytes)


def touch_chain(pool: KVPool | None, keys: Sequence[bytes]) -> None:
    """A read of the held blocks of a chain (recency only; tail first)."""
    if pool is not None and keys:
        pool.touch(keys)
