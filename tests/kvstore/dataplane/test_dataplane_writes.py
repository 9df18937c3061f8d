"""Puts through the same-host data plane (kvstore/dataplane/slab_writes.py, spares.py): bytes
copied into slab slots read back identical over gRPC, large blocks hashed beside their copy,
spare slots reserved ahead and never written past their write-by time, a failed copy that
leaves the client usable, paged blocks gathered at put."""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.integrity import checksum_of
from tests.helpers.dataplane_helpers import MIB, block_of, key_of


def test_puts_through_the_slab_read_back_over_grpc(slab_node, client_of) -> None:
    pool, address, _ = slab_node()
    local, remote = client_of(address), client_of(address, data_path="grpc")
    blocks = [(key_of(i), block_of(i, 256 << 10)) for i in range(8)]
    results = local.put_blocks(blocks, chain=True)
    assert [r.ok and not r.existed for r in results] == [True] * 8
    assert local.put_blocks(blocks[:2]) and all(r.existed for r in local.put_blocks(blocks[:2]))
    assert remote.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
    assert remote.lookup([k for k, _ in blocks]).blocks == 8 == local.lookup([k for k, _ in blocks]).blocks
    assert local.get_blocks([k for k, _ in blocks[:3]] + [key_of(99), blocks[4][0]], stop_at_miss=True) == \
        [d for _, d in blocks[:3]] + [None]
    pool.check_integrity()


def test_large_puts_and_gets_hash_beside_the_copy_and_catch_a_flipped_byte(slab_node, client_of) -> None:
    """Blocks of 1 MiB and 5 MiB: the put hashes them on a helper thread and commits in
    pipelined chunks; the get of the 5 MiB block verifies chunk by chunk beside its copy.
    The checksums the writer sent are those of the bytes; one flipped byte in the slab
    makes the block a miss, and the reader's report (Scrub) has the node drop it."""
    pool, address, _ = slab_node(dram_bytes=64 * MIB)
    client, remote = client_of(address), client_of(address, data_path="grpc")
    blocks = [(key_of(i), block_of(i, size)) for i, size in enumerate([MIB, 5 * MIB + 3, MIB, 3 * MIB])]
    assert all(r.ok and not r.existed for r in client.put_blocks(blocks, chain=True))
    assert remote.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
    assert [pool.tiers[0].locate(k)[2] for k, _ in blocks] == [checksum_of(d) for _, d in blocks]
    pool.check_integrity()
    outs = [np.zeros(len(d), dtype=np.uint8) for _, d in blocks]
    assert client.get_into([k for k, _ in blocks], outs) == [len(d) for _, d in blocks]
    assert all(o.tobytes() == d for o, (_, d) in zip(outs, blocks))
    tier = pool.tiers[0]
    offset, size, _ = tier.locate(blocks[1][0])
    tier._slab[offset + size // 2] ^= 0xFF  # corrupt the middle of the 5 MiB block in place
    assert client.get_into([blocks[1][0], blocks[2][0]], outs[1:3]) == [None, MIB]
    # the client reported it, the node verified it and dropped it: the next read misses at once
    assert not pool.contains(blocks[1][0]) and pool.contains(blocks[2][0])
    assert {s.name: s.integrity_failures for s in pool.stats()}["dram"] == 1
    assert remote.scrub([blocks[0][0], blocks[2][0]]) == (2, 0)        # a healthy block stays on a report
    with pytest.raises(InvalidArgument, match="key"):
        remote.scrub([b"short"])
    offset, size, _ = tier.locate(blocks[3][0])
    tier._slab[offset] ^= 0x01                 # the gRPC stream's reader verifies and reports too
    assert remote.get_blocks([blocks[3][0], blocks[0][0]]) == [None, blocks[0][1]]
    assert not pool.contains(blocks[3][0])
    assert {s.name: s.integrity_failures for s in pool.stats()}["dram"] == 2
    pool.check_integrity()


def test_repeated_puts_of_one_size_use_spare_slots_and_survive_their_timeout(slab_node, client_of) -> None:
    pool, address, _ = slab_node(reservation_timeout_s=0.5)
    client = client_of(address)
    plane = client._local()
    assert client.put(key_of(1), block_of(1)).ok
    plane.spares.stock(plane.control.take_spares(wait=True))  # granted just after the commit's reply
    assert plane.spares.by_size.get(64 << 10), "a commit hands out spare slots for the next put"
    assert client.put(key_of(2), block_of(2)).ok  # written into a spare: one round trip
    host = slab_node.nodes[id(pool)].dataplane
    assert host.lent()[1] > 0                  # the spares lent out (kvstore_reservations)
    time.sleep(0.8)                            # the spares time out in the pool
    pool.stats()                               # a scrape reads the pool's stats: it frees expired reservations
    assert host.lent()[1] == 0                 # the gauge drops with them (it stayed up until 256 operations)
    assert client.put(key_of(3), block_of(3)).ok  # put again through a fresh reservation
    assert client.get_blocks([key_of(1), key_of(2), key_of(3)]) == [block_of(1), block_of(2), block_of(3)]
    client.close()                             # the session's spares are given back
    deadline = time.monotonic() + 5
    while pool.stats()[0].reserved_bytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.stats()[0].reserved_bytes == 0
    pool.check_integrity()


def test_a_spare_slot_past_its_write_by_time_is_never_written(slab_node, client_of) -> None:
    """A holds spare slots, idles past their reservation timeout, B's blocks take the freed
    space, then A puts again: A must not copy into its stale spares (B's bytes stay intact,
    read straight out of the slab without a checksum) and A's put still succeeds."""
    pool, address, _ = slab_node(dram_bytes=16 * MIB, reservation_timeout_s=1.0)
    a, b = client_of(address), client_of(address)
    plane = a._local()
    assert a.put(key_of(1), block_of(1)).ok
    plane.spares.stock(plane.control.take_spares(wait=True))
    assert plane.spares.by_size.get(64 << 10)
    time.sleep(1.3)                                   # A's spares time out in the pool
    ours = [(key_of(100 + i), block_of(100 + i)) for i in range(16)]
    assert all(r.ok for r in b.put_blocks(ours))      # B may get the space A's spares held
    assert a.put(key_of(2), block_of(2)).ok
    assert [pool.get(k) for k, _ in ours] == [d for _, d in ours]  # no verification on this read
    assert a.get_blocks([key_of(1), key_of(2)]) == [block_of(1), block_of(2)]


def test_spare_slots_stay_under_the_per_connection_cap_when_sizes_change(slab_node, client_of) -> None:
    """One block per call, the size changing every call: the writer keeps spares of the
    current size only and the slab_node caps a connection's spares at 1/16 of the tier, so no
    stored block is evicted to make room for spares."""
    pool, address, _ = slab_node(dram_bytes=64 * MIB)
    client = client_of(address)
    cap = 64 * MIB // 16
    sizes = [(64 << 10) * (1 + i % 12) for i in range(48)]
    for i, size in enumerate(sizes):
        assert client.put(key_of(i), block_of(i, size)).ok
        assert pool.stats()[0].reserved_bytes <= cap + max(sizes)
    assert client.lookup([key_of(i) for i in range(len(sizes))]).blocks > 0
    assert all(pool.get(key_of(i)) == block_of(i, size) for i, size in enumerate(sizes))  # none evicted


@pytest.mark.timeout(60)
def test_a_pipelined_put_whose_copy_fails_raises_and_leaves_the_client_usable(slab_node, client_of) -> None:
    torch = pytest.importorskip("torch")
    pool, address, _ = slab_node(dram_bytes=64 * MIB)
    client = client_of(address)
    bad = torch.empty(3 * MIB, dtype=torch.uint8, device="meta")  # a copy out of it raises
    blocks = [(key_of(1), block_of(1, 3 * MIB)), (key_of(2), block_of(2, 3 * MIB)), (key_of(3), bad)]
    with pytest.raises(NotImplementedError):
        client.put_blocks(blocks)                     # over 4 MiB: committed in pipelined chunks
    with pytest.raises(NotImplementedError):          # one block: its COMMIT went out before the copy
        client.put_blocks([(key_of(5), torch.empty(MIB, dtype=torch.uint8, device="meta"))])
    assert client.put(key_of(4), block_of(4)).ok and client.get(key_of(4)) == block_of(4)
    assert client.get(key_of(5)) is None
    assert client.get(key_of(3)) is None
    deadline = time.monotonic() + 5
    while pool.stats()[0].reserved_bytes > 64 * MIB // 16 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.stats()[0].reserved_bytes <= 64 * MIB // 16  # at most the writer's spares
    pool.check_integrity()


def test_a_one_block_put_whose_spare_timed_out_before_commit_is_put_again(slab_node, client_of) -> None:
    """The one-block fast path: a spare slot that the slab_node no longer holds at commit (its
    reservation ran out; here the write-by time is erased so the writer uses it anyway,
    which a real writer never does) fails its commit, and the block is put again through
    a fresh reservation: the put succeeds and the bytes read back."""
    pool, address, _ = slab_node(reservation_timeout_s=0.4)
    client = client_of(address)
    plane = client._local()
    assert client.put(key_of(1), block_of(1)).ok
    plane.spares.stock(plane.control.take_spares(wait=True))
    stock = plane.spares.by_size[64 << 10]
    stock[:] = [g._replace(write_by=0.0) for g in stock]   # always "in time"
    time.sleep(0.6)                                         # the slab_node's reservations run out
    redone = []
    put_window = plane._put_window
    plane._put_window = lambda *a, **kw: redone.append(a[0]) or put_window(*a, **kw)
    assert client.put(key_of(2), block_of(2)).ok
    assert redone == [[key_of(2)]]                            # the commit failed; put again once
    assert client.get_blocks([key_of(1), key_of(2)]) == [block_of(1), block_of(2)]
    pool.check_integrity()


@pytest.mark.parametrize("data_path", ["auto", "grpc"])
def test_a_block_in_segments_is_gathered_at_put_and_scattered_at_get(slab_node, client_of, data_path) -> None:
    """A paged KV block (one part per layer, engines/vllm/layout.py) goes into one slot and
    comes back out into its parts, with no staging buffer on the same host; its checksum is
    that of the concatenated parts, so a flipped byte in the slab is a miss."""
    from kvstore.tiers.buffers import Segments

    pool, address, _ = slab_node(dram_bytes=16 * MIB)
    client = client_of(address, data_path=data_path)
    layers = [np.frombuffer(block_of(i, 4096), dtype=np.uint8).copy() for i in range(3)]
    whole = b"".join(p.tobytes() for p in layers)
    assert client.put_blocks([(key_of(1), Segments(layers))])[0].ok
    assert client.get(key_of(1)) == whole
    assert pool.tiers[0].locate(key_of(1))[2] == checksum_of(whole)
    outs = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    assert client.get_into([key_of(1)], [Segments(outs)]) == [3 * 4096]
    assert all(np.array_equal(o, p) for o, p in zip(outs, layers))
    offset, size, _ = pool.tiers[0].locate(key_of(1))
    pool.tiers[0]._slab[offset + 5000] ^= 0xFF
    assert client.get_into([key_of(1)], [Segments(outs)]) == [None]


def test_tiny_spares_are_capped_by_the_pages_they_take(slab_node) -> None:
    """A connection's spares are capped at 1/16 of the tier counted in the pages they take
    of the slab: one-byte spares asked for after every commit (64 a time, never used) hold
    at most 4 MiB of a 64 MiB slab, not 4 MiB of one-byte sizes (a page each: 10 MiB)."""
    from kvstore.dataplane.control_client import UdsControl

    pool, _, path = slab_node(dram_bytes=64 * MIB)
    ctl = UdsControl(path)
    try:
        for i in range(40):
            grant = ctl.reserve([(key_of(i), 1)])[0]
            assert grant.res_id and ctl.commit([grant.res_id], [key_of(i)], spare=(1, 64))[0].ok
            ctl.take_spares(wait=True)                 # read, kept, never used
        assert pool.stats()[0].reserved_bytes <= 64 * MIB // 16
        assert pool.stats()[0].blocks == 40
    finally:
        ctl.close()
    pool.check_integrity()
