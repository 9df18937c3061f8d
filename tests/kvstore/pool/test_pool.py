"""The KV pool (kvstore/pool/pool.py) over real DRAM tiers: puts and gets, the two-phase put,
chain-aware eviction under every policy, watermarks, lookups that renew nothing, policy
switches, stats and concurrent puts of one key. The SSD side is tests/kvstore/pool/test_pool_ssd.py."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvstore.errors import CapacityError, IntegrityError, InvalidArgument, ReservationExpired
from kvstore.pool.eviction import POLICIES
from kvstore.pool.pool import KVPool, PoolSettings, checksum_of
from kvstore.tiers.slab import PAGE_BYTES
from tests.helpers.pool_helpers import BS, block_of, key_of, stats_of

pytest_plugins = ("tests.helpers.pool_fixtures",)  # make_pool, dram_pool, two_tier_pool


def test_put_get_roundtrip(dram_pool: KVPool) -> None:
    r = dram_pool.put(key_of(1), block_of(1))
    assert r.ok and not r.existed and r.key == key_of(1)
    assert dram_pool.get(key_of(1)) == block_of(1) and dram_pool.get(key_of(2)) is None
    out = np.zeros(BS + 1, np.uint8)
    assert dram_pool.get_into(key_of(1), out) == BS and out[:BS].tobytes() == block_of(1)
    tensor = torch.zeros(BS // 2, dtype=torch.float16)
    assert dram_pool.get_into(key_of(1), tensor) == BS and tensor.numpy().tobytes() == block_of(1)
    assert dram_pool.get_many([key_of(1), key_of(2)]) == [block_of(1), None]
    outs = [np.zeros(BS, np.uint8), np.zeros(BS, np.uint8)]
    assert dram_pool.get_many_into([key_of(2), key_of(1)], outs) == [None, BS] and outs[1].tobytes() == block_of(1)
    assert dram_pool.contains(key_of(1)) and not dram_pool.contains(key_of(2))


def test_two_phase_put_is_invisible_until_commit(dram_pool: KVPool) -> None:
    data = block_of(1, 3 * BS - 10)
    res = dram_pool.reserve(key_of(1), len(data), checksum_of(data))
    assert stats_of(dram_pool)["dram"].reserved_bytes == 3 * BS     # the slab pages it takes
    for off in range(0, len(data), 1000):
        dram_pool.write(res, data[off:off + 1000])
        assert dram_pool.lookup([key_of(1)]) == (0, ()) and dram_pool.get(key_of(1)) is None
    assert dram_pool.commit(res).ok and dram_pool.get(key_of(1)) == data
    assert stats_of(dram_pool)["dram"].reserved_bytes == 0 and dram_pool.lookup([key_of(1)])[0] == 1
    with pytest.raises(ReservationExpired):
        dram_pool.write(res, b"x")  # committed: closed for writes


def test_reserve_many_reserves_in_order_and_reports_each_block(two_tier_pool: KVPool) -> None:
    # A same-host RESERVE frame's blocks in one call: one held already (EXISTED, no slot), a
    # bad size, one that needs the held block demoted to SSD first (settled between
    # blocks), one for which the top tier has only open slots left, one that can never fit;
    # every slot it opens commits like one reserve's.
    pool = two_tier_pool                                          # DRAM: 2 blocks; SSD: 8
    assert pool.put(key_of(0), block_of(0)).ok
    items = [(key_of(0), BS, None), (key_of(1), BS, None), (key_of(2), -1, None),
             (key_of(3), BS, key_of(1)), (key_of(4), BS, key_of(3)), (key_of(5), 100 * BS, None)]
    got = pool.reserve_many(items)
    assert got[0].existed and got[0].slot is None
    assert isinstance(got[2], InvalidArgument)
    assert isinstance(got[4], CapacityError) and isinstance(got[5], CapacityError)
    opened = [got[1], got[3]]
    assert [r.key for r in opened] == [key_of(1), key_of(3)] and all(r.slot for r in opened)
    assert stats_of(pool)["dram"].reserved_bytes == 2 * BS and pool.lookup([key_of(0)]).tiers == ("ssd",)
    for r, i in zip(opened, (1, 3)):
        pool.write(r, block_of(i))
    done = pool.commit_filled([(r, checksum_of(block_of(i))) for r, i in zip(opened, (1, 3))])
    assert [x.ok for x in done] == [True] * 2
    assert [pool.get(key_of(i)) for i in (0, 1, 3)] == [block_of(i) for i in (0, 1, 3)]
    assert all(pool.get(key_of(i)) is None for i in (2, 4, 5))


def test_abort_short_and_overrun_writes_leave_nothing(dram_pool: KVPool) -> None:
    res = dram_pool.reserve(key_of(1), BS)
    dram_pool.write(res, block_of(1)[:100])
    dram_pool.abort(res)
    dram_pool.abort(res)  # idempotent
    res = dram_pool.reserve(key_of(2), BS)
    dram_pool.write(res, block_of(2)[:100])
    with pytest.raises(IntegrityError, match="bytes"):
        dram_pool.commit(res)  # short
    res = dram_pool.reserve(key_of(3), 10)
    with pytest.raises(InvalidArgument, match="reserved"):
        dram_pool.write(res, b"x" * 11)
    dram_pool.abort(res)
    s = stats_of(dram_pool)["dram"]
    assert (s.used_bytes, s.reserved_bytes, s.blocks) == (0, 0, 0)
    assert dram_pool.lookup([key_of(1)]) == (0, ()) and dram_pool.get(key_of(2)) is None


def test_reservation_older_than_the_timeout_frees_its_space(make_dram, make_pool) -> None:
    pool = make_pool([make_dram(2 * BS)], settings=PoolSettings(reservation_timeout_s=0.2))
    res = pool.reserve(key_of(1), 2 * BS)
    pool.write(res, block_of(1, BS))
    assert stats_of(pool)["dram"].used_bytes == 2 * BS
    with pytest.raises(CapacityError):
        pool.reserve(key_of(2), BS)  # everything left is being written
    time.sleep(0.3)
    s = stats_of(pool)["dram"]  # an observer reaps: the space is free, no key visible
    assert (s.used_bytes, s.reserved_bytes) == (0, 0) and not pool.contains(key_of(1))
    with pytest.raises(ReservationExpired):
        pool.write(res, block_of(1, BS))
    with pytest.raises(ReservationExpired):
        pool.commit(res)
    assert pool.put(key_of(1), block_of(1, 2 * BS)).ok and pool.get(key_of(1)) == block_of(1, 2 * BS)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_chain_tail_evicted_before_head(make_dram, make_pool, policy: str) -> None:
    """Capacity of 3 blocks, chain [1,2,3], one unrelated block: 3 goes; a lookup of
    [1,2,3] hits 2; removing block 1 makes it hit 0."""
    pool = make_pool([make_dram(3 * BS)], settings=PoolSettings(policy, 1.0, 1.0))
    chain = [(key_of(i), block_of(i)) for i in (1, 2, 3)]
    assert all(r.ok for r in pool.put_chain(chain))
    keys = [k for k, _ in chain]
    assert pool.lookup(keys) == (3, ("dram",) * 3)
    assert pool.put(key_of(9), block_of(9)).ok  # unrelated block: something must go
    assert pool.get(key_of(3)) is None  # the tail went, not the head
    assert pool.lookup(keys) == (2, ("dram", "dram"))
    assert stats_of(pool)["dram"].evictions == 1
    pool.put(key_of(8), block_of(8))
    assert pool.lookup(keys) == (1, ("dram",))  # then the new tail, 2
    assert pool.remove(key_of(1)) == BS
    assert pool.lookup(keys) == (0, ()) and pool.remove(key_of(1)) == 0
    pool.check_integrity()


def test_chain_put_through_parent_links_a_later_segment(dram_pool: KVPool) -> None:
    dram_pool.put(key_of(1), block_of(1))
    dram_pool.put_chain([(key_of(2), block_of(2)), (key_of(3), block_of(3))], parent=key_of(1))
    dram_pool.put(key_of(9), block_of(9))
    assert dram_pool.lookup([key_of(1), key_of(2), key_of(3)])[0] == 2


def test_get_chain_keeps_head_warm(dram_pool: KVPool) -> None:
    keys = [key_of(i) for i in (1, 2, 3)]
    for i in (3, 2, 1):  # put out of chain order, unlinked: LRU is 3, 2, 1
        dram_pool.put(key_of(i), block_of(i))
    assert dram_pool.get_chain(keys) == [block_of(i) for i in (1, 2, 3)]  # links them, tail-first
    dram_pool.put(key_of(9), block_of(9))
    assert dram_pool.lookup(keys)[0] == 2
    assert dram_pool.get_chain([key_of(1), key_of(7), key_of(2)], stop_at_miss=True) == [block_of(1), None]


def test_lookups_and_existence_checks_renew_nothing(dram_pool: KVPool) -> None:
    """A stream of lookups on a block does not keep it from eviction."""
    for i in (1, 2, 3):
        dram_pool.put(key_of(i), block_of(i))
    for i in range(4, 10):
        for _ in range(20):
            assert dram_pool.lookup([key_of(1)])[0] in (0, 1)
            dram_pool.contains(key_of(1))
        dram_pool.put(key_of(i), block_of(i))
        if i == 4:
            assert not dram_pool.contains(key_of(1)) and dram_pool.contains(key_of(2))  # oldest first


def test_watermarks_evict_down_to_the_low_mark(make_dram, make_pool) -> None:
    pool = make_pool([make_dram(10 * BS)], settings=PoolSettings(high_watermark=0.8, low_watermark=0.5))
    for i in range(8):
        assert pool.put(key_of(i), block_of(i)).ok
    assert stats_of(pool)["dram"].evictions == 0 and stats_of(pool)["dram"].blocks == 8  # at the high mark
    pool.put(key_of(8), block_of(8))  # 9 blocks would exceed 80 %: evict to <= 50 % first
    s = stats_of(pool)["dram"]
    assert s.blocks == 5 and s.evictions == 4 and s.used_bytes <= 0.8 * s.capacity_bytes
    assert [pool.contains(key_of(i)) for i in range(9)] == [False] * 4 + [True] * 5


def test_put_with_wrong_checksum_raises_and_stores_nothing(dram_pool: KVPool) -> None:
    with pytest.raises(IntegrityError):
        dram_pool.put(key_of(1), block_of(1), checksum_of(block_of(1)) ^ 1)
    assert dram_pool.lookup([key_of(1)]) == (0, ()) and dram_pool.get(key_of(1)) is None
    assert stats_of(dram_pool)["dram"].used_bytes == 0
    assert dram_pool.put(key_of(1), block_of(1), checksum_of(block_of(1))).ok


def test_block_larger_than_tier_fails_cleanly(dram_pool: KVPool) -> None:
    r = dram_pool.put(key_of(1), block_of(1, 3 * BS + 1))
    assert not r.ok and "capacity" in r.error
    assert dram_pool.lookup([key_of(1)]) == (0, ())


def test_a_block_larger_than_the_tier_evicts_nothing(two_tier_pool: KVPool) -> None:
    """Review: a 1 GiB put to a 256 MiB DRAM tier was refused only after the watermark had
    evicted (demoted) every block there. Refused first, nothing moves: through a one-call
    put, a reserve and a batch reserve (where the tenant's quota check comes next)."""
    pool = two_tier_pool
    for i in range(2):
        assert pool.put(key_of(i), block_of(i)).ok
    before = stats_of(pool)["dram"]
    assert before.blocks == 2
    assert not pool.put(key_of(9), block_of(9, 2 * BS + 1), tier="dram").ok
    with pytest.raises(CapacityError, match="exceeds the tier's capacity"):
        pool.reserve(key_of(9), 2 * BS + 1, tier="dram")
    got = pool.reserve_many([(key_of(9), 2 * BS + 1, None)], tier="dram")
    assert len(got) == 1 and isinstance(got[0], CapacityError)
    after = stats_of(pool)["dram"]
    assert after.blocks == 2 and after.evictions == before.evictions
    assert pool.lookup([key_of(0), key_of(1)])[0] == 2


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policy_switch_at_run_time_keeps_every_block(two_tier_pool: KVPool, policy: str) -> None:
    pool = two_tier_pool
    for i in range(5):
        pool.put(key_of(i), block_of(i))
    assert pool.set_policy(policy, "ssd") == {"ssd": "lru"}
    assert pool.set_policy(policy) == {"dram": "lru", "ssd": policy}
    assert {s.policy for s in pool.stats()} == {policy}
    pool.check_integrity()
    for i in range(5, 12):
        assert pool.put(key_of(i), block_of(i)).ok
    assert sum(s.blocks for s in pool.stats()) == 10
    with pytest.raises(InvalidArgument, match="lru"):
        pool.set_policy("random")


def test_byte_figures_of_a_slab_tier_are_in_the_pages_its_blocks_take(make_dram, make_ssd, make_pool) -> None:
    """used, pinned, leased, evictable and evicted bytes of a DRAM tier, and a tenant's bytes
    there, are all whole pages (one unit: an operator can add and compare them); in the SSD
    tier, sizes. Evicting 8 KiB of one-byte blocks evicts two of them, not every one."""
    from kvstore.pool.tenants import attach, namespace_stats
    pool = make_pool([make_dram(16 * BS), make_ssd(64 * BS)])
    attach(pool)
    for i in range(8):
        assert pool.put(key_of(i), b"x", namespace="t").ok
    pool.pin([key_of(0)], hard=True)
    lease = pool.acquire([key_of(1)], ttl_s=30)
    d = stats_of(pool)["dram"]
    assert (d.used_bytes, d.pinned_bytes, d.leased_bytes) == (8 * PAGE_BYTES, PAGE_BYTES, PAGE_BYTES)
    assert pool.evictable_bytes("dram") == 6 * PAGE_BYTES
    assert pool.evict("dram", 2 * PAGE_BYTES) == (2 * PAGE_BYTES, 2)      # two blocks, demoted
    tiers = namespace_stats(pool)["t"].tier_bytes
    assert tiers == {"dram": 6 * PAGE_BYTES, "ssd": 2} and stats_of(pool)["ssd"].used_bytes == 2
    pool.release(lease)
    pool.check_integrity()


def test_stats_fields(two_tier_pool: KVPool) -> None:
    pool = two_tier_pool
    for i in (1, 2, 3):
        pool.put(key_of(i), block_of(i, 1000))
    pool.get(key_of(3))
    pool.get(key_of(99))
    s = stats_of(pool)
    assert list(s) == ["dram", "ssd"]
    d = s["dram"]
    # two 1000-byte blocks, a slab page each: used counts what they take of the capacity
    assert (d.device, d.capacity_bytes, d.used_bytes, d.blocks, d.policy) == ("cpu", 2 * BS, 2 * BS, 2, "lru")
    assert (d.hits, d.misses, d.evictions, d.demotions, d.promotions, d.integrity_failures) == (1, 1, 1, 1, 0, 0)
    assert (d.leased_bytes, d.pinned_bytes, d.reserved_bytes) == (0, 0, 0)
    assert (s["ssd"].used_bytes, s["ssd"].blocks, s["ssd"].misses) == (1000, 1, 1)


def test_pool_needs_a_tier_and_valid_settings() -> None:
    with pytest.raises(InvalidArgument):
        KVPool([])
    with pytest.raises(ValueError, match="low <= high"):
        PoolSettings(high_watermark=0.5, low_watermark=0.9)
    with pytest.raises(ValueError, match="s3fifo"):
        PoolSettings(policy="arc")


def test_concurrent_puts_of_one_key_leave_one_value(make_dram, make_pool) -> None:
    pool = make_pool([make_dram(16 * BS)])
    values = [block_of(i) for i in range(8)]
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda v: pool.put(key_of(1), v), values))
    assert all(r.ok for r in results) and sum(not r.existed for r in results) == 1
    assert pool.get(key_of(1)) == values[[r.existed for r in results].index(False)]
    assert stats_of(pool)["dram"].used_bytes == BS and stats_of(pool)["dram"].reserved_bytes == 0
