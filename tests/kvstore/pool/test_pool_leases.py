"""Leases and pins of the KV pool (kvstore/pool/pool.py, kvstore/pool/lease.py): a read that outlives
its lease fails cleanly, a locked match survives a full tier, hard
and soft pins by key and by prefix."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, LeaseExpired
from kvstore.pool.pool import KVPool, PoolSettings, TierStats
from kvstore.tiers.dram import PAGE_BYTES

BS = PAGE_BYTES
CHUNK = BS // 4


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _block(i: int, size: int = BS) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size=size, dtype=np.uint8).tobytes()


def _stats(pool: KVPool) -> TierStats:
    return pool.stats()[0]


@pytest.fixture
def make_pool(make_dram):
    made: list[KVPool] = []

    def make(blocks: int, **settings) -> KVPool:
        made.append(KVPool([make_dram(blocks * BS)],
                           settings=PoolSettings(high_watermark=1.0, low_watermark=1.0, **settings)))
        return made[-1]

    yield make
    for pool in made:
        pool.check_integrity()
        pool.close()


@pytest.mark.parametrize("batched", [False, True], ids=["single", "batched"])
def test_a_read_outliving_its_lease_raises_and_never_returns_the_new_bytes(make_pool, batched) -> None:
    """Lease 200 ms, a reader copying slowly; force eviction and put new blocks into
    the freed space during the read: LeaseExpired, never the new bytes; single and batched
    reads agree."""
    pool = make_pool(2, lease_ttl_s=0.2)
    pool.put(_key(0), _block(0))
    pool.put(_key(1), _block(1))
    started, reused = threading.Event(), threading.Event()
    seen: list[bytes] = []

    def slow_copy(view: np.ndarray) -> bytes:  # ~0.3 s, and the last quarter after the reuse
        started.set()
        out = b""
        for i in range(4):
            if i == 3:
                reused.wait(5)
            out += view[i * CHUNK:(i + 1) * CHUNK].tobytes()
            time.sleep(0.1)
        seen.append(out)
        return out

    outcome: dict[str, object] = {}

    def reader() -> None:
        try:
            if batched:
                outcome["value"] = pool.read_many([_key(0), _key(1)], [bytes, slow_copy])
            else:
                outcome["value"] = pool.read(_key(1), slow_copy)
        except LeaseExpired as exc:
            outcome["value"] = exc

    thread = threading.Thread(target=reader)
    thread.start()
    assert started.wait(5)
    unleased = 0 if batched else 1  # a single read leases block 1 only
    assert pool.evict("dram", 2 * BS) == (unleased * BS, unleased)  # forced eviction spares leases
    assert _stats(pool).leased_bytes == (2 - unleased) * BS
    time.sleep(0.25)  # the lease (200 ms) runs out while the reader is still copying
    assert pool.evict("dram", 2 * BS) == ((2 - unleased) * BS, 2 - unleased)
    assert pool.put(_key(2), _block(2)).ok and pool.put(_key(3), _block(3)).ok  # reuse the pages
    reused.set()
    thread.join(10)
    assert isinstance(outcome["value"], LeaseExpired)
    tail = seen[0][3 * CHUNK:]
    assert tail in (_block(2)[3 * CHUNK:], _block(3)[3 * CHUNK:])  # the copy did see new bytes...
    assert tail != _block(1)[3 * CHUNK:]  # ...and the pool discarded them
    assert pool.get(_key(1)) is None and pool.get(_key(2)) == _block(2)
    assert _stats(pool).leased_bytes == 0


def test_a_valid_lease_blocks_eviction_and_reuse(make_pool) -> None:
    pool = make_pool(1)
    pool.put(_key(1), _block(1))
    lease = pool.acquire([_key(1)], ttl_s=10)
    r = pool.put(_key(2), _block(2))
    assert not r.ok and "leased" in r.error  # the only space is leased: no overwrite
    assert pool.get(_key(1)) == _block(1)
    pool.release(lease)
    assert pool.put(_key(2), _block(2)).ok and pool.get(_key(1)) is None


def test_a_locked_match_survives_a_full_tier(make_pool) -> None:
    """A locked match of 3 blocks survives filling the tier to 100 %; releasing twice
    is an error; lease counts never go below zero; evictable bytes = unlocked, unpinned."""
    pool = make_pool(8)
    chain = [_key(i) for i in (1, 2, 3)]
    pool.put_chain([(k, _block(i)) for i, k in enumerate(chain, 1)])
    lease = pool.acquire(chain + [_key(4)], ttl_s=30)
    assert (lease.blocks, lease.keys, lease.tiers) == (3, tuple(chain), ("dram",) * 3)
    lease2 = pool.acquire(chain[:1], ttl_s=30)  # a second hold on the head
    for i in range(10, 30):  # fill the tier to 100 %, then keep going
        assert pool.put(_key(i), _block(i)).ok
        pool.check_integrity()
    s = _stats(pool)
    assert s.used_bytes == s.capacity_bytes and s.leased_bytes == 3 * BS
    assert pool.lookup(chain) == (3, ("dram",) * 3)
    assert [pool.get(k) for k in chain] == [_block(i) for i in (1, 2, 3)]
    assert pool.evictable_bytes("dram") == 5 * BS
    assert pool.pin([_key(29)]) == 1 and pool.evictable_bytes("dram") == 4 * BS
    pool.release(lease)
    with pytest.raises(InvalidArgument, match="released already"):
        pool.release(lease)
    pool.check_integrity()  # lease counts >= 0
    assert _stats(pool).leased_bytes == BS and pool.evictable_bytes("dram") == 6 * BS
    pool.release(lease2)
    assert pool.evictable_bytes("dram") == 7 * BS and _stats(pool).leased_bytes == 0
    assert pool.evict("dram", 7 * BS) == (7 * BS, 7)  # the chain is fair game now
    assert pool.lookup(chain)[0] == 0 and pool.contains(_key(29))


def test_expired_locked_match_no_longer_protects(make_pool) -> None:
    pool = make_pool(2)
    pool.put(_key(1), _block(1))
    lease = pool.acquire([_key(1)], ttl_s=0.05)
    time.sleep(0.1)
    assert lease.expired()
    with pytest.raises(LeaseExpired):
        lease.check()
    assert pool.evictable_bytes("dram") == BS and pool.evict("dram", BS) == (BS, 1)
    pool.release(lease)  # releasing an expired lease once is fine
    with pytest.raises(InvalidArgument):
        pool.release(lease)


def test_hard_pin_is_never_evicted(make_pool) -> None:
    pool = make_pool(3)
    for i in (1, 2, 3):
        pool.put(_key(i), _block(i))
    assert pool.pin([_key(1), _key(2), _key(99)], hard=True) == 2
    assert _stats(pool).pinned_bytes == 2 * BS
    for i in range(10, 15):
        assert pool.put(_key(i), _block(i)).ok
    assert pool.contains(_key(1)) and pool.contains(_key(2)) and not pool.contains(_key(3))
    assert pool.evict("dram", 10 * BS) == (BS, 1)  # only the unpinned one
    pool.put(_key(14), _block(14))
    pool.pin([_key(14)], hard=True)
    r = pool.put(_key(20), _block(20))
    assert not r.ok and "pinned" in r.error
    assert pool.pin([_key(1)], hard=False) == 1 and _stats(pool).pinned_bytes == 3 * BS  # stays hard
    assert pool.unpin([_key(1), _key(5)]) == 1
    assert pool.put(_key(20), _block(20)).ok and not pool.contains(_key(1))


def test_soft_pin_goes_only_as_a_last_resort_and_expires(make_pool) -> None:
    pool = make_pool(3)
    for i in (1, 2, 3):
        pool.put(_key(i), _block(i))
    pool.pin([_key(1)])  # the oldest block, soft
    pool.put(_key(4), _block(4))
    pool.put(_key(5), _block(5))
    assert pool.contains(_key(1)) and not pool.contains(_key(2)) and not pool.contains(_key(3))
    pool.pin([_key(4), _key(5)], hard=True)
    assert pool.put(_key(6), _block(6)).ok and not pool.contains(_key(1))  # the last resort
    assert _stats(pool).pinned_bytes == 2 * BS
    pool.pin([_key(6)], ttl_s=0.05)
    assert _stats(pool).pinned_bytes == 3 * BS
    time.sleep(0.1)
    assert _stats(pool).pinned_bytes == 2 * BS and pool.evictable_bytes("dram") == BS


def test_pin_and_unpin_by_prefix(make_pool) -> None:
    pool = make_pool(6)
    chain = [_key(i) for i in range(5)]
    pool.put_chain([(k, _block(i)) for i, k in enumerate(chain[:3])])
    assert pool.pin_prefix(chain, hard=True) == 3
    assert _stats(pool).pinned_bytes == 3 * BS
    for i in range(10, 20):
        pool.put(_key(i), _block(i))
    assert pool.lookup(chain)[0] == 3
    assert pool.unpin_prefix(chain) == 3 and _stats(pool).pinned_bytes == 0
    assert pool.remove(chain[0]) == BS and pool.pin_prefix(chain) == 0
