"""Prometheus metrics of the front door, on a registry of its own (never the global one, so
several front doors can live in one process)."""
from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvstore.events.replica import IndexReplica

# Seconds; TTFT spans a tiny CPU model to long prompts, TBT a few ms to a second.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class FrontdoorMetrics:
    """The front door's series. Names carry the ``kvstore_scheduler_`` prefix; times are
    seconds, counts are requests or tokens."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._prompt = self._cached = 0
        self._by_source: dict[str, int] = {}
        p, r = "kvstore_scheduler_", self.registry
        self.ttft = Histogram(p + "ttft_seconds", "Time to first token, request arrival to first token sent "
                              "(a streamed request's; over vLLM a whole response's tokens are not timed)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram(p + "tbt_seconds", "Time between tokens sent to a client",
                             buckets=TBT_BUCKETS, registry=r)
        self.admitted = Counter(p + "requests_admitted", "Requests admitted", registry=r)
        self.rejected = Counter(p + "requests_rejected", "Requests rejected with a 429, by reason: admission's "
                                "(bounds, SLOs) or tenant_parse_waiting (scheduler/frontdoor/parse_slots.py)",
                                ["reason"], registry=r)
        self.finished = Counter(p + "requests_finished", "Admitted requests by outcome",
                                ["outcome"], registry=r)
        self.request_seconds = Histogram(p + "request_seconds", "Admitted requests' time, arrival to the "
                                         "response's end (whole or streamed), by outcome",
                                         ["outcome"], buckets=(*TTFT_BUCKETS, 300, 600), registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter(p + "cached_prompt_tokens",
                                     "Prompt tokens a request's prefill did not compute because they were cached "
                                     "(an instance's own prefix cache or the pool; never the prefill-to-decode "
                                     "hand-off): the cached_tokens the clients are told", registry=r)
        self.cached_by_source = Counter(p + "cached_prompt_tokens_by_source",
                                        "kvstore_scheduler_cached_prompt_tokens by where they came from (source: "
                                        "instance, pool_hbm, pool_dram, pool_ssd, unknown; "
                                        "scheduler/routing/hit_sources.py)",
                                        ["source"], registry=r)
        self.handoff_tokens = Counter(p + "handoff_tokens",
                                      "Prompt tokens whose KV a decode instance took from the prefill instance "
                                      "instead of computing (via: pool, or direct with the prefill's answer); "
                                      "a transfer, not a hit", ["via"], registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens sent to clients", registry=r)
        self.queue_depth = Gauge(p + "prefill_queue_depth",
                                 "Requests routed to a prefill instance and not yet prefilled",
                                 ["instance"], registry=r)
        self.decode_running = Gauge(p + "decode_running",
                                    "Sequences routed to a decode instance and running (a request with n counts n)",
                                    ["instance"], registry=r)
        self.inflight = Gauge(p + "inflight_requests",
                              "Sequences admitted and not finished (a request with n counts n)", registry=r)
        self.routed = Counter(p + "requests_routed", "Admitted requests by policy and chosen instances",
                              ["policy", "prefill", "decode"], registry=r)
        self.ttft_error = Histogram(p + "ttft_prediction_error_seconds",
                                    "Absolute error of the predicted TTFT (measured minus predicted)",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.retried = Counter(p + "requests_moved", "Requests moved to another instance after "
                               "their engine failed", ["role"], registry=r)
        self.resumed = Counter(p + "resumed_streams", "Streams whose decode instance failed after tokens were "
                               "sent, continued on another instance (each continuation; docs/resume.md)",
                               registry=r)
        self.hit_ratio = Gauge(p + "prefix_hit_ratio",
                               "Cached prompt tokens / prompt tokens of admitted requests (reuse; the "
                               "hand-off is not counted)", registry=r)
        self.hit_ratio_by_source = Gauge(p + "prefix_hit_ratio_by_source",
                                         "Cached prompt tokens from one source / prompt tokens of admitted "
                                         "requests (the sources sum to prefix_hit_ratio)", ["source"], registry=r)
        self.prefill_error = Gauge(p + "prefill_prediction_log_error",
                                   "The Conductor's T_prefill predictor against the engines: mean and sd "
                                   "of ln(observed / predicted) prefill seconds over every observed prefill",
                                   ["stat"], registry=r)
        self.up = Gauge(p + "up", "1 while a part the front door depends on answers its health checks, else 0 "
                        "(role: prefill, decode or store)", ["role", "instance"], registry=r)
        self.http = Counter(p + "http_responses", "HTTP responses by route and status, refusals before "
                            "admission included (401, 400, 413, 429, 503; 499: the client left first)",
                            ["route", "status"], registry=r)
        self.kv_index = Gauge(p + "kv_index_replica", "The router's replica of the store's index over KV "
                              "events (scheduler/routing/cache_index.py): events applied, gaps, snapshots applied",
                              ["what"], registry=r)
        self.pool_lookups = Counter(p + "pool_lookups", "Lookup RPCs the router sent the store to plan a "
                                    "request, by outcome (ok, failed: planned as a pool miss); none while a "
                                    "replica of the store's index over KV events gives the pool's hits",
                                    ["outcome"], registry=r)
        self._lookups_seen: dict[str, int] = {}

    def request_finished(self, outcome: str, seconds: float) -> None:
        """One admitted request ended (``ok``, ``error``, ``cancelled``) ``seconds`` after it arrived."""
        self.finished.labels(outcome=outcome).inc()
        self.request_seconds.labels(outcome=outcome).observe(seconds)

    def set_up(self, parts: Iterable[tuple[str, str, bool]]) -> None:
        """``kvstore_scheduler_up`` from (role, instance, up) of every part; a part no longer
        listed drops out."""
        self.up.clear()
        for role, instance, up in parts:
            self.up.labels(role=role, instance=instance).set(1 if up else 0)

    def middleware(self) -> Any:
        """An aiohttp middleware counting every response in ``kvstore_scheduler_http_responses``
        by route (the route's pattern, ``unmatched`` for none: a bounded label) and status.
        Put it first, so that the answers of the middlewares after it (401) count too."""
        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            status = 500
            try:
                resp = await handler(request)
                status = resp.status
                return resp
            except web.HTTPException as exc:
                status = exc.status
                raise
            except asyncio.CancelledError:
                status = 499
                raise
            finally:
                resource = request.match_info.route.resource
                route = resource.canonical if resource is not None else "unmatched"
                self.http.labels(route=route, status=str(status)).inc()
        return count

    def count_prompt(self, tokens: int) -> None:
        self._prompt += tokens
        self.prompt_tokens.inc(tokens)

    def count_cached(self, tokens: int, by_source: dict[str, int] | None = None) -> None:
        """A request's cached prompt tokens (the figure its client is told), and their split
        by source (:func:`scheduler.routing.hit_sources.hit_sources`; None: all ``unknown``)."""
        self._cached += tokens
        self.cached_tokens.inc(tokens)
        for source, n in (by_source if by_source is not None else {"unknown": tokens}).items():
            if n > 0:
                self._by_source[source] = self._by_source.get(source, 0) + n
                self.cached_by_source.labels(source=source).inc(n)

    def count_handoff(self, via_pool: int, direct: int = 0) -> None:
        """Prompt tokens a decode instance took from the prefill instance (through the pool,
        with the prefill's answer)."""
        for via, n in (("pool", via_pool), ("direct", direct)):
            if n > 0:
                self.handoff_tokens.labels(via=via).inc(n)

    def render(self, queue_depths: dict[str, int], decode_running: dict[str, int], inflight: int,
               replica: IndexReplica | None = None,
               prefill_log_error: tuple[float, float] | None = None,
               pool_lookups: dict[str, int] | None = None) -> bytes:
        """The text exposition format, with the gauges set from the router's current state
        (``replica``: its index replica, when it keeps one; ``prefill_log_error``: its
        T_prefill predictor's (mean, sd) of ln(observed / predicted), once measured —
        :attr:`scheduler.policy.costing.PrefillModel.log_error`; ``pool_lookups``: its
        Lookup RPCs so far by outcome, :attr:`scheduler.routing.router.Router.pool_lookups`)."""
        for outcome, n in (pool_lookups or {}).items():
            self.pool_lookups.labels(outcome=outcome).inc(n - self._lookups_seen.get(outcome, 0))
            self._lookups_seen[outcome] = n
        if prefill_log_error is not None:
            self.prefill_error.labels(stat="mean").set(prefill_log_error[0])
            self.prefill_error.labels(stat="sd").set(prefill_log_error[1])
        if replica is not None:
            stats = replica.stats()
            for what in ("events", "gaps", "resyncs", "resync_failures"):
                self.kv_index.labels(what=what).set(getattr(stats, what))
        for name, depth in queue_depths.items():
            self.queue_depth.labels(instance=name).set(depth)
        for name, running in decode_running.items():
            self.decode_running.labels(instance=name).set(running)
        self.inflight.set(inflight)
        self.hit_ratio.set(self._cached / self._prompt if self._prompt else 0.0)
        for source, n in self._by_source.items():
            self.hit_ratio_by_source.labels(source=source).set(n / self._prompt if self._prompt else 0.0)
        return generate_latest(self.registry)
