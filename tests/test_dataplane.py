"""The same-host data plane (kvstore/dataplane): a real store service on 127.0.0.1 with its
Unix control socket, a real shared-memory DRAM slab mapped by the client, the client's
automatic choice of path, byte-identical gets into numpy arrays and torch tensors, puts
through the slab, and the lease rule: a block is never readable through the mapping after
its lease expired and it was evicted (its bytes reused)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np
import pytest

from kvstore.client import StoreClient
from kvstore.dataplane import framing
from kvstore.dataplane.control_client import UdsControl
from kvstore.dataplane.local import LocalDataPlane
from kvstore.errors import InvalidArgument, LeaseExpired, Unavailable
from kvstore.integrity import checksum_of
from kvstore.limits import MAX_KEYS_PER_CALL
from kvstore.node import StoreNode
from kvstore.pool import KVPool, PoolSettings
from kvstore.wire import frame_codec as wire
from kvstore.wire.errors import frame_status
from kvstore.wire.types import MAPPED, LeaseGrant

MIB = 1 << 20


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _block(i: int, size: int = 64 << 10) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size=size, dtype=np.uint8).tobytes()


def _socket_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"kvstore-test-{uuid.uuid4().hex[:8]}.sock")  # < 108 bytes


@pytest.fixture
def node(make_dram, make_ssd):
    """Yields a factory: ``start(dram_bytes, ssd_bytes=0, socket=True, token=None, **settings)``
    → (pool, address, socket path or ""); everything is stopped after the test."""
    started = []

    def start(dram_bytes: int = 16 * MIB, ssd_bytes: int = 0, socket: bool = True, token: str | None = None,
              **settings):
        tiers = [make_dram(dram_bytes)] + ([make_ssd(ssd_bytes)] if ssd_bytes else [])
        pool = KVPool(tiers, settings=PoolSettings(high_watermark=1.0, low_watermark=1.0, **settings))
        path = _socket_path() if socket else ""
        served = StoreNode.serve(pool, auth_token=token, dataplane_socket=path or None)
        started.append(served)
        nodes[id(pool)] = served
        return pool, served.address, path

    nodes: dict[int, StoreNode] = {}
    start.nodes = nodes  # type: ignore[attr-defined]  # id(pool) -> its StoreNode
    yield start
    for served in started:
        served.stop(grace_s=None)


@pytest.fixture
def client_of():
    made: list[StoreClient] = []

    def make(address: str, **kw) -> StoreClient:
        c = StoreClient(address, timeout_s=30, **kw)
        c.wait_ready(10)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_client_picks_the_same_host_path(node, client_of) -> None:
    _, address, path = node()
    assert client_of(address).data_path_in_use == "same-host/uds"
    assert client_of(address, data_path="grpc").data_path_in_use == "grpc"
    _, address2, _ = node(socket=False)
    assert client_of(address2).data_path_in_use == "same-host/grpc"  # slab mapped, control over gRPC
    assert os.stat(path).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("socket", [True, False], ids=["uds", "grpc-control"])
@pytest.mark.parametrize("size", [1, 4096, MIB + 3])
def test_get_into_numpy_is_byte_identical(node, client_of, socket: bool, size: int) -> None:
    pool, address, _ = node(socket=socket)
    blocks = [(_key(i), _block(i, size)) for i in range(3)]
    assert all(r.ok for r in pool.put_many(blocks))
    client = client_of(address)
    outs = [np.zeros(size + 5, dtype=np.uint8) for _ in blocks]
    assert client.get_into([k for k, _ in blocks] + [_key(99)], outs + [np.zeros(1, np.uint8)]) == [size] * 3 + [None]
    for (_, data), out in zip(blocks, outs):
        assert out[:size].tobytes() == data and not out[size:].any()
    assert client.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]


def test_get_into_torch_tensor_is_byte_identical(node, client_of) -> None:
    torch = pytest.importorskip("torch")
    pool, address, _ = node()
    kv = torch.randn(2, 4, 16, 64, dtype=torch.float16)  # one block of a layer's K: 16 KiB
    raw = kv.numpy().tobytes()
    pool.put(_key(1), raw)
    out = torch.empty_like(kv)
    assert client_of(address).get_into([_key(1)], [out]) == [len(raw)]
    assert torch.equal(out, kv) and out.numpy().tobytes() == raw


@pytest.mark.skipif("torch" not in sys.modules and not __import__("importlib").util.find_spec("torch"),
                    reason="torch is not installed")
def test_get_into_cuda_tensor(node, client_of) -> None:
    import torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pool, address, _ = node()
    kv = torch.randn(4096, dtype=torch.float32)
    pool.put(_key(2), kv.numpy().tobytes())
    out = torch.empty(4096, dtype=torch.float32, device="cuda")
    assert client_of(address).get_into([_key(2)], [out]) == [kv.numel() * 4]
    assert torch.equal(out.cpu(), kv)


def test_puts_through_the_slab_read_back_over_grpc(node, client_of) -> None:
    pool, address, _ = node()
    local, remote = client_of(address), client_of(address, data_path="grpc")
    blocks = [(_key(i), _block(i, 256 << 10)) for i in range(8)]
    results = local.put_blocks(blocks, chain=True)
    assert [r.ok and not r.existed for r in results] == [True] * 8
    assert local.put_blocks(blocks[:2]) and all(r.existed for r in local.put_blocks(blocks[:2]))
    assert remote.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
    assert remote.lookup([k for k, _ in blocks]).blocks == 8 == local.lookup([k for k, _ in blocks]).blocks
    assert local.get_blocks([k for k, _ in blocks[:3]] + [_key(99), blocks[4][0]], stop_at_miss=True) == \
        [d for _, d in blocks[:3]] + [None]
    pool.check_integrity()


def test_large_puts_and_gets_hash_beside_the_copy_and_catch_a_flipped_byte(node, client_of) -> None:
    """Blocks of 1 MiB and 5 MiB: the put hashes them on a helper thread and commits in
    pipelined chunks; the get of the 5 MiB block verifies chunk by chunk beside its copy.
    The checksums the writer sent are those of the bytes; one flipped byte in the slab
    makes the block a miss."""
    pool, address, _ = node(dram_bytes=64 * MIB)
    client, remote = client_of(address), client_of(address, data_path="grpc")
    blocks = [(_key(i), _block(i, size)) for i, size in enumerate([MIB, 5 * MIB + 3, MIB, 3 * MIB])]
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


def test_a_prefix_chain_is_one_lease_and_one_copy_per_block(node, client_of) -> None:
    pool, address, _ = node()
    client = client_of(address)
    chain = [(_key(i), _block(i, 4096)) for i in range(300)]
    assert all(r.ok for r in client.put_blocks(chain, chain=True))
    keys = [k for k, _ in chain]
    assert client.lookup(keys + [_key(999)]).blocks == 300
    outs = [np.zeros(4096, np.uint8) for _ in range(302)]
    got = client.get_into(keys[:150] + [_key(999)] + keys[150:], outs[:301], stop_at_miss=True)
    assert got == [4096] * 150 + [None]
    assert all(o.tobytes() == d for o, (_, d) in zip(outs[:150], chain[:150]))
    deadline = time.monotonic() + 5  # the release frame needs no reply: it lands a moment later
    while pool.stats()[0].leased_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    s = pool.stats()[0]
    assert s.leased_bytes == 0 and s.hits == 150 and s.misses == 1
    pool.check_integrity()


def test_repeated_puts_of_one_size_use_spare_slots_and_survive_their_timeout(node, client_of) -> None:
    pool, address, _ = node(reservation_timeout_s=0.5)
    client = client_of(address)
    plane = client._local()
    assert client.put(_key(1), _block(1)).ok
    plane.spares.stock(plane.control.take_spares(wait=True))  # granted just after the commit's reply
    assert plane.spares.by_size.get(64 << 10), "a commit hands out spare slots for the next put"
    assert client.put(_key(2), _block(2)).ok  # written into a spare: one round trip
    time.sleep(0.8)                            # the spares time out in the pool
    assert client.put(_key(3), _block(3)).ok  # put again through a fresh reservation
    assert client.get_blocks([_key(1), _key(2), _key(3)]) == [_block(1), _block(2), _block(3)]
    client.close()                             # the session's spares are given back
    deadline = time.monotonic() + 5
    while pool.stats()[0].reserved_bytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.stats()[0].reserved_bytes == 0
    pool.check_integrity()


def test_blocks_in_another_tier_come_over_the_grpc_stream(node, client_of) -> None:
    pool, address, _ = node(dram_bytes=4 * MIB, ssd_bytes=16 * MIB, promote_on_hit=False)
    data = _block(5, MIB)
    assert pool.put(_key(5), data, tier="ssd").ok
    client = client_of(address)
    out = np.zeros(MIB, dtype=np.uint8)
    assert client.get_into([_key(5)], [out]) == [MIB] and out.tobytes() == data
    assert client.get_blocks([_key(5)]) == [data]


def test_a_large_batch_leases_in_pipelined_chunks_and_keeps_every_block_in_place(node, client_of) -> None:
    """300 keys (over two lease chunks): DRAM hits, misses and SSD blocks interleaved come
    back in the caller's order, and every chunk's lease is released."""
    from kvstore.dataplane.slab_reads import LEASE_CHUNK
    n = 300
    assert n > 2 * LEASE_CHUNK
    pool, address, _ = node(dram_bytes=16 * MIB, ssd_bytes=16 * MIB, promote_on_hit=False)
    blocks = {i: _block(i, 4096) for i in range(n) if i % 7}  # every 7th key is a miss
    assert all(pool.put(_key(i), d, tier="ssd" if i % 50 == 1 else None).ok for i, d in blocks.items())
    client = client_of(address)
    outs = [np.zeros(4096, dtype=np.uint8) for _ in range(n)]
    got = client.get_into([_key(i) for i in range(n)], outs)
    assert got == [4096 if i in blocks else None for i in range(n)]
    assert all(outs[i].tobytes() == d for i, d in blocks.items())
    assert client.get_blocks([_key(i) for i in range(n)]) == [blocks.get(i) for i in range(n)]
    deadline = time.monotonic() + 5  # releases need no reply: they land a moment later
    while pool.stats()[0].leased_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.stats()[0].leased_bytes == 0


def test_an_expired_and_evicted_block_is_never_read_through_the_mapping(node) -> None:
    """Lease A with a short TTL, let it expire, evict it and put B into the same slab space:
    the mapped read of A raises LeaseExpired and never returns B's bytes; and even a grant
    that claimed to be valid would only give a miss (the checksum guard)."""
    pool, address, path = node(dram_bytes=4 * MIB)
    plane = _plane(pool, path)
    a, b = _block(10, MIB), _block(11, MIB)
    assert plane.put_blocks([(_key(10), a)])[0].ok
    grant = plane.control.lease([_key(10)], ttl_s=0.05)
    assert grant.blocks[0].state == MAPPED
    # a live lease keeps A from being evicted
    assert pool.evict("dram", 4 * MIB) == (0, 0) and pool.contains(_key(10))
    time.sleep(0.1)
    assert pool.evict("dram", 4 * MIB)[1] == 1 and not pool.contains(_key(10))
    plane.spares.by_size.clear()  # so B takes the lowest free pages: A's
    assert plane.put_blocks([(_key(11), b)])[0].ok
    assert pool.tier("dram").locate(_key(11))[0] == grant.blocks[0].offset, "B reuses A's pages"
    out = np.zeros(MIB, dtype=np.uint8)
    with pytest.raises(LeaseExpired):
        plane.copy_leased(grant, [_key(10)], [out])
    forged = LeaseGrant(grant.lease_id, time.monotonic() + 60, grant.blocks)
    assert plane.copy_leased(forged, [_key(10)], [out])[0] == [None]  # B's bytes fail A's checksum
    plane.control.release(grant.lease_id)
    # through the public API a too-short lease is LeaseExpired or A's bytes, never B's
    plane.lease_ttl_s = 1e-9
    with pytest.raises(LeaseExpired):
        plane.get_into([_key(11)], [out])
    plane.close()
    pool.check_integrity()


def test_a_vanished_client_leaves_no_lease_or_reservation(node) -> None:
    pool, address, path = node()
    code = ("import sys; from kvstore.dataplane.control_client import UdsControl\n"
            "c = UdsControl(sys.argv[1]); print(c.reserve([(b'k' * 32, 1 << 20)])[0].state, flush=True)\n"
            "c.lease([sys.argv[2].encode()], ttl_s=600); import os; os._exit(0)\n")
    pool.put(b"x" * 32, _block(1))
    out = subprocess.run([sys.executable, "-c", code, path, "x" * 32], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0", out.stderr
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (pool.stats()[0].reserved_bytes or pool.stats()[0].leased_bytes):
        time.sleep(0.02)
    assert pool.stats()[0].reserved_bytes == 0 and pool.stats()[0].leased_bytes == 0
    pool.check_integrity()


def test_a_store_process_serves_a_client_process(node) -> None:
    """Two processes, as deployed: the client maps the store's slab from another process."""
    pool, address, _ = node()
    code = ("import sys, numpy as np; from kvstore.client import StoreClient\n"
            "c = StoreClient(sys.argv[1]); c.wait_ready(10)\n"
            "data = np.arange(1 << 20, dtype=np.uint8)\n"
            "assert c.put_blocks([(b'p' * 32, data)])[0].ok\n"
            "out = np.zeros(1 << 20, np.uint8); c.get_into([b'q' * 32], [out])\n"
            "print(c.data_path_in_use, out.tobytes().hex()[:16], flush=True); c.close()\n")
    pool.put(b"q" * 32, bytes(range(256)) * 4096)
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["same-host/uds", bytes(range(8)).hex()]
    assert pool.get(b"p" * 32) == np.arange(1 << 20, dtype=np.uint8).tobytes()


def test_a_lost_control_socket_falls_back_and_reattaches(node, client_of) -> None:
    pool, address, _ = node()
    client = client_of(address)
    assert client.put(_key(1), _block(1)).ok and client.data_path_in_use == "same-host/uds"
    node.nodes[id(pool)].control.close()  # as if the node's socket went away under the client
    assert client.get_blocks([_key(1)]) == [_block(1)]     # this call: over gRPC
    assert client.data_path_in_use == "same-host/grpc"      # then the slab again, control over gRPC
    assert client.put(_key(2), _block(2)).ok and pool.get(_key(2)) == _block(2)


def test_auth_token_is_required_on_the_socket(node, client_of) -> None:
    _, address, path = node(token="s3cret")
    with pytest.raises(Unavailable):
        UdsControl(path, "wrong").lookup([_key(1)])
    client = client_of(address, auth_token="s3cret")
    assert client.data_path_in_use == "same-host/uds"
    assert client.put(_key(1), b"abc").ok and client.get(_key(1)) == b"abc"


def test_malformed_requests_are_refused(node) -> None:
    pool, _, path = node()
    ctl = UdsControl(path)
    for bad in (b"", b"k", b"k" * 31, b"k" * 33, b"k" * 56, b"k" * 65):  # the key spec makes 16 or 32
        with pytest.raises(InvalidArgument, match=f"{len(bad)} bytes.*16 .*32 "):
            ctl.reserve([(_key(2), 10), (bad, 10)])
        with pytest.raises(InvalidArgument, match=f"{len(bad)} bytes"):
            ctl.lookup([bad])
        with pytest.raises(InvalidArgument, match=f"{len(bad)} bytes"):
            ctl.lease([_key(1), bad])
    grants = ctl.reserve([(b"k" * 32, 1 << 40)])
    assert [g.state for g in grants] == [2] and all(g.error for g in grants)
    results = ctl.commit([12345], [b"k" * 32])
    assert not results[0].ok
    with pytest.raises(InvalidArgument):
        ctl._call(99, b"")
    assert ctl.lookup([_key(1)]) == (0, [])  # the connection survives a refused request
    ctl.close()


@pytest.mark.parametrize("keys", [[], [b"a" * 32] * 3, [b"", b"a" * 16, b"bb" * 16]])
def test_wire_keys_round_trip(keys: list[bytes]) -> None:
    raw = b"xx" + wire.encode_keys(keys)
    assert wire.decode_keys(raw, 2, allow_empty=True) == (keys, len(raw))


@pytest.mark.parametrize("raw", [b"", b"\x01\x00", wire.KEYS_HEAD.pack(2, 32) + b"a" * 40,
                                 wire.KEYS_HEAD.pack(1, 0) + b"\x20" + b"a" * 5,
                                 wire.KEYS_HEAD.pack(3, 0) + b"\x10" + b"a" * 16,
                                 wire.KEYS_HEAD.pack(1, 31) + b"a" * 31,
                                 wire.KEYS_HEAD.pack(1, 0) + b"\x00",
                                 wire.KEYS_HEAD.pack(MAX_KEYS_PER_CALL + 1, 32)])
def test_wire_keys_that_cannot_be_decoded_are_invalid_argument(raw: bytes) -> None:
    with pytest.raises(InvalidArgument):
        wire.decode_keys(raw, 0)


def _plane(pool: KVPool, path: str) -> LocalDataPlane:
    from kvstore.dataplane.host import DataPlaneHost
    info = DataPlaneHost(pool, path).info()
    return LocalDataPlane(info, UdsControl(path))


def test_a_spare_slot_past_its_write_by_time_is_never_written(node, client_of) -> None:
    """A holds spare slots, idles past their reservation timeout, B's blocks take the freed
    space, then A puts again: A must not copy into its stale spares (B's bytes stay intact,
    read straight out of the slab without a checksum) and A's put still succeeds."""
    pool, address, _ = node(dram_bytes=16 * MIB, reservation_timeout_s=1.0)
    a, b = client_of(address), client_of(address)
    plane = a._local()
    assert a.put(_key(1), _block(1)).ok
    plane.spares.stock(plane.control.take_spares(wait=True))
    assert plane.spares.by_size.get(64 << 10)
    time.sleep(1.3)                                   # A's spares time out in the pool
    ours = [(_key(100 + i), _block(100 + i)) for i in range(16)]
    assert all(r.ok for r in b.put_blocks(ours))      # B may get the space A's spares held
    assert a.put(_key(2), _block(2)).ok
    assert [pool.get(k) for k, _ in ours] == [d for _, d in ours]  # no verification on this read
    assert a.get_blocks([_key(1), _key(2)]) == [_block(1), _block(2)]


def test_spare_slots_stay_under_the_per_connection_cap_when_sizes_change(node, client_of) -> None:
    """One block per call, the size changing every call: the writer keeps spares of the
    current size only and the node caps a connection's spares at 1/16 of the tier, so no
    stored block is evicted to make room for spares."""
    pool, address, _ = node(dram_bytes=64 * MIB)
    client = client_of(address)
    cap = 64 * MIB // 16
    sizes = [(64 << 10) * (1 + i % 12) for i in range(48)]
    for i, size in enumerate(sizes):
        assert client.put(_key(i), _block(i, size)).ok
        assert pool.stats()[0].reserved_bytes <= cap + max(sizes)
    assert client.lookup([_key(i) for i in range(len(sizes))]).blocks > 0
    assert all(pool.get(_key(i)) == _block(i, size) for i, size in enumerate(sizes))  # none evicted


@pytest.mark.timeout(60)
def test_a_pipelined_put_whose_copy_fails_raises_and_leaves_the_client_usable(node, client_of) -> None:
    torch = pytest.importorskip("torch")
    pool, address, _ = node(dram_bytes=64 * MIB)
    client = client_of(address)
    bad = torch.empty(3 * MIB, dtype=torch.uint8, device="meta")  # a copy out of it raises
    blocks = [(_key(1), _block(1, 3 * MIB)), (_key(2), _block(2, 3 * MIB)), (_key(3), bad)]
    with pytest.raises(NotImplementedError):
        client.put_blocks(blocks)                     # over 4 MiB: committed in pipelined chunks
    with pytest.raises(NotImplementedError):          # one block: its COMMIT went out before the copy
        client.put_blocks([(_key(5), torch.empty(MIB, dtype=torch.uint8, device="meta"))])
    assert client.put(_key(4), _block(4)).ok and client.get(_key(4)) == _block(4)
    assert client.get(_key(5)) is None
    assert client.get(_key(3)) is None
    deadline = time.monotonic() + 5
    while pool.stats()[0].reserved_bytes > 64 * MIB // 16 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.stats()[0].reserved_bytes <= 64 * MIB // 16  # at most the writer's spares
    pool.check_integrity()


def test_a_malformed_release_frame_ends_only_that_connection(node) -> None:
    pool, _, path = node()
    ctl = UdsControl(path)
    framing.write_frame(ctl._sock, wire.OP_RELEASE, b"abc")  # not 8 bytes
    with pytest.raises((Unavailable, OSError)):
        ctl.lookup([_key(1)])
    ctl.close()
    assert UdsControl(path).lookup([_key(1)]) == (0, [])


def test_a_one_block_put_whose_spare_timed_out_before_commit_is_put_again(node, client_of) -> None:
    """The one-block fast path: a spare slot that the node no longer holds at commit (its
    reservation ran out; here the write-by time is erased so the writer uses it anyway,
    which a real writer never does) fails its commit, and the block is put again through
    a fresh reservation: the put succeeds and the bytes read back."""
    pool, address, _ = node(reservation_timeout_s=0.4)
    client = client_of(address)
    plane = client._local()
    assert client.put(_key(1), _block(1)).ok
    plane.spares.stock(plane.control.take_spares(wait=True))
    stock = plane.spares.by_size[64 << 10]
    stock[:] = [g._replace(write_by=0.0) for g in stock]   # always "in time"
    time.sleep(0.6)                                         # the node's reservations run out
    redone = []
    put_window = plane._put_window
    plane._put_window = lambda *a, **kw: redone.append(a[0]) or put_window(*a, **kw)
    assert client.put(_key(2), _block(2)).ok
    assert redone == [[_key(2)]]                            # the commit failed; put again once
    assert client.get_blocks([_key(1), _key(2)]) == [_block(1), _block(2)]
    pool.check_integrity()


@pytest.mark.parametrize("node_poll_s, reply_poll_s", [(0.0, 0.0), (200e-6, 500e-6), (0.05, 0.0)])
def test_control_channel_polling_is_only_a_latency_choice(make_dram, node_poll_s, reply_poll_s) -> None:
    """However long the node polls for the next request and the client for its reply
    (0: sleep at once), every request gets its own answer and the bytes are right."""
    from kvstore.config import StoreConfig
    with pytest.raises(ValueError, match="dataplane_poll_us"):
        StoreConfig(dataplane_poll_us=-1)
    pool = KVPool([make_dram(64 * MIB)], settings=PoolSettings(high_watermark=1.0, low_watermark=1.0))
    path = _socket_path()
    served = StoreNode.serve(pool, dataplane_socket=path, dataplane_poll_s=node_poll_s)
    try:
        with StoreClient(served.address) as client:
            plane = client._local()
            plane.control.poll_s = reply_poll_s
            blocks = [(_key(i), _block(i, (i + 1) << 14)) for i in range(40)]
            for k, d in blocks:
                assert client.put(k, d).ok
            outs = [np.zeros(len(d), np.uint8) for _, d in blocks]
            assert client.get_into([k for k, _ in blocks], outs) == [len(d) for _, d in blocks]
            assert [o.tobytes() for o in outs] == [d for _, d in blocks]
            assert client.lookup([k for k, _ in blocks]).blocks == 40
    finally:
        served.stop(grace_s=None)


def test_a_client_builds_its_slab_mapping_in_the_background(node, client_of) -> None:
    """The same-host client populates its own mapping of the slab (page tables) on a
    thread; the whole slab ends up resident in this process; close() stops it first."""
    pool, address, _ = node(dram_bytes=64 * MIB)
    client = client_of(address)
    plane = client._local()
    assert plane._prefault is not None and plane._prefault.done.wait(30)
    assert plane._prefault.populated == plane._slab.nbytes
    assert client.put(_key(1), _block(1)).ok and client.get_blocks([_key(1)]) == [_block(1)]
    client.close()
    assert not plane._prefault._thread.is_alive()
    plain = StoreClient(address, prefault=False)
    try:
        assert plain._local()._prefault is None
    finally:
        plain.close()


def test_a_connection_releases_only_its_own_leases(node) -> None:
    """Lease ids are small integers, not secrets: a RELEASE of another connection's
    lease is ignored (the lease keeps its blocks until its holder lets go)."""
    pool, _, path = node()
    pool.put(_key(1), _block(1))
    a, b = UdsControl(path), UdsControl(path)
    grant = a.lease([_key(1)], ttl_s=60)
    assert grant.lease_id and pool.stats()[0].leased_bytes == len(_block(1))
    for lid in range(1, grant.lease_id + 5):
        b.release(lid)
    assert b.lookup([_key(1)])[0] == 1                     # b's releases were all read
    assert pool.stats()[0].leased_bytes == len(_block(1))  # a's lease stands
    a.release(grant.lease_id)
    assert a.lookup([_key(1)])[0] == 1 and pool.stats()[0].leased_bytes == 0
    a.close(), b.close()


def test_bad_frames_and_leases_get_clear_errors(node) -> None:
    """A frame over the pre-auth limit gets an error reply, then the connection closes; a
    lease whose reply could not fit a frame, or with a TTL that is not a sane number of
    seconds, is refused and the connection stays usable; a reply that cannot be read
    makes the client drop the connection (Unavailable), never read out of step."""
    import socket as so
    pool, _, path = node(token="s3cret")
    raw = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    raw.connect(path)
    raw.sendall(wire.HEADER.pack(wire.OP_HELLO, 1 << 20))  # claims 1 MiB before any token
    status, reply = framing.read_frame(raw)
    assert status == frame_status(InvalidArgument('')) and b"at most 4096" in reply
    assert raw.recv(1) == b""                                # then closed
    raw.close()
    ctl = UdsControl(path, "s3cret")
    for ttl in (float("nan"), -1.0, float("inf"), 1e9):
        with pytest.raises(InvalidArgument, match="lease TTL"):
            ctl.lease([_key(1)], ttl_s=ttl)
    with pytest.raises(InvalidArgument, match="at most"):
        ctl.lease([_key(1)] * (MAX_KEYS_PER_CALL + 1))
    assert ctl.lookup([_key(1)]) == (0, []) and pool.stats()[0].leased_bytes == 0
    ctl.close()


def test_a_reply_that_cannot_be_read_drops_the_connection() -> None:
    """A node (here a fake one) whose reply header claims more than a frame may hold: the
    client raises Unavailable and closes, instead of reading the next replies out of step."""
    import socket as so
    path = _socket_path()
    listener = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        framing.read_frame(conn)                      # HELLO
        framing.write_frame(conn, wire.OK)
        framing.read_frame(conn)                      # LOOKUP
        conn.sendall(wire.HEADER.pack(wire.OK, wire.MAX_FRAME_BYTES + 1))
        conn.recv(1)                               # until the client hangs up
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        ctl = UdsControl(path)
        with pytest.raises(Unavailable, match="unreadable reply"):
            ctl.lookup([_key(1)])
        with pytest.raises(Unavailable):
            ctl.lookup([_key(1)])                  # closed since: never out of step
        thread.join(5)
        assert not thread.is_alive()
    finally:
        listener.close()
        os.unlink(path)


def test_the_accept_loop_survives_accept_errors(node) -> None:
    """EMFILE and the like are transient: the server logs, backs off and accepts again."""
    import errno
    pool, _, path = node()
    server = node.nodes[id(pool)].control

    class Flaky:
        def __init__(self, sock):
            self.sock, self.failures = sock, 3

        def accept(self):
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return self.sock.accept()

        def __getattr__(self, name):
            return getattr(self.sock, name)

    flaky = server._sock = Flaky(server._sock)
    UdsControl(path).close()           # wakes the accept already waiting; the next ones fail
    deadline = time.monotonic() + 5
    while flaky.failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert flaky.failures == 0
    ctl = UdsControl(path)             # served after the failures
    assert ctl.lookup([_key(1)]) == (0, [])
    ctl.close()


def test_unusable_buffers_get_invalid_argument(node, client_of) -> None:
    pool, address, _ = node()
    client = client_of(address)
    assert client.put(_key(1), _block(1)).ok
    frozen = np.zeros(len(_block(1)), np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgument, match="output buffer 0"):
        client.get_into([_key(1)], [frozen])
    strided = memoryview(bytearray(8192))[::2]
    with pytest.raises(InvalidArgument, match="contiguous"):
        client.put(_key(2), strided)
    assert client.get_blocks([_key(1)]) == [_block(1)]
    assert client.lookup([_key(1)]).blocks == 1           # after the releases on that socket
    assert pool.stats()[0].leased_bytes == 0


@pytest.mark.parametrize("data_path", ["auto", "grpc"])
def test_a_block_in_segments_is_gathered_at_put_and_scattered_at_get(node, client_of, data_path) -> None:
    """A paged KV block (one part per layer, engines/vllm/layout.py) goes into one slot and
    comes back out into its parts, with no staging buffer on the same host; its checksum is
    that of the concatenated parts, so a flipped byte in the slab is a miss."""
    from kvstore.tiers.buffers import Segments

    pool, address, _ = node(dram_bytes=16 * MIB)
    client = client_of(address, data_path=data_path)
    layers = [np.frombuffer(_block(i, 4096), dtype=np.uint8).copy() for i in range(3)]
    whole = b"".join(p.tobytes() for p in layers)
    assert client.put_blocks([(_key(1), Segments(layers))])[0].ok
    assert client.get(_key(1)) == whole
    assert pool.tiers[0].locate(_key(1))[2] == checksum_of(whole)
    outs = [np.zeros(4096, dtype=np.uint8) for _ in range(3)]
    assert client.get_into([_key(1)], [Segments(outs)]) == [3 * 4096]
    assert all(np.array_equal(o, p) for o, p in zip(outs, layers))
    offset, size, _ = pool.tiers[0].locate(_key(1))
    pool.tiers[0]._slab[offset + 5000] ^= 0xFF
    assert client.get_into([_key(1)], [Segments(outs)]) == [None]
