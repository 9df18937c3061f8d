"""The transfer engine inside its trust boundary, on real store node processes: off on a
single node unless asked for, on (with a warning that it listens on every interface) when
the node joins a cluster through Redis."""
from __future__ import annotations

import grpc
import pytest

from protos import transfer_pb2 as pb
from protos import transfer_pb2_grpc as pb_grpc

pytest.importorskip("mooncake.engine")
WARNING = "listens on every interface"


def _info(address: str) -> pb.TransferInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.BlockTransferStub(channel).Info(pb.TransferInfoRequest(), timeout=10)


def test_a_single_node_runs_no_transfer_engine_by_default(spawn_store_node, tmp_path):
    _, address = spawn_store_node("solo", "--dram", "8MiB", "--ssd", "0")
    info = _info(address)
    assert info.te_endpoint == "" and info.control_port == 0
    assert WARNING not in (tmp_path / "solo.log").read_text(errors="replace")


def test_a_cluster_node_runs_it_and_warns(spawn_store_node, redis_url, tmp_path):
    _, address = spawn_store_node("member", "--dram", "8MiB", "--ssd", "0", "--redis", redis_url)
    info = _info(address)
    assert info.te_endpoint and info.control_port
    log = (tmp_path / "member.log").read_text(errors="replace")
    assert WARNING in log and "private fabric" in log


def test_asked_for_on_a_single_node_it_runs_and_warns(spawn_store_node, tmp_path):
    _, address = spawn_store_node("asked", "--dram", "8MiB", "--ssd", "0", "--transfer-engine", "tcp")
    assert _info(address).te_endpoint
    assert WARNING in (tmp_path / "asked.log").read_text(errors="replace")


# -- the staging area: only blocks in flight are registered ----------------------------------
def test_staging_area_allocates_first_fit_and_coalesces():
    from kvstore.transfer.staging import ALIGN, StagingArea

    area = StagingArea(8 * ALIGN)
    a, b, c = area.alloc(ALIGN), area.alloc(2 * ALIGN + 1), area.alloc(0)
    assert (a, b, c) == (0, ALIGN, 4 * ALIGN) and area.used == 5 * ALIGN
    assert area.alloc(4 * ALIGN) is None               # 3 pages left
    area.buf[b:b + 5] = 7
    area.free(b, 2 * ALIGN + 1)
    assert not area.buf[b:b + 5].any()                 # freed space is zeroed
    area.free(a, ALIGN)                                 # merges with the right neighbour
    assert area.alloc(3 * ALIGN) == 0
    area.free(0, 3 * ALIGN)
    area.free(c, 1)                                     # merges on both sides: one extent again
    assert area.used == 0 and area.alloc(8 * ALIGN) == 0


@pytest.fixture
def staged_node(spawn_store_node):
    from kvstore.client import StoreClient

    _, address = spawn_store_node("staged", "--dram", "32MiB", "--ssd", "0", "--transfer-engine", "tcp",
                                  "--te-staging", "4MiB", "--auth-token", "tok")
    with StoreClient(address, auth_token="tok") as client:
        yield address, client


def _stranger_read(engine, endpoint: str, remote: int, n: int) -> bytes | None:
    """A raw transfer-engine read with no token and no lease: what any peer can do."""
    import math

    import numpy as np

    from kvstore.transfer.engine import DONE

    buf = np.zeros(n, dtype=np.uint8)
    addr = engine.register(buf)
    try:
        tid = engine.read_piece(endpoint, addr, remote, n)
        return buf.tobytes() if engine.wait_piece(tid, math.inf) == DONE else None
    finally:
        engine.unregister(addr)


def test_a_staging_node_registers_only_blocks_in_flight(staged_node):
    """Info names a 4 MiB staging area, not the 32 MiB slab; reads through it are right;
    once released, a stranger's raw read of the whole area finds only zeros, and past its
    end the engine refuses."""
    import os

    import numpy as np

    from kvstore.transfer import TransferEngineTransport

    address, client = staged_node
    blocks = [(bytes([i]) * 32, os.urandom(n)) for i, n in enumerate([1 << 20, 5000, 3 << 19])]
    assert all(r.ok for r in client.put_blocks(blocks))
    info = _info_with(address, "tok")
    assert info.staged and info.slab_bytes == 4 << 20
    t = TransferEngineTransport(address, auth_token="tok")
    try:
        assert t.staged and t.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
        assert t.te_reads == 3 and t.grpc_reads == 0
        big = [(bytes([66 + i]) * 32, os.urandom(3 << 20)) for i in range(3)]
        assert all(r.ok for r in client.put_blocks(big))
        # 9 MiB asked at once: leased in batches that fit the 4 MiB area, one block each
        assert t.get_blocks([k for k, _ in big]) == [d for _, d in big]
        assert (t.te_reads, t.grpc_reads) == (6, 0)
        out = np.zeros(9 << 20, dtype=np.uint8)
        t.register(out)
        views = [out[i * (3 << 20):(i + 1) * (3 << 20)] for i in range(3)]
        assert t.get_into([k for k, _ in big], views) == [3 << 20] * 3
        assert out.tobytes() == b"".join(d for _, d in big) and (t.te_reads, t.grpc_reads) == (9, 0)
        # a block larger than the whole area never fits: the gRPC stream, after one lease
        huge = (b"H" * 32, os.urandom(5 << 20))
        assert client.put_blocks([huge])[0].ok
        assert t.get_blocks([big[0][0], huge[0]]) == [big[0][1], huge[1]]
        assert (t.te_reads, t.grpc_reads) == (10, 1)
        import time
        time.sleep(0.2)   # the release is not waited for
        seen = _stranger_read(t.engine, info.te_endpoint, info.slab_address, info.slab_bytes)
        assert seen is not None and not any(seen)
        assert _stranger_read(t.engine, info.te_endpoint, info.slab_address + info.slab_bytes, 4096) is None
    finally:
        t.close()


def test_a_block_as_large_as_the_staging_area_is_staged_in_two_halves(staged_node):
    """A 4 MiB block fills the 4 MiB area, copied in by two threads (SPLIT_COPY_BYTES):
    its bytes arrive whole through the engine, twice in a row (the space zeroed and freed
    between the leases)."""
    import os

    from kvstore.transfer import TransferEngineTransport
    from kvstore.transfer.staging import SPLIT_COPY_BYTES

    address, client = staged_node
    key, data = b"W" * 32, os.urandom(4 << 20)
    assert len(data) >= SPLIT_COPY_BYTES and client.put(key, data).ok
    t = TransferEngineTransport(address, auth_token="tok")
    try:
        assert t.get_blocks([key]) == [data] and t.get_blocks([key]) == [data]
        assert (t.te_reads, t.grpc_reads) == (2, 0)
    finally:
        t.close()


def test_what_a_stranger_writes_into_a_staged_block_is_caught_by_the_checksum(staged_node):
    """A peer overwrites a block while it is staged for a reader: the reader's checksum
    fails, the block comes over the gRPC stream, and the bytes returned are the put's."""
    import os

    import numpy as np

    from kvstore.transfer import TransferEngineTransport

    address, client = staged_node
    key, data = b"S" * 32, os.urandom(1 << 20)
    assert client.put(key, data).ok
    info = _info_with(address, "tok")
    t = TransferEngineTransport(address, auth_token="tok")
    try:
        real_lease = t._lease

        def lease_then_tamper(keys, stop_at_miss):  # type: ignore[no-untyped-def]
            lease_id, grant = real_lease(keys, stop_at_miss)
            junk = np.frombuffer(os.urandom(4096), dtype=np.uint8).copy()
            addr = t.engine.register(junk)
            try:
                for _ in range(3):   # the transfer engine's TCP session may drop on a loaded machine: write again
                    rc = t.engine.engine.batch_transfer_sync_write(info.te_endpoint, [addr],
                                                                   [info.slab_address + grant[0].offset], [4096])
                    if rc == 0:
                        break
                assert rc == 0
            finally:
                t.engine.unregister(addr)
            return lease_id, grant

        t._lease = lease_then_tamper  # type: ignore[method-assign]
        assert t.get_blocks([key]) == [data]
        assert t.te_reads == 0 and t.grpc_reads == 1
    finally:
        t.close()


def _info_with(address: str, token: str) -> pb.TransferInfoResponse:
    from kvstore.auth import bearer_metadata

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.BlockTransferStub(channel).Info(pb.TransferInfoRequest(), timeout=10,
                                                       metadata=bearer_metadata(token))
