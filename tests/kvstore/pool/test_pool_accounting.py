"""The pool's accounting-only mode: real KVPool books (ledger, placement, eviction policies,
chain order, demotion, pins, index) over tiers that keep sizes but no bytes — what the
cluster simulator runs on."""
from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.index.prefix_index import PrefixIndex
from kvstore.pool.pool import KVPool, PoolSettings
from kvstore.tiers import TIERS
from kvstore.tiers.accounting import AccountingTier

SIZE = 100


def chain(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "s3fifo"])
def test_accounting_pool_evicts_demotes_and_keeps_the_index_true(policy: str) -> None:
    index = PrefixIndex()
    pool = KVPool([AccountingTier(4 * SIZE, name="dram"), AccountingTier(3 * SIZE, name="ssd")], "n0", index,
                  settings=PoolSettings(policy=policy, high_watermark=1.0, low_watermark=1.0, promote_on_hit=False))
    assert pool.account_chain(chain("a", 3), SIZE) == 3
    assert pool.account_chain(chain("a", 3), SIZE) == 0             # held already: only touched
    pool.pin([b"a0"], hard=True)
    assert pool.account_chain(chain("b", 4), SIZE) == 4
    dram, ssd = pool.stats()
    assert dram.blocks == 4 and dram.used_bytes == 4 * SIZE and dram.evictions == 3 and dram.demotions == 3
    assert ssd.used_bytes <= 3 * SIZE and pool.contains(b"a0")
    assert pool.lookup(chain("a", 3))[1][0] == "dram"              # the hard pin kept the head
    assert pool.touch(chain("a", 3)) == pool.lookup(chain("a", 3))[0]
    assert pool.get(b"b0") == b""                                  # no payloads
    pool.check_integrity()
    index.check_integrity()


def test_account_chain_refuses_a_tier_that_keeps_bytes() -> None:
    pool = KVPool([TIERS["dram"](1 << 20)])
    try:
        with pytest.raises(InvalidArgument, match="keeps bytes"):
            pool.account_chain([b"k"], SIZE)
    finally:
        pool.close()
