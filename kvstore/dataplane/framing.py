"""The socket I/O of the light control channel: whole frames in and out, and polling for
the next one. What a frame holds, and its codec, is kvstore/wire/frame_codec.py."""
from __future__ import annotations

import select
import socket
import time

from kvstore.errors import InvalidArgument
from kvstore.wire.frame_codec import HEADER, MAX_FRAME_BYTES


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


def read_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES,
               deadline: float | None = None) -> tuple[int, bytes]:
    """(op or status, payload) of the next frame. Raises ConnectionError at the end of the
    stream and InvalidArgument for a frame over ``max_bytes`` (its payload is not read:
    the stream is out of step afterwards, and the caller must drop the connection).
    ``deadline`` (``time.monotonic()`` seconds): the whole frame must be in by then, however
    the peer spaces its bytes (each read's timeout is the time left; TimeoutError past it;
    the socket's timeout is left set, for the caller to reset)."""
    if deadline is None:
        code, n = HEADER.unpack(recv_exact(sock, HEADER.size))
    else:
        code, n = HEADER.unpack(_recv_by(sock, HEADER.size, deadline))
    if n > max_bytes:
        raise InvalidArgument(f"control frame of {n} bytes; at most {max_bytes}")
    if not n:
        return code, b""
    return code, recv_exact(sock, n) if deadline is None else _recv_by(sock, n, deadline)


def _recv_by(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes by ``deadline``; TimeoutError past it, ConnectionError as
    :func:`recv_exact`."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("control frame not received in time")
        sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("control channel closed")
        got += k
    return bytes(buf)


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
