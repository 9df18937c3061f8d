"""The across-host path between real processes: a store node process serves its DRAM slab
to this process's Mooncake Transfer Engine (tcp over 127.0.0.1); bytes are identical to
what was put, and identical again over the gRPC stream when the transfer engine is off or
cannot start (the fallback is picked automatically and reported)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvstore.client import StoreClient
from kvstore.errors import Unavailable
from kvstore.transfer import GrpcStreamTransport, SameHostTransport, TransferEngineTransport, open_transport
from kvstore.transfer import base as transfer_base
from kvstore.transfer.engine import shutdown_engines

pytest.importorskip("mooncake.engine")

SIZES = [1, 4096, 8192 + 17, 3 << 20, 100_000]     # one block spans several gRPC chunks


def blocks_of(seed: int) -> list[tuple[bytes, bytes]]:
    return [(seed.to_bytes(2, "big") + i.to_bytes(14, "big"), os.urandom(n)) for i, n in enumerate(SIZES)]


@pytest.fixture
def te_node(spawn_store_node):
    _, address = spawn_store_node("te-a", "--dram", "32MiB", "--ssd", "0", "--transfer-engine", "tcp")
    with StoreClient(address) as client:
        yield address, client


@pytest.fixture
def http_metadata_server():
    """Mooncake's HTTP metadata server (mooncake.http_metadata_server) on a free port."""
    import socket
    import subprocess
    import sys
    import time

    from launcher.supervisor import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mooncake.http_metadata_server", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "WARNING"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "metadata server did not start"
            time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/metadata"
    yield url
    shutdown_engines(url)       # engines unregister from the server as they go: it must still run
    proc.terminate()
    proc.wait(timeout=10)


def test_transfer_engine_with_the_http_metadata_server(spawn_store_node, http_metadata_server):
    _, address = spawn_store_node("te-http", "--dram", "16MiB", "--ssd", "0", "--transfer-engine", "tcp",
                                  "--te-metadata", http_metadata_server)
    blocks = blocks_of(5)
    with StoreClient(address) as client:
        assert all(r.ok for r in client.put_blocks(blocks))
    t = open_transport("transfer_engine", address)
    try:
        assert isinstance(t, TransferEngineTransport) and t.engine.metadata == http_metadata_server
        assert t.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
        assert t.te_reads == len(blocks) and t.grpc_reads == 0
    finally:
        t.close()


def test_transfer_engine_reads_are_byte_identical(te_node):
    address, client = te_node
    blocks = blocks_of(1)
    assert all(r.ok for r in client.put_blocks(blocks, chain=True))
    t = open_transport("transfer_engine", address)
    try:
        assert isinstance(t, TransferEngineTransport) and t.endpoint.startswith("127.0.0.1:")
        keys = [k for k, _ in blocks]
        assert t.get_blocks(keys) == [d for _, d in blocks]
        assert t.te_reads == len(blocks) and t.grpc_reads == 0
        # a chain read stops at the first miss; a scattered read reports misses as None
        missing = b"\xff" * 16
        got = t.get_blocks(keys[:2] + [missing] + keys[2:], stop_at_miss=True)
        assert got == [blocks[0][1], blocks[1][1], None]
        assert t.get_blocks([missing, keys[3]]) == [None, blocks[3][1]]
        # the gRPC stream gives the same bytes
        assert GrpcStreamTransport(address).get_blocks(keys) == [d for _, d in blocks]
    finally:
        t.close()


def test_a_transfer_the_engine_fails_is_started_again_before_grpc(te_node, monkeypatch):
    """A piece the engine fails outright (here: its first try asks the node for bytes outside
    its registered slab, which the node's engine refuses) is started again and lands over the
    engine; one that fails every time goes over gRPC after TE_RETRIES more tries (one). Right
    bytes both ways."""
    from kvstore.transfer.te_transport import TE_RETRIES

    address, client = te_node
    blocks = blocks_of(7)[:3]
    assert all(r.ok for r in client.put_blocks(blocks))
    keys, want = [k for k, _ in blocks], [d for _, d in blocks]
    t = open_transport("transfer_engine", address)
    try:
        start, tries = t.engine.read_piece, []

        def failing(times):
            def read_piece(endpoint, local, remote, length):
                tries.append(remote)
                bad = len(tries) <= times
                return start(endpoint, local, (1 << 62) if bad else remote, length)
            return read_piece

        monkeypatch.setattr(t.engine, "read_piece", failing(1))   # the first piece of the read
        assert t.get_blocks(keys) == want
        assert (t.te_reads, t.grpc_reads, t.te_retries) == (3, 0, 1) and len(tries) == 4
        tries.clear()
        monkeypatch.setattr(t.engine, "read_piece", failing(10 ** 6))
        assert t.get_blocks(keys) == want
        # started again only when the try failed at once: the engine may hold this peer's next
        # transfer for a second after the refusal above
        again = t.te_retries - 1
        assert (t.te_reads, t.grpc_reads) == (3, 3) and 0 <= again <= TE_RETRIES
        assert len(tries) == 3 * (1 + again)
    finally:
        monkeypatch.undo()
        t.close()


def test_transfer_engine_get_into_registered_and_plain_buffers(te_node):
    """A 9 MiB block lands straight in a registered arena; others go through the transport's
    buffer into a plain array and a tensor. A byte flipped in the node's slab makes that block a miss on the engine path
    and on the gRPC stream too (both check the checksum taken at put), and the node drops
    it on the reader's report."""
    torch = pytest.importorskip("torch")
    address, client = te_node
    sizes = [9 << 20, 100_000, 4096]
    blocks = [(b"into-" + i.to_bytes(11, "big"), os.urandom(n)) for i, n in enumerate(sizes)]
    assert all(r.ok for r in client.put_blocks(blocks))
    keys = [k for k, _ in blocks]
    t = open_transport("transfer_engine", address)
    try:
        arena = np.zeros(sizes[0] + 64, dtype=np.uint8)
        t.register(arena)
        outs = [arena[64:], np.zeros(sizes[1], dtype=np.uint8), torch.zeros(sizes[2], dtype=torch.uint8)]
        assert t.get_into(keys + [b"\xee" * 16], outs + [np.zeros(1, np.uint8)]) == sizes + [None]
        assert [bytes(outs[0]), outs[1].tobytes(), outs[2].numpy().tobytes()] == [d for _, d in blocks]
        assert t.te_reads == 3 and t.grpc_reads == 0
        plane = client._local()  # same host: flip one byte of the big block in the node's slab
        grant = plane.control.lease([keys[0]])
        plane._slab[grant.blocks[0].offset + (5 << 20)] ^= 0xFF
        plane.control.release(grant.lease_id)
        assert t.get_into(keys[:2], outs[:2]) == [None, sizes[1]]
        # the engine's miss was read again over gRPC, whose reader reported it (Scrub): the
        # node verified the copy, dropped it, and now holds the healthy blocks only
        assert client.lookup(keys[:1]).blocks == 0 and client.lookup(keys[1:2]).blocks == 1
        assert GrpcStreamTransport(address).get_blocks(keys[:1]) == [None]
    finally:
        t.close()


def test_node_without_transfer_engine_falls_back_to_grpc(spawn_store_node):
    _, address = spawn_store_node("te-off", "--dram", "16MiB", "--ssd", "0", "--transfer-engine", "off")
    blocks = blocks_of(2)
    with StoreClient(address) as client:
        assert all(r.ok for r in client.put_blocks(blocks))
    t = open_transport("transfer_engine", address)
    try:
        assert type(t) is GrpcStreamTransport
        assert "runs no transfer engine" in (t.fallback_reason or "")
        assert t.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
    finally:
        t.close()


def test_transfer_engine_that_cannot_start_falls_back(te_node, monkeypatch):
    address, client = te_node
    blocks = blocks_of(3)
    client.put_blocks(blocks)

    class Broken(TransferEngineTransport):
        def __init__(self, *a, **kw):
            from kvstore.transfer.engine import TransferEngineUnavailable
            raise TransferEngineUnavailable("no libibverbs here")

    monkeypatch.setitem(transfer_base.TRANSPORTS, "transfer_engine", Broken)
    t = open_transport("transfer_engine", address)
    try:
        assert type(t) is GrpcStreamTransport and t.fallback_reason == "no libibverbs here"
        assert t.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
    finally:
        t.close()


def test_auto_prefers_the_same_host_slab_then_the_transfer_engine(te_node, monkeypatch):
    address, client = te_node
    blocks = blocks_of(4)
    client.put_blocks(blocks)
    keys, want = [k for k, _ in blocks], [d for _, d in blocks]
    t = open_transport("auto", address, te_endpoint="announced")
    try:
        assert isinstance(t, SameHostTransport) and t.get_blocks(keys) == want
    finally:
        t.close()

    class Elsewhere(SameHostTransport):       # as seen from another host
        def __init__(self, *a, **kw):
            raise Unavailable("not this host")

    monkeypatch.setitem(transfer_base.TRANSPORTS, "same_host", Elsewhere)
    t = open_transport("auto", address, te_endpoint="announced")
    try:
        assert isinstance(t, TransferEngineTransport) and t.get_blocks(keys) == want
    finally:
        t.close()
    t = open_transport("auto", address)                # the node announced no engine
    try:
        assert type(t) is GrpcStreamTransport and t.get_blocks(keys) == want
    finally:
        t.close()


def test_unknown_transport_is_rejected():
    with pytest.raises(ValueError, match="valid: auto"):
        open_transport("carrier-pigeon", "127.0.0.1:1")


def _assert_no_lease_left(client: StoreClient) -> None:
    """Releases are not waited for, so they land a moment later: allow 5 s."""
    deadline = time.monotonic() + 5
    while client.stats()[1][0].leased_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.stats()[1][0].leased_bytes == 0


def test_transfer_engine_reads_an_empty_block_and_releases_every_lease(te_node):
    """A 0-byte block reads back empty; the lease of each engine read is released (the
    release is not waited for, so it lands a moment later), not held until its TTL."""
    address, client = te_node
    blocks = [(b"empty-0".ljust(16, b"\0"), b""), (b"empty-1".ljust(16, b"\0"), os.urandom(3 << 20))]
    assert all(r.ok for r in client.put_blocks(blocks))
    t = open_transport("transfer_engine", address)
    try:
        for _ in range(20):
            assert t.get_blocks([k for k, _ in blocks]) == [d for _, d in blocks]
        assert t.get_into([blocks[0][0]], [np.zeros(4, np.uint8)]) == [0]
    finally:
        t.close()
    _assert_no_lease_left(client)


def _engine_get(t: TransferEngineTransport, keys: list[bytes], want: list[bytes]) -> None:
    """``t.get_blocks(keys)`` is ``want`` with every block read by the transfer engine. The
    engine's TCP read can fail on a loaded 2-core machine, and the blocks then come over gRPC,
    still right (checked): such a round is tried again, three rounds at most."""
    for _ in range(3):
        te0, grpc0 = t.te_reads, t.grpc_reads
        assert t.get_blocks(keys) == want
        if t.te_reads - te0 == len(keys):
            return
        assert t.te_reads - te0 + t.grpc_reads - grpc0 == len(keys)
    pytest.fail(f"the transfer engine read none of 3 rounds of {len(keys)} blocks whole")


@pytest.mark.parametrize("staging", ["16MiB", "0"])
def test_transfer_engine_leases_over_the_read_only_tcp_control_channel(spawn_store_node, staging):
    """The reader leases over the node's compact TCP channel (not gRPC); that channel
    serves reads only; when it breaks, the bytes stay right: from a node that registers its
    slab (``--te-staging 0``) leases go over gRPC, from a staging node (whose gRPC leases
    point outside what its engine registered) blocks come over the gRPC stream."""
    from kvstore.dataplane.control_client import TcpControl
    from kvstore.errors import InvalidArgument

    _, address = spawn_store_node("te-ctl", "--dram", "32MiB", "--ssd", "0", "--transfer-engine", "tcp",
                                  "--te-staging", staging)
    client = StoreClient(address)
    blocks = blocks_of(7)
    assert all(r.ok for r in client.put_blocks(blocks))
    keys, want = [k for k, _ in blocks], [d for _, d in blocks]
    t = open_transport("transfer_engine", address)
    try:
        assert isinstance(t, TransferEngineTransport) and isinstance(t.control, TcpControl)
        assert t.control.path.startswith("127.0.0.1:") and t.control.path != address
        _engine_get(t, keys, want)
        reserved = client.stats()[1][0].reserved_bytes   # the same-host writer's spare slots
        with pytest.raises(InvalidArgument, match="reads only"):
            t.control.reserve([(b"w" * 16, 4096)])
        assert t.control.lookup(keys) == (len(keys), ("dram",) * len(keys))  # still usable
        assert client.stats()[1][0].reserved_bytes == reserved             # nothing reserved
        import socket
        t.control._sock.shutdown(socket.SHUT_RDWR)   # the channel breaks mid-session
        te0, grpc0 = t.te_reads, t.grpc_reads
        if staging != "0":
            assert t.get_blocks(keys) == want
            assert t.te_reads == te0 and t.grpc_reads == grpc0 + len(blocks)
        else:
            _engine_get(t, keys, want)
        assert t.control is None and t.staged == (staging != "0")
    finally:
        t.close()
    _assert_no_lease_left(client)
    client.close()


def test_tcp_control_channel_needs_the_node_token(spawn_store_node):
    from kvstore.dataplane.control_client import TcpControl

    _, address = spawn_store_node("te-tok", "--dram", "8MiB", "--ssd", "0", "--transfer-engine", "tcp",
                                  "--auth-token", "s3cret")
    key, data = b"tok".ljust(16, b"\0"), os.urandom(1 << 20)
    with StoreClient(address, auth_token="s3cret") as client:
        assert client.put(key, data).ok
    t = TransferEngineTransport(address, auth_token="s3cret")
    try:
        assert isinstance(t.control, TcpControl)
        assert t.get_blocks([key]) == [data] and t.grpc_reads == 0
        with pytest.raises(Unavailable, match="auth token"):
            TcpControl(t.control.path, "wrong").lookup([key])
    finally:
        t.close()


def test_control_port_is_checked_and_a_taken_one_fails_the_node_cleanly(tmp_path):
    import glob
    import socket

    from kvstore.config import StoreConfig
    from kvstore.node import StoreNode

    with pytest.raises(ValueError, match="control_port must be in"):
        StoreConfig(control_port=70000)
    with pytest.raises(ValueError, match="a port of its own"):
        StoreConfig(port=5000, control_port=5000)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        before = set(glob.glob("/dev/shm/*"))
        cfg = StoreConfig(node_id="ctl-taken", port=0, dram_bytes=1 << 20, ssd_bytes=0, data_dir=str(tmp_path),
                          control_port=taken.getsockname()[1], dataplane_socket="", transfer_engine="tcp")
        with pytest.raises(OSError, match="cannot listen for control connections"):
            StoreNode.start(cfg)
        assert set(glob.glob("/dev/shm/*")) - before == set()   # no slab left behind


def _state(pid: int) -> str:
    """A process's state letter in /proc (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_stalled_read_retires_its_buffer_until_the_engine_lets_go(spawn_store_node, monkeypatch):
    """A node that stops (SIGSTOP) mid-read: the reader gives up after its timeout, but its
    transfers may still land, so the buffer they target is retired (kept registered and
    alive, never reused) until they end; after the node resumes, reads are right again
    and the retired buffer is let go."""
    import signal

    proc, address = spawn_store_node("te-stall", "--dram", "32MiB", "--ssd", "0", "--transfer-engine", "tcp")
    blocks = [(b"stall%d" % i + b"\0" * 10, os.urandom(4 << 20)) for i in range(2)]
    keys, want = [k for k, _ in blocks], [d for _, d in blocks]
    with StoreClient(address) as client:
        assert all(r.ok for r in client.put_blocks(blocks))
    t = TransferEngineTransport(address, timeout_s=1.5)
    stopped: list[bool] = []
    try:
        assert t.get_blocks(keys) == want
        old_buf = t._buf
        start = t.engine.read_piece

        def stall(*args):
            if not stopped:     # the node stops once the lease is granted, before its bytes are sent
                os.kill(proc.pid, signal.SIGSTOP)
                stopped.append(True)
                until = time.monotonic() + 5   # SIGSTOP lands asynchronously: wait until it has
                while _state(proc.pid) != "T" and time.monotonic() < until:
                    time.sleep(0.001)
                assert _state(proc.pid) == "T", "the node did not stop"
            return start(*args)

        monkeypatch.setattr(t.engine, "read_piece", stall)
        with pytest.raises(Unavailable):        # the engine gave up; the gRPC fallback timed out
            t.get_blocks(keys)
        assert t._buf is None and len(t._retired) == 1 and t._retired[0][1] is old_buf
        monkeypatch.undo()
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:
            assert t.get_blocks(keys) == want   # a fresh buffer: right bytes
            if not t._retired or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert not t._retired                   # its transfers ended: unregistered, dropped
    finally:
        if stopped:
            os.kill(proc.pid, signal.SIGCONT)
        t.close()


def test_one_pick_decides_every_path() -> None:
    """pick_transport alone decides: same_host for a slab on this host that takes puts, else
    the transfer engine the node announces, else the gRPC stream; a named transport is taken
    as asked."""
    from dataclasses import replace

    from kvstore.transfer import pick_transport
    from kvstore.wire.types import DataPlaneInfo, host_id
    here = DataPlaneInfo("slab", 1 << 20, "", host_id(), "n1")
    assert pick_transport("auto", here, "te:1").name == "same_host"
    assert pick_transport("auto", replace(here, puts_in_slab=False), "te:1") == (
        "transfer_engine", "the node's top tier is not a DRAM slab; the node runs a transfer engine")
    assert pick_transport("auto", replace(here, host_id="another")) == (
        "grpc_stream", "store node n1 runs on another host")
    assert pick_transport("auto", None).name == "grpc_stream"
    assert pick_transport("grpc_stream", here).name == "grpc_stream"
    with pytest.raises(ValueError, match="valid: auto"):
        pick_transport("carrier-pigeon")
