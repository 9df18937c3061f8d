"""Abort a request while its blocks are being transferred, admit another
at once. Real pools (shared-memory DRAM slabs), real threads; no mocks."""
from __future__ import annotations

import hashlib
import threading

import pytest

from kvstore.pool.pool import KVPool
from scheduler.routing.request_transfers import KVTransfer, TransferTable

BLOCK = 256 << 10          # big enough that a write is still in flight when the abort comes
BLOCKS = 4


def chain(tag: str) -> list[tuple[bytes, bytes]]:
    return [(hashlib.sha256(f"{tag}{i}".encode()).digest(), bytes([i + (1 if tag == "a" else 101)]) * BLOCK)
            for i in range(BLOCKS)]


def free_bytes(pool: KVPool) -> int:
    return sum(s.capacity_bytes - s.used_bytes for s in pool.stats())


@pytest.fixture
def pools(make_dram):
    source = KVPool([make_dram(16 << 20)], node_id="store-0")
    target = KVPool([make_dram(4 << 20)], node_id="decode-0")
    return source, target


def overlaps(a, b) -> bool:
    return a.slot is not None and b.slot is not None and \
        a.slot.offset < b.slot.offset + b.slot.size and b.slot.offset < a.slot.offset + a.slot.size


def test_abort_mid_transfer_then_admit_at_once_100_cycles(pools):
    """Even cycles stop the first transfer between two chunks, abort it there and admit the
    second before it may go on (deterministic); odd cycles race the abort against the
    copying (a write may be in flight; the transfer may also win and complete)."""
    source, target = pools
    a, b = chain("a"), chain("b")
    source.put_chain(a)
    source.put_chain(b)
    start = free_bytes(target)
    b_bytes = dict(b)
    aborted = 0
    for cycle in range(100):
        midway, go = threading.Event(), threading.Event()

        def pace(done: int, paced: bool = cycle % 2 == 0, midway: threading.Event = midway,
                 go: threading.Event = go) -> None:
            if paced and done == 3 * BLOCK // 2:     # halfway through the second block
                midway.set()
                go.wait(10)
        first = KVTransfer(f"a{cycle}", source, target, [k for k, _ in a], chunk_bytes=32 << 10, on_chunk=pace)
        worker = threading.Thread(target=first.run)
        worker.start()
        assert (midway if cycle % 2 == 0 else first.written).wait(10)
        first.abort()                               # the client went away mid-transfer
        in_flight = [r for r in first.reservations if r.writing]
        second = KVTransfer(f"b{cycle}", source, target, [k for k, _ in b])
        results = second.run()                      # admitted at once
        go.set()
        assert [r.ok for r in results] == [True] * BLOCKS
        for mine in second.reservations:
            assert not any(overlaps(mine, theirs) for theirs in in_flight)
        worker.join(10)
        assert not worker.is_alive()
        if cycle % 2 == 0:
            assert first.aborted
        aborted += first.aborted
        for key, _ in a:                            # an aborted transfer leaves nothing visible
            if first.aborted:
                assert not target.contains(key)
            target.remove(key)
        for key, _ in b:                         # and none of its bytes landed in the second's blocks
            assert target.get(key) == b_bytes[key]
            target.remove(key)
        target.check_integrity()
    assert aborted >= 50
    assert free_bytes(target) == start
    assert all(s.leased_bytes == 0 for s in source.stats())


def test_transfer_table_aborts_what_a_finished_request_left(pools):
    source, target = pools
    a = chain("a")
    source.put_chain(a)
    table = TransferTable()
    midway, go = threading.Event(), threading.Event()

    def pace(done: int) -> None:                    # hold the transfer in its second block
        if done == 3 * BLOCK // 2:
            midway.set()
            go.wait(10)
    t = KVTransfer("req-1", source, target, [k for k, _ in a], chunk_bytes=16 << 10, on_chunk=pace)
    table.add(t)
    worker = threading.Thread(target=t.run)
    worker.start()
    assert midway.wait(10)
    assert table.finish("req-1") == 1 and len(table) == 0 and t.aborted
    go.set()
    worker.join(10)
    assert free_bytes(target) == sum(s.capacity_bytes for s in target.stats())
    done = KVTransfer("req-2", source, target, [k for k, _ in a])
    assert len(done.run()) == BLOCKS and all(target.contains(k) for k, _ in a)
    done.abort()                                    # after completion an abort changes nothing
    assert all(target.contains(k) for k, _ in a)
