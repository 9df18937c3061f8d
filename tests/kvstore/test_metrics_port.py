"""A metrics port's own defences (kvstore/metrics_http.py): idle and dripping connections closed
without holding threads or keeping a scrape out, the metrics token reading metrics and
nothing else, and a port that binds again at once after a scrape but is never shared."""
from __future__ import annotations

import asyncio
import os

import pytest

from kvstore.client import StoreClient
from kvstore.config import StoreConfig
from kvstore.node import StoreNode
from tests.helpers.metrics_helpers import TOKEN, scrape, status_of, value


def test_idle_connections_to_a_metrics_port_hold_no_thread_for_long():
    """A caller without the token that opens connections and never finishes a request (300
    of them would otherwise hold 300 threads for good) is closed after the idle timeout, and past
    ``max_connections`` at once; a scrape with the token still gets through."""
    import socket
    import threading
    import time

    from prometheus_client import CollectorRegistry, Counter

    from kvstore.metrics_http import MetricsServer

    registry = CollectorRegistry()
    Counter("kvstore_test_scrapes", "a counter", registry=registry).inc()
    server = MetricsServer(registry, token=TOKEN, idle_timeout_s=0.5, max_connections=8, name="idle-test")
    before = threading.active_count()
    socks = []
    try:
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")     # never finished
            socks.append(s)
        time.sleep(0.2)
        assert threading.active_count() - before <= 8
        deadline = time.monotonic() + 5
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= before            # the idle ones were closed
        for s in socks:                   # the server hung up on every one (a read ends, no timeout)
            s.settimeout(5)
            while s.recv(65536):
                pass
        assert value(scrape(server.url), "kvstore_test_scrapes_total") == 1.0
    finally:
        for s in socks:
            s.close()
        server.close()


def test_dripping_connections_neither_outlive_the_head_deadline_nor_keep_a_scrape_out():
    """Connections that drip one byte of a request head at a time (each read within the idle
    timeout) are cut at the connection's head deadline, and while every slot holds one, a
    scrape with the token closes the oldest half-sent one and is served."""
    import socket
    import time

    from prometheus_client import CollectorRegistry, Counter

    from kvstore.metrics_http import MetricsServer

    registry = CollectorRegistry()
    Counter("kvstore_test_scrapes", "a counter", registry=registry).inc()
    server = MetricsServer(registry, token=TOKEN, idle_timeout_s=1.0, max_connections=4, name="drip-test")
    socks = []
    try:
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\nX")
            socks.append(s)
        time.sleep(0.2)
        assert value(scrape(server.url), "kvstore_test_scrapes_total") == 1.0   # all 4 slots were half-sent
        t0, cut = time.monotonic(), set()
        while len(cut) < len(socks) and time.monotonic() - t0 < 5:
            for i, s in enumerate(socks):
                if i in cut:
                    continue
                try:
                    s.sendall(b"x")                           # a byte every 0.25 s: no read idles 1 s
                    s.settimeout(0.01)
                    if s.recv(65536) == b"":
                        cut.add(i)
                except TimeoutError:
                    pass
                except OSError:
                    cut.add(i)
            time.sleep(0.25)
        assert len(cut) == len(socks) and time.monotonic() - t0 < 3    # the deadline is 1 s
    finally:
        for s in socks:
            s.close()
        server.close()


def test_a_metrics_token_reads_metrics_and_nothing_else(tmp_path, monkeypatch):
    """``$KVSTORE_METRICS_TOKEN`` (kvstore/auth.py): a scraper's token, taken by a node's
    metrics port beside the store token and by the front door on /metrics alone; it reads
    no block and runs no request."""
    from aiohttp import ClientSession, web

    from kvstore.errors import Unauthenticated
    from launcher.supervisor import free_port
    from scheduler.frontdoor.api_keys import api_key_middleware

    monkeypatch.setenv("KVSTORE_METRICS_TOKEN", "scrape-only")
    cfg = StoreConfig(node_id="scraped", port=0, metrics_port=0, dram_bytes=4 << 20, ssd_bytes=0,
                      data_dir=str(tmp_path), auth_token=TOKEN, dram_prefault=False)
    served = StoreNode.start(cfg)
    try:
        assert value(scrape(served.metrics_url, "scrape-only"), "kvstore_node_info", node="scraped") == 1
        assert status_of(served.metrics_url, {"Authorization": f"Bearer {TOKEN}"}) == 200     # still
        assert status_of(served.metrics_url, {"Authorization": "Bearer other"}) == 401
        with StoreClient(served.address, auth_token="scrape-only", data_path="grpc") as c, \
                pytest.raises(Unauthenticated, match="UNAUTHENTICATED"):
            c.lookup([os.urandom(32)])
    finally:
        served.stop(grace_s=0)

    async def front_door() -> dict[tuple[str, str], int]:
        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="ok")
        app = web.Application(middlewares=[api_key_middleware(frozenset({"sk-tenant"}))])
        app.router.add_get("/metrics", ok)
        app.router.add_get("/v1/models", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        out = {}
        try:
            async with ClientSession() as s:
                for path in ("/metrics", "/v1/models"):
                    for key in ("scrape-only", "sk-tenant"):
                        async with s.get(f"http://127.0.0.1:{port}{path}",
                                         headers={"Authorization": f"Bearer {key}"}) as r:
                            out[path, key] = r.status
        finally:
            await runner.cleanup()
        return out

    assert asyncio.run(front_door()) == {("/metrics", "scrape-only"): 200, ("/metrics", "sk-tenant"): 200,
                                         ("/v1/models", "scrape-only"): 401, ("/v1/models", "sk-tenant"): 200}


def test_a_metrics_port_binds_again_at_once_after_a_scrape_but_is_never_shared():
    """The server closes each scrape's connection first, so the port holds connections in
    TIME-WAIT for a minute after it: a node restarted on its port (kvstore up restarts it
    within seconds) must still bind. A second listener on a port in use is refused."""
    import socket

    from prometheus_client import CollectorRegistry, Counter

    from kvstore.metrics_http import MetricsServer

    registry = CollectorRegistry()
    Counter("kvstore_test_scrapes", "a counter", registry=registry).inc()
    first = MetricsServer(registry, token=TOKEN, name="first")
    port = first.port
    try:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            MetricsServer(registry, port=port, token=TOKEN, name="second")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:   # an HTTP/1.0 scrape
            s.sendall(f"GET /metrics HTTP/1.0\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
            reply = b""
            while chunk := s.recv(65536):                  # the server hangs up first
                reply += chunk
        assert b"200 OK" in reply.split(b"\r\n", 1)[0]
    finally:
        first.close()
    again = MetricsServer(registry, port=port, token=TOKEN, name="restarted")
    try:
        assert value(scrape(again.url), "kvstore_test_scrapes_total") == 1.0
    finally:
        again.close()
