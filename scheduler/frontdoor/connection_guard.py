"""Bounds on the front door's HTTP connections, so that no caller — with or without an API
key — can hold the port: a client that sends part of a request head and waits (slowloris),
or opens connections and sends nothing, would otherwise keep each one open for good
(aiohttp times out neither a request head nor, from an ``AppRunner``, an idle keep-alive
connection within the hour), and enough of them would run the process out of file
descriptors: every real request would then go unanswered.

:class:`ConnectionGuard` sits between the listening socket and aiohttp:

- a connection that has not sent a whole request head ``head_timeout_s`` after connecting
  (however slowly it drips bytes) is closed, and so is a keep-alive one whose next request
  head is not whole ``head_timeout_s`` after its first byte, or that is idle — no request in
  progress — for ``idle_timeout_s`` since its last response (longer than
  the keep-alive of the usual clients' pools: aiohttp's 15 s, httpx's 5 s, so that none sends
  a request on a connection the server is closing);
- at most ``max_connections`` are open at once: one more first closes another, the least
  useful — one that has sent no byte yet (the oldest of those), else the one silent longest
  (no byte received, no response finished): a stalled head, an idle keep-alive connection or
  a stalled body before a body still arriving. It is itself closed at once when every open
  connection has a request in progress with its body whole (a request's own time is bounded
  elsewhere: scheduler/frontdoor/request_parts.py's body deadline, a 408, and streaming write timeout,
  admission, the engines' timeouts). Oldest-first let bare connections that sent nothing
  (no key needed) close a legitimate upload in progress.

A request is "in progress" from the moment aiohttp hands it to the application (its head is
whole) until its handler returns, as the guard's middleware (the outermost) sees it. Until
its body is whole too, its connection can be closed for a new one: a caller that sent heads
and part of their bodies held every slot, and other callers' connections were refused.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from scheduler.config import DEFAULT_HEAD_TIMEOUT_S, DEFAULT_IDLE_TIMEOUT_S, check_bounds
from scheduler.frontdoor.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 1024
_FD_RESERVE = 256      # descriptors left to the process (engine channels, the store, logs)


def default_max_connections() -> int:
    """:data:`DEFAULT_MAX_CONNECTIONS`, or fewer where the process may open fewer files
    (RLIMIT_NOFILE's soft limit less a reserve of 256, at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(16, min(DEFAULT_MAX_CONNECTIONS, soft - _FD_RESERVE))


@dataclass(eq=False)
class _Conn:
    transport: asyncio.Transport
    idle_since: float                 # monotonic seconds: idle since (active == 0), else its request began
    active: int = 0                   # requests in progress on it
    served: bool = False              # a whole request head has arrived on it
    request: web.BaseRequest | None = None    # the one in progress
    heard_at: float | None = None     # its last byte received (None: none yet)
    head_since: float | None = None   # first byte received while idle: a next request's head began

    def closable(self) -> bool:
        """Idle, or its request's body is not whole (``is_eof``: all of it arrived, read or not)."""
        return self.active == 0 or (self.request is not None and not self.request.content.is_eof())

    def rank(self) -> tuple[bool, float]:
        """Smallest first closes for a new connection: none sent a byte, the oldest; then
        silent longest, since its last byte received or its last response (``idle_since``)."""
        if self.heard_at is None:
            return False, self.idle_since
        return True, max(self.heard_at, self.idle_since)


@dataclass(eq=False)
class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the guard told when it opens and closes."""

    inner: asyncio.Protocol
    guard: ConnectionGuard
    conn: _Conn | None = field(default=None)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)
        assert isinstance(transport, asyncio.Transport)
        self.conn = self.guard._opened(transport)

    def data_received(self, data: bytes) -> None:
        if (conn := self.conn) is not None:
            conn.heard_at = now = time.monotonic()
            if conn.served and conn.active == 0 and conn.head_since is None:
                conn.head_since = now
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.guard._closed(self.conn)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class ConnectionGuard:
    """Idle timeout and connection bound of one aiohttp server (see the module's docstring).

    ``max_connections`` >= 1 (None: :func:`default_max_connections`); ``head_timeout_s``,
    ``idle_timeout_s`` > 0 (seconds). Use :meth:`middleware` as the application's first middleware,
    :meth:`factory` as the listening socket's protocol factory (``loop.create_server``),
    :meth:`start` / :meth:`stop` around serving. Raises ValueError on a bad bound."""

    def __init__(self, max_connections: int | None = None, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S) -> None:
        check_bounds(max_connections, idle_timeout_s, head_timeout_s)
        self.max_connections = default_max_connections() if max_connections is None else max_connections
        self.idle_timeout_s = idle_timeout_s
        self.head_timeout_s = head_timeout_s
        self._conns: dict[asyncio.Transport, _Conn] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.closed_idle = 0           # connections closed for idling
        self.refused = 0               # connections closed at accept: every slot busy
        self._warned_at = -1e9

    # -- wiring ---------------------------------------------------------------------------
    def factory(self, server: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory to listen with: ``server``'s (aiohttp's ``web.Server``) wrapped."""
        return lambda: _GuardedProtocol(server(), self)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        conn = self._conns.get(request.transport) if request.transport is not None else None
        if conn is None:
            return await handler(request)
        conn.active += 1
        conn.served = True
        conn.request, conn.idle_since = request, time.monotonic()    # waiting for its body since
        conn.head_since = None
        try:
            return await handler(request)
        finally:
            conn.active -= 1
            conn.request, conn.idle_since, conn.head_since = None, time.monotonic(), None

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="connection-guard")

    async def stop(self) -> None:
        await cancel_and_wait(self._sweeper)
        self._sweeper = None

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    # -- bookkeeping ----------------------------------------------------------------------
    def _opened(self, transport: asyncio.Transport) -> _Conn | None:
        now = time.monotonic()
        if len(self._conns) >= self.max_connections:
            idle = [c for c in self._conns.values() if c.closable()]
            if not idle:
                self.refused += 1
                self._warn(f"every one of its {self.max_connections} connections has a request in progress; "
                           "a new one was closed")
                transport.abort()
                return None
            self._drop(min(idle, key=_Conn.rank))
            self._warn(f"{self.max_connections} connections open; the one silent longest was closed for a new one")
        conn = self._conns[transport] = _Conn(transport, now)
        return conn

    def _closed(self, conn: _Conn) -> None:
        if self._conns.get(conn.transport) is conn:
            del self._conns[conn.transport]

    def _drop(self, conn: _Conn) -> None:
        self._closed(conn)
        self.closed_idle += 1
        conn.transport.abort()     # abort, not close: a client that reads nothing never lets close flush

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= 10:          # one line per 10 s, not one per connection
            self._warned_at = now
            log.warning("front door: %s (max_connections %d)", message, self.max_connections)

    def sweep(self) -> int:
        """Close every connection past its deadline (no whole head ``head_timeout_s`` after
        connecting or after the first byte of a next head, or idle ``idle_timeout_s`` since its
        last response); returns how many."""
        now = time.monotonic()
        stale = [c for c in self._conns.values() if c.active == 0 and (
            now - c.idle_since >= (self.idle_timeout_s if c.served else self.head_timeout_s)
            or (c.head_since is not None and now - c.head_since >= self.head_timeout_s))]
        for conn in stale:
            self._drop(conn)
        return len(stale)

    async def _sweep(self) -> None:
        period = min(1.0, self.idle_timeout_s / 4, self.head_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep()


class GuardedTCPSite(web.TCPSite):
    """aiohttp's TCPSite listening through a :class:`ConnectionGuard`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)      # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.factory(server), self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
        self.guard.start()

    async def stop(self) -> None:
        await self.guard.stop()
        await super().stop()
