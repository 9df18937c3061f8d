"""The KV pool (kvstore/pool.py) over real DRAM and SSD tiers: puts and gets, the two-phase
put, chain-aware eviction under every policy, watermarks, demotion and promotion, idempotent
and concurrent puts, integrity failures, an injected SSD write fault, SSD capacity across a
restart, stats. Issue cases 1, 5, 6, 7 and 8 are marked."""
from __future__ import annotations

import errno
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from kvstore.errors import CapacityError, IntegrityError, InvalidArgument, ReservationExpired
from kvstore.eviction import POLICIES
from kvstore.pool import KVPool, PoolSettings, TierStats, checksum_of
from kvstore.tiers.dram import PAGE_BYTES
from kvstore.tiers.ssd import SsdTier

BS = PAGE_BYTES  # one block fills one DRAM page exactly
EXACT = PoolSettings(high_watermark=1.0, low_watermark=1.0)  # evict only what a put needs


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like a SHA-256 key


def _block(i: int, size: int = BS) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size=size, dtype=np.uint8).tobytes()


def _stats(pool: KVPool) -> dict[str, TierStats]:
    return {s.name: s for s in pool.stats()}


@pytest.fixture
def make_pool():
    made: list[KVPool] = []

    def make(tiers, **kw) -> KVPool:
        kw.setdefault("settings", EXACT)
        made.append(KVPool(tiers, **kw))
        return made[-1]

    yield make
    for pool in made:
        pool.check_integrity()
        pool.close()


@pytest.fixture
def dram_pool(make_dram, make_pool) -> KVPool:
    return make_pool([make_dram(3 * BS)])


@pytest.fixture
def two_tier_pool(make_dram, make_ssd, make_pool) -> KVPool:
    return make_pool([make_dram(2 * BS), make_ssd(8 * BS)])


def test_put_get_roundtrip(dram_pool: KVPool) -> None:
    r = dram_pool.put(_key(1), _block(1))
    assert r.ok and not r.existed and r.key == _key(1)
    assert dram_pool.get(_key(1)) == _block(1) and dram_pool.get(_key(2)) is None
    out = np.zeros(BS + 1, np.uint8)
    assert dram_pool.get_into(_key(1), out) == BS and out[:BS].tobytes() == _block(1)
    tensor = torch.zeros(BS // 2, dtype=torch.float16)
    assert dram_pool.get_into(_key(1), tensor) == BS and tensor.numpy().tobytes() == _block(1)
    assert dram_pool.get_many([_key(1), _key(2)]) == [_block(1), None]
    outs = [np.zeros(BS, np.uint8), np.zeros(BS, np.uint8)]
    assert dram_pool.get_many_into([_key(2), _key(1)], outs) == [None, BS] and outs[1].tobytes() == _block(1)
    assert dram_pool.contains(_key(1)) and not dram_pool.contains(_key(2))


def test_two_phase_put_is_invisible_until_commit(dram_pool: KVPool) -> None:
    data = _block(1, 3 * BS - 10)
    res = dram_pool.reserve(_key(1), len(data), checksum_of(data))
    assert _stats(dram_pool)["dram"].reserved_bytes == len(data)
    for off in range(0, len(data), 1000):
        dram_pool.write(res, data[off:off + 1000])
        assert dram_pool.lookup([_key(1)]) == (0, []) and dram_pool.get(_key(1)) is None
    assert dram_pool.commit(res).ok and dram_pool.get(_key(1)) == data
    assert _stats(dram_pool)["dram"].reserved_bytes == 0 and dram_pool.lookup([_key(1)])[0] == 1
    with pytest.raises(ReservationExpired):
        dram_pool.write(res, b"x")  # committed: closed for writes


def test_abort_short_and_overrun_writes_leave_nothing(dram_pool: KVPool) -> None:
    res = dram_pool.reserve(_key(1), BS)
    dram_pool.write(res, _block(1)[:100])
    dram_pool.abort(res)
    dram_pool.abort(res)  # idempotent
    res = dram_pool.reserve(_key(2), BS)
    dram_pool.write(res, _block(2)[:100])
    with pytest.raises(IntegrityError, match="bytes"):
        dram_pool.commit(res)  # short
    res = dram_pool.reserve(_key(3), 10)
    with pytest.raises(InvalidArgument, match="reserved"):
        dram_pool.write(res, b"x" * 11)
    dram_pool.abort(res)
    s = _stats(dram_pool)["dram"]
    assert (s.used_bytes, s.reserved_bytes, s.blocks) == (0, 0, 0)
    assert dram_pool.lookup([_key(1)]) == (0, []) and dram_pool.get(_key(2)) is None


def test_reservation_older_than_the_timeout_frees_its_space(make_dram, make_pool) -> None:
    pool = make_pool([make_dram(2 * BS)], settings=PoolSettings(reservation_timeout_s=0.2))
    res = pool.reserve(_key(1), 2 * BS)
    pool.write(res, _block(1, BS))
    assert _stats(pool)["dram"].used_bytes == 2 * BS
    with pytest.raises(CapacityError):
        pool.reserve(_key(2), BS)  # everything left is being written
    time.sleep(0.3)
    s = _stats(pool)["dram"]  # an observer reaps: the space is free, no key visible
    assert (s.used_bytes, s.reserved_bytes) == (0, 0) and not pool.contains(_key(1))
    with pytest.raises(ReservationExpired):
        pool.write(res, _block(1, BS))
    with pytest.raises(ReservationExpired):
        pool.commit(res)
    assert pool.put(_key(1), _block(1, 2 * BS)).ok and pool.get(_key(1)) == _block(1, 2 * BS)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_case5_chain_tail_evicted_before_head(make_dram, make_pool, policy: str) -> None:
    """Case 5: capacity of 3 blocks, chain [1,2,3], one unrelated block: 3 goes; a lookup of
    [1,2,3] hits 2; removing block 1 makes it hit 0."""
    pool = make_pool([make_dram(3 * BS)], settings=PoolSettings(policy, 1.0, 1.0))
    chain = [(_key(i), _block(i)) for i in (1, 2, 3)]
    assert all(r.ok for r in pool.put_chain(chain))
    keys = [k for k, _ in chain]
    assert pool.lookup(keys) == (3, ["dram"] * 3)
    assert pool.put(_key(9), _block(9)).ok  # unrelated block: something must go
    assert pool.get(_key(3)) is None  # the tail went, not the head
    assert pool.lookup(keys) == (2, ["dram", "dram"])
    assert _stats(pool)["dram"].evictions == 1
    pool.put(_key(8), _block(8))
    assert pool.lookup(keys) == (1, ["dram"])  # then the new tail, 2
    assert pool.remove(_key(1)) == BS
    assert pool.lookup(keys) == (0, []) and pool.remove(_key(1)) == 0
    pool.check_integrity()


def test_chain_put_through_parent_links_a_later_segment(dram_pool: KVPool) -> None:
    dram_pool.put(_key(1), _block(1))
    dram_pool.put_chain([(_key(2), _block(2)), (_key(3), _block(3))], parent=_key(1))
    dram_pool.put(_key(9), _block(9))
    assert dram_pool.lookup([_key(1), _key(2), _key(3)])[0] == 2


def test_get_chain_keeps_head_warm(dram_pool: KVPool) -> None:
    keys = [_key(i) for i in (1, 2, 3)]
    for i in (3, 2, 1):  # put out of chain order, unlinked: LRU is 3, 2, 1
        dram_pool.put(_key(i), _block(i))
    assert dram_pool.get_chain(keys) == [_block(i) for i in (1, 2, 3)]  # links them, tail-first
    dram_pool.put(_key(9), _block(9))
    assert dram_pool.lookup(keys)[0] == 2
    assert dram_pool.get_chain([_key(1), _key(7), _key(2)], stop_at_miss=True) == [_block(1), None]


def test_lookups_and_existence_checks_renew_nothing(dram_pool: KVPool) -> None:
    """Case 3, second half: a stream of lookups on a block does not keep it from eviction."""
    for i in (1, 2, 3):
        dram_pool.put(_key(i), _block(i))
    for i in range(4, 10):
        for _ in range(20):
            assert dram_pool.lookup([_key(1)])[0] in (0, 1)
            dram_pool.contains(_key(1))
        dram_pool.put(_key(i), _block(i))
        if i == 4:
            assert not dram_pool.contains(_key(1)) and dram_pool.contains(_key(2))  # oldest first


def test_watermarks_evict_down_to_the_low_mark(make_dram, make_pool) -> None:
    pool = make_pool([make_dram(10 * BS)], settings=PoolSettings(high_watermark=0.8, low_watermark=0.5))
    for i in range(8):
        assert pool.put(_key(i), _block(i)).ok
    assert _stats(pool)["dram"].evictions == 0 and _stats(pool)["dram"].blocks == 8  # at the high mark
    pool.put(_key(8), _block(8))  # 9 blocks would exceed 80 %: evict to <= 50 % first
    s = _stats(pool)["dram"]
    assert s.blocks == 5 and s.evictions == 4 and s.used_bytes <= 0.8 * s.capacity_bytes
    assert [pool.contains(_key(i)) for i in range(9)] == [False] * 4 + [True] * 5


def test_dram_full_demotes_to_ssd_and_hit_promotes(two_tier_pool: KVPool) -> None:
    pool = two_tier_pool
    for i in (1, 2, 3):
        assert pool.put(_key(i), _block(i)).ok
    s = _stats(pool)
    assert s["dram"].demotions == 1 and s["dram"].evictions == 1 and s["dram"].blocks == 2
    assert s["ssd"].blocks == 1 and s["ssd"].used_bytes == BS
    assert pool.lookup([_key(1), _key(2), _key(3)]) == (3, ["ssd", "dram", "dram"])
    assert pool.get(_key(1)) == _block(1)  # an SSD hit promotes back to DRAM
    s = _stats(pool)
    assert s["ssd"].hits == 1 and s["ssd"].promotions == 1 and s["dram"].misses == 1
    n, tiers = pool.lookup([_key(1), _key(2), _key(3)])
    assert n == 3 and tiers[0] == "dram" and tiers.count("ssd") == 1  # block 2 went down
    assert pool.get(_key(1)) == _block(1)
    assert _stats(pool)["dram"].hits == 1


def test_promotion_can_be_disabled(make_dram, make_ssd, make_pool) -> None:
    pool = make_pool([make_dram(BS), make_ssd(4 * BS)], promote_on_hit=False)
    pool.put(_key(1), _block(1))
    pool.put(_key(2), _block(2))
    assert pool.get(_key(1)) == _block(1)
    assert pool.lookup([_key(1)]) == (1, ["ssd"]) and _stats(pool)["ssd"].promotions == 0


def test_last_tier_drops_when_full(two_tier_pool: KVPool) -> None:
    for i in range(12):
        assert two_tier_pool.put(_key(i), _block(i)).ok
    s = _stats(two_tier_pool)
    assert s["dram"].blocks == 2 and s["ssd"].blocks == 8
    assert s["ssd"].used_bytes <= s["ssd"].capacity_bytes and s["ssd"].evictions == 2
    assert two_tier_pool.get(_key(0)) is None and two_tier_pool.get(_key(11)) == _block(11)


def test_put_is_idempotent(two_tier_pool: KVPool) -> None:
    assert two_tier_pool.put(_key(1), _block(1)).existed is False
    r = two_tier_pool.put(_key(1), b"different bytes")
    assert r.ok and r.existed and two_tier_pool.get(_key(1)) == _block(1)
    for i in (2, 3):  # push block 1 down to SSD: still existed there
        two_tier_pool.put(_key(i), _block(i))
    assert two_tier_pool.lookup([_key(1)]) == (1, ["ssd"]) and two_tier_pool.put(_key(1), _block(1)).existed


def test_case7_batched_put_with_one_existing_key(make_dram, make_ssd, make_pool) -> None:
    """Case 7: the others are stored and readable; the existing one counts as success."""
    pool = make_pool([make_dram(8 * BS), make_ssd(8 * BS)])
    pool.put(_key(2), _block(2))
    for tier in ("dram", "ssd"):
        base = 0 if tier == "dram" else 10
        if tier == "ssd":
            pool.put(_key(12), _block(12), tier="ssd")
        results = pool.put_many([(_key(base + i), _block(base + i)) for i in (1, 2, 3, 4)], tier=tier)
        assert [r.ok for r in results] == [True] * 4
        assert [r.existed for r in results] == [False, True, False, False]
        assert all(pool.get(_key(base + i)) == _block(base + i) for i in (1, 2, 3, 4))


def test_put_with_wrong_checksum_raises_and_stores_nothing(dram_pool: KVPool) -> None:
    with pytest.raises(IntegrityError):
        dram_pool.put(_key(1), _block(1), checksum_of(_block(1)) ^ 1)
    assert dram_pool.lookup([_key(1)]) == (0, []) and dram_pool.get(_key(1)) is None
    assert _stats(dram_pool)["dram"].used_bytes == 0
    assert dram_pool.put(_key(1), _block(1), checksum_of(_block(1))).ok


def test_block_larger_than_tier_fails_cleanly(dram_pool: KVPool) -> None:
    r = dram_pool.put(_key(1), _block(1, 3 * BS + 1))
    assert not r.ok and "capacity" in r.error
    assert dram_pool.lookup([_key(1)]) == (0, [])


def test_case1_ssd_write_error_on_block_2_of_a_chain(make_ssd, make_pool) -> None:
    """Case 1: a chain of 3 to the SSD tier, ENOSPC on block 2: per-block results; a lookup
    hits at most 1 block; block 2 is a miss, never zeros or partial bytes."""
    ssd = make_ssd(16 * BS)
    pool = make_pool([ssd])

    def fault(key: bytes) -> None:
        if key == _key(2):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    ssd.write_fault = fault
    chain = [(_key(i), _block(i, 3 * BS)) for i in (1, 2, 3)]
    results = pool.put_chain(chain, tier="ssd")
    assert [r.ok for r in results] == [True, False, True] and "No space" in results[1].error
    assert pool.lookup([k for k, _ in chain]) == (1, ["ssd"])
    assert pool.get(_key(2)) is None
    out = np.full(3 * BS, 7, np.uint8)
    assert pool.get_into(_key(2), out) is None and (out == 7).all()
    s = _stats(pool)["ssd"]
    assert (s.used_bytes, s.reserved_bytes, s.blocks) == (6 * BS, 0, 2)
    ssd.write_fault = None
    assert pool.put(_key(2), _block(2, 3 * BS), tier="ssd").ok  # the space was given back
    assert pool.lookup([k for k, _ in chain])[0] == 3 and pool.get(_key(2)) == _block(2, 3 * BS)


def test_case8_flipped_byte_on_disk_is_a_miss_and_the_block_is_gone(tmp_path: Path, make_dram) -> None:
    """Case 8: flip one byte of a stored SSD block on disk: the next get is a miss, the
    integrity-failure count is 1, and the block is gone."""
    path = str(tmp_path / "ssd")
    pool = KVPool([SsdTier(8 * BS, path)])
    pool.put(_key(1), _block(1))
    pool.put(_key(2), _block(2))
    pool.close()
    env = lmdb.open(path, max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        raw = bytearray(txn.get(_key(1)))
        raw[100] ^= 0x01
        txn.put(_key(1), bytes(raw))
    env.close()
    pool = KVPool([make_dram(2 * BS), SsdTier(8 * BS, path)])  # restart: the SSD blocks are indexed
    try:
        assert pool.lookup([_key(1), _key(2)]) == (2, ["ssd", "ssd"])
        assert pool.get(_key(1)) is None
        s = _stats(pool)
        assert s["ssd"].integrity_failures == 1 and s["ssd"].blocks == 1 and s["ssd"].hits == 0
        assert s["ssd"].used_bytes == BS and s["dram"].blocks == 0  # nothing promoted
        assert pool.lookup([_key(1), _key(2)]) == (0, []) and pool.get(_key(1)) is None
        assert pool.get(_key(2)) == _block(2)
        pool.check_integrity()
    finally:
        pool.close()


def test_case6_ssd_capped_at_10mib_survives_40mib_and_a_restart(tmp_path: Path) -> None:
    """Case 6: usage stays <= 10 MiB while 40 MiB go in (puts succeed by eviction); after a
    restart on the same directory the usage equals the bytes stored and the next put evicts."""
    path, cap, size = str(tmp_path / "ssd"), 10 << 20, 1 << 20
    pool = KVPool([SsdTier(cap, path)], settings=EXACT)
    for i in range(40):
        assert pool.put(_key(i), _block(i, size)).ok
        assert pool.stats()[0].used_bytes <= cap
    s = pool.stats()[0]
    assert s.blocks == 10 and s.evictions == 30 and s.used_bytes == 10 * size
    pool.close()
    env = lmdb.open(path, max_dbs=2, readonly=True)
    with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
        on_disk = sum(len(v) for _, v in txn.cursor())
    env.close()
    pool = KVPool([SsdTier(cap, path)], settings=EXACT)
    try:
        s = pool.stats()[0]
        assert s.used_bytes == on_disk == 10 * size and s.blocks == 10
        assert pool.get(_key(39)) == _block(39, size)
        assert pool.put(_key(40), _block(40, size)).ok
        assert pool.stats()[0].evictions == 1 and pool.stats()[0].used_bytes == cap
        assert not pool.contains(_key(30))  # the oldest write went first
        pool.check_integrity()
    finally:
        pool.close()


def test_ssd_tier_larger_than_its_new_capacity_is_evicted_down_at_start(tmp_path: Path) -> None:
    path = str(tmp_path / "ssd")
    pool = KVPool([SsdTier(8 * BS, path)])
    for i in range(6):
        pool.put(_key(i), _block(i))
    pool.close()
    pool = KVPool([SsdTier(4 * BS, path)])
    try:
        assert pool.stats()[0].used_bytes <= 4 * BS and pool.contains(_key(5)) and not pool.contains(_key(0))
    finally:
        pool.close()


def test_evict_by_tier_and_bytes(two_tier_pool: KVPool) -> None:
    pool = two_tier_pool
    for i in (1, 2):
        pool.put(_key(i), _block(i))
    assert pool.evict("dram", 1) == (BS, 1)  # least recently used first: block 1, demoted
    assert pool.lookup([_key(1), _key(2)]) == (2, ["ssd", "dram"])
    assert pool.evict("ssd", 10 * BS) == (BS, 1)
    assert pool.lookup([_key(1)]) == (0, [])
    assert pool.evict("dram", 0) == (0, 0)
    with pytest.raises(InvalidArgument, match="dram"):
        pool.evict("hbm", 1)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policy_switch_at_run_time_keeps_every_block(two_tier_pool: KVPool, policy: str) -> None:
    pool = two_tier_pool
    for i in range(5):
        pool.put(_key(i), _block(i))
    assert pool.set_policy(policy, "ssd") == {"ssd": "lru"}
    assert pool.set_policy(policy) == {"dram": "lru", "ssd": policy}
    assert {s.policy for s in pool.stats()} == {policy}
    pool.check_integrity()
    for i in range(5, 12):
        assert pool.put(_key(i), _block(i)).ok
    assert sum(s.blocks for s in pool.stats()) == 10
    with pytest.raises(InvalidArgument, match="lru"):
        pool.set_policy("random")


def test_stats_fields(two_tier_pool: KVPool) -> None:
    pool = two_tier_pool
    for i in (1, 2, 3):
        pool.put(_key(i), _block(i, 1000))
    pool.get(_key(3))
    pool.get(_key(99))
    s = _stats(pool)
    assert list(s) == ["dram", "ssd"]
    d = s["dram"]
    assert (d.device, d.capacity_bytes, d.used_bytes, d.blocks, d.policy) == ("cpu", 2 * BS, 2000, 2, "lru")
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
    values = [_block(i) for i in range(8)]
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda v: pool.put(_key(1), v), values))
    assert all(r.ok for r in results) and sum(not r.existed for r in results) == 1
    assert pool.get(_key(1)) == values[[r.existed for r in results].index(False)]
    assert _stats(pool)["dram"].used_bytes == BS and _stats(pool)["dram"].reserved_bytes == 0


def test_concurrent_puts_gets_and_evictions_stay_consistent(make_dram, make_ssd, make_pool) -> None:
    pool = make_pool([make_dram(8 * BS), make_ssd(16 * BS)], settings=PoolSettings(policy="s3fifo"))

    def work(t: int) -> None:
        rng = np.random.default_rng(t)
        for _ in range(150):
            i = int(rng.integers(0, 40))
            if rng.random() < 0.5:
                assert pool.put(_key(i), _block(i)).ok
            else:
                got = pool.get(_key(i))
                assert got is None or got == _block(i)

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(work, range(4)))
    pool.check_integrity()
