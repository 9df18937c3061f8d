"""The client side of the light control channel (the store side is
:mod:`kvstore.dataplane.server`): :class:`UdsControl` over the node's Unix domain socket,
for a same-host client that maps the slab, and :class:`TcpControl` over its read-only TCP
channel, for a reader on another host (transfer engine). Frames are those of
:mod:`kvstore.dataplane.wire`."""
from __future__ import annotations

import socket
import struct
import threading
from typing import Callable, Iterable, Sequence

from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.pool import PutResult
from kvstore.dataplane import wire as w
from kvstore.dataplane.types import SLOT_FAILED, BlockLocation, LeaseGrant, SlotGrant

# Polling instead of sleeping while a reply or the next request is due: on this project's
# 2-core VM, one-block 1 MiB gets went from 217 to 141-161 us (the lease's round trip from
# 85 to 22-25 us) and puts from 236-357 to 165-218 us, with both sides polling.
REPLY_POLL_S = 500e-6    # a client, for the reply to its request


def _commit_frame(res_ids: Sequence[int], keys: Sequence[bytes], parents: Sequence[bytes | None] | None,
                  spare: tuple[int, int], checksums: Sequence[int] | None, give_back: Sequence[int] = ()) -> bytes:
    n = len(res_ids)
    sections = (w.COMMIT_CHECKSUMS if checksums else 0) | (w.COMMIT_GIVE_BACK if give_back else 0)
    return (w.U32.pack(n) + struct.pack(f"<{n}Q", *res_ids) + w.encode_keys(keys)
            + w.encode_keys([p or b"" for p in parents] if parents else [b""] * n) + w.SPARE_ASK.pack(*spare)
            + bytes((sections,)) + (struct.pack(f"<{n}Q", *checksums) if checksums else b"")
            + (w.U32.pack(len(give_back)) + struct.pack(f"<{len(give_back)}Q", *give_back) if give_back else b""))


def _commit_results(reply: bytes, keys: Sequence[bytes]) -> list[PutResult]:
    n = len(keys)
    codes = reply[:n]
    it = iter(w.decode_errors(reply, n, sum(c == 2 for c in codes)))
    return [PutResult(k, c != 2, c == 1, next(it) if c == 2 else "") for k, c in zip(keys, codes)]


def _grant(reply: bytes) -> LeaseGrant:
    lease_id, deadline = w.LEASE_REPLY.unpack_from(reply, 0)
    blocks = [BlockLocation(*t) for t in w.LOCATION.iter_unpack(memoryview(reply)[w.LEASE_REPLY.size:])]
    return LeaseGrant(lease_id, deadline, blocks)


class UdsControl:
    """The client side of the Unix-socket control channel; thread-safe (one request at a
    time). Raises Unavailable when the store node cannot be reached, and the node's own
    error class (InvalidArgument, CapacityError, ...) when it refuses a request."""

    def __init__(self, path: str, auth_token: str | None = None, timeout_s: float = 60.0,
                 poll_s: float = REPLY_POLL_S) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock = self._connect(timeout_s)
        self._poller = w.poller_of(self._sock)
        self.poll_s = poll_s
        self._owed = 0  # spare-slot frames the node sends after commit replies, not read yet
        self._granted: list[tuple[int, SlotGrant]] = []  # (size, spare slot) read, not taken
        self._call(w.OP_HELLO, (auth_token or "").encode())

    def _connect(self, timeout_s: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise Unavailable(f"store control socket {self.path}: {exc}") from None
        return sock

    def _call(self, op: int, payload: bytes, asks_spares: bool = False) -> bytes:
        with self._lock:
            try:
                w.write_frame(self._sock, op, payload)
                self._read_spares()
                status, reply = self._reply()
            except OSError as exc:
                raise Unavailable(f"store control socket {self.path}: {exc}") from None
            if status == w.OK and asks_spares:
                self._owed += 1
        if status != w.OK:
            raise w.ERRORS.get(status, KVStoreError)(reply.decode(errors="replace"))
        return reply

    def _reply(self) -> tuple[int, bytes]:
        """The next frame from the node, polled for up to ``poll_s`` before sleeping. A
        frame that cannot be read leaves the stream out of step: the connection is closed
        and ConnectionError raised (callers turn it into Unavailable)."""
        w.spin_until_readable(self._poller, self.poll_s)
        try:
            return w.read_frame(self._sock)
        except InvalidArgument as exc:
            self._sock.close()
            raise ConnectionError(f"unreadable reply ({exc}); connection closed") from None

    def _read_spares(self, wait: bool = True) -> None:
        """Read the spare-slot frames owed (lock held); without ``wait``, only those that
        have arrived."""
        while self._owed:
            if not wait and not self._poller.poll(0):
                return
            status, frame = self._reply()
            self._owed -= 1
            size, count = w.SPARE_ASK.unpack_from(frame, 0)
            self._granted += [(size, SlotGrant(st, rid, off, "", by)) for st, rid, off, by in
                              w.SLOT.iter_unpack(memoryview(frame)[w.SPARE_ASK.size:w.SPARE_ASK.size
                                                                   + count * w.SLOT.size])]

    def take_spares(self, wait: bool = False) -> list[tuple[int, SlotGrant]]:
        """The spare slots granted since the last call, as (size, slot); ``wait``: also
        those still being reserved by the node (asked for at an earlier commit)."""
        with self._lock:
            try:
                self._read_spares(wait)
            except OSError as exc:
                raise Unavailable(f"store control socket {self.path}: {exc}") from None
            out, self._granted = self._granted, []
        return out

    @property
    def spares_owed(self) -> int:
        """Spare-slot grants asked for and not read yet."""
        return self._owed

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, list[str]]:
        reply = self._call(w.OP_LOOKUP, w.encode_keys(keys))
        (n,) = w.U32.unpack_from(reply, 0)
        return n, (reply[4:].decode().split(",") if n else [])

    def lease(self, keys: Sequence[bytes], ttl_s: float | None = None, stop_at_miss: bool = False,
              chain: bool = False) -> LeaseGrant:
        flags = (w.FLAG_STOP_AT_MISS if stop_at_miss else 0) | (w.FLAG_CHAIN if chain else 0)
        return _grant(self._call(w.OP_LEASE, w.LEASE_HEAD.pack(ttl_s or 0.0, flags) + w.encode_keys(keys)))

    def lease_pipelined(self, chunks: Sequence[Sequence[bytes]], ttl_s: float | None,
                        consume: Callable[[int, LeaseGrant], None]) -> None:
        """Ask for a lease on every chunk of keys at once, then for each in order: read its
        grant, ``consume(i, grant)`` (copy the blocks out), release it. The node grants the
        next chunk while ``consume`` runs. If ``consume`` or a grant fails, the remaining
        grants are still read and released, and the first error goes on."""
        head = w.LEASE_HEAD.pack(ttl_s or 0.0, 0)
        error: BaseException | None = None
        with self._lock:
            try:
                self._read_spares()
                frames = [head + w.encode_keys(c) for c in chunks]
                self._sock.sendall(b"".join(w.HEADER.pack(w.OP_LEASE, len(f)) + f for f in frames))
                for n in range(len(chunks)):
                    status, reply = self._reply()
                    if status != w.OK:
                        error = error or w.ERRORS.get(status, KVStoreError)(reply.decode(errors="replace"))
                        continue
                    grant = _grant(reply)
                    try:
                        if error is None:
                            consume(n, grant)
                    except BaseException as exc:  # noqa: BLE001 - kept, raised after the drain
                        error = exc
                    finally:
                        if grant.lease_id:
                            w.write_frame(self._sock, w.OP_RELEASE, w.U64.pack(grant.lease_id))
            except OSError as exc:
                raise Unavailable(f"store control socket {self.path}: {exc}") from None
        if error is not None:
            raise error

    def release(self, lease_id: int) -> None:
        """End a lease without waiting for the node (no reply frame)."""
        if not lease_id:
            return
        with self._lock:
            try:
                w.write_frame(self._sock, w.OP_RELEASE, w.U64.pack(lease_id))
            except OSError as exc:
                raise Unavailable(f"store control socket {self.path}: {exc}") from None

    def reserve(self, items: Sequence[tuple[bytes, int]], chain: bool = False,
                parent: bytes | None = None) -> list[SlotGrant]:
        keys = [k for k, _ in items]
        payload = (bytes((w.FLAG_CHAIN if chain else 0,)) + w.encode_keys([parent] if parent else [])
                   + w.encode_keys(keys) + struct.pack(f"<{len(items)}Q", *(s for _, s in items)))
        reply = self._call(w.OP_RESERVE, payload)
        end = len(items) * w.SLOT.size
        raw = list(w.SLOT.iter_unpack(memoryview(reply)[:end]))
        errors = iter(w.decode_errors(reply, end, sum(s == SLOT_FAILED for s, _, _, _ in raw)))
        return [SlotGrant(s, rid, off, next(errors) if s == SLOT_FAILED else "", by) for s, rid, off, by in raw]

    name = "uds"
    spares = True  # commit can hand out spare slots (one round trip per put)

    def commit(self, res_ids: Sequence[int], keys: Sequence[bytes], parents: Sequence[bytes | None] | None = None,
               spare: tuple[int, int] = (0, 0), checksums: Sequence[int] | None = None,
               give_back: Sequence[int] = ()) -> list[PutResult]:
        """Commit filled slots as ``keys`` (chain ``parents``; ``checksums``: the writer's
        xxh3_64 of each slot, None: the node takes them); ask for ``spare`` = (size, count)
        slots for the next puts, which the node reserves after its reply (see
        :meth:`take_spares`); ``give_back``: unused spare slots to abort. Returns a result
        per id."""
        reply = self._call(w.OP_COMMIT, _commit_frame(res_ids, keys, parents, spare, checksums, give_back),
                           spare[1] > 0)
        return _commit_results(reply, keys)

    def commit_pipelined(self, chunks: Iterable[tuple[Sequence[int], Sequence[bytes], Sequence[bytes | None],
                                                      Sequence[int]]]) -> list[PutResult]:
        """Commit chunk after chunk of (ids, keys, parents, checksums) without waiting for
        the replies, which are read once ``chunks`` is exhausted: the node commits a chunk
        while the caller still fills the next (``chunks`` may be a generator that copies).
        If ``chunks`` raises, the replies of the chunks sent are read and the error goes on.
        Returns a result per id, in order."""
        sent: list[Sequence[bytes]] = []
        out: list[PutResult] = []
        with self._lock:
            try:
                self._read_spares()
                try:
                    for ids, keys, parents, sums in chunks:
                        w.write_frame(self._sock, w.OP_COMMIT, _commit_frame(ids, keys, parents, (0, 0), sums))
                        sent.append(keys)
                finally:
                    replies = [self._reply() for _ in sent]
            except OSError as exc:
                raise Unavailable(f"store control socket {self.path}: {exc}") from None
        for keys, (status, reply) in zip(sent, replies):
            if status != w.OK:
                raise w.ERRORS.get(status, KVStoreError)(reply.decode(errors="replace"))
            out += _commit_results(reply, keys)
        return out

    def abort(self, res_ids: Sequence[int]) -> None:
        if res_ids:
            self._call(w.OP_ABORT, struct.pack(f"<{len(res_ids)}Q", *res_ids))

    def close(self) -> None:
        self._sock.close()


class TcpControl(UdsControl):
    """The client side of ``kvstore.dataplane.server.TcpControlServer`` (``address`` =
    host:port): LOOKUP, LEASE and RELEASE as :class:`UdsControl` does them, one TCP
    connection, no Nagle delay. About 0.3 ms a lease on loopback where a gRPC
    ``LeaseBlocks`` costs about 1.1 ms."""

    name = "tcp"
    spares = False

    def _connect(self, timeout_s: float) -> socket.socket:
        host, _, port = self.path.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        except (OSError, ValueError) as exc:
            raise Unavailable(f"store control channel {self.path}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
