"""Fuzz targets of the control channel's frames (kvstore/wire/frame_codec.py, served by
kvstore/dataplane/control_server.py) against real servers on a real pool: the same-host Unix socket
(every op), the read-only TCP channel, and the bytes a client may send before its token was
checked. Each input is a frame (or a raw byte stream) built by hypothesis; after it the
connection either answers a probe LOOKUP of a stored block correctly or was closed by the
node — never a hang, never a reply out of step, never a dead node. At the end a fresh client
still puts and gets byte-identical blocks, and nothing the fuzzed connections leased or
reserved is still held. Short deterministic runs here; ``make fuzz`` runs them long."""
from __future__ import annotations

import os
import socket
import struct
import tempfile
import time
import uuid

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.client import StoreClient
from kvstore.dataplane import framing
from kvstore.dataplane.control_server import TcpControlServer
from kvstore.dataplane.host import DataPlaneHost
from kvstore.errors import InvalidArgument
from kvstore.limits import MAX_KEYS_PER_CALL
from kvstore.node import StoreNode
from kvstore.pool.pool import KVPool, PoolSettings
from kvstore.wire import frame_codec as w
from tests.helpers.fuzzing import Counter, fuzz_settings, run_target

TOKEN = "fuzz-token"
STORED = [bytes([i]) * 32 for i in range(1, 5)]           # blocks the node holds throughout
PROBE_KEY = b"\xee" * 16                                  # held too; never in a fuzzed frame
PROBE_BLOCKS = 9                                           # more keys than a fuzzed list holds (6), so
PROBE = w.encode_keys([PROBE_KEY] * PROBE_BLOCKS)          # no fuzzed LOOKUP's reply looks like the probe's
REPLY_TIMEOUT_S = 5.0                                      # a reply later than this is a hang


@pytest.fixture(scope="module")
def node():
    """A store node (16 MiB DRAM) with its Unix socket and read-only TCP channel, both
    requiring TOKEN. Yields (pool, host, uds path, tcp port, grpc address)."""
    from kvstore.tiers.dram import DramTier
    dram = DramTier(16 << 20)
    pool = KVPool([dram], settings=PoolSettings(high_watermark=1.0, low_watermark=1.0))
    for i, key in enumerate(STORED + [PROBE_KEY]):
        assert pool.put(key, bytes([i]) * 4096).ok
        pool.pin([key], hard=True)   # a fuzzed RESERVE may fill the tier: these stay
    path = os.path.join(tempfile.gettempdir(), f"kvstore-fuzz-{uuid.uuid4().hex[:8]}.sock")
    served = StoreNode.serve(pool, auth_token=TOKEN, dataplane_socket=path)
    host = DataPlaneHost(pool)
    tcp = TcpControlServer(host, "127.0.0.1", 0, TOKEN)
    yield pool, host, path, tcp.port, served.address
    tcp.close()
    served.stop(grace_s=None)
    pool.close()
    dram.close()


# -- inputs ------------------------------------------------------------------------------------
KEY_LENGTHS = st.sampled_from([0, 1, 15, 16, 17, 31, 32, 33, 56, 64, 255])
key = st.one_of(st.sampled_from(STORED), KEY_LENGTHS.flatmap(lambda n: st.binary(min_size=n, max_size=n)))
keys = st.lists(key, max_size=6)
u64 = st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1))
u32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-9, 5.0, 3600.0, -1.0]))


@st.composite
def key_list(draw) -> bytes:
    """A key list as the wire packs it, or one whose header lies about it."""
    ks = draw(keys)
    if draw(st.integers(0, 9)) == 0:
        return w.KEYS_HEAD.pack(draw(u32), draw(st.integers(0, 255))) + b"".join(ks)
    try:
        return w.encode_keys(ks)
    except InvalidArgument:
        return w.KEYS_HEAD.pack(len(ks), 0)


@st.composite
def payload_of(draw, op: int) -> bytes:
    if op == w.OP_LOOKUP:
        body = draw(key_list())
    elif op == w.OP_LEASE:
        body = w.LEASE_HEAD.pack(draw(floats), draw(st.integers(0, 255))) + draw(key_list())
    elif op == w.OP_RELEASE:
        body = w.U64.pack(draw(u64))
    elif op == w.OP_RESERVE:
        n = draw(st.integers(0, 4))
        sizes = draw(st.lists(st.one_of(st.integers(0, 1 << 20), u64), min_size=n, max_size=n))
        body = (bytes([draw(st.integers(0, 255))]) + draw(key_list()) + draw(key_list())
                + struct.pack(f"<{n}Q", *sizes))
    elif op == w.OP_COMMIT:
        ids = draw(st.lists(u64, max_size=4))
        body = (w.U32.pack(len(ids)) + struct.pack(f"<{len(ids)}Q", *ids) + draw(key_list()) + draw(key_list())
                + w.SPARE_ASK.pack(draw(st.integers(0, 1 << 20)), draw(st.integers(0, 100)))
                + bytes([draw(st.integers(0, 3))]) + draw(st.binary(max_size=40)))
    elif op == w.OP_ABORT:
        body = b"".join(w.U64.pack(i) for i in draw(st.lists(u64, max_size=4)))
    else:
        body = draw(st.binary(max_size=64))
    cut = draw(st.integers(0, 3))
    if cut == 1 and body:
        body = body[:draw(st.integers(0, len(body) - 1))]        # truncated
    elif cut == 2:
        body += draw(st.binary(min_size=1, max_size=16))         # trailing bytes
    return body


ops = st.one_of(st.sampled_from([w.OP_LOOKUP, w.OP_LEASE, w.OP_RELEASE, w.OP_RESERVE, w.OP_COMMIT,
                                 w.OP_ABORT, w.OP_HELLO]), st.integers(0, 255))
frame = ops.flatmap(lambda op: st.tuples(st.just(op), payload_of(op)))


# -- the connection under fuzz -------------------------------------------------------------------
class Conn:
    """A raw authenticated control connection, reopened when the node closed it."""

    def __init__(self, connect) -> None:
        self._connect = connect
        self.sock: socket.socket | None = None
        self.closes = 0
        self.history: list[tuple[int, int, str]] = []   # (op, payload bytes, outcome) on this connection

    def open(self) -> socket.socket:
        if self.sock is None:
            s = self._connect()
            s.settimeout(REPLY_TIMEOUT_S)
            framing.write_frame(s, w.OP_HELLO, TOKEN.encode())
            assert framing.read_frame(s) == (w.OK, b"")
            self.sock = s
            self.history = []
        return self.sock

    def drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self.closes += 1


def _check_reply(code: int, payload: bytes) -> None:
    assert code == w.OK or code in w.ERRORS, f"reply status {code}"
    if code != w.OK:
        assert payload, "an error reply names its error"


def exchange(conn: Conn, op: int, payload: bytes, probe_reply: bytes) -> None:
    """Send one fuzzed frame, then a probe LOOKUP; read replies until the probe's (at most
    the fuzzed frame's reply and a spare-slot frame come first). The node may hang up only
    where the wire says it does: a malformed RELEASE (it gets no reply), a HELLO with a
    wrong token, or after a reply saying it is closing the connection."""
    s = conn.open()
    said_closing = False
    try:
        framing.write_frame(s, op, payload)
        framing.write_frame(s, w.OP_LOOKUP, PROBE)
        for _ in range(4):
            code, reply = framing.read_frame(s)
            _check_reply(code, reply)
            said_closing |= b"closing the connection" in reply
            if (code, reply) == (w.OK, probe_reply):
                conn.history.append((op, len(payload), "probe answered"))
                return
        raise AssertionError(f"no probe reply after op {op}: out of step")
    except TimeoutError:
        raise AssertionError(f"op {op} with {len(payload)} bytes: no reply in {REPLY_TIMEOUT_S} s (hang)") from None
    except (ConnectionError, BrokenPipeError):
        history = conn.history
        conn.drop()
        assert op in (w.OP_RELEASE, w.OP_HELLO) or said_closing, \
            f"the node hung up on op {op} ({len(payload)} bytes: {payload[:64].hex()}) without saying why; " \
            f"earlier on this connection: {history[-5:]}"


def _wait_released(pool: KVPool, host: DataPlaneHost, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = pool.stats()[0]
        if s.leased_bytes == 0 and s.reserved_bytes == 0 and host.lent() == (0, 0):
            return
        time.sleep(0.05)
    raise AssertionError(f"still held after the fuzzed connections closed: {pool.stats()[0]}, {host.lent()}")


def _still_serves(address: str, path: str) -> None:
    with StoreClient(address, auth_token=TOKEN, timeout_s=30) as c:
        assert c.data_path_in_use == "same-host/uds"
        data = np.random.default_rng(5).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
        fresh = os.urandom(32)
        assert c.put(fresh, data).ok and c.get(fresh) == data
        assert c.get_blocks(STORED) == [bytes([i]) * 4096 for i in range(len(STORED))]


# -- targets ---------------------------------------------------------------------------------------
def _uds(path: str):
    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s
    return connect


def _tcp(port: int):
    return lambda: socket.create_connection(("127.0.0.1", port))


@pytest.mark.parametrize("channel", ["uds", "tcp"])
def test_fuzz_control_frames(node, channel: str) -> None:
    pool, host, path, port, address = node
    conn, counter = Conn(_uds(path) if channel == "uds" else _tcp(port)), Counter()
    probe_reply = w.U32.pack(PROBE_BLOCKS) + ",".join(["dram"] * PROBE_BLOCKS).encode()

    @fuzz_settings(300)
    @given(frames=st.lists(frame, min_size=1, max_size=3))
    def target(frames) -> None:
        for op, payload in frames:
            counter()
            exchange(conn, op, payload, probe_reply)

    run = run_target(f"control frames ({channel})", target, counter)
    conn.drop()
    _wait_released(pool, host)
    _still_serves(address, path)
    assert run.executions >= 300


def test_fuzz_raw_streams_before_and_after_the_token(node) -> None:
    """Arbitrary bytes, with or without a good HELLO first, then the client's end of the
    stream: the node answers frames it can read, refuses the rest, and closes at the end —
    and never serves a connection that did not show the token."""
    pool, host, path, port, address = node
    counter = Counter()
    hello = w.HEADER.pack(w.OP_HELLO, len(TOKEN)) + TOKEN.encode()

    @fuzz_settings(300)
    @given(authed=st.booleans(), data=st.one_of(
        st.binary(max_size=200),
        st.lists(frame, max_size=3).map(lambda fs: b"".join(w.HEADER.pack(op, len(p)) + p for op, p in fs))))
    def target(authed: bool, data: bytes) -> None:
        counter()
        s = _uds(path)()
        s.settimeout(REPLY_TIMEOUT_S)
        try:
            s.sendall((hello if authed else b"") + data)
            s.shutdown(socket.SHUT_WR)
            got = b""
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                got += chunk
        except TimeoutError:
            raise AssertionError("the node did not close a finished stream (hang)") from None
        except ConnectionError:
            return
        finally:
            s.close()
        pos, first = 0, True
        while pos + w.HEADER.size <= len(got):
            code, n = w.HEADER.unpack_from(got, pos)
            _check_reply(code, got[pos + w.HEADER.size:pos + w.HEADER.size + n])
            if first and not authed:
                assert code != w.OK, "a connection without the token was served"
            first = False
            pos += w.HEADER.size + n

    run_target("control raw streams (uds)", target, counter)
    _wait_released(pool, host)
    _still_serves(address, path)


def test_fuzz_key_list_decoder() -> None:
    """decode_keys on any bytes: the keys and the position after them, or InvalidArgument —
    never another exception, never more than MAX_KEYS_PER_CALL keys or a key of a length the
    key spec cannot make."""
    counter = Counter()

    @fuzz_settings(1500)
    @given(raw=st.one_of(st.binary(max_size=300), key_list()), pos=st.integers(0, 4),
           allow_empty=st.booleans())
    def target(raw: bytes, pos: int, allow_empty: bool) -> None:
        counter()
        try:
            got, end = w.decode_keys(raw, pos, allow_empty)
        except InvalidArgument:
            return
        assert pos <= end <= len(raw) and len(got) <= MAX_KEYS_PER_CALL
        assert all(len(k) in (16, 32) or (allow_empty and not k) for k in got)

    run_target("control key lists (decoder)", target, counter)
