"""The HTTP front door: an aiohttp app serving OpenAI-compatible completions over the
disaggregated engines (docs/architecture.md §7).

Per request: validate and tokenize, take the tenant from ``Authorization``, route (the
:class:`Router` and its scheduling policy, which also admits or rejects: 429), prefill, then
stream the decode engine's tokens to the client. The first token is sent as soon as prefill returns it.
A client that disconnects cancels its request (the engine calls are cancelled with it).

Sampling: ``temperature`` (absent or 0: greedy, the built-in engines' default — OpenAI's is
1), ``top_p`` and ``seed`` go to both engines (engines/sampling.py); a sampled request sent
without a seed gets a random one here, so a decode resumed on another engine repeats the
tokens already sent.

``logprobs`` (completions: 0-5 alternatives; chat: ``logprobs`` with ``top_logprobs`` 0-20)
come from the engines: each token's log-softmax under the model (scheduler/frontdoor/openai_shapes.py).

Errors map to statuses here and only here: bad request 400 (fields the built-in engines do
not apply, :data:`~scheduler.frontdoor.openai_api.NOT_BUILT_IN`, included), unknown
model or path 404, wrong method 405, a prompt over the model's limit 400 too
(``context_length_exceeded``), a body not whole 30 s after the head 408, a body over
:func:`~scheduler.frontdoor.request_parts.body_limit` (64 bytes a token of context, 1-32 MiB) 413, a
body not sent as JSON 415 (:func:`~scheduler.frontdoor.request_parts.parse_json_body`), admission 429
(with ``Retry-After``; also ``tenant_parse_waiting``, :mod:`scheduler.frontdoor.parse_slots`), engine
or store failure 503; bodies are OpenAI's error shape. A large body (as sent or as decoded) is
parsed in a worker thread, one at a time per tenant (scheduler/frontdoor/parse_slots.py).

A request with ``"prefix_cache": false`` is served with the pool off: the router plans it
as a full prefill (no pool lookup, no local hit) and the prefill engine is asked to
``recompute`` (protos/engine.proto: no cache read or written, the whole KV handed to decode).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from engines.tokenizer import Tokenizer
from engines.types import PrefillResult, TokenLogprobs
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from scheduler.config import FrontdoorConfig
from scheduler.frontdoor.api_keys import api_key_middleware
from scheduler.frontdoor.extra_routes import extra_routes
from scheduler.frontdoor.health import HealthChecker
from scheduler.frontdoor.metrics import CONTENT_TYPE, FrontdoorMetrics
from scheduler.frontdoor.openai_api import (
    NOT_BUILT_IN,
    APIError,
    GenerationRequest,
    ModelLimits,
    model_not_found,
    parse_chat,
    parse_completion,
    refuse_fields,
)
from scheduler.frontdoor.openai_shapes import (
    LogprobsShape,
    chunk_body,
    request_id,
    response_body,
    usage,
    usage_chunk,
)
from scheduler.frontdoor.parse_slots import ParseSlots
from scheduler.frontdoor.request_parts import (
    StreamWriter,
    TokenClock,
    body_limit,
    json_errors,
    parse_json_body,
    sampling_of,
)
from scheduler.frontdoor.status_page import install_status_page
from scheduler.frontdoor.text_stream import StopText, TextStream
from scheduler.policy.admission import Rejection
from scheduler.routing.hit_sources import handoff_of, hit_sources
from scheduler.routing.router import RoutePlan, Router
from scheduler.routing.tenancy import namespace_from_authorization

log = logging.getLogger(__name__)

# (token id, its logprobs when asked) -> True: a stop string appeared, end the generation
Emit = Callable[[int, TokenLogprobs | None], Awaitable[bool]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def tenant_of(request: web.Request) -> str:
    """The request's tenant namespace, from its ``Authorization`` header only
    (:func:`scheduler.routing.tenancy.namespace_from_authorization`)."""
    return namespace_from_authorization(request.headers.get("Authorization"))


class Frontdoor:
    """Holds the router, tokenizer, admission and metrics; :meth:`app` builds the web app."""

    def __init__(self, router: Router, tokenizer: Tokenizer, config: FrontdoorConfig) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = FrontdoorMetrics()
        infos = [p.info for p in router.prefill.values()] + [d.info for d in router.decode.values()]
        self.info = router.info
        names = (self.info.model_id, *([config.model_dir] if config.model_dir else []))
        engines_limit = min(i.max_model_len for i in infos)
        if config.max_model_len is not None and config.max_model_len > engines_limit:
            log.warning("max_model_len %d is above the engines' limit of %d tokens: the front door refuses "
                        "requests over %d", config.max_model_len, engines_limit, engines_limit)
        self.limits = ModelLimits(self.info.vocab_size, min(engines_limit, config.max_model_len or engines_limit),
                                  names)
        self.health_checks = HealthChecker(router, config.health_interval_s)
        self.body_limit = body_limit(self.limits.max_model_len)    # bytes, as sent and as decoded
        self.parse_slots = ParseSlots(refused=lambda reason: self.metrics.rejected.labels(reason=reason).inc())

    def routes(self) -> list[web.RouteDef]:
        """The route table (add a route here, or extend the list in a subclass)."""
        return [web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model:.+}", self.model),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics_text),
                *extra_routes(self)]      # /tokenize, /detokenize, /version, /ping (frontdoor/extra_routes.py)

    def app(self) -> web.Application:
        middlewares: list[Any] = [self.metrics.middleware(), json_errors]
        if self.config.api_keys:
            middlewares.append(api_key_middleware(self.config.api_keys))
        app = web.Application(client_max_size=self.body_limit, middlewares=middlewares)
        app.add_routes(self.routes())
        install_status_page(app, self)     # /status, /status.json (scheduler/frontdoor/status_page.py)
        return app

    async def health(self, request: web.Request) -> web.Response:
        report = self.health_checks.report()
        return web.json_response({"status": report.status, "reasons": list(report.reasons),
                                  "policy": self.router.policy.name,
                                  "prefill": len(self.router.prefill),
                                  "decode": len(self.router.decode), "model": self.info.model_id,
                                  "block_size": self.info.block_size, "vocab_size": self.limits.vocab_size,
                                  "max_model_len": self.limits.max_model_len}, status=report.http_status)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.info.model_id, "object": "model", "created": 0, "owned_by": "kvstore",
                "max_model_len": self.limits.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: the served model's card, else 404 ``model_not_found``."""
        name = request.match_info["model"]
        if name not in self.limits.model_ids:
            err = model_not_found(name)
            return web.json_response(err.body(), status=err.status)
        return web.json_response(self._model_card())

    async def metrics_text(self, request: web.Request) -> web.Response:
        self.metrics.set_up(self.health_checks.parts())
        body = self.metrics.render(self.router.queue_depths(), self.router.decode_running(),
                                   self.router.inflight, self.router.replica,
                                   self.router.policy.prefill_model.log_error, self.router.pool_lookups)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_chat)

    async def _handle(self, request: web.Request, parse: Callable[..., GenerationRequest]) -> web.StreamResponse:
        t0 = time.perf_counter()

        def parsed(body: Any) -> GenerationRequest:
            req = parse(body, self.tokenizer, self.limits, self.config.default_max_tokens)
            refuse_fields(body, NOT_BUILT_IN, "the built-in engines")
            return req
        try:
            req = await parse_json_body(request, parsed, self.parse_slots, tenant_of(request), limit=self.body_limit)
            plan = await self._admit(request, req)
        except APIError as exc:
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        self._begin(plan, req)
        outcome = "error"
        try:
            if req.stream:
                resp, outcome = await self._stream(request, req, plan, t0)
            else:
                resp = await self._whole(req, plan, t0)
                outcome = "ok"
            return resp
        except APIError as exc:
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.router.finished(plan)
            self.metrics.request_finished(outcome, time.perf_counter() - t0)

    async def _admit(self, request: web.Request, req: GenerationRequest, sequences: int = 1) -> RoutePlan:
        """The request's plan (``sequences``: OpenAI's ``n``, each admitted as a sequence);
        raises APIError 400, 429 (admission) or 503 (no instance up for a role)."""
        namespace = tenant_of(request)
        rid = request_id(req.chat, uuid.uuid4().hex)
        try:
            plan = await self.router.plan(rid, req.prompt, namespace, req.max_tokens, reuse=req.prefix_cache,
                                          sequences=sequences)
        except InvalidArgument as exc:
            raise APIError(400, str(exc)) from None
        except KVStoreError as exc:     # no instance up for a role
            raise APIError(503, str(exc), "service_unavailable", "engine_unavailable",
                           {"Retry-After": "1"}) from None
        # No await between here and Router.begin: the decision saw the state it admits into.
        if isinstance(plan, Rejection):
            self.metrics.rejected.labels(reason=plan.reason).inc()
            raise APIError(429, plan.message, "rate_limit", plan.reason,
                           {"Retry-After": str(plan.retry_after_s)})
        return plan

    async def _generate(self, req: GenerationRequest, plan: RoutePlan,
                        emit: Emit) -> tuple[PrefillResult, str, RoutePlan]:
        """Prefill, then decode; ``emit`` is awaited with each token id (and its logprobs when
        the request asked for them) in order (the first from prefill; it returns True once a
        stop string appeared, and the decode stream is then closed, which cancels it on the
        engine). Returns the prefill result, the finish reason and the plan as it ended (an
        engine that fails is marked down and the request moves to another instance of its
        role: a prefill before anything was sent, a decode from the token it had reached —
        the same sampling parameters and seed give the same tokens). Raises APIError 503
        (naming the engine and why) when no other instance is up, 400 when an engine
        rejects the request."""
        tried: set[str] = set()
        sampling = sampling_of(req)
        while True:
            try:
                result = await self.router.prefill_client(plan).prefill(
                    plan.request_id, req.prompt, plan.namespace, plan.max_load_blocks, sampling, req.logprobs,
                    recompute=not req.prefix_cache)
                break
            except KVStoreError as exc:
                if isinstance(exc, InvalidArgument):
                    self.router.prefill_finished(plan, None)
                    raise APIError(400, str(exc)) from None
                try:
                    plan = self._failover(plan, "prefill", tried, exc, 0)   # moves its queue entry
                except APIError:
                    self.router.prefill_finished(plan, None)
                    raise
            except BaseException:
                self.router.prefill_finished(plan, None)
                raise
        self.router.prefill_finished(plan, result)
        stop = () if req.ignore_eos else (self.info.eos_token_id,)
        if await emit(result.first_token, result.first_logprobs) or result.first_token in stop:
            return result, "stop", plan
        if req.max_tokens == 1:
            return result, "length", plan
        sent = 1
        tried = set()
        while True:
            steps = self.router.decode_client(plan).decode(plan.request_id, req.prompt, plan.namespace,
                                                           result, req.max_tokens, stop, sampling, req.logprobs)
            try:
                async with contextlib.aclosing(steps):
                    async for step in steps:
                        if step.index >= sent:   # a decode resumed elsewhere repeats the first ones
                            sent += 1
                            if await emit(step.token, step.logprobs):
                                return result, "stop", plan
                        if step.finished:
                            return result, step.finish_reason or "length", plan
            except InvalidArgument as exc:
                raise APIError(400, str(exc)) from None
            except KVStoreError as exc:
                plan = self._failover(plan, "decode", tried, exc, sent)
                if req.stream:
                    self.metrics.resumed.inc()
                continue
            if sent < req.max_tokens:
                raise APIError(503, f"decode stream ended after {sent} of {req.max_tokens} tokens",
                               "service_unavailable", "engine_unavailable")
            return result, "length", plan

    def _failover(self, plan: RoutePlan, role: str, tried: set[str], exc: Exception, sent: int) -> RoutePlan:
        """``plan``'s ``role`` engine failed: move the request to another one, or raise the 503
        that ends it. An engine that is gone (:class:`Unavailable`) is marked down; one that
        only failed this request (its handler raised) stays in routing for everyone else."""
        engine_id = plan.prefill_id if role == "prefill" else plan.decode_id
        tried.add(engine_id)
        if isinstance(exc, Unavailable):
            self.router.mark_down(engine_id, f"{role} failed: {exc}")
        moved = self.router.reroute(plan, role, tried)
        if moved is None:
            raise APIError(503, f"{role} engine {engine_id} failed after {sent} tokens were sent "
                                f"and no other {role} instance is up: {exc}", "service_unavailable",
                           "engine_unavailable", {"Retry-After": "1"}) from None
        self.metrics.retried.labels(role=role).inc()
        log.warning("request %s: %s engine %s failed (%s); moved to %s after %d tokens", plan.request_id,
                    role, engine_id, exc, moved.prefill_id if role == "prefill" else moved.decode_id, sent)
        return moved

    def _begin(self, plan: RoutePlan, req: GenerationRequest) -> None:
        """An admitted request starts: booked with the router, counted in the metrics."""
        self.router.begin(plan)
        self.metrics.admitted.inc()
        self.metrics.routed.labels(policy=self.router.policy.name, prefill=plan.prefill_id,
                                   decode=plan.decode_id).inc()
        self.metrics.count_prompt(len(req.prompt))

    def _count_prefill(self, plan: RoutePlan, result: PrefillResult, prompt_tokens: int) -> None:
        """The books of a finished prefill: its cached tokens by source (what the client is
        told), and the hand-off to decode apart (scheduler/routing/hit_sources.py)."""
        bs = self.info.block_size
        self.metrics.count_cached(result.cached_tokens, hit_sources(result.cached_tokens, plan, bs, result.load_tier))
        self.metrics.count_handoff(*handoff_of(result, prompt_tokens))

    def _timer(self, t0: float, plan: RoutePlan) -> TokenClock:
        return TokenClock(self.metrics, self.router, t0, plan)

    async def _whole(self, req: GenerationRequest, plan: RoutePlan, t0: float) -> web.Response:
        ids: list[int] = []
        tick = self._timer(t0, plan)
        pieces, stream, stop = [], TextStream(self.tokenizer), StopText(req.stop)
        lps: list[tuple[int, TokenLogprobs | None]] = []

        async def emit(token: int, lp: TokenLogprobs | None) -> bool:
            ids.append(token)
            lps.append((token, lp))
            tick()
            if req.stop:
                pieces.append(stop.push(stream.push(token)))
            return stop.hit

        result, finish, tick.plan = await self._generate(req, plan, emit)
        tick.done()
        self._count_prefill(tick.plan, result, len(req.prompt))
        text = "".join(pieces) + stop.push(stream.flush()) + stop.flush() if req.stop else self.tokenizer.decode(ids)
        logprobs = None if req.logprobs is None else LogprobsShape(self.tokenizer, req.chat).of(lps)
        body = response_body(req, plan.request_id, int(time.time()), self.info.model_id, text, ids, finish,
                             usage(len(req.prompt), len(ids), result.cached_tokens), logprobs)
        return web.json_response(body)

    async def _stream(self, request: web.Request, req: GenerationRequest, plan: RoutePlan,
                      t0: float) -> tuple[web.StreamResponse, str]:
        """Server-sent events: one per token (its text as soon as it decodes), a last one
        with finish_reason, one with the usage when the client asked
        (``stream_options.include_usage``), then ``[DONE]``. Headers go out with the first
        token, so a failed prefill is still a 503. The events are written by a
        :class:`StreamWriter`: a client that reads slowly never slows its engine."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        created, text, tick = int(time.time()), TextStream(self.tokenizer), self._timer(t0, plan)
        stop = StopText(req.stop)
        shape = None if req.logprobs is None else LogprobsShape(self.tokenizer, req.chat)
        writer = StreamWriter(resp)
        send = writer.event
        count = 0

        async def emit(token: int, lp: TokenLogprobs | None) -> bool:
            nonlocal count
            if not resp.prepared:
                await resp.prepare(request)
            logprobs = None if shape is None else shape.of([(token, lp)])
            send(chunk_body(req, plan.request_id, created, self.info.model_id, stop.push(text.push(token)),
                            [token], first=count == 0, logprobs=logprobs))
            count += 1
            tick()
            return stop.hit

        try:
            try:
                result, finish, tick.plan = await self._generate(req, plan, emit)
            except APIError as exc:
                if not resp.prepared:
                    raise
                await writer.end_with_error(exc.body())
                return resp, "error"
            except ConnectionResetError:
                log.info("client went away, request %s cancelled", plan.request_id)
                return resp, "cancelled"
            tick.done()
            self._count_prefill(tick.plan, result, len(req.prompt))
            try:
                send(chunk_body(req, plan.request_id, created, self.info.model_id,
                                stop.push(text.flush()) + stop.flush(), [], finish))
                if req.include_usage:
                    send(usage_chunk(req, plan.request_id, created, self.info.model_id,
                                     usage(len(req.prompt), count, result.cached_tokens)))
                send("[DONE]")
            except ConnectionResetError:
                return resp, "cancelled"
            return resp, "ok" if await writer.close() else "cancelled"
        finally:
            await writer.abandon()   # a request cancelled or ended early: its writer stops too
