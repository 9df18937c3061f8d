"""What the front doors (scheduler/frontdoor/server.py, scheduler/vllm/frontdoor.py) share around a
request: the HTTP middleware that answers aiohttp's own errors (404, 405, 413, ...) in
OpenAI's error shape, reading a request's body within a deadline (:func:`receive_body`) and
parsing it as JSON (:func:`parse_json_body`: within :func:`body_limit`, large ones off the
event loop), the engines' sampling parameters of a request, the clock that observes TTFT and
TBT as tokens are sent, and the writer that keeps a slow client from slowing its engine
(:class:`StreamWriter`)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from engines.types import SamplingParams
from scheduler.frontdoor.content_encoding import IDENTITY, decode_body
from scheduler.frontdoor.metrics import FrontdoorMetrics
from scheduler.frontdoor.openai_api import APIError, GenerationRequest, read_json
from scheduler.frontdoor.parse_slots import LARGE_BODY_BYTES, ParseSlots
from scheduler.frontdoor.tasks import cancel_and_wait
from scheduler.routing.router import RoutePlan, Router

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY_BYTES = 32 << 20       # the most a request body's limit can be, as sent and as decoded
MIN_BODY_BYTES = 1 << 20        # the least it is, whatever the context
BODY_BYTES_PER_TOKEN = 64       # a body's limit per token of context (see body_limit)
log = logging.getLogger(__name__)
CLIENT_WRITE_TIMEOUT_S = 30.0   # a streaming client that accepts no bytes for this long is dropped
BODY_TIMEOUT_S = 30.0           # a request body not whole this long after its head is a 408


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors — 404 (no such path), 405 (a path that takes another method), 413
    (a body over the limit) and any other 4xx/5xx it raises — answered in OpenAI's error
    shape, as JSON, instead of plain text."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code: str | None = None
        if exc.status == 404:
            what, code = f"no route {request.method} {request.path}", "not_found"
        elif exc.status == 405:
            what, code = f"{request.path} does not take {request.method}", "method_not_allowed"
        else:
            what = exc.text or exc.reason
            code = "request_too_large" if exc.status == 413 else None
        err = APIError(exc.status, what, "server_error" if exc.status >= 500 else "invalid_request_error", code)
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
        return web.json_response(err.body(), status=exc.status, headers=headers)


def body_limit(max_model_len: int) -> int:
    """A request body's limit in bytes, as sent and as decoded, for a model whose context
    is ``max_model_len`` tokens: :data:`BODY_BYTES_PER_TOKEN` per token, at least
    :data:`MIN_BODY_BYTES` and at most :data:`MAX_BODY_BYTES` (1 MiB up to a 16,384-token
    context, 8 MiB at 131,072). A prompt that fits the context takes a few bytes of JSON a
    token (ids: up to 7; text: 4 characters a token on average, 6 bytes a character escaped
    as ``\\uXXXX``); the limit bounds what a body costs to parse, which ``json.loads`` does
    holding the GIL (1 MiB of the smallest objects: 50 ms here; 29 MiB, a million empty
    chat messages: 0.9 s, during which no other request was served)."""
    return min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len))


async def receive_body(request: web.Request, timeout_s: float | None = None) -> tuple[bytes, str | None]:
    """The request's body as sent, and its ``Content-Encoding`` (None: identity). It must
    arrive whole within ``timeout_s`` (None: :data:`BODY_TIMEOUT_S`) of the handler asking
    for it, which the front doors do as soon as the head is whole: otherwise a client that sent a
    head and part of its body, then waited, would hold its connection for good (the
    connection guard never closes one with a request in progress). Raises APIError: 400 when it cannot
    be read (a connection cut mid-body), 408 ``request_timeout`` past the deadline (with
    ``Connection: close``: the connection is closed once that answer is sent), 413 over the
    application's ``client_max_size`` as sent."""
    timeout_s = BODY_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        request.protocol.close()    # after the 408: nothing more is read, closed at aiohttp's lingering_time (10 s)
        raise APIError(408, f"request body not received within {timeout_s:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(413, exc.text or "the request body is too large", code="request_too_large") from None
    except web.RequestPayloadError as exc:
        raise APIError(400, f"the request body could not be read: {exc}", code="invalid_body") from None
    # Several header lines are one list (RFC 9110 §5.3): "gzip" then "br" is "gzip, br".
    coding = ", ".join(request.headers.getall("Content-Encoding", [])) or None
    if coding is None or coding.strip().lower() in IDENTITY:
        return raw, None
    return raw, coding


def check_media_type(request: web.Request) -> None:
    """Raises APIError 415 ``unsupported_media_type`` unless the request's ``Content-Type``
    is JSON (``application/json``, ``application/*+json``) or absent. Browsers send
    ``text/plain``, form and multipart bodies to any origin without asking it first (CORS
    "simple requests"), so a web page could otherwise spend a key-less front door's
    engines; vLLM's server (FastAPI) refuses those types too, with a 422."""
    declared = request.headers.get("Content-Type")
    if declared is not None:
        kind = request.content_type          # the media type, parameters dropped, lower case
        major, _, minor = kind.partition("/")
        if major != "application" or not (minor == "json" or minor.endswith("+json")):
            raise APIError(415, f"the request body must be JSON (Content-Type: application/json), "
                                f"got Content-Type {declared!r}", code="unsupported_media_type")


async def parse_json_body(request: web.Request, parse: Callable[[Any], T], slots: ParseSlots | None = None,
                          tenant: str = "", timeout_s: float | None = None, limit: int = MAX_BODY_BYTES) -> T:
    """``parse`` of the request's JSON body (:func:`check_media_type` first, before the body
    is read; then :func:`receive_body` within ``timeout_s``). A body of
    :data:`~scheduler.frontdoor.parse_slots.LARGE_BODY_BYTES` or more, sent or decoded, is decoded,
    parsed and given to ``parse`` in a worker thread, holding ``tenant``'s slot in ``slots``
    (scheduler/frontdoor/parse_slots.py; None: no slot, and no check of ``Content-Length`` against a
    full slot before the body is read); a smaller one on the event loop. Raises
    APIError as those do, 413 for a body over ``limit`` bytes as sent or decoded
    (:func:`body_limit`), 400 for one that is not JSON (:func:`~scheduler.frontdoor.openai_api.read_json`),
    and whatever ``parse`` raises."""
    check_media_type(request)
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(declared, limit)  # at once: its sender would wait for a timeout otherwise
    if slots is not None and declared is not None and declared >= LARGE_BODY_BYTES:
        slots.check(tenant)              # a 429 before the body is read, when it would be one after
    raw, coding = await receive_body(request, timeout_s)
    if len(raw) > limit:
        raise too_large(len(raw), limit)
    if len(raw) < LARGE_BODY_BYTES:
        # a small body, or a small compressed one that decodes small: on the event loop
        # (a compressed one that decodes large is decoded again in the thread, up to limit)
        small = raw if coding is None else _decode_small(raw, coding)
        if small is not None:
            return parse(read_json(small))

    def work() -> T:
        return parse(read_json(decode_body(raw, coding, limit)))
    if slots is None:
        return await asyncio.to_thread(work)
    return await slots.run(tenant, work)


def _decode_small(raw: bytes, coding: str) -> bytes | None:
    """``raw`` decoded when it decodes to less than LARGE_BODY_BYTES, else None."""
    try:
        return decode_body(raw, coding, LARGE_BODY_BYTES - 1)
    except APIError as exc:
        if exc.status == 413:
            return None
        raise


def too_large(size: int, limit: int) -> APIError:
    """The 413 of a body of ``size`` bytes over ``limit``."""
    return APIError(413, f"the request body is {size} bytes, over this server's limit of {limit} bytes",
                    code="request_too_large")


async def read_json_body(request: web.Request, timeout_s: float | None = None) -> Any:
    """The request's body parsed as JSON (:func:`parse_json_body` with no slots)."""
    return await parse_json_body(request, _as_is, timeout_s=timeout_s)


def _as_is(body: Any) -> Any:
    return body


def sampling_of(req: GenerationRequest) -> SamplingParams:
    """The engines' sampling parameters of a request: greedy when ``temperature`` is absent or
    0 or ``top_p`` is 0; else sampled, with the client's seed or a random one (so every
    engine that serves the request draws the same tokens)."""
    temperature = req.temperature or 0.0
    if temperature == 0.0 or req.top_p == 0.0:
        return SamplingParams()
    seed = req.seed if req.seed is not None else secrets.randbits(64)
    return SamplingParams(temperature, 1.0 if req.top_p is None else req.top_p, seed)


class TokenClock:
    """Called at each token sent (``tick()``): observes TTFT and the error of its prediction
    once, then TBT, and from the second token re-times the request's decode work at its pace
    so far (``Router.decode_progress``); ``done()`` after the last token feeds the mean TBT
    to the router's fit."""

    def __init__(self, metrics: FrontdoorMetrics, router: Router, t0: float, plan: RoutePlan) -> None:
        self.metrics, self.router, self.plan = metrics, router, plan
        self.t0 = t0
        self.first = self.last = 0.0
        self.tokens = 0

    def __call__(self) -> None:
        now = time.perf_counter()
        if not self.tokens:
            self.metrics.ttft.observe(now - self.t0)
            self.metrics.ttft_error.observe(abs(now - self.t0 - self.plan.predicted_ttft_s))
            self.first = now
        else:
            self.metrics.tbt.observe(now - self.last)
        self.last = now
        self.tokens += 1
        self.metrics.generated_tokens.inc()
        if self.tokens >= 2:    # its decode work re-timed at its pace so far
            self.router.decode_progress(self.plan, self.tokens, (now - self.first) / (self.tokens - 1))

    def done(self) -> None:
        if self.tokens >= 2:
            self.router.observe_decode(self.plan, (self.last - self.first) / (self.tokens - 1))


class StreamWriter:
    """A streamed response's server-sent events, written by a task of their own: :meth:`send`
    queues an event and returns at once, so the engine's stream is read at the engine's
    pace whatever the client's (a client that stops reading would otherwise block the front
    door's reads, and so the engine's gRPC worker: 16 such clients would freeze a decode
    engine for every tenant). What a slow client has not read waits here (a request's events: at most
    its ``max_tokens``). A client that accepts no bytes for ``timeout_s`` is dropped;
    after a failed write :attr:`gone` is True and :meth:`send` raises ConnectionResetError,
    which ends the request (its engine stream is closed, so the engine stops it)."""

    def __init__(self, resp: web.StreamResponse, timeout_s: float | None = None) -> None:
        self.resp = resp
        self.timeout_s = CLIENT_WRITE_TIMEOUT_S if timeout_s is None else timeout_s
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.gone = False
        self._abandoned = False

    async def _pump(self) -> None:
        try:
            while not self._abandoned and (data := await self._queue.get()) is not None:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that
                # lands as the write completes, and abandon() then waited on a pump that lived on.
                async with asyncio.timeout(self.timeout_s):
                    await self.resp.write(data)
        except (ConnectionError, TimeoutError, RuntimeError) as exc:   # aiohttp: RuntimeError once closed
            self.gone = True
            if isinstance(exc, TimeoutError):
                log.warning("a streaming client accepted no bytes for %.0f s; dropped", self.timeout_s)

    def send(self, data: bytes) -> None:
        """Queue ``data`` for the client. Raises ConnectionResetError once the client is gone."""
        if self.gone:
            raise ConnectionResetError("the client stopped reading or went away")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pump())
        self._queue.put_nowait(data)

    def event(self, obj: dict[str, Any] | str) -> None:
        """Queue one server-sent event: ``obj`` as compact JSON (a str as is, e.g. "[DONE]")."""
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        self.send(f"data: {data}\n\n".encode())

    async def end_with_error(self, body: dict[str, Any]) -> None:
        """The stream fails after it began: an error event (OpenAI's error shape), then
        ``[DONE]`` and the end of the stream (a client already gone gets nothing)."""
        with contextlib.suppress(ConnectionResetError):
            self.event(body)
            self.event("[DONE]")
        await self.close()

    async def close(self) -> bool:
        """Write what is queued, then the end of the stream; whether the client got it all
        (False: it went away or stopped reading)."""
        if self._task is not None:
            self._queue.put_nowait(None)
            await self._task
        if self.gone:
            return False
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.resp.write_eof()
        except (ConnectionError, TimeoutError, RuntimeError):
            self.gone = True
        return not self.gone

    async def abandon(self) -> None:
        """Stop writing (the request is being cancelled): queued events are dropped. The
        pump also stops at its next event should the cancellation itself be lost."""
        self._abandoned = True
        if self._task is not None:
            self._queue.put_nowait(None)
        await cancel_and_wait(self._task)
