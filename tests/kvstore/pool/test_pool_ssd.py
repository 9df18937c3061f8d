"""The KV pool (kvstore/pool/pool.py) over real DRAM and SSD tiers: demotion and promotion, the
last tier dropping, idempotent and batched puts, an injected SSD write fault, integrity
failures on disk, SSD capacity across a restart, eviction by tier, concurrent puts, gets and
evictions."""
from __future__ import annotations

import errno
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.pool.pool import KVPool, PoolSettings
from kvstore.tiers.ssd import SsdTier
from tests.helpers.pool_helpers import BS, EXACT, block_of, key_of, stats_of

pytest_plugins = ("tests.helpers.pool_fixtures",)  # make_pool, dram_pool, two_tier_pool


def test_dram_full_demotes_to_ssd_and_hit_promotes(two_tier_pool: KVPool) -> None:
    pool = two_tier_pool
    for i in (1, 2, 3):
        assert pool.put(key_of(i), block_of(i)).ok
    s = stats_of(pool)
    assert s["dram"].demotions == 1 and s["dram"].evictions == 1 and s["dram"].blocks == 2
    assert s["ssd"].blocks == 1 and s["ssd"].used_bytes == BS
    assert pool.lookup([key_of(1), key_of(2), key_of(3)]) == (3, ("ssd", "dram", "dram"))
    assert pool.get(key_of(1)) == block_of(1)  # an SSD hit promotes back to DRAM
    s = stats_of(pool)
    assert s["ssd"].hits == 1 and s["ssd"].promotions == 1 and s["dram"].misses == 1
    n, tiers = pool.lookup([key_of(1), key_of(2), key_of(3)])
    assert n == 3 and tiers[0] == "dram" and tiers.count("ssd") == 1  # block 2 went down
    assert pool.get(key_of(1)) == block_of(1)
    assert stats_of(pool)["dram"].hits == 1


def test_promotion_can_be_disabled(make_dram, make_ssd, make_pool) -> None:
    pool = make_pool([make_dram(BS), make_ssd(4 * BS)], promote_on_hit=False)
    pool.put(key_of(1), block_of(1))
    pool.put(key_of(2), block_of(2))
    assert pool.get(key_of(1)) == block_of(1)
    assert pool.lookup([key_of(1)]) == (1, ("ssd",)) and stats_of(pool)["ssd"].promotions == 0


def test_last_tier_drops_when_full(two_tier_pool: KVPool) -> None:
    for i in range(12):
        assert two_tier_pool.put(key_of(i), block_of(i)).ok
    s = stats_of(two_tier_pool)
    assert s["dram"].blocks == 2 and s["ssd"].blocks == 8
    assert s["ssd"].used_bytes <= s["ssd"].capacity_bytes and s["ssd"].evictions == 2
    assert two_tier_pool.get(key_of(0)) is None and two_tier_pool.get(key_of(11)) == block_of(11)


def test_put_is_idempotent(two_tier_pool: KVPool) -> None:
    assert two_tier_pool.put(key_of(1), block_of(1)).existed is False
    r = two_tier_pool.put(key_of(1), b"different bytes")
    assert r.ok and r.existed and two_tier_pool.get(key_of(1)) == block_of(1)
    for i in (2, 3):  # push block 1 down to SSD: still existed there
        two_tier_pool.put(key_of(i), block_of(i))
    assert two_tier_pool.lookup([key_of(1)]) == (1, ("ssd",)) and two_tier_pool.put(key_of(1), block_of(1)).existed


def test_batched_put_with_one_existing_key(make_dram, make_ssd, make_pool) -> None:
    """A batched put with one key already stored: the others are stored and readable; the
    existing one counts as success."""
    pool = make_pool([make_dram(8 * BS), make_ssd(8 * BS)])
    pool.put(key_of(2), block_of(2))
    for tier in ("dram", "ssd"):
        base = 0 if tier == "dram" else 10
        if tier == "ssd":
            pool.put(key_of(12), block_of(12), tier="ssd")
        results = pool.put_many([(key_of(base + i), block_of(base + i)) for i in (1, 2, 3, 4)], tier=tier)
        assert [r.ok for r in results] == [True] * 4
        assert [r.existed for r in results] == [False, True, False, False]
        assert all(pool.get(key_of(base + i)) == block_of(base + i) for i in (1, 2, 3, 4))


def test_ssd_write_error_on_block_2_of_a_chain(make_ssd, make_pool) -> None:
    """A chain of 3 to the SSD tier, ENOSPC on block 2: per-block results; a lookup
    hits at most 1 block; block 2 is a miss, never zeros or partial bytes."""
    ssd = make_ssd(16 * BS)
    pool = make_pool([ssd])

    def fault(key: bytes) -> None:
        if key == key_of(2):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    ssd.write_fault = fault
    chain = [(key_of(i), block_of(i, 3 * BS)) for i in (1, 2, 3)]
    results = pool.put_chain(chain, tier="ssd")
    assert [r.ok for r in results] == [True, False, True] and "No space" in results[1].error
    assert pool.lookup([k for k, _ in chain]) == (1, ("ssd",))
    assert pool.get(key_of(2)) is None
    out = np.full(3 * BS, 7, np.uint8)
    assert pool.get_into(key_of(2), out) is None and (out == 7).all()
    s = stats_of(pool)["ssd"]
    assert (s.used_bytes, s.reserved_bytes, s.blocks) == (6 * BS, 0, 2)
    ssd.write_fault = None
    assert pool.put(key_of(2), block_of(2, 3 * BS), tier="ssd").ok  # the space was given back
    assert pool.lookup([k for k, _ in chain])[0] == 3 and pool.get(key_of(2)) == block_of(2, 3 * BS)


def test_flipped_byte_on_disk_is_a_miss_and_the_block_is_gone(tmp_path: Path, make_dram) -> None:
    """Flip one byte of a stored SSD block on disk: the next get is a miss, the
    integrity-failure count is 1, and the block is gone."""
    path = str(tmp_path / "ssd")
    pool = KVPool([SsdTier(8 * BS, path)])
    pool.put(key_of(1), block_of(1))
    pool.put(key_of(2), block_of(2))
    pool.close()
    env = lmdb.open(path, max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        raw = bytearray(txn.get(key_of(1)))
        raw[100] ^= 0x01
        txn.put(key_of(1), bytes(raw))
    env.close()
    pool = KVPool([make_dram(2 * BS), SsdTier(8 * BS, path)])  # restart: the SSD blocks are indexed
    try:
        assert pool.lookup([key_of(1), key_of(2)]) == (2, ("ssd", "ssd"))
        assert pool.get(key_of(1)) is None
        s = stats_of(pool)
        assert s["ssd"].integrity_failures == 1 and s["ssd"].blocks == 1 and s["ssd"].hits == 0
        assert s["ssd"].used_bytes == BS and s["dram"].blocks == 0  # nothing promoted
        assert pool.lookup([key_of(1), key_of(2)]) == (0, ()) and pool.get(key_of(1)) is None
        assert pool.get(key_of(2)) == block_of(2)
        pool.check_integrity()
    finally:
        pool.close()


def test_ssd_capped_at_10mib_survives_40mib_and_a_restart(tmp_path: Path) -> None:
    """Usage stays <= 10 MiB while 40 MiB go in (puts succeed by eviction); after a
    restart on the same directory the usage equals the bytes stored and the next put evicts."""
    path, cap, size = str(tmp_path / "ssd"), 10 << 20, 1 << 20
    pool = KVPool([SsdTier(cap, path)], settings=EXACT)
    for i in range(40):
        assert pool.put(key_of(i), block_of(i, size)).ok
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
        assert pool.get(key_of(39)) == block_of(39, size)
        assert pool.put(key_of(40), block_of(40, size)).ok
        assert pool.stats()[0].evictions == 1 and pool.stats()[0].used_bytes == cap
        assert not pool.contains(key_of(30))  # the oldest write went first
        pool.check_integrity()
    finally:
        pool.close()


def test_ssd_tier_larger_than_its_new_capacity_is_evicted_down_at_start(tmp_path: Path) -> None:
    path = str(tmp_path / "ssd")
    pool = KVPool([SsdTier(8 * BS, path)])
    for i in range(6):
        pool.put(key_of(i), block_of(i))
    pool.close()
    pool = KVPool([SsdTier(4 * BS, path)])
    try:
        assert pool.stats()[0].used_bytes <= 4 * BS and pool.contains(key_of(5)) and not pool.contains(key_of(0))
    finally:
        pool.close()


def test_evict_by_tier_and_bytes(two_tier_pool: KVPool) -> None:
    pool = two_tier_pool
    for i in (1, 2):
        pool.put(key_of(i), block_of(i))
    assert pool.evict("dram", 1) == (BS, 1)  # least recently used first: block 1, demoted
    assert pool.lookup([key_of(1), key_of(2)]) == (2, ("ssd", "dram"))
    assert pool.evict("ssd", 10 * BS) == (BS, 1)
    assert pool.lookup([key_of(1)]) == (0, ())
    assert pool.evict("dram", 0) == (0, 0)
    with pytest.raises(InvalidArgument, match="dram"):
        pool.evict("hbm", 1)


def test_concurrent_puts_gets_and_evictions_stay_consistent(make_dram, make_ssd, make_pool) -> None:
    pool = make_pool([make_dram(8 * BS), make_ssd(16 * BS)], settings=PoolSettings(policy="s3fifo"))

    def work(t: int) -> None:
        rng = np.random.default_rng(t)
        for _ in range(150):
            i = int(rng.integers(0, 40))
            if rng.random() < 0.5:
                assert pool.put(key_of(i), block_of(i)).ok
            else:
                got = pool.get(key_of(i))
                assert got is None or got == block_of(i)

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(work, range(4)))
    pool.check_integrity()
