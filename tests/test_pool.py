"""The KV pool (kvstore/pool.py): put/get over real DRAM and SSD tiers, chain-aware LRU
eviction, demotion and promotion, idempotent puts, integrity failures, stats."""
from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvstore.errors import IntegrityError, InvalidArgument
from kvstore.pool import KVPool, TierStats, checksum_of
from kvstore.tiers.dram import PAGE_BYTES, DramTier
from kvstore.tiers.ssd import SsdTier

BS = PAGE_BYTES  # one block fills one DRAM page exactly


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like a SHA-256 key


def _block(i: int, size: int = BS) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size=size, dtype=np.uint8).tobytes()


@pytest.fixture
def dram_pool(make_dram):
    pool = KVPool([make_dram(3 * BS)])
    yield pool
    pool.close()


@pytest.fixture
def two_tier_pool(make_dram, make_ssd):
    pool = KVPool([make_dram(2 * BS), make_ssd(8 * BS)])
    yield pool
    pool.close()


def _stats(pool: KVPool) -> dict[str, TierStats]:
    return {s.name: s for s in pool.stats()}


def test_put_get_roundtrip(dram_pool: KVPool) -> None:
    r = dram_pool.put(_key(1), _block(1))
    assert r.ok and not r.existed and r.key == _key(1)
    assert dram_pool.get(_key(1)) == _block(1)
    assert dram_pool.get(_key(2)) is None


def test_chain_tail_evicted_before_head(dram_pool: KVPool) -> None:
    chain = [(_key(i), _block(i)) for i in (1, 2, 3)]
    assert all(r.ok for r in dram_pool.put_chain(chain))
    assert dram_pool.lookup([k for k, _ in chain]) == (3, ["dram"] * 3)
    assert dram_pool.put(_key(9), _block(9)).ok  # unrelated block: something must go
    assert dram_pool.get(_key(3)) is None  # the tail went, not the head
    assert dram_pool.get(_key(1)) == _block(1) and dram_pool.get(_key(2)) == _block(2)
    assert dram_pool.lookup([k for k, _ in chain]) == (2, ["dram", "dram"])
    assert _stats(dram_pool)["dram"].evictions == 1
    assert dram_pool.remove(_key(1)) == BS
    assert dram_pool.lookup([k for k, _ in chain]) == (0, [])
    assert dram_pool.remove(_key(1)) == 0


def test_get_chain_keeps_head_warm(dram_pool: KVPool) -> None:
    keys = [_key(i) for i in (1, 2, 3)]
    for i in (3, 2, 1):  # put out of chain order: LRU is 3, 2, 1
        dram_pool.put(_key(i), _block(i))
    dram_pool.get_chain(keys)  # recency becomes tail-first: 3 oldest, 1 newest
    dram_pool.put(_key(9), _block(9))
    assert dram_pool.lookup(keys)[0] == 2


def test_lookup_changes_no_recency(dram_pool: KVPool) -> None:
    for i in (1, 2, 3):
        dram_pool.put(_key(i), _block(i))
    dram_pool.lookup([_key(1)])  # must not rescue block 1 from eviction
    dram_pool.put(_key(9), _block(9))
    assert dram_pool.get(_key(1)) is None and dram_pool.get(_key(2)) is not None


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


def test_promotion_can_be_disabled(make_dram, make_ssd) -> None:
    pool = KVPool([make_dram(BS), make_ssd(4 * BS)], promote_on_hit=False)
    try:
        pool.put(_key(1), _block(1))
        pool.put(_key(2), _block(2))
        assert pool.get(_key(1)) == _block(1)
        assert pool.lookup([_key(1)]) == (1, ["ssd"])
        assert _stats(pool)["ssd"].promotions == 0
    finally:
        pool.close()


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
    assert r.ok and r.existed
    assert two_tier_pool.get(_key(1)) == _block(1)
    for i in (2, 3):  # push block 1 down to SSD: still existed there
        two_tier_pool.put(_key(i), _block(i))
    assert two_tier_pool.lookup([_key(1)]) == (1, ["ssd"])
    assert two_tier_pool.put(_key(1), _block(1)).existed


def test_batched_put_with_one_existing_key(make_dram) -> None:
    pool = KVPool([make_dram(8 * BS)])
    try:
        pool.put(_key(2), _block(2))
        results = pool.put_chain([(_key(i), _block(i)) for i in (1, 2, 3, 4)])
        assert [r.ok for r in results] == [True] * 4
        assert [r.existed for r in results] == [False, True, False, False]
        assert pool.lookup([_key(i) for i in (1, 2, 3, 4)])[0] == 4
        assert all(pool.get(_key(i)) == _block(i) for i in (1, 2, 3, 4))
    finally:
        pool.close()


def test_put_with_wrong_checksum_raises_and_stores_nothing(dram_pool: KVPool) -> None:
    with pytest.raises(IntegrityError):
        dram_pool.put(_key(1), _block(1), checksum_of(_block(1)) ^ 1)
    assert dram_pool.lookup([_key(1)]) == (0, []) and dram_pool.get(_key(1)) is None
    assert dram_pool.put(_key(1), _block(1), checksum_of(_block(1))).ok


def test_block_larger_than_tier_fails_cleanly(dram_pool: KVPool) -> None:
    r = dram_pool.put(_key(1), _block(1, 3 * BS + 1))
    assert not r.ok and "capacity" in r.error
    assert dram_pool.lookup([_key(1)]) == (0, [])


def test_ssd_integrity_failure_is_a_miss(tmp_path: Path) -> None:
    path = str(tmp_path / "ssd")
    pool = KVPool([SsdTier(8 * BS, path)])
    pool.put(_key(1), _block(1))
    pool.put(_key(2), _block(2))
    pool.close()
    env = lmdb.open(path, max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        raw = bytearray(txn.get(_key(1)))
        raw[0] ^= 0xFF
        txn.put(_key(1), bytes(raw))
    env.close()
    dram = DramTier(2 * BS)
    pool = KVPool([dram, SsdTier(8 * BS, path)])  # restart: the SSD blocks are indexed again
    try:
        assert pool.lookup([_key(1), _key(2)]) == (2, ["ssd", "ssd"])
        assert pool.get(_key(1)) is None
        s = _stats(pool)
        assert s["ssd"].integrity_failures == 1 and s["ssd"].blocks == 1
        assert s["ssd"].used_bytes == BS and s["dram"].blocks == 0  # nothing promoted
        assert pool.lookup([_key(1), _key(2)]) == (0, [])
        assert pool.get(_key(2)) == _block(2)
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


def test_stats_fields(two_tier_pool: KVPool) -> None:
    pool = two_tier_pool
    for i in (1, 2, 3):
        pool.put(_key(i), _block(i, 1000))
    pool.get(_key(3))
    pool.get(_key(99))
    s = _stats(pool)
    assert list(s) == ["dram", "ssd"]
    d = s["dram"]
    assert (d.device, d.capacity_bytes, d.used_bytes, d.blocks) == ("cpu", 2 * BS, 2000, 2)
    assert (d.hits, d.misses, d.evictions, d.demotions, d.promotions, d.integrity_failures) == (1, 1, 1, 1, 0, 0)
    assert (s["ssd"].used_bytes, s["ssd"].blocks, s["ssd"].misses) == (1000, 1, 1)


def test_pool_needs_a_tier() -> None:
    with pytest.raises(InvalidArgument):
        KVPool([])


def test_concurrent_puts_of_one_key_leave_one_value(make_dram) -> None:
    from concurrent.futures import ThreadPoolExecutor

    pool = KVPool([make_dram(16 * BS)])
    try:
        values = [_block(i) for i in range(8)]
        with ThreadPoolExecutor(8) as ex:
            results = list(ex.map(lambda v: pool.put(_key(1), v), values))
        assert all(r.ok for r in results) and sum(not r.existed for r in results) == 1
        assert pool.get(_key(1)) == values[[r.existed for r in results].index(False)]
        assert _stats(pool)["dram"].used_bytes == BS
    finally:
        pool.close()
