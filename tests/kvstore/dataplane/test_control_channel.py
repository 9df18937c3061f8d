"""The same-host control channel (kvstore/dataplane/control_server.py, control_client.py;
frames of kvstore/wire/frame_codec.py) against real servers: a vanished client leaves
nothing lent, a client in another process, the fallback to gRPC and back, the token, and
every malformed frame, reply or connection answered cleanly, never out of step. The socket
itself (its accept loop and its path): test_control_socket.py."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvstore.client import StoreClient
from kvstore.dataplane import framing
from kvstore.dataplane.control_client import UdsControl
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.limits import MAX_KEYS_PER_CALL
from kvstore.node import StoreNode
from kvstore.pool.pool import KVPool, PoolSettings
from kvstore.wire import frame_codec as wire
from kvstore.wire.errors import frame_status
from tests.helpers.dataplane_helpers import MIB, block_of, key_of, socket_path


def test_a_vanished_client_leaves_no_lease_or_reservation(slab_node) -> None:
    pool, address, path = slab_node()
    code = ("import sys; from kvstore.dataplane.control_client import UdsControl\n"
            "c = UdsControl(sys.argv[1]); print(c.reserve([(b'k' * 32, 1 << 20)])[0].state, flush=True)\n"
            "c.lease([sys.argv[2].encode()], ttl_s=600); import os; os._exit(0)\n")
    pool.put(b"x" * 32, block_of(1))
    out = subprocess.run([sys.executable, "-c", code, path, "x" * 32], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0", out.stderr
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (pool.stats()[0].reserved_bytes or pool.stats()[0].leased_bytes):
        time.sleep(0.02)
    assert pool.stats()[0].reserved_bytes == 0 and pool.stats()[0].leased_bytes == 0
    pool.check_integrity()


def test_a_store_process_serves_a_client_process(slab_node) -> None:
    """Two processes, as deployed: the client maps the store's slab from another process."""
    pool, address, _ = slab_node()
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


def test_a_lost_control_socket_falls_back_and_reattaches(slab_node, client_of) -> None:
    pool, address, _ = slab_node()
    client = client_of(address)
    assert client.put(key_of(1), block_of(1)).ok and client.data_path_in_use == "same-host/uds"
    slab_node.nodes[id(pool)].control.close()  # as if the slab_node's socket went away under the client
    assert client.get_blocks([key_of(1)]) == [block_of(1)]     # this call: over gRPC
    assert client.data_path_in_use == "same-host/grpc"      # then the slab again, control over gRPC
    assert client.put(key_of(2), block_of(2)).ok and pool.get(key_of(2)) == block_of(2)


def test_auth_token_is_required_on_the_socket(slab_node, client_of) -> None:
    _, address, path = slab_node(token="s3cret")
    with pytest.raises(Unavailable):
        UdsControl(path, "wrong").lookup([key_of(1)])
    client = client_of(address, auth_token="s3cret")
    assert client.data_path_in_use == "same-host/uds"
    assert client.put(key_of(1), b"abc").ok and client.get(key_of(1)) == b"abc"


def test_a_connection_that_never_sends_its_token_is_closed(slab_node, client_of, monkeypatch) -> None:
    """Before its HELLO a connection holds a slot and a thread: one that sends nothing is
    closed after HELLO_TIMEOUT_S, so tokenless callers cannot fill the node's
    MAX_CONNECTIONS; a client with the token is unaffected (it is checked after that time)."""
    import socket as socket_mod

    from kvstore.dataplane import control_server
    monkeypatch.setattr(control_server, "HELLO_TIMEOUT_S", 0.5)
    _, address, path = slab_node(token="s3cret")
    client = client_of(address, auth_token="s3cret")
    idle = socket_mod.socket(socket_mod.AF_UNIX)
    idle.connect(path)
    idle.settimeout(10)
    t0 = time.monotonic()
    assert idle.recv(1) == b""                      # closed by the node
    assert 0.4 < time.monotonic() - t0 < 5
    idle.close()
    time.sleep(0.6)                                 # an authenticated connection has no deadline
    assert client.data_path_in_use == "same-host/uds"
    assert client.put(key_of(2), b"abc").ok and client.get(key_of(2)) == b"abc"


def test_a_hello_sent_a_byte_at_a_time_is_cut_at_the_deadline(slab_node, monkeypatch) -> None:
    """HELLO_TIMEOUT_S is a deadline for the whole HELLO, not a timeout per read: a peer
    without the token that sends one byte every 0.2 s (each read well inside the limit) is
    closed once the deadline passes, and its HELLO is never judged."""
    import socket as socket_mod

    from kvstore.dataplane import control_server
    from kvstore.wire import frame_codec as w
    monkeypatch.setattr(control_server, "HELLO_TIMEOUT_S", 0.5)
    _, _, path = slab_node(token="s3cret")
    hello = w.HEADER.pack(w.OP_HELLO, 6) + b"s3cret"           # the right token, sent too slowly
    slow = socket_mod.socket(socket_mod.AF_UNIX)
    slow.connect(path)
    t0 = time.monotonic()
    sent = 0
    try:
        for byte in hello:
            slow.sendall(bytes([byte]))
            sent += 1
            time.sleep(0.2)
    except (BrokenPipeError, ConnectionResetError):
        pass
    slow.settimeout(5)
    try:
        reply = slow.recv(64)
    except ConnectionResetError:
        reply = b""
    assert reply == b""                                        # closed, no OK frame
    assert sent < len(hello)                                   # before the HELLO was whole
    assert time.monotonic() - t0 < 5
    slow.close()


def test_a_connection_cannot_commit_or_abort_another_ones_reservation(slab_node) -> None:
    """Reservation ids are not secrets: another connection naming one is refused as unknown
    (commit) or ignored (abort), and the reservation stays its owner's to commit."""
    pool, _, path = slab_node()
    owner, other = UdsControl(path), UdsControl(path)
    grant = owner.reserve([(key_of(5), 10)])[0]
    assert grant.res_id
    assert not other.commit([grant.res_id], [key_of(6)])[0].ok
    other.abort([grant.res_id])
    assert pool.stats()[0].reserved_bytes > 0                 # still open
    results = owner.commit([grant.res_id], [key_of(5)])
    assert results[0].ok and pool.get(key_of(6)) is None
    owner.close()
    other.close()


def test_malformed_requests_are_refused(slab_node) -> None:
    pool, _, path = slab_node()
    ctl = UdsControl(path)
    for bad in (b"", b"k", b"k" * 31, b"k" * 33, b"k" * 56, b"k" * 65):  # the key spec makes 16 or 32
        with pytest.raises(InvalidArgument, match=f"{len(bad)} bytes.*16 .*32 "):
            ctl.reserve([(key_of(2), 10), (bad, 10)])
        with pytest.raises(InvalidArgument, match=f"{len(bad)} bytes"):
            ctl.lookup([bad])
        with pytest.raises(InvalidArgument, match=f"{len(bad)} bytes"):
            ctl.lease([key_of(1), bad])
    grants = ctl.reserve([(b"k" * 32, 1 << 40)])
    assert [g.state for g in grants] == [2] and all(g.error for g in grants)
    results = ctl.commit([12345], [b"k" * 32])
    assert not results[0].ok
    with pytest.raises(InvalidArgument):
        ctl._call(99, b"")
    assert ctl.lookup([key_of(1)]) == (0, ())  # the connection survives a refused request
    ctl.close()


def test_a_reserve_with_two_parents_is_refused(slab_node) -> None:
    """A RESERVE names at most one parent (the key its first block extends): one with two
    is refused naming the field, reserves nothing, and the connection goes on."""
    pool, _, path = slab_node()
    ctl = UdsControl(path)
    frame = (bytes((wire.FLAG_CHAIN,)) + wire.encode_keys([key_of(8), key_of(9)])
             + wire.encode_keys([key_of(1)]) + wire.U64.pack(10))
    with pytest.raises(InvalidArgument, match="parent: RESERVE carries 2 parents; at most 1"):
        ctl._call(wire.OP_RESERVE, frame)
    assert pool.stats()[0].reserved_bytes == 0
    grant = ctl.reserve([(key_of(1), 10)], chain=True, parent=key_of(8))[0]   # one parent is fine
    assert ctl.commit([grant.res_id], [key_of(1)])[0].ok
    ctl.close()


def test_a_commit_whose_counts_do_not_match_its_ids_commits_nothing(slab_node) -> None:
    """A COMMIT carries one key, one parent and one checksum per reservation id (keys and
    parents may be left out): one with more or fewer is refused naming the field, commits
    none of its blocks and leaves every reservation open for a commit that is right."""
    pool, _, path = slab_node()
    ctl = UdsControl(path)
    grants = ctl.reserve([(key_of(2), 10), (key_of(3), 10)])
    ids = [g.res_id for g in grants]

    def frame(keys: list[bytes], parents: list[bytes], sums: list[int] | None = None) -> bytes:
        return (wire.U32.pack(len(ids)) + b"".join(wire.U64.pack(i) for i in ids) + wire.encode_keys(keys)
                + wire.encode_keys(parents) + wire.SPARE_ASK.pack(0, 0)
                + bytes((wire.COMMIT_CHECKSUMS if sums is not None else 0,))
                + b"".join(wire.U64.pack(s) for s in sums or ()))

    both, none = [key_of(2), key_of(3)], [b"", b""]
    for bad, match in ((frame(both[:1], none), "keys: COMMIT of 2 reservation ids carries 1 keys"),
                       (frame(both + [key_of(4)], none), "keys: COMMIT of 2 reservation ids carries 3 keys"),
                       (frame(both, none[:1]), "parents: COMMIT of 2 reservation ids carries 1 parents"),
                       (frame(both, none, [1]), "checksums: COMMIT of 2 reservation ids carries 1 checksums")):
        with pytest.raises(InvalidArgument, match=match):
            ctl._call(wire.OP_COMMIT, bad)
        assert pool.get(key_of(2)) is None and pool.get(key_of(3)) is None
        assert pool.stats()[0].reserved_bytes == 2 * 4096     # two 10-byte blocks: a slab page each
    with pytest.raises(InvalidArgument):                      # three checksums: bytes past the sections
        ctl._call(wire.OP_COMMIT, frame(both, none, [1, 2, 3]))
    assert [r.ok for r in ctl.commit(ids, both)] == [True, True]    # both were still open
    assert pool.get(key_of(2)) is not None and pool.stats()[0].reserved_bytes == 0
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


def test_a_malformed_release_frame_ends_only_that_connection(slab_node) -> None:
    pool, _, path = slab_node()
    ctl = UdsControl(path)
    framing.write_frame(ctl._sock, wire.OP_RELEASE, b"abc")  # not 8 bytes
    with pytest.raises((Unavailable, OSError)):
        ctl.lookup([key_of(1)])
    ctl.close()
    assert UdsControl(path).lookup([key_of(1)]) == (0, ())


@pytest.mark.parametrize("node_poll_s, reply_poll_s", [(0.0, 0.0), (200e-6, 500e-6), (0.05, 0.0)])
def test_control_channel_polling_is_only_a_latency_choice(make_dram, node_poll_s, reply_poll_s) -> None:
    """However long the slab_node polls for the next request and the client for its reply
    (0: sleep at once), every request gets its own answer and the bytes are right."""
    from kvstore.config import StoreConfig
    with pytest.raises(ValueError, match="dataplane_poll_us"):
        StoreConfig(dataplane_poll_us=-1)
    pool = KVPool([make_dram(64 * MIB)], settings=PoolSettings(high_watermark=1.0, low_watermark=1.0))
    path = socket_path()
    served = StoreNode.serve(pool, dataplane_socket=path, dataplane_poll_s=node_poll_s)
    try:
        with StoreClient(served.address) as client:
            plane = client._local()
            plane.control.poll_s = reply_poll_s
            blocks = [(key_of(i), block_of(i, (i + 1) << 14)) for i in range(40)]
            for k, d in blocks:
                assert client.put(k, d).ok
            outs = [np.zeros(len(d), np.uint8) for _, d in blocks]
            assert client.get_into([k for k, _ in blocks], outs) == [len(d) for _, d in blocks]
            assert [o.tobytes() for o in outs] == [d for _, d in blocks]
            assert client.lookup([k for k, _ in blocks]).blocks == 40
    finally:
        served.stop(grace_s=None)


def test_a_connection_releases_only_its_own_leases(slab_node) -> None:
    """A RELEASE of another connection's lease is ignored (the lease keeps its blocks
    until its holder lets go), whatever the id."""
    pool, _, path = slab_node()
    pool.put(key_of(1), block_of(1))
    a, b = UdsControl(path), UdsControl(path)
    grant = a.lease([key_of(1)], ttl_s=60)
    assert grant.lease_id and pool.stats()[0].leased_bytes == len(block_of(1))
    for lid in (grant.lease_id, grant.lease_id - 1, grant.lease_id + 1, 1, 2):
        b.release(lid)
    assert b.lookup([key_of(1)])[0] == 1                     # b's releases were all read
    assert pool.stats()[0].leased_bytes == len(block_of(1))  # a's lease stands
    a.release(grant.lease_id)
    assert a.lookup([key_of(1)])[0] == 1 and pool.stats()[0].leased_bytes == 0
    a.close(), b.close()


def test_bad_frames_and_leases_get_clear_errors(slab_node) -> None:
    """A frame over the pre-auth limit gets an error reply, then the connection closes; a
    lease whose reply could not fit a frame, or with a TTL that is not a sane number of
    seconds, is refused and the connection stays usable; a reply that cannot be read
    makes the client drop the connection (Unavailable), never read out of step."""
    import socket as so
    pool, _, path = slab_node(token="s3cret")
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
            ctl.lease([key_of(1)], ttl_s=ttl)
    with pytest.raises(InvalidArgument, match="at most"):
        ctl.lease([key_of(1)] * (MAX_KEYS_PER_CALL + 1))
    assert ctl.lookup([key_of(1)]) == (0, ()) and pool.stats()[0].leased_bytes == 0
    ctl.close()


def test_a_reply_that_cannot_be_read_drops_the_connection() -> None:
    """A slab_node (here a fake one) whose reply header claims more than a frame may hold: the
    client raises Unavailable and closes, instead of reading the next replies out of step."""
    import socket as so
    path = socket_path()
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
            ctl.lookup([key_of(1)])
        with pytest.raises(Unavailable):
            ctl.lookup([key_of(1)])                  # closed since: never out of step
        thread.join(5)
        assert not thread.is_alive()
    finally:
        listener.close()
        os.unlink(path)


def test_grpc_control_calls_cannot_reach_another_clients_lease_or_reservation(slab_node) -> None:
    """Over gRPC there is no connection to check an id against: ids are random, so a gRPC
    caller that names ids near its own (sequential ids let it) releases, commits or aborts
    nothing of a socket client's. A commit of another's reservation before its bytes were
    written published the slot's stale bytes (a former block's) under the new key, with a
    checksum the node took of them."""
    import grpc

    from protos import kvstore_pb2 as pb
    from protos import kvstore_pb2_grpc as pb_grpc

    pool, address, path = slab_node()
    pool.put(key_of(1), block_of(1))
    owner = UdsControl(path)
    grant = owner.lease([key_of(1)], ttl_s=60)
    slot = owner.reserve([(key_of(2), MIB)])[0]
    assert grant.lease_id and slot.res_id
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        mine = stub.ReserveBlocks(pb.ReserveBlocksRequest(keys=[key_of(3)], sizes=[MIB])).slots[0].reservation_id
        own_lease = stub.LeaseBlocks(pb.LeaseBlocksRequest(keys=[key_of(1)], ttl_s=60)).lease_id
        near = [i for base in (mine, own_lease) for i in range(max(1, base - 8), base + 9) if i != base]
        near += list(range(1, 17))
        for lid in near:
            stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lid))
        stub.CommitBlocks(pb.CommitBlocksRequest(reservation_ids=[i for i in near if i != mine]))
        stub.AbortBlocks(pb.AbortBlocksRequest(reservation_ids=[i for i in near if i != mine]))
        assert stub.Lookup(pb.LookupRequest(keys=[key_of(2)])).prefix_blocks == 0   # nothing committed
        assert stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=own_lease)).released
        stub.AbortBlocks(pb.AbortBlocksRequest(reservation_ids=[mine]))
    assert pool.stats()[0].leased_bytes == len(block_of(1))              # the socket client's lease stands
    owner.release(grant.lease_id)
    assert owner.lookup([key_of(1)])[0] == 1
    assert pool.stats()[0].leased_bytes == 0
    assert owner.commit([slot.res_id], [key_of(2)])[0].ok                             # its reservation is still its own
    assert pool.contains(key_of(2))
    owner.close()
