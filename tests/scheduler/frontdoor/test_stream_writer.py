"""The front doors' StreamWriter (scheduler/frontdoor/request_parts.py) on a real aiohttp server and a
real client socket that stops reading: the handler's sends never wait for the client, and a
client that accepts no bytes for the write timeout is dropped (``gone``; the next send
raises ConnectionResetError, which ends the request)."""
from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from launcher.supervisor import free_port
from scheduler.frontdoor.request_parts import StreamWriter


async def _serve(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> tuple[web.AppRunner, int]:
    """``handler`` served on GET /stream of a real aiohttp server on 127.0.0.1: (runner, port)."""
    app = web.Application()
    app.router.add_get("/stream", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def _run() -> dict:
    seen: dict = {}

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        writer = StreamWriter(resp, timeout_s=1.0)
        t0 = time.monotonic()
        sent = 0
        try:
            for _ in range(2000):                        # 128 MiB: far more than any socket buffer
                writer.send(b"data: " + b"x" * (64 << 10) + b"\n\n")
                sent += 1
                await asyncio.sleep(0)
            seen["send_s"] = time.monotonic() - t0       # queued at once, whatever the client
            while not writer.gone and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.05)
            seen["gone_after_s"] = time.monotonic() - t0
            try:
                writer.send(b"data: more\n\n")
            except ConnectionResetError:
                seen["raised"] = True
            seen["closed_ok"] = await writer.close()
        finally:
            await writer.abandon()
        seen["sent"] = sent
        return resp

    runner, port = await _serve(handler)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    client.sendall(f"GET /stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    try:
        deadline = time.monotonic() + 40
        while "closed_ok" not in seen and time.monotonic() < deadline:
            await asyncio.sleep(0.1)                     # the client never reads
    finally:
        client.close()
        await runner.cleanup()
    return seen


def test_a_client_that_stops_reading_never_blocks_sends_and_is_dropped() -> None:
    seen = asyncio.run(_run())
    assert seen["sent"] == 2000 and seen["send_s"] < 5
    assert seen["gone_after_s"] < 20 and seen["raised"] and seen["closed_ok"] is False


async def _abandon_at_each_step(steps: int) -> list[int]:
    """A handler sends one event and abandons its writer ``steps`` loop iterations later, for
    every ``steps`` in range(steps): where the write completes and the pump's cancellation
    land in one iteration, Python 3.11's ``asyncio.wait_for`` can swallow the cancel, so
    the pump would live on and abandon() (so the request, its in-flight count and the
    server's shutdown) would wait for good. Returns the step counts at which abandon() took over 2 s."""
    hung: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(steps):
            writer = StreamWriter(resp, timeout_s=5.0)
            writer.send(b"data: x\n\n")
            for _ in range(k):
                await asyncio.sleep(0)
            t0 = time.monotonic()
            try:
                async with asyncio.timeout(5):           # abandon() may swallow this cancel too
                    await writer.abandon()
            except TimeoutError:
                pass
            if time.monotonic() - t0 > 2:
                hung.append(k)
        return resp

    runner, port = await _serve(handler)
    try:
        reader, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(f"GET /stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        async with asyncio.timeout(5 * steps + 10):
            await reader.read()                          # the client reads to the end
        w.close()
    finally:
        await runner.cleanup()
    return hung


def test_abandon_returns_at_every_step_of_a_write() -> None:
    assert asyncio.run(_abandon_at_each_step(12)) == []
