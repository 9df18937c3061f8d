"""The metrics port of a service (store node, engine): Prometheus' text exposition format
over HTTP on ``GET /metrics``, from a registry of the service's own (never the process-wide
default, so several services can live in one process).

It takes the service's bearer token when the service has one (kvstore/auth.py): a scrape
must send ``Authorization: Bearer <token>`` — Prometheus does, with ``authorization:
{credentials_file: ...}`` in its scrape config
(https://prometheus.io/docs/prometheus/latest/configuration/configuration/#scrape_config) —
else it is answered 401. It listens on 127.0.0.1 unless told otherwise. The handler is
prometheus-client's own (``MetricsHandler``: content negotiation, gzip, ``name[]``
filters); this module adds the token check, the one path, and the thread it runs on, and
bounds what a caller without the token can hold: a connection that has not sent its whole
request head within ``idle_timeout_s`` of connecting is closed (however slowly it drips
bytes: the deadline is the connection's, not each read's), and at most ``max_connections``
are served at once — one more closes the oldest that has not sent its head yet, and is
itself closed at accept only when every slot holds a whole request — so neither idle nor
half-sent connections can keep a scrape out.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

from kvstore.auth import METRICS_TOKEN_ENV, bearer_matches, token_from
from kvstore.port_hold import held

log = logging.getLogger(__name__)
METRICS_PATH = "/metrics"


class _TokenMetricsHandler(MetricsHandler):
    """prometheus-client's handler behind a bearer-token check, on ``/metrics`` only."""

    token: str | None = None
    scrape_token: str | None = None

    def parse_request(self) -> bool:
        ok = super().parse_request()             # the request line and headers are in
        self.server.head_received(self.connection)    # type: ignore[attr-defined]
        return ok

    def do_GET(self) -> None:
        if urlparse(self.path).path != METRICS_PATH:
            self._refuse(404, f"not found: this port serves only GET {METRICS_PATH}\n")
            return
        sent = self.headers.get("Authorization")
        if self.token and not (bearer_matches(sent, self.token)
                               or (self.scrape_token and bearer_matches(sent, self.scrape_token))):
            self._refuse(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                              f"(the service's token, or ${METRICS_TOKEN_ENV})\n",
                         {"WWW-Authenticate": 'Bearer realm="kvstore"'})
            return
        super().do_GET()

    def _refuse(self, status: int, text: str, headers: dict[str, str] | None = None) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        log.debug("metrics %s: " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True      # a scrape in progress never holds the process up at exit
    # SO_REUSEADDR: a node restarted on its port binds while the last scrapes' connections
    # linger in TIME-WAIT (the server closes each one first); on Linux it never lets a second
    # listener share the port (that is SO_REUSEPORT, left off): a port in use stays an error,
    # unless a supervisor holds the port for this node (kvstore/port_hold.py).
    allow_reuse_address = True

    def server_bind(self) -> None:
        self.allow_reuse_port = held()
        super().server_bind()

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int, head_timeout_s: float) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._head_timeout_s = head_timeout_s
        self._lock = threading.Lock()
        self._waiting: dict[socket.socket, float] = {}   # connections without a whole head: since when

    def head_received(self, conn: socket.socket) -> None:
        with self._lock:
            self._waiting.pop(conn, None)

    def _cut(self, conn: socket.socket) -> None:
        """End a connection whose head is not in: its thread's read returns, its slot frees."""
        self._waiting.pop(conn, None)
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def service_actions(self) -> None:
        """Between accepts (serve_forever's poll): cut connections past their head deadline."""
        deadline = time.monotonic() - self._head_timeout_s
        with self._lock:
            for conn in [c for c, t in self._waiting.items() if t <= deadline]:
                self._cut(conn)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with self._lock:                          # every slot taken: the oldest half-sent one goes
                oldest = min(self._waiting, key=self._waiting.__getitem__, default=None)
                if oldest is not None:
                    self._cut(oldest)
            if oldest is None or not self._slots.acquire(timeout=1.0):
                log.debug("metrics: %s refused, every connection slot holds a request", client_address)
                self.shutdown_request(request)
                return
        with self._lock:
            self._waiting[request] = time.monotonic()
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._waiting.pop(request, None)
            self._slots.release()


class MetricsServer:
    """``GET /metrics`` of ``registry`` on ``host:port`` (port 0 picks a free one; :attr:`port`
    is the bound one), served by a daemon thread until :meth:`close`. ``token``: the bearer
    token a scrape must carry (None: any caller on ``host``); ``scrape_token``: a read-only
    one taken beside it (default: ``$KVSTORE_METRICS_TOKEN``, kvstore/auth.py; ignored
    without ``token``); ``idle_timeout_s``: seconds a connection may take to send its
    request head, and each read or write after it (> 0); ``max_connections``: served at
    once (>= 1). Raises OSError when the port
    cannot be bound."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, name: str = "metrics", scrape_token: str | None = None,
                 idle_timeout_s: float = 10.0, max_connections: int = 32) -> None:
        scrape = token_from(scrape_token, METRICS_TOKEN_ENV)
        handler = type("MetricsHandler", (_TokenMetricsHandler,),
                       {"registry": registry, "token": token or None, "scrape_token": scrape,
                        "timeout": idle_timeout_s})
        try:
            self._server = _Server((host, port), handler, max_connections, idle_timeout_s)
        except OSError as exc:
            raise OSError(f"{name}: cannot listen on {host}:{port} for metrics ({exc.strerror or exc})") from None
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"{name}-metrics", daemon=True)
        self._thread.start()
        if not token:
            log.warning("%s: metrics on http://%s:%d%s take no token: any caller that reaches the port reads "
                        "them", name, host, self.port, METRICS_PATH)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{METRICS_PATH}"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()
