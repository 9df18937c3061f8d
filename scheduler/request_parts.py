"""What the front doors (scheduler/frontdoor.py, scheduler/vllm_frontdoor.py) share around a
request: the HTTP middleware that answers aiohttp's 404/405 in OpenAI's error shape, the
engines' sampling parameters of a request, and the clock that observes TTFT and TBT as tokens
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
    """aiohttp's own 404 (no such path) and 405 (a path that takes another method) answered in
    OpenAI's error shape, as JSON, instead of plain text."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status not in (404, 405):
            raise
        what = (f"no route {request.method} {request.path}" if exc.status == 404 else
                f"{request.path} does not take {request.method}")
        code = "not_found" if exc.status == 404 else "method_not_allowed"
        err = APIError(exc.status, what, code=code)
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
        return web.json_response(err.body(), status=exc.status, headers=headers)


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
