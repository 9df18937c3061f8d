"""The front door over vLLM instances (disaggregated prefill and decode, or colocated): the
same HTTP API, tokenizer, Conductor and admission as :mod:`scheduler.frontdoor.server`, with the
generation done by vLLM.

Per request: validate and tokenize with the model's tokenizer, key the prompt as the kvstore
connector does, route (the pool's hit by tier, the instances' load; 429 before any prefill),
then — disaggregated — a one-token completion on the chosen prefill instance (``cache_salt``
= the tenant's namespace; the ``kv_producer`` has saved every full block when it answers)
and the request itself on the chosen decode instance (``kv_consumer``: loads those blocks
from kvstore and computes the tail), relayed back as vLLM streams it; colocated, the request
goes to the one chosen instance. ``usage`` is vLLM's, but for ``cached_tokens``: the prompt
tokens the request's prefill did not compute because they were cached — disaggregated, the
prefill instance's count (its one-token completion's usage), never the decode instance's,
which counts the hand-off it loaded from the pool (booked apart as
``kvstore_scheduler_handoff_tokens``; scheduler/routing/hit_sources.py, docs/metrics.md); a stream
carries the usage only when the client asked (``stream_options.include_usage``), as the
built-in front door. Sampling parameters
(:data:`PASSTHROUGH`) go to vLLM as sent; the OpenAI points the built-in front door checks
(``model``, chat content parts, ids, fields never applied) are checked here the same way.
``/health`` is 503 with the reasons when an instance or the store is down.

Errors: as :mod:`scheduler.frontdoor.server` (400, 429; an instance that fails — gone, or a 5xx —
is routed around until it answers again, and a request it failed before anything was sent
moves to another instance of its role; 503 when there is none); a 4xx from vLLM is relayed
as 400. A decode that fails mid-stream is marked down too and the stream resumes on another
instance that decodes (:mod:`scheduler.vllm.resume`, docs/resume.md: the prompt's blocks
from the pool, the tokens sent so far recomputed, the same id; greedy output equals an
uninterrupted run's); an error event ends it only where it cannot resume (``n`` > 1,
``stop`` strings, presence or frequency penalties, chat ``logprobs``) or no other instance
is up.
The prefill request carries the sampling fields vLLM checks per value
(:data:`scheduler.vllm.instances.PREFILL_SAMPLING`), so a bad one is refused there,
before any prompt token is computed.
Responses carry ``X-Kvstore-Prefill`` and ``X-Kvstore-Decode``: the instances chosen.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from aiohttp import web

from engines.tokenizer import Tokenizer
from engines.types import PrefillResult
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from scheduler.config import FrontdoorConfig
from scheduler.frontdoor.health import HealthChecker
from scheduler.frontdoor.openai_api import APIError, GenerationRequest, parse_chat
from scheduler.frontdoor.request_parts import StreamWriter, TokenClock, parse_json_body
from scheduler.frontdoor.server import Frontdoor, tenant_of
from scheduler.routing.hit_sources import hit_sources
from scheduler.routing.router import RoutePlan
from scheduler.vllm.resume import CONTINUATION_PATH, StreamResume, not_resumable
from scheduler.vllm.router import VLLMRouter

log = logging.getLogger(__name__)

PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs",
               "top_logprobs", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "min_tokens", "ignore_eos", "logit_bias", "include_stop_str_in_output", "skip_special_tokens",
               "spaces_between_special_tokens")
MAX_N = 16


class VLLMFrontdoor(Frontdoor):
    """:class:`Frontdoor` whose generation is relayed to vLLM instances (``router`` is a
    :class:`VLLMRouter`)."""

    router: VLLMRouter

    def __init__(self, router: VLLMRouter, tokenizer: Tokenizer, config: FrontdoorConfig) -> None:
        super().__init__(router, tokenizer, config)
        self._prefilled: dict[str, PrefillResult] = {}   # request id -> its prefill, until it ends
        # the instances are watched by router.watch (their /metrics); the checks here ask the store
        self.health_checks = HealthChecker(router, config.health_interval_s, probe_engines=False)

    async def _handle(self, request: web.Request, parse: Callable[..., GenerationRequest]) -> web.StreamResponse:
        t0 = time.perf_counter()
        chat = parse is parse_chat

        def parsed(body: Any) -> tuple[Any, int, GenerationRequest]:
            n = 1
            if isinstance(body, dict):
                n = body.get("n", 1)
                if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N):
                    raise APIError(400, f"'n' must be an integer in [1, {MAX_N}], got {n!r}", code="invalid_value",
                                   param="n")
                body_n = {k: v for k, v in body.items() if k != "n"}
                if n is None:       # OpenAI's default; vLLM refuses null, after the prefill ran
                    n, body = 1, body_n
            else:
                body_n = body
            return body, n, parse(body_n, self.tokenizer, self.limits, self.config.default_max_tokens)
        try:
            body, n, req = await parse_json_body(request, parsed, self.parse_slots, tenant_of(request),
                                                  limit=self.body_limit)
            if not req.prefix_cache:
                raise APIError(400, "'prefix_cache': false is not supported over vLLM instances (their "
                                    "connector always reuses the pool)", code="unsupported_value")
            try:
                plan = await self._admit(request, req, n)   # n sequences: n in flight and in decode
            except Unavailable as exc:
                raise APIError(503, str(exc), "service_unavailable", "engine_unavailable") from None
        except APIError as exc:
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        self._begin(plan, req)
        outcome = "error"
        try:
            resp, outcome = await self._relay(request, body, req, plan, t0, chat)
            return resp
        except APIError as exc:
            return web.json_response(exc.body(), status=exc.status, headers={**exc.headers, **_route(plan)})
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self._prefilled.pop(plan.request_id, None)
            self.router.finished(plan)
            self.metrics.request_finished(outcome, time.perf_counter() - t0)

    def _failed(self, engine_id: str, stage: str, exc: KVStoreError) -> APIError:
        if isinstance(exc, InvalidArgument):
            return APIError(400, str(exc), code="invalid_value")
        self.router.mark_down(engine_id, str(exc))
        return APIError(503, f"{stage} failed: {exc}", "service_unavailable", "engine_unavailable")

    async def _prefill(self, body: dict[str, Any], req: GenerationRequest, plan: RoutePlan) -> RoutePlan:
        """The one-token prefill on the plan's prefill instance; one that fails (gone, or a
        5xx) is marked down and the prefill moves to another (:meth:`Frontdoor._failover`).
        Returns the plan as it ended; raises APIError 400 (vLLM refused the request) or 503
        (no other prefill instance is up)."""
        tried: set[str] = set()
        while True:
            try:
                result = await self.router.prefill_client(plan).prefill(plan.request_id, req.prompt,
                                                                        plan.namespace, sampling=body)
            except InvalidArgument as exc:
                self.router.prefill_finished(plan, None)
                raise APIError(400, str(exc), code="invalid_value") from None
            except KVStoreError as exc:
                try:
                    plan = self._failover(plan, "prefill", tried, exc, 0)   # moves its queue entry
                except APIError:
                    self.router.prefill_finished(plan, None)
                    raise
                continue
            except BaseException:
                self.router.prefill_finished(plan, None)
                raise
            self.router.prefill_finished(plan, result)
            self._prefilled[plan.request_id] = result    # its cached tokens are the request's
            return plan

    def _decode_body(self, body: dict[str, Any], req: GenerationRequest, plan: RoutePlan, chat: bool) -> dict[str, Any]:
        out = {k: body[k] for k in PASSTHROUGH if k in body}
        out.update(model=self.router.decode_client(plan).served_model, max_tokens=req.max_tokens,
                   cache_salt=plan.namespace, request_id=plan.request_id, stream=req.stream,
                   return_token_ids=True)
        if chat:   # what the front door rendered and prefilled: role and text alone (parse_chat checked them)
            out["messages"] = list(req.messages)
        else:
            out["prompt"] = list(req.prompt)
        if req.stream:
            out["stream_options"] = {"include_usage": True}
        return out

    async def _relay(self, request: web.Request, body: dict[str, Any], req: GenerationRequest, plan: RoutePlan,
                     t0: float, chat: bool) -> tuple[web.StreamResponse, str]:
        """Prefill (disaggregated), then the request on the decode instance, relayed. An
        instance that fails before anything reached the client is marked down (when gone or
        5xx) and the request moves to another of its role (colocated: another instance), as
        the built-in front door does; a decode that fails mid-stream is marked down too and
        the stream resumes on another instance (:mod:`scheduler.vllm.resume`)."""
        if not self.router.colocated:
            plan = await self._prefill(body, req, plan)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        tried: set[str] = set()
        while True:
            out = self._decode_body(body, req, plan, chat)
            client = self.router.decode_client(plan)
            try:
                if req.stream:
                    resume = StreamResume({k: body[k] for k in PASSTHROUGH if k in body}, req.prompt, req.max_tokens,
                                          chat, not_resumable(body, int(body.get("n") or 1), chat),
                                          getattr(self.tokenizer, "backend", None))
                    return await self._stream_relay(request, client.stream(path, out), plan, t0, req.include_usage,
                                                    resume, tried)
                try:
                    answer = await client.complete(path, out)
                except KVStoreError as exc:
                    raise _NothingSent(exc) from None
            except _NothingSent as failed:
                if isinstance(failed.cause, InvalidArgument):
                    raise APIError(400, str(failed.cause), code="invalid_value") from None
                plan = self._failover(plan, "decode", tried, failed.cause, 0)
                continue
            answer["id"] = plan.request_id
            answer["model"] = self.info.model_id      # the id /v1/models lists, not vLLM's served name
            self._account(plan, answer.get("usage"))
            self.metrics.generated_tokens.inc(int((answer.get("usage") or {}).get("completion_tokens") or 0))
            return web.json_response(answer, headers=_route(plan)), "ok"

    def _account(self, plan: RoutePlan, usage: dict[str, Any] | None) -> None:
        cached = self._true_usage(plan, usage)
        if self.router.colocated:       # not streamed: the first token's time is the response's end
            self.router.first_token(plan, measured=False)
            self.router.colocated_prefilled(plan, cached)

    def _true_usage(self, plan: RoutePlan, usage: dict[str, Any] | None) -> int:
        """Book vLLM's ``usage`` of a request and make its ``cached_tokens`` the request's
        (in place): colocated, the one instance's count; disaggregated, the prefill
        instance's — the decode instance's count is the hand-off, booked apart. Returns the
        cached tokens."""
        details = ((usage or {}).get("prompt_tokens_details") or {})
        reported = int(details.get("cached_tokens") or 0)
        prefilled = self._prefilled.get(plan.request_id)
        cached, tier = reported, ""
        if prefilled is not None:
            cached, tier = prefilled.cached_tokens, prefilled.load_tier
            self.metrics.count_handoff(reported)
            if usage is not None:
                usage["prompt_tokens_details"] = {**details, "cached_tokens": cached}
        self.metrics.count_cached(cached, hit_sources(cached, plan, self.info.block_size, tier))
        return cached

    async def _stream_relay(self, request: web.Request, events: AsyncGenerator[dict[str, Any], None], plan: RoutePlan,
                            t0: float, include_usage: bool, resume: StreamResume,
                            tried: set[str]) -> tuple[web.StreamResponse, str]:
        """vLLM's server-sent events as they come, with our request id; headers go out with
        the first event, so a decode that fails before it raises :class:`_NothingSent` (the
        caller moves the request elsewhere or answers 503). One that fails after it is
        marked down and the stream goes on from another instance (:meth:`_resume`), or
        ends with an error event when it cannot. vLLM is always asked for usage (it feeds
        the books); it reaches the client only when asked."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **_route(plan)})
        tick = TokenClock(self.metrics, self.router, t0, plan)
        writer = StreamWriter(resp)    # a client that reads slowly never holds vLLM's stream back
        try:
            try:
                while True:
                    try:
                        await self._relay_events(request, resp, writer, events, plan, tick, include_usage, resume)
                        break
                    except KVStoreError as exc:
                        if not resp.prepared:
                            raise _NothingSent(exc) from None
                        try:
                            moved = self._resume(plan, exc, resume, tried)
                        except APIError as err:
                            await writer.end_with_error(err.body())
                            return resp, "error"
                        if moved is None:          # it had generated every token: the stream ends here
                            if include_usage and not resume.usage_seen:
                                writer.event(resume.usage_event(plan.request_id, self.info.model_id))
                            break
                        plan = tick.plan = moved
                        client = self.router.decode_client(plan)
                        events = client.stream(CONTINUATION_PATH, resume.continuation(
                            client.served_model, plan.request_id, plan.namespace))
            except ConnectionResetError:
                log.info("client went away, request %s cancelled", plan.request_id)
                return resp, "cancelled"
            tick.done()
            try:
                if not resp.prepared:
                    await resp.prepare(request)
                writer.event("[DONE]")
            except ConnectionResetError:
                return resp, "cancelled"
            return resp, "ok" if await writer.close() else "cancelled"
        finally:
            await writer.abandon()

    async def _relay_events(self, request: web.Request, resp: web.StreamResponse, writer: StreamWriter,
                            events: AsyncGenerator[dict[str, Any], None], plan: RoutePlan, tick: TokenClock,
                            include_usage: bool, resume: StreamResume) -> None:
        """One instance's events (the request's, or a continuation's shaped as the stream's)
        to the client; raises what the instance's stream raises."""
        leg_tokens = 0
        async with contextlib.aclosing(events):
            async for event in events:
                resume.seen(event)
                if resume.resumed:
                    event = resume.shape(event)
                event["id"] = plan.request_id
                if "model" in event:
                    event["model"] = self.info.model_id
                tokens = sum(len(c.get("token_ids") or ()) or (1 if _has_text(c) else 0)
                             for c in event.get("choices") or ())
                if not resp.prepared:
                    await resp.prepare(request)
                if tokens and not leg_tokens and self.router.colocated:
                    self.router.first_token(plan)      # this instance's prefill is over
                leg_tokens += tokens
                for _ in range(tokens):
                    tick()
                if event.get("usage"):
                    self._account_stream(plan, event["usage"], resume.resumed)
                    if not include_usage:
                        event.pop("usage")
                        if not event.get("choices"):
                            continue      # the usage chunk itself
                writer.event(event)

    def _resume(self, plan: RoutePlan, exc: KVStoreError, resume: StreamResume, tried: set[str]) -> RoutePlan | None:
        """The decode instance of a stream already begun failed: it is marked down (gone, or a
        5xx) and the plan moves to another instance that decodes, where the stream goes on
        (:meth:`StreamResume.continuation`). Returns the moved plan, or None when the stream
        had carried every token (nothing to resume). Raises the APIError that ends the
        stream: 400 (vLLM refused a continuation), 503 (the request cannot resume,
        :func:`~scheduler.vllm.resume.not_resumable`, or no other instance is up)."""
        if resume.complete or isinstance(exc, InvalidArgument) or resume.why_not:
            failed = self._failed(plan.decode_id, "decode", exc)
            if resume.complete:
                return None
            if resume.why_not:
                log.warning("request %s: decode %s failed mid-stream; not resumed: %s", plan.request_id,
                            plan.decode_id, resume.why_not)
                failed.message = f"{failed.message} (not resumed: {resume.why_not})"
            raise failed
        moved = self._failover(plan, "decode", tried, exc, len(resume.generated))
        self.metrics.resumed.inc()
        return moved

    def _account_stream(self, plan: RoutePlan, usage: dict[str, Any], resumed: bool) -> None:
        """The stream's usage event (``usage`` made the request's in place, before it is sent)."""
        cached = self._true_usage(plan, usage)
        if self.router.colocated and not resumed:   # a continuation's prefill is not the request's
            self.router.colocated_prefilled(plan, cached)


class _NothingSent(Exception):
    """An instance failed before any byte of the response reached the client (``cause``)."""

    def __init__(self, cause: KVStoreError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _has_text(choice: dict[str, Any]) -> bool:
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def _route(plan: RoutePlan) -> dict[str, str]:
    return {"X-Kvstore-Prefill": plan.prefill_id, "X-Kvstore-Decode": plan.decode_id}
