"""The compact framing of the same-host control channel (a Unix domain socket). No pickle:
every frame is a struct-packed header and a struct-packed payload, little-endian.

Frame: ``<B op | status> <I payload bytes>`` then the payload. A request gets exactly one
reply, except RELEASE, which gets none (a reader releases its lease without waiting).

- HELLO: auth token (utf-8) → empty.
- LOOKUP: keys → ``<I`` prefix blocks, tier names joined by ``,``.
- LEASE: ``<dB`` ttl seconds, flags (1: stop at miss, 2: chain); keys → ``<Qd`` lease id,
  deadline; per key ``<QQQQ`` state, offset, size, checksum.
- RELEASE: ``<Q`` lease id → no reply.
- RESERVE: ``<B`` flags (2: chain); parent (keys, 0 or 1); keys; ``<Q`` size per key → per key
  ``<BQQd`` state, reservation id, offset, write-by time (monotonic seconds); then the
  failed ones' errors.
- COMMIT: ``<I`` n, ``<Q`` per reservation id; the keys to commit as and their parents (empty:
  keep, none); ``<QI`` size, count of spare slots wanted; ``<B`` sections: 1 = ``<Q`` per
  id, the writer's xxh3_64 of each filled slot (absent: the node checksums the slots);
  2 = ``<I`` count, ``<Q`` each: spare slots of this connection given back unused → per id
  ``<B`` 0 stored, 1 existed, 2 failed; the failed ones' errors. When the commit succeeded
  and asked for spares, a second frame follows the reply: ``<QI`` size, count granted,
  ``<BQQd`` each (the node reserves them after replying, while the writer copies on).
  A client may send several COMMITs before reading their replies (they come in order).
- ABORT: ``<Q`` per reservation id → empty.

Keys: ``<IB`` count, length (all keys that long, concatenated) or length 0 (each key
prefixed by its ``<B`` length). Errors: ``<H`` length + utf-8 each. A reply with a non-zero
status carries the error message; the status names its class (:data:`ERRORS`).
"""
from __future__ import annotations

import select
import socket
import struct
import time
from typing import Sequence

from kvstore.errors import (CapacityError, IntegrityError, InvalidArgument, KVStoreError, LeaseExpired,
                            ReservationExpired, Unavailable)
from kvstore.limits import check_count, check_key

HEADER = struct.Struct("<BI")
OP_HELLO, OP_LOOKUP, OP_LEASE, OP_RELEASE, OP_RESERVE, OP_COMMIT, OP_ABORT = range(1, 8)
FLAG_STOP_AT_MISS, FLAG_CHAIN = 1, 2
COMMIT_CHECKSUMS, COMMIT_GIVE_BACK = 1, 2  # the COMMIT frame's optional sections
LEASE_HEAD = struct.Struct("<dB")
LEASE_REPLY = struct.Struct("<Qd")
LOCATION = struct.Struct("<QQQQ")
SLOT = struct.Struct("<BQQd")
SPARE_ASK = struct.Struct("<QI")
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")
KEYS_HEAD = struct.Struct("<IB")
MAX_FRAME_BYTES = 64 << 20
MAX_HELLO_BYTES = 4096          # any frame before the connection's token was checked
MAX_LEASE_KEYS = (MAX_FRAME_BYTES - LEASE_REPLY.size) // LOCATION.size  # a LEASE reply fits a frame

OK = 0
ERRORS: dict[int, type[KVStoreError]] = {1: InvalidArgument, 2: LeaseExpired, 3: CapacityError,
                                         4: IntegrityError, 5: ReservationExpired, 6: Unavailable,
                                         7: KVStoreError}
STATUS_OF = {cls: code for code, cls in ERRORS.items()}


def status_of(exc: KVStoreError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return 7


def encode_keys(keys: Sequence[bytes]) -> bytes:
    n = len(keys)
    length = len(keys[0]) if n else 0
    if n and 0 < length < 256 and all(len(k) == length for k in keys):
        return KEYS_HEAD.pack(n, length) + b"".join(keys)
    if any(len(k) > 255 for k in keys):
        raise InvalidArgument("a block key is at most 255 bytes on the control channel")
    return KEYS_HEAD.pack(n, 0) + b"".join(bytes((len(k),)) + k for k in keys)


def decode_keys(buf: bytes, pos: int, allow_empty: bool = False) -> tuple[list[bytes], int]:
    """Keys at ``pos`` of ``buf`` and the position after them. Raises InvalidArgument for a
    truncated list, more than :data:`~kvstore.limits.MAX_KEYS_PER_CALL` keys, or a key of a
    length the key spec cannot make (``allow_empty``: b"" too, the wire's "none")."""
    if pos + KEYS_HEAD.size > len(buf):
        raise InvalidArgument("truncated key list")
    n, length = KEYS_HEAD.unpack_from(buf, pos)
    pos += KEYS_HEAD.size
    check_count(n)
    if length:
        check_key(b"\0" * length, "keys")
        end = pos + n * length
        if end > len(buf):
            raise InvalidArgument("truncated key list")
        return [buf[i:i + length] for i in range(pos, end, length)], end
    keys = []
    for i in range(n):
        if pos >= len(buf):
            raise InvalidArgument("truncated key list")
        k = buf[pos]
        if pos + 1 + k > len(buf):
            raise InvalidArgument("truncated key list")
        key = buf[pos + 1:pos + 1 + k]
        check_key(key, f"keys[{i}]", allow_empty)
        keys.append(key)
        pos += 1 + k
    return keys, pos


def encode_errors(errors: Sequence[str]) -> bytes:
    out = []
    for e in errors:
        raw = e.encode()[:65535]
        out.append(struct.pack("<H", len(raw)) + raw)
    return b"".join(out)


def decode_errors(buf: bytes, pos: int, count: int) -> list[str]:
    out = []
    for _ in range(count):
        (n,) = struct.unpack_from("<H", buf, pos)
        out.append(bytes(buf[pos + 2:pos + 2 + n]).decode(errors="replace"))
        pos += 2 + n
    return out


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes; raises ConnectionError when the peer closed the socket first."""
    data = sock.recv(n)
    if len(data) == n:
        return data
    if not data and n:
        raise ConnectionError("control channel closed")
    buf = bytearray(n)
    view = memoryview(buf)
    view[:len(data)] = data
    got = len(data)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("control channel closed")
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> tuple[int, bytes]:
    """(op or status, payload) of the next frame. Raises ConnectionError at the end of the
    stream and InvalidArgument for a frame over ``max_bytes`` (its payload is not read:
    the stream is out of step afterwards, and the caller must drop the connection)."""
    code, n = HEADER.unpack(recv_exact(sock, HEADER.size))
    if n > max_bytes:
        raise InvalidArgument(f"control frame of {n} bytes; at most {max_bytes}")
    return code, recv_exact(sock, n) if n else b""


def poller_of(sock: socket.socket) -> select.poll:
    """A poll object watching ``sock`` for readable data (for :func:`spin_until_readable`)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return poller


def spin_until_readable(poller: select.poll, spin_s: float) -> bool:
    """Poll without sleeping, for at most ``spin_s`` seconds, until the watched socket has
    data (or was closed); whether it has. A thread asleep in ``recv`` takes 20-60 us to
    wake up on a virtual machine, more than a request takes to serve: a UDS ping-pong
    between two processes had a median round trip of 61 us with both blocking and 7 us
    with both polling (2-core VM). Each poll releases the GIL, so other threads run."""
    poll = poller.poll
    if poll(0):
        return True
    if spin_s <= 0:
        return False
    clock = time.perf_counter
    end = clock() + spin_s
    while clock() < end:
        if poll(0):
            return True
    return False


def write_frame(sock: socket.socket, code: int, payload: bytes = b"") -> None:
    sock.sendall(HEADER.pack(code, len(payload)) + payload)
