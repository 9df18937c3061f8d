"""The front door's ConnectionGuard (scheduler/connection_guard.py) on a real aiohttp server
on 127.0.0.1 and real client sockets: a request head dripped byte by byte is closed at the
head timeout, an idle keep-alive connection at the idle timeout, a request in progress is
never cut, one connection over the bound closes the
longest idle one (so a real request gets through 8 slowloris connections), and a connection
that finds every slot with a request in progress is closed at once; a request whose body is
not whole within its deadline is a 408 (scheduler/request_parts.py), and until it is whole its
connection is closed for a new one like an idle one."""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import pytest
from aiohttp import web

from launcher.flags import connection_flags
from scheduler.app import config_from_args
from scheduler.connection_guard import ConnectionGuard, GuardedTCPSite, default_max_connections
from scheduler.openai_api import APIError
from scheduler.request_parts import read_json_body

HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"     # the head never ends


async def _serve(guard: ConnectionGuard) -> tuple[web.AppRunner, int]:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query["s"]))
        return web.Response(text="slow ok")

    async def echo(request: web.Request) -> web.Response:     # the front doors' body reading
        try:
            body = await read_json_body(request, float(request.query["body_s"]))
        except APIError as exc:
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        return web.json_response(body)

    app = web.Application(middlewares=[guard.middleware])
    app.router.add_get("/ok", ok)
    app.router.add_get("/slow", slow)
    app.router.add_post("/echo", echo)
    # handler_cancellation as the front doors run it; lingering (aiohttp's 10 s) short: a 408 closes sooner
    runner = web.AppRunner(app, handler_cancellation=True, lingering_time=0.5)
    await runner.setup()
    site = GuardedTCPSite(runner, "127.0.0.1", 0, guard)
    await site.start()
    return runner, site.port


async def _get(port: int, path: str, timeout_s: float = 10) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    try:
        async with asyncio.timeout(timeout_s):
            return await reader.read()
    finally:
        writer.close()


async def _closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """Whether the server closed the connection (EOF or reset) within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            await reader.read()
            return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


def test_half_sent_head_is_closed_and_requests_in_progress_are_not() -> None:
    async def run() -> None:
        guard = ConnectionGuard(max_connections=64, idle_timeout_s=1.5, head_timeout_s=0.5)
        runner, port = await _serve(guard)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.monotonic()
            for i in range(3):                     # a byte of the head every 0.2 s: still cut
                writer.write(HALF_HEAD[i:i + 1])
                await asyncio.sleep(0.2)
            assert await _closed_within(reader, 5)
            assert 0.4 < time.monotonic() - t0 < 3 and guard.closed_idle == 1
            writer.close()
            # A request three times the head timeout long is answered whole.
            assert (await _get(port, "/slow?s=1.5")).endswith(b"slow ok")
            # A keep-alive connection idle after its response lives the idle timeout, not the head's.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert await _closed_within(reader, 5)
            idle_s = time.monotonic() - t0
            assert guard.closed_idle == 2 and 1.3 < idle_s < 4
            writer.close()
            assert guard.open_connections == 0
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_over_the_bound_the_longest_idle_is_closed_for_a_real_request() -> None:
    async def run() -> None:
        guard = ConnectionGuard(max_connections=8, head_timeout_s=60)
        runner, port = await _serve(guard)
        try:
            loris = []
            for _ in range(8):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(HALF_HEAD)
                loris.append((reader, writer))
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert guard.open_connections == 8
            assert (await _get(port, "/ok", timeout_s=5)).endswith(b"ok")
            assert await _closed_within(loris[0][0], 5)          # the oldest half-sent one went
            assert guard.closed_idle >= 1
            for _, writer in loris:
                writer.close()
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_every_slot_busy_refuses_the_next_connection() -> None:
    async def run() -> None:
        guard = ConnectionGuard(max_connections=2, head_timeout_s=60)
        runner, port = await _serve(guard)
        try:
            busy = [asyncio.create_task(_get(port, "/slow?s=2")) for _ in range(2)]
            await asyncio.sleep(0.5)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await _closed_within(reader, 2)
            writer.close()
            assert guard.refused == 1
            assert all(r.endswith(b"slow ok") for r in await asyncio.gather(*busy))
        finally:
            await runner.cleanup()

    asyncio.run(run())


def _post_head(length: int, body_s: float) -> bytes:
    return (f"POST /echo?body_s={body_s} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


async def _response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head, await reader.readexactly(length)


def test_a_body_not_whole_by_its_deadline_is_a_408_and_holds_no_slot() -> None:
    """A whole head (so past the head timeout's reach) and one byte of a 100,000-byte body,
    then nothing, held its connection for good (150 s, then served) and 1,100 of them took
    every slot from other callers. Now: 408 at the body's deadline, in OpenAI's error shape,
    the connection then closed; meanwhile a real request takes the slot of the oldest, and a
    large body sent slowly but within the deadline is served."""
    async def run() -> None:
        guard = ConnectionGuard(max_connections=4, idle_timeout_s=60, head_timeout_s=0.5)
        runner, port = await _serve(guard)
        try:
            halves = []
            for _ in range(4):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(_post_head(100_000, 1.0) + b"{")
                halves.append((reader, writer, time.monotonic()))
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert guard.open_connections == 4
            assert (await _get(port, "/ok", timeout_s=2)).endswith(b"ok")     # every slot taken, none whole
            assert await _closed_within(halves[0][0], 1)

            async def answer_of(reader: asyncio.StreamReader, t0: float) -> tuple[bytes, bytes, float]:
                async with asyncio.timeout(3):
                    head, answer = await _response(reader)
                return head, answer, time.monotonic() - t0

            answers = [asyncio.create_task(answer_of(reader, t0)) for reader, _, t0 in halves[1:]]
            # A 200 kB body in 20 pieces over ~1 s, within its 2 s deadline, is served.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = b'{"p": "' + b"x" * 200_000 + b'"}'
            writer.write(_post_head(len(body), 2.0))
            for i in range(0, len(body), 10_001):
                writer.write(body[i:i + 10_001])
                await asyncio.sleep(0.05)
            head, answer = await _response(reader)
            assert head.startswith(b"HTTP/1.1 200") and json.loads(answer) == json.loads(body)
            writer.close()
            for head, answer, after_s in await asyncio.gather(*answers):
                assert 0.9 < after_s < 2
                assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head
                assert json.loads(answer) == {"error": {
                    "message": "request body not received within 1 s", "type": "invalid_request_error",
                    "param": None, "code": "request_timeout"}}
            assert not any(c.active for c in guard._conns.values())       # the slots are free
            for reader, writer, _ in halves[1:]:     # the rest of the body, another request: not served
                writer.write(b" " * 99_999 + b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
                try:
                    async with asyncio.timeout(2):
                        assert await reader.read() == b""
                except ConnectionError:
                    pass
                writer.close()
            assert guard.open_connections == 0
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_bounds_from_flags_and_bad_bounds() -> None:
    assert 16 <= default_max_connections() <= 1024
    config = config_from_args(argparse.Namespace(max_connections=100, idle_timeout_s=3.0, head_timeout_s=2.0))
    assert (config.max_connections, config.idle_timeout_s, config.head_timeout_s) == (100, 3.0, 2.0)
    default = config_from_args(argparse.Namespace())
    assert (default.max_connections, default.idle_timeout_s, default.head_timeout_s) == (None, 75.0, 15.0)
    assert connection_flags(argparse.Namespace(max_connections=100, idle_timeout_s=None, head_timeout_s=2.0)) == [
        "--max-connections=100", "--head-timeout-s=2.0"]
    with pytest.raises(ValueError, match="max_connections"):
        ConnectionGuard(max_connections=0)
    with pytest.raises(ValueError, match="idle_timeout_s"):
        ConnectionGuard(idle_timeout_s=0)
    with pytest.raises(ValueError, match="head_timeout_s"):
        ConnectionGuard(head_timeout_s=-1)
