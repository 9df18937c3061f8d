"""A slow tier never stalls the others: the pool runs an SSD tier's commit (its LMDB
transaction) outside its lock, for a put into the SSD tier, for a block demoted there and for
a batch, and keeps its invariants while that write is in flight. The SSD tier is a real
:class:`kvstore.tiers.ssd.SsdTier` on an LMDB directory whose ``persist`` waits on an Event,
so each test parks a write, shows what the rest of the pool does meanwhile, then lets it go.
No timing: every wait is on an Event, bounded only so that a regression fails instead of
hanging."""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore.pool.pool import KVPool, PutResult
from kvstore.tiers.base import Slot
from kvstore.tiers.ssd import SsdTier
from tests.helpers.pool_helpers import BS, EXACT, block_of, key_of, stats_of

BOUND_S = 60.0   # a liveness bound, not a measurement: a parked write never waits this long


class ParkedSsd(SsdTier):
    """An SSD tier whose next ``persist`` (while :attr:`parking`) stops until released."""

    def __init__(self, capacity_bytes: int, path: str) -> None:
        super().__init__(capacity_bytes, path)
        self.parking = False
        self.parked = threading.Event()
        self.go = threading.Event()

    def persist(self, items: Sequence[tuple[Slot, bytes, int]]) -> list[Exception | None]:
        if self.parking:
            self.parking = False
            self.parked.set()
            assert self.go.wait(BOUND_S), "the parked SSD write was never released"
        return super().persist(items)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def _done(fn: Callable[[], Any]) -> Any:
    """``fn()`` on another thread; its result once it returned (fails if it blocks)."""
    t, out = _in_thread(fn)
    t.join(BOUND_S)
    assert not t.is_alive(), "blocked behind the parked SSD write"
    return out[0]


@pytest.fixture
def pool_and_ssd(make_dram: Callable[..., Any], tmp_path: Path) -> Any:
    ssd = ParkedSsd(16 * BS, str(tmp_path / "ssd"))
    pool = KVPool([make_dram(2 * BS), ssd], settings=EXACT)
    yield pool, ssd
    ssd.go.set()
    pool.check_integrity()
    pool.close()


def test_a_parked_ssd_put_does_not_block_a_dram_get(pool_and_ssd: Any) -> None:
    pool, ssd = pool_and_ssd
    assert pool.put(key_of(1), block_of(1)).ok               # in DRAM
    ssd.parking = True
    writer, result = _in_thread(lambda: pool.put(key_of(2), block_of(2), tier="ssd"))
    assert ssd.parked.wait(BOUND_S)
    # The SSD transaction is parked: DRAM gets, lookups, stats and the invariants go on.
    assert _done(lambda: pool.get(key_of(1))) == block_of(1)
    assert _done(lambda: pool.lookup([key_of(1)])) == (1, ("dram",))
    assert _done(lambda: pool.contains(key_of(2))) is False  # not visible before its commit
    _done(pool.check_integrity)
    assert writer.is_alive() and not ssd.go.is_set()         # still parked all along
    ssd.go.set()
    writer.join(BOUND_S)
    assert result == [PutResult(key_of(2), True)]
    assert pool.get(key_of(2)) == block_of(2)
    assert stats_of(pool)["ssd"].blocks == 1


def test_a_parked_demotion_does_not_block_a_dram_get(pool_and_ssd: Any) -> None:
    pool, ssd = pool_and_ssd
    for i in (1, 2):
        assert pool.put(key_of(i), block_of(i)).ok           # DRAM full (2 blocks)
    ssd.parking = True
    # The third put evicts block 1 (least recent) and demotes it to SSD: parked there.
    writer, result = _in_thread(lambda: pool.put(key_of(3), block_of(3)))
    assert ssd.parked.wait(BOUND_S)
    assert _done(lambda: pool.get(key_of(2))) == block_of(2)
    # In flight to SSD, block 1 is held nowhere yet (a miss), and the books still agree.
    assert _done(lambda: pool.lookup([key_of(1)])) == (0, ())
    _done(pool.check_integrity)
    # A put of the same key into SSD meanwhile waits for the demotion, then finds it stored.
    racer, raced = _in_thread(lambda: pool.put(key_of(1), block_of(1), tier="ssd"))
    assert writer.is_alive() and not ssd.go.is_set()
    ssd.go.set()
    writer.join(BOUND_S)
    racer.join(BOUND_S)
    assert result == [PutResult(key_of(3), True)]
    assert raced == [PutResult(key_of(1), True, existed=True)]
    stats = stats_of(pool)
    assert (stats["dram"].demotions, stats["ssd"].blocks) == (1, 1)
    assert pool.lookup([key_of(1)]) == (1, ("ssd",))
    assert pool.read(key_of(1), bytes) == block_of(1)        # from SSD (then promoted)


def test_a_parked_batch_commit_keeps_chain_links_and_aborts_cleanly(pool_and_ssd: Any) -> None:
    pool, ssd = pool_and_ssd
    chain = [(key_of(i), block_of(i)) for i in (10, 11, 12)]
    ssd.parking = True
    writer, result = _in_thread(lambda: pool.put_chain(chain, tier="ssd"))
    assert ssd.parked.wait(BOUND_S)
    assert _done(lambda: pool.put(key_of(1), block_of(1))).ok   # DRAM puts go on
    ssd.go.set()
    writer.join(BOUND_S)
    assert all(r.ok and not r.existed for r in result[0])
    assert pool.lookup([k for k, _ in chain]) == (3, ("ssd",) * 3)
    # An aborted reservation whose bytes were never persisted leaves nothing behind.
    res = pool.reserve(key_of(20), BS, tier="ssd")
    pool.write(res, block_of(20))
    pool.abort(res)
    assert not pool.contains(key_of(20))
    assert ssd.pending_deletes == 0


def test_removed_ssd_blocks_are_deleted_on_disk_outside_the_lock(pool_and_ssd: Any) -> None:
    pool, ssd = pool_and_ssd
    assert pool.put(key_of(5), block_of(5), tier="ssd").ok
    assert pool.remove(key_of(5)) == BS
    assert ssd.pending_deletes == 0                           # flushed by the pool, after the lock
    with ssd._env.begin(db=ssd._data) as txn:
        assert txn.get(key_of(5)) is None
    assert pool.get(key_of(5)) is None
