"""The same-host data plane (kvstore/dataplane): a real store service on 127.0.0.1 with its
Unix control socket, a real shared-memory DRAM slab mapped by the client, the client's
automatic choice of path, byte-identical gets into numpy arrays and torch tensors, puts
through the slab, and the lease rule: a block is never readable through the mapping after
its lease expired and it was evicted (its bytes reused)."""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from kvstore.client import StoreClient
from kvstore.errors import InvalidArgument, LeaseExpired
from kvstore.wire.types import MAPPED, LeaseGrant
from tests.helpers.dataplane_helpers import MIB, block_of, key_of, plane_of


def test_client_picks_the_same_host_path(slab_node, client_of) -> None:
    _, address, path = slab_node()
    assert client_of(address).data_path_in_use == "same-host/uds"
    assert client_of(address, data_path="grpc").data_path_in_use == "grpc"
    _, address2, _ = slab_node(socket=False)
    assert client_of(address2).data_path_in_use == "same-host/grpc"  # slab mapped, control over gRPC
    assert os.stat(path).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("socket", [True, False], ids=["uds", "grpc-control"])
@pytest.mark.parametrize("size", [1, 4096, MIB + 3])
def test_get_into_numpy_is_byte_identical(slab_node, client_of, socket: bool, size: int) -> None:
    pool, address, _ = slab_node(socket=socket)
    blocks = [(key_of(i), block_of(i, size)) for i in range(3)]
    assert all(r.ok for r in pool.put_many(blocks))
    client = client_of(address)
    outs = [np.zeros(size + 5, dtype=np.uint8) for _ in blocks]
    assert client.get_into([k for k, _ in blocks] + [key_of(99)], outs + [np.zeros(1, np.uint8)]) == [size] * 3 + [None]
    for (_, data), out in zip(blocks, outs):
        assert out[:size].tobytes() == data and not out[size:].any()
    assert client.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]


def test_get_into_torch_tensor_is_byte_identical(slab_node, client_of) -> None:
    torch = pytest.importorskip("torch")
    pool, address, _ = slab_node()
    kv = torch.randn(2, 4, 16, 64, dtype=torch.float16)  # one block of a layer's K: 16 KiB
    raw = kv.numpy().tobytes()
    pool.put(key_of(1), raw)
    out = torch.empty_like(kv)
    assert client_of(address).get_into([key_of(1)], [out]) == [len(raw)]
    assert torch.equal(out, kv) and out.numpy().tobytes() == raw


@pytest.mark.skipif("torch" not in sys.modules and not __import__("importlib").util.find_spec("torch"),
                    reason="torch is not installed")
def test_get_into_cuda_tensor(slab_node, client_of) -> None:
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pool, address, _ = slab_node()
    kv = torch.randn(4096, dtype=torch.float32)
    pool.put(key_of(2), kv.numpy().tobytes())
    out = torch.empty(4096, dtype=torch.float32, device="cuda")
    assert client_of(address).get_into([key_of(2)], [out]) == [kv.numel() * 4]
    assert torch.equal(out.cpu(), kv)


def test_a_prefix_chain_is_one_lease_and_one_copy_per_block(slab_node, client_of) -> None:
    pool, address, _ = slab_node()
    client = client_of(address)
    chain = [(key_of(i), block_of(i, 4096)) for i in range(300)]
    assert all(r.ok for r in client.put_blocks(chain, chain=True))
    keys = [k for k, _ in chain]
    assert client.lookup(keys + [key_of(999)]).blocks == 300
    outs = [np.zeros(4096, np.uint8) for _ in range(302)]
    got = client.get_into(keys[:150] + [key_of(999)] + keys[150:], outs[:301], stop_at_miss=True)
    assert got == [4096] * 150 + [None]
    assert all(o.tobytes() == d for o, (_, d) in zip(outs[:150], chain[:150]))
    deadline = time.monotonic() + 5  # the release frame needs no reply: it lands a moment later
    while pool.stats()[0].leased_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    s = pool.stats()[0]
    assert s.leased_bytes == 0 and s.hits == 150 and s.misses == 1
    pool.check_integrity()


def test_blocks_in_another_tier_come_over_the_grpc_stream(slab_node, client_of) -> None:
    pool, address, _ = slab_node(dram_bytes=4 * MIB, ssd_bytes=16 * MIB, promote_on_hit=False)
    data = block_of(5, MIB)
    assert pool.put(key_of(5), data, tier="ssd").ok
    client = client_of(address)
    out = np.zeros(MIB, dtype=np.uint8)
    assert client.get_into([key_of(5)], [out]) == [MIB] and out.tobytes() == data
    assert client.get_blocks([key_of(5)]) == [data]


def test_a_large_batch_leases_in_pipelined_chunks_and_keeps_every_block_in_place(slab_node, client_of) -> None:
    """300 keys (over two lease chunks): DRAM hits, misses and SSD blocks interleaved come
    back in the caller's order, and every chunk's lease is released."""
    from kvstore.dataplane.slab_reads import LEASE_CHUNK
    n = 300
    assert n > 2 * LEASE_CHUNK
    pool, address, _ = slab_node(dram_bytes=16 * MIB, ssd_bytes=16 * MIB, promote_on_hit=False)
    blocks = {i: block_of(i, 4096) for i in range(n) if i % 7}  # every 7th key is a miss
    assert all(pool.put(key_of(i), d, tier="ssd" if i % 50 == 1 else None).ok for i, d in blocks.items())
    client = client_of(address)
    outs = [np.zeros(4096, dtype=np.uint8) for _ in range(n)]
    got = client.get_into([key_of(i) for i in range(n)], outs)
    assert got == [4096 if i in blocks else None for i in range(n)]
    assert all(outs[i].tobytes() == d for i, d in blocks.items())
    assert client.get_blocks([key_of(i) for i in range(n)]) == [blocks.get(i) for i in range(n)]
    deadline = time.monotonic() + 5  # releases need no reply: they land a moment later
    while pool.stats()[0].leased_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.stats()[0].leased_bytes == 0


def test_an_expired_and_evicted_block_is_never_read_through_the_mapping(slab_node) -> None:
    """Lease A with a short TTL, let it expire, evict it and put B into the same slab space:
    the mapped read of A raises LeaseExpired and never returns B's bytes; and even a grant
    that claimed to be valid would only give a miss (the checksum guard)."""
    pool, address, path = slab_node(dram_bytes=4 * MIB)
    plane = plane_of(pool, path)
    a, b = block_of(10, MIB), block_of(11, MIB)
    assert plane.put_blocks([(key_of(10), a)])[0].ok
    grant = plane.control.lease([key_of(10)], ttl_s=0.05)
    assert grant.blocks[0].state == MAPPED
    # a live lease keeps A from being evicted
    assert pool.evict("dram", 4 * MIB) == (0, 0) and pool.contains(key_of(10))
    time.sleep(0.1)
    assert pool.evict("dram", 4 * MIB)[1] == 1 and not pool.contains(key_of(10))
    plane.spares.by_size.clear()  # so B takes the lowest free pages: A's
    assert plane.put_blocks([(key_of(11), b)])[0].ok
    assert pool.tier("dram").locate(key_of(11))[0] == grant.blocks[0].offset, "B reuses A's pages"
    out = np.zeros(MIB, dtype=np.uint8)
    with pytest.raises(LeaseExpired):
        plane.copy_leased(grant, [key_of(10)], [out])
    forged = LeaseGrant(grant.lease_id, time.monotonic() + 60, grant.blocks)
    assert plane.copy_leased(forged, [key_of(10)], [out])[0] == [None]  # B's bytes fail A's checksum
    plane.control.release(grant.lease_id)
    # through the public API a too-short lease is LeaseExpired or A's bytes, never B's
    plane.lease_ttl_s = 1e-9
    with pytest.raises(LeaseExpired):
        plane.get_into([key_of(11)], [out])
    plane.close()
    pool.check_integrity()


def test_a_client_builds_its_slab_mapping_in_the_background(slab_node, client_of) -> None:
    """The same-host client populates its own mapping of the slab (page tables) on a
    thread; the whole slab ends up resident in this process; close() stops it first."""
    pool, address, _ = slab_node(dram_bytes=64 * MIB)
    client = client_of(address)
    plane = client._local()
    assert plane._prefault is not None and plane._prefault.done.wait(30)
    assert plane._prefault.populated == plane._slab.nbytes
    assert client.put(key_of(1), block_of(1)).ok and client.get_blocks([key_of(1)]) == [block_of(1)]
    client.close()
    assert not plane._prefault._thread.is_alive()
    plain = StoreClient(address, prefault=False)
    try:
        assert plain._local()._prefault is None
    finally:
        plain.close()


def test_attach_maps_the_slab_at_once_and_waits_for_its_page_tables(slab_node, client_of) -> None:
    """``attach`` decides the data path before any get or put and returns with this
    process's page tables of the slab built; a node not reached yet is asked again later."""
    from launcher.supervisor import free_port
    _, address, _ = slab_node(dram_bytes=64 * MIB)
    client = client_of(address)
    assert client.attach(wait_s=30) == ("same-host/uds", True)
    plane = client._plane
    assert plane._prefault.done.is_set() and plane._prefault.populated == plane._slab.nbytes
    nowhere = StoreClient(f"127.0.0.1:{free_port()}", timeout_s=0.5)
    try:
        assert nowhere.attach(wait_s=30) == ("", False) and not nowhere._plane_decided
    finally:
        nowhere.close()


def test_unusable_buffers_get_invalid_argument(slab_node, client_of) -> None:
    pool, address, _ = slab_node()
    client = client_of(address)
    assert client.put(key_of(1), block_of(1)).ok
    frozen = np.zeros(len(block_of(1)), np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgument, match="output buffer 0"):
        client.get_into([key_of(1)], [frozen])
    strided = memoryview(bytearray(8192))[::2]
    with pytest.raises(InvalidArgument, match="contiguous"):
        client.put(key_of(2), strided)
    assert client.get_blocks([key_of(1)]) == [block_of(1)]
    assert client.lookup([key_of(1)]).blocks == 1           # after the releases on that socket
    assert pool.stats()[0].leased_bytes == 0


def test_a_same_host_read_of_a_block_in_ssd_counts_one_hit(slab_node, client_of) -> None:
    """The same-host reader leases a block, finds it below the slab, and reads it over
    gRPC: the tiers and the tenant count that one read once (a DRAM miss, an SSD hit, a
    tenant hit), as a gRPC read of it does — the lease does not count it too."""
    from kvstore.pool.tenants import attach, namespace_stats
    pool, address, _ = slab_node(dram_bytes=4 * MIB, ssd_bytes=16 * MIB)
    attach(pool)
    client = client_of(address)
    assert client.put_blocks([(key_of(1), block_of(1, MIB))], namespace="t")[0].ok
    assert pool.evict("dram", 1) == (MIB, 1)                       # demoted: in SSD only
    before = {s.name: (s.hits, s.misses) for s in pool.stats()}
    hits = namespace_stats(pool)["t"].hits
    assert client.get_blocks([key_of(1)]) == [block_of(1, MIB)]
    assert client.data_path_in_use == "same-host/uds"
    after = {s.name: (s.hits, s.misses) for s in pool.stats()}
    assert after["dram"] == (before["dram"][0], before["dram"][1] + 1)
    assert after["ssd"] == (before["ssd"][0] + 1, before["ssd"][1])
    assert namespace_stats(pool)["t"].hits == hits + 1
