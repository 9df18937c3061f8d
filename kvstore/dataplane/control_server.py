"""The store side of the light control channel: a Unix domain socket for same-host clients
(:class:`UdsServer`) and the same frames over TCP for readers on other hosts, which move the
bytes with the transfer engine (:class:`TcpControlServer`, reads only: LOOKUP, LEASE,
RELEASE); a thread per connection. Frames are those of :mod:`kvstore.wire.frame_codec`; the
client side is :mod:`kvstore.dataplane.control_client`. A connection's leases and reservations end
with it, so a client that dies holds nothing past its socket."""
from __future__ import annotations

import hmac
import logging
import os
import socket
import stat
import struct
import threading
import time

from kvstore.dataplane import framing as io
from kvstore.dataplane.host import DataPlaneHost
from kvstore.errors import InvalidArgument, KVStoreError, Unauthenticated
from kvstore.wire import frame_codec as w
from kvstore.wire.errors import frame_status

log = logging.getLogger(__name__)
READ_OPS = frozenset((w.OP_HELLO, w.OP_LOOKUP, w.OP_LEASE, w.OP_RELEASE))
MAX_CONNECTIONS = 1024   # per server; more are closed at once (each costs a thread)
HELLO_TIMEOUT_S = 5.0    # a connection whose whole HELLO is not in by then is closed
# Polling instead of sleeping while a reply or the next request is due: on this project's
# 2-core VM, one-block 1 MiB gets went from 217 to 141-161 us (the lease's round trip from
# 85 to 22-25 us) and puts from 236-357 to 165-218 us, with both sides polling.
NODE_POLL_S = 200e-6     # a node's connection thread, after each request (StoreConfig.dataplane_poll_us)


class ControlServer:
    """Serves a :class:`DataPlaneHost` on a listening socket, a thread per connection. With
    an ``auth_token``, a connection must open with HELLO carrying it, whole within
    :data:`HELLO_TIMEOUT_S` of its accept (a deadline, not a per-read timeout: a peer
    sending a byte at a time is closed too). ``read_only``: only
    LOOKUP, LEASE and RELEASE are served (other ops get InvalidArgument). ``poll_s``:
    after each request, a connection's thread polls this long for the next one before it
    sleeps (:func:`~kvstore.dataplane.framing.spin_until_readable`; 0: never), trading that
    much CPU per request for a faster answer to a client that keeps asking. One connection
    polls at a time (the others sleep meanwhile), so a node never spends more than about
    one core polling, however many clients it serves."""

    kind = "control"
    quiet_after: int | None = None   # an op after whose reply the connection does not poll

    def __init__(self, host: DataPlaneHost, sock: socket.socket, auth_token: str | None = None,
                 read_only: bool = False, poll_s: float = NODE_POLL_S) -> None:
        self.host = host
        self.poll_s = poll_s
        self._poll_gate = threading.Lock()  # held by the one connection thread polling now
        self._token = (auth_token or "").encode()
        self.read_only = read_only
        self._sock = sock
        self._sock.listen(64)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name=f"kvstore-{self.kind}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        failures = 0
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                # EMFILE, ENFILE, ENOBUFS, ECONNABORTED...: transient; the listener stays
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    log.warning("%s control channel: accept failed (%s; %d in a row); retrying", self.kind, exc,
                                failures)
                time.sleep(min(1.0, 0.01 * failures))
                continue
            failures = 0
            with self._lock:
                crowded = len(self._conns) >= MAX_CONNECTIONS
                if not crowded:
                    self._conns.add(conn)
            if crowded:
                log.warning("%s control channel: %d connections open; refusing another", self.kind,
                            MAX_CONNECTIONS)
                conn.close()
                continue
            self._prepare(conn)
            threading.Thread(target=self._serve, args=(conn,), name=f"kvstore-{self.kind}-conn",
                             daemon=True).start()

    def _prepare(self, conn: socket.socket) -> None:
        """Set up an accepted connection (TCP: no Nagle delay)."""

    def _serve(self, conn: socket.socket) -> None:
        leases: set[int] = set()
        slots: set[int] = set()
        spares: dict[int, int] = {}  # spare slots lent on this connection: id -> bytes
        authed = not self._token
        poller, poll_s, gate, op = io.poller_of(conn), self.poll_s, self._poll_gate, 0
        refused = frame_status(Unauthenticated("")), b"missing or wrong auth token"
        invalid = frame_status(InvalidArgument(""))
        # a caller without the token cannot hold a connection slot and a thread: its frames
        # must be whole by this deadline, however it spaces its bytes
        hello_by = time.monotonic() + HELLO_TIMEOUT_S
        try:
            while True:
                # a busy client's next request comes soon
                if poll_s and op != self.quiet_after and gate.acquire(blocking=False):
                    try:
                        io.spin_until_readable(poller, poll_s)
                    finally:
                        gate.release()
                # before the token is checked, a frame is at most a HELLO's worth of bytes
                try:
                    op, payload = (io.read_frame(conn) if authed
                                   else io.read_frame(conn, w.MAX_HELLO_BYTES, hello_by))
                except InvalidArgument as exc:  # out of step with the client: say why, then hang up
                    io.write_frame(conn, invalid, f"{exc}; closing the connection".encode())
                    return
                if op == w.OP_HELLO:
                    authed = not self._token or hmac.compare_digest(payload, self._token)
                    if not authed:
                        io.write_frame(conn, *refused)
                        return
                    conn.settimeout(None)
                    io.write_frame(conn, w.OK)
                    continue
                if not authed:
                    io.write_frame(conn, *refused)
                    return
                if self.read_only and op not in READ_OPS:
                    io.write_frame(conn, invalid,
                                   f"control op {op} is not served on {self.kind}: it reads only".encode())
                    continue
                if op == w.OP_RELEASE:  # no reply: a malformed one ends the connection
                    try:
                        lid = w.decode_release_request(payload)
                    except InvalidArgument as exc:
                        log.warning("%s; closing the connection", exc)
                        return
                    if lid in leases:  # its own only (random handles, but a guess must not free another's)
                        leases.discard(lid)
                        self.host.release(lid)
                    continue
                spare = [0, 0]  # a COMMIT's ask: (size, count) slots, granted after its reply
                try:
                    reply = self._dispatch(op, payload, leases, slots, spare, spares)
                except KVStoreError as exc:
                    io.write_frame(conn, frame_status(exc), str(exc).encode())
                    continue
                except (struct.error, IndexError, ValueError) as exc:
                    io.write_frame(conn, invalid, f"malformed frame: {exc}".encode())
                    continue
                io.write_frame(conn, w.OK, reply)
                if spare[1]:  # reserved while the client copies its next block, off its path
                    for rid in set(spares) - set(self.host.still_open(list(spares))):
                        del spares[rid]  # committed, given back or timed out
                    grants = self.host.reserve_spares(spare[0], spare[1], sum(spares.values()))
                    slots.update(g.res_id for g in grants)
                    fp = self.host.tier.footprint(spare[0])   # what each takes of the slab
                    spares.update((g.res_id, fp) for g in grants)
                    io.write_frame(conn, w.OK, w.spare_grant(spare[0], grants))
        except (ConnectionError, OSError, KVStoreError):
            pass
        finally:
            for lid in leases:
                self.host.release(lid)
            self.host.abort(list(slots))
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _dispatch(self, op: int, p: bytes, leases: set[int], slots: set[int], spare: list[int],
                  spares: dict[int, int]) -> bytes:
        host = self.host
        if op == w.OP_LEASE:
            req = w.decode_lease_request(p)  # at most MAX_KEYS_PER_CALL keys: the reply fits a frame
            lease_id, deadline, flat = host.lease_flat(req.keys, req.ttl_s, req.stop_at_miss, req.chain)
            if lease_id:
                leases.add(lease_id)
            return w.lease_reply(lease_id, deadline, flat)
        if op == w.OP_RESERVE:
            grants = host.reserve_for(w.decode_reserve_request(p))
            slots.update(g.res_id for g in grants if g.res_id)
            return w.reserve_reply(grants)
        if op == w.OP_COMMIT:
            c = w.decode_commit_request(p)
            if c.give_back:
                back = [i for i in c.give_back if i in slots]  # its own only
                slots.difference_update(back)
                host.abort(back)
            # a connection commits its own reservations only
            results = host.commit(c.res_ids, c.keys, c.parents, c.checksums, c.namespace, owned=slots)
            slots.difference_update(c.res_ids)
            spare[:] = c.spare
            return w.commit_reply(results)
        if op == w.OP_ABORT:
            ids = [i for i in w.decode_abort_request(p) if i in slots]   # its own only
            slots.difference_update(ids)
            host.abort(ids)
            return b""
        if op == w.OP_LOOKUP:
            keys, purpose, namespace = w.decode_lookup_request(p)
            return w.lookup_reply(host.pool.lookup(keys, purpose, namespace))
        raise InvalidArgument(f"unknown control op {op}")

    def close(self) -> None:
        """Stop accepting and drop every connection (their leases and reservations end);
        idempotent."""
        if self._closed:
            return
        self._closed = True
        for s in [self._sock] + list(self._conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._sock.close()
        self._thread.join(timeout=2)


class UdsServer(ControlServer):
    """The same-host control channel: every op, on a Unix socket at ``path`` (mode 0600)."""

    kind = "uds"

    def __init__(self, host: DataPlaneHost, path: str, auth_token: str | None = None,
                 poll_s: float = NODE_POLL_S) -> None:
        self.path = path
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):   # never remove what is not a socket
                raise OSError(f"{path} exists and is not a Unix socket; give --dataplane-socket a free path")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
                raise OSError(f"{path} is served by another store node")
            except ConnectionRefusedError:
                os.unlink(path)  # a stale socket of a node that died
            finally:
                probe.close()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o600)
        super().__init__(host, sock, auth_token, poll_s=poll_s)
        log.info("same-host control channel on %s", path)

    def close(self) -> None:
        """As :meth:`ControlServer.close`, and unlink the socket."""
        if self._closed:
            return
        super().close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class TcpControlServer(ControlServer):
    """The control channel of readers on other hosts (transfer-engine path): LOOKUP, LEASE
    and RELEASE only, on TCP at ``bind_host``:``port`` (0: a free one; see :attr:`port`).
    A lease's ``deadline`` is this host's monotonic clock, meaningless elsewhere: such
    readers trust a block by its checksum."""

    kind = "tcp-control"
    # The reader's next frame follows a transfer-engine read (hundreds of us at least): no
    # polling after a LEASE, which would take a core from that read on a small host.
    quiet_after = w.OP_LEASE

    def __init__(self, host: DataPlaneHost, bind_host: str = "127.0.0.1", port: int = 0,
                 auth_token: str | None = None, poll_s: float = NODE_POLL_S) -> None:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen for control connections on {bind_host}:{port}: {exc}") from None
        self.port: int = sock.getsockname()[1]
        super().__init__(host, sock, auth_token, read_only=True, poll_s=poll_s)
        log.info("read-only control channel on %s:%d (transfer-engine readers)", bind_host, self.port)

    def _prepare(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
