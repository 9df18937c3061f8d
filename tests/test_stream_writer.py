"""The front doors' StreamWriter (scheduler/request_parts.py) on a real aiohttp server and a
real client socket that stops reading: the handler's sends never wait for the client, and a
client that accepts no bytes for the write timeout is dropped (``gone``; the next send
raises ConnectionResetError, which ends the request)."""
from __future__ import annotations

import asyncio
import socket
import time

from aiohttp import web

from launcher.supervisor import free_port
from scheduler.request_parts import StreamWriter


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

    app = web.Application()
    app.router.add_get("/stream", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
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
