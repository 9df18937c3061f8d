"""The front door's ConnectionGuard (scheduler/frontdoor/connection_guard.py) on a real aiohttp server
on 127.0.0.1 and real client sockets: a request head dripped byte by byte is closed at the
head timeout (a keep-alive connection's next head too), an idle keep-alive connection at the
idle timeout, a request in progress is never cut, one connection over the bound closes one
that sent nothing, else the one silent longest (so a real request gets through 8 slowloris
connections, and bare connections do not cut an upload), and a connection that finds every
slot with a request in progress is closed at once; a request whose body is not whole within
its deadline is a 408 (scheduler/frontdoor/request_parts.py), and until it is whole its connection is
closed for a new one like an idle one."""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import pytest
from aiohttp import web

from launcher.flags import connection_flags
from scheduler.frontdoor.app import config_from_args
from scheduler.frontdoor.connection_guard import ConnectionGuard, GuardedTCPSite, default_max_connections
from scheduler.frontdoor.openai_api import APIError
from scheduler.frontdoor.request_parts import read_json_body

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


async def _upload(port: int, seconds: float, body_s: float) -> tuple[bytes, bytes]:
    """A POST whose body arrives steadily, a piece every 0.05 s over ``seconds``; its answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"p": "' + b"x" * 2_000 + b'"}'
    writer.write(_post_head(len(body), body_s))
    pieces = max(1, int(seconds / 0.05))
    step = -(-len(body) // pieces)
    try:
        for i in range(0, len(body), step):
            await asyncio.sleep(0.05)
            writer.write(body[i:i + step])
            await writer.drain()
        async with asyncio.timeout(3):
            head, answer = await _response(reader)
        assert json.loads(answer) == json.loads(body)
        return head, answer
    finally:
        writer.close()


def test_a_flood_of_empty_connections_does_not_cut_an_upload() -> None:
    """At the bound, bare connections (nothing sent, no key) do not close the oldest one (a
    body arriving steadily over 10 s would be cut by 8 of them): a connection that has sent
    nothing goes first, so they close each other and the upload is served."""
    async def run() -> None:
        guard = ConnectionGuard(max_connections=4, idle_timeout_s=60, head_timeout_s=10)
        runner, port = await _serve(guard)
        try:
            upload = asyncio.create_task(_upload(port, 1.5, body_s=5))
            await asyncio.sleep(0.2)
            bare = []
            for _ in range(12):                       # three times the bound, one every 0.1 s
                bare.append(await asyncio.open_connection("127.0.0.1", port))
                await asyncio.sleep(0.1)
            head, _ = await upload
            assert head.startswith(b"HTTP/1.1 200")
            assert guard.closed_idle >= 9
            assert await _closed_within(bare[0][0], 1)        # the oldest bare one went
            for _, writer in bare:
                writer.close()
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_over_the_bound_the_quietest_goes_and_a_steady_upload_last() -> None:
    """With every slot holding something that has sent bytes, a new connection closes the
    one silent longest: a stalled request head, then an idle keep-alive connection, and not a
    body still arriving, though that began first."""
    async def run() -> None:
        guard = ConnectionGuard(max_connections=3, idle_timeout_s=60, head_timeout_s=10)
        runner, port = await _serve(guard)
        try:
            upload = asyncio.create_task(_upload(port, 1.5, body_s=5))
            await asyncio.sleep(0.1)
            stalled_r, stalled_w = await asyncio.open_connection("127.0.0.1", port)
            stalled_w.write(HALF_HEAD)                     # then nothing
            await asyncio.sleep(0.1)
            kept_r, kept_w = await asyncio.open_connection("127.0.0.1", port)
            kept_w.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await kept_r.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.2)
            assert guard.open_connections == 3
            assert (await _get(port, "/ok", timeout_s=2)).endswith(b"ok")
            assert await _closed_within(stalled_r, 1)          # silent longest
            assert not await _closed_within(kept_r, 0.2)
            fresh_r, fresh_w = await asyncio.open_connection("127.0.0.1", port)
            fresh_w.write(HALF_HEAD)                       # a head stalled later than kept's answer
            await asyncio.sleep(0.1)
            assert guard.open_connections == 3
            assert (await _get(port, "/ok", timeout_s=2)).endswith(b"ok")
            assert await _closed_within(kept_r, 1)             # then the idle keep-alive one
            assert not await _closed_within(fresh_r, 0.1) and not upload.done()
            head, _ = await upload
            assert head.startswith(b"HTTP/1.1 200") and guard.closed_idle == 2
            for writer in (stalled_w, kept_w, fresh_w):
                writer.close()
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_a_second_request_head_is_bounded_by_the_head_timeout() -> None:
    """On a keep-alive connection, a second request head dripped byte by byte lasted the idle
    timeout; now it is closed ``head_timeout_s`` after its first byte. An idle wait longer than
    the head timeout before a whole second request is still served."""
    async def run() -> None:
        guard = ConnectionGuard(max_connections=8, idle_timeout_s=5, head_timeout_s=0.5)
        runner, port = await _serve(guard)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(2):
                writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
                await asyncio.sleep(1)                         # idle twice the head timeout
            t0 = time.monotonic()
            for i in range(len(HALF_HEAD)):                    # a byte every 0.1 s
                try:
                    writer.write(HALF_HEAD[i:i + 1])
                    await writer.drain()
                except ConnectionError:
                    break
                if reader.at_eof():
                    break
                await asyncio.sleep(0.1)
            assert await _closed_within(reader, 5)
            assert 0.4 < time.monotonic() - t0 < 2 and guard.closed_idle == 1
            writer.close()
        finally:
            await runner.cleanup()

    asyncio.run(run())
