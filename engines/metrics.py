"""Prometheus metrics of a prefill or decode engine, on a registry of its own, served on the
engine's metrics port (kvstore/metrics_http.py; ``kvstore engine --metrics-port``).

Names as the store node's (kvstore/metrics.py) with the ``kvstore_engine_`` prefix, in the
style of vLLM's request metrics (``vllm:request_prefill_time_seconds``,
``vllm:request_decode_time_seconds``, ``vllm:num_requests_waiting``,
https://docs.vllm.ai/en/latest/design/metrics.html); every series carries ``engine``.

================================================ ========= =================================
``kvstore_engine_prefill_seconds``               histogram a prefill in the engine (load,
                                                           compute, publish)
``kvstore_engine_pool_load_seconds``             histogram reading a prompt's prefix from the
                                                           pool (``tier``: where most came from)
``kvstore_engine_decode_seconds``                histogram a request's decode, start to last token
``kvstore_engine_time_per_output_token_seconds`` histogram between two decoded tokens
``kvstore_engine_prompt_tokens_total``           counter   prompt tokens prefilled, by ``source``:
                                                           ``loaded`` (KV reused) or ``computed``
``kvstore_engine_pool_loaded_bytes_total``       counter   KV bytes read from the pool, by ``tier``
``kvstore_engine_stored_blocks_total``           counter   blocks this engine put into the pool
``kvstore_engine_requests_total``                counter   requests ended, by ``outcome`` (ok, error,
                                                           cancelled)
``kvstore_engine_requests_waiting``              gauge     requests queued for the model
``kvstore_engine_requests_running``              gauge     requests on the model
``kvstore_engine_queued_tokens``                 gauge     prompt tokens of the queued requests
``kvstore_engine_recomputed_tokens_total``       counter   decode: prompt tokens recomputed (blocks
                                                           missing from the pool)
``kvstore_engine_identity_mismatches_total``     counter   blocks read whose tokens were not the
                                                           prompt's (kvstore/identity.py)
``kvstore_engine_info``                          gauge     1, with ``role`` and ``model``
================================================ ========= =================================
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engines.types import DecodeStep, PrefillResult

# Seconds: a tiny CPU model prefills in milliseconds, a long prompt on a real one in seconds.
PREFILL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DECODE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    """The engine's load (``engine.load()``) and counters it keeps itself, read at scrape."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        e, ids = self.engine, [self.engine.engine_id]
        load = e.load()
        for name, value, text in (("kvstore_engine_requests_waiting", load.queued, "Requests queued for the model"),
                                  ("kvstore_engine_requests_running", load.running, "Requests on the model"),
                                  ("kvstore_engine_queued_tokens", load.queued_tokens,
                                   "Prompt tokens of the queued requests")):
            g = GaugeMetricFamily(name, text, labels=["engine"])
            g.add_metric(ids, value)
            yield g
        c = CounterMetricFamily("kvstore_engine_recomputed_tokens", "Decode: prompt tokens recomputed because "
                                "their blocks were missing from the pool", labels=["engine"])
        c.add_metric(ids, getattr(e, "recomputed_tokens", 0))
        yield c
        c = CounterMetricFamily("kvstore_engine_identity_mismatches", "Blocks read from the pool whose tokens "
                                "were not the prompt's (a key collision), treated as misses", labels=["engine"])
        identity = getattr(e, "identity", None)
        c.add_metric(ids, getattr(identity, "mismatches", 0))
        yield c
        info = GaugeMetricFamily("kvstore_engine_info", "The engine's role and model",
                                 labels=["engine", "role", "model"])
        info.add_metric([e.engine_id, e.role, e.lm.model_id], 1)
        yield info


class EngineMetrics:
    """A prefill or decode engine's registry. The service calls :meth:`observe_prefill` with
    each prefill's result and runs each decode's steps through :meth:`timed_decode`."""

    def __init__(self, engine: Any) -> None:
        self.registry = r = CollectorRegistry()
        self.engine_id = engine.engine_id
        r.register(_EngineCollector(engine))
        e = ["engine"]
        self.prefill_seconds = Histogram("kvstore_engine_prefill_seconds", "A prefill in the engine: load the "
                                         "cached prefix, compute the rest, publish the new blocks", e,
                                         buckets=PREFILL_BUCKETS, registry=r).labels(self.engine_id)
        self.load_seconds = Histogram("kvstore_engine_pool_load_seconds", "Reading a prompt's cached prefix "
                                      "from the pool", e + ["tier"], buckets=LOAD_BUCKETS, registry=r)
        self.decode_seconds = Histogram("kvstore_engine_decode_seconds", "A request's decode, start to last "
                                        "token", e, buckets=DECODE_BUCKETS, registry=r).labels(self.engine_id)
        self.token_seconds = Histogram("kvstore_engine_time_per_output_token_seconds", "Time between two "
                                       "decoded tokens", e, buckets=TOKEN_BUCKETS, registry=r).labels(self.engine_id)
        self.prompt_tokens = Counter("kvstore_engine_prompt_tokens", "Prompt tokens whose KV the engine "
                                     "needed, by source: loaded (prefill: from its own cache or the pool; "
                                     "decode: from the pool or the prefill's hand-off) or computed",
                                     e + ["source"], registry=r)
        self.loaded_bytes = Counter("kvstore_engine_pool_loaded_bytes", "KV bytes read from the pool",
                                    e + ["tier"], registry=r)
        self.stored_blocks = Counter("kvstore_engine_stored_blocks", "Blocks this engine put into the pool",
                                     e, registry=r).labels(self.engine_id)
        self.requests = Counter("kvstore_engine_requests", "Requests ended, by outcome (ok, error, cancelled)",
                                e + ["outcome"], registry=r)
        for source in ("loaded", "computed"):       # present from the first scrape on
            self.prompt_tokens.labels(self.engine_id, source)
        for outcome in ("ok", "error", "cancelled"):
            self.requests.labels(self.engine_id, outcome)
        if hasattr(engine, "on_load"):   # a decode engine: its prompt's KV, loaded or recomputed
            engine.on_load = self.observe_decode_load

    def observe_decode_load(self, seconds: float, nbytes: int, loaded_tokens: int, recomputed_tokens: int) -> None:
        """A decode's prompt KV: ``nbytes`` read from the pool in ``seconds`` (tier not
        known to the decode engine: ``unknown``), ``loaded_tokens`` from the pool or the
        prefill's hand-off, ``recomputed_tokens`` computed again (blocks missing)."""
        e = self.engine_id
        self.prompt_tokens.labels(e, "loaded").inc(loaded_tokens)
        self.prompt_tokens.labels(e, "computed").inc(recomputed_tokens)
        if nbytes:
            self.load_seconds.labels(e, "unknown").observe(seconds)
            self.loaded_bytes.labels(e, "unknown").inc(nbytes)

    def observe_prefill(self, r: PrefillResult) -> None:
        """Count one finished prefill."""
        e = self.engine_id
        self.prefill_seconds.observe(r.prefill_s)
        self.prompt_tokens.labels(e, "loaded").inc(r.cached_tokens)
        self.prompt_tokens.labels(e, "computed").inc(r.computed_tokens)
        if r.load_bytes:
            tier = r.load_tier or "unknown"
            self.load_seconds.labels(e, tier).observe(r.load_s)
            self.loaded_bytes.labels(e, tier).inc(r.load_bytes)
        self.stored_blocks.inc(r.stored_blocks)
        self.requests.labels(e, "ok").inc()

    def cancelled(self) -> None:
        """Count one request whose caller left before the engine began it."""
        self.requests.labels(self.engine_id, "cancelled").inc()

    def failed(self) -> None:
        """Count one request that ended in an error."""
        self.requests.labels(self.engine_id, "error").inc()

    def timed_decode(self, steps: Iterator[DecodeStep]) -> Iterator[DecodeStep]:
        """``steps`` as they come, timing the decode (observed when the steps end, however
        they end) and the gap before each token after the first."""
        t0 = last = time.perf_counter()
        outcome = "error"
        try:
            for i, step in enumerate(steps):
                now = time.perf_counter()
                if i:
                    self.token_seconds.observe(now - last)
                last = now
                if step.finished:   # the last step: done, whether or not the caller asks for more
                    outcome = "ok"
                yield step
            outcome = "ok"
        except GeneratorExit:       # the caller went away: a cancelled request, unless it had it all
            if outcome != "ok":
                outcome = "cancelled"
            raise
        finally:
            self.decode_seconds.observe(time.perf_counter() - t0)
            self.requests.labels(self.engine_id, outcome).inc()
