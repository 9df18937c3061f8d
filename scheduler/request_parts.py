"""What the front doors (scheduler/frontdoor.py, scheduler/vllm_frontdoor.py) share around a
request: the HTTP middleware that answers aiohttp's own errors (404, 405, 413, ...) in
OpenAI's error shape, reading a request's body (:func:`read_body`), the engines' sampling
parameters of a request, and the clock that observes TTFT and TBT as tokens
are sent."""
from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from engines.types import SamplingParams
from scheduler.metrics import FrontdoorMetrics
from scheduler.openai_api import APIError, GenerationRequest
from scheduler.router import RoutePlan, Router

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


async def read_body(request: web.Request) -> bytes:
    """The request's body, decoded as its ``Content-Encoding`` says. Raises APIError: 400
    when it cannot be read (a body that is not the encoding it claims, a connection cut
    mid-body), 413 over the server's size limit."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise APIError(413, exc.text or "the request body is too large", code="request_too_large") from None
    except web.RequestPayloadError as exc:
        encoding = request.headers.get("Content-Encoding")
        raise APIError(400, "the request body could not be read" +
                       (f" as Content-Encoding {encoding!r}" if encoding else "") + f": {exc}",
                       code="invalid_body") from None


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
    once, then TBT; ``done()`` after the last token feeds the mean TBT to the router's fit."""

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

    def done(self) -> None:
        if self.tokens >= 2:
            self.router.observe_decode(self.plan, (self.last - self.first) / (self.tokens - 1))
