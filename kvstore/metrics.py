"""Prometheus metrics of a store node, on a registry of its own.

Names follow Prometheus' conventions (https://prometheus.io/docs/practices/naming/: base
units, ``_bytes`` / ``_seconds`` suffixes, ``_total`` on counters) and the style of the
serving stacks beside kvstore (vLLM's ``vllm:prefix_cache_hits_total``, LMCache's
``lmcache:num_hit_tokens_total``): one ``kvstore_`` prefix, the thing counted, its unit.
Every series carries ``node`` (the node id); tier series carry ``tier`` (hbm, dram, ssd).

Read at scrape time from the pool (:class:`PoolCollector`: nothing on the hot path):

==================================== ======= ===============================================
``kvstore_tier_capacity_bytes``      gauge   bytes the tier may hold
``kvstore_tier_used_bytes``          gauge   bytes held, puts in flight included
``kvstore_tier_reserved_bytes``      gauge   bytes reserved by puts in flight
``kvstore_tier_leased_bytes``        gauge   bytes of blocks under an unexpired read lease
``kvstore_tier_pinned_bytes``        gauge   bytes of pinned blocks (hard or soft)
``kvstore_tier_blocks``              gauge   committed blocks
``kvstore_block_lookup_hits_total``  counter blocks a reuse lookup found, their fastest copy in the tier
``kvstore_block_lookup_misses_total`` counter blocks a reuse lookup reached the tier with and did not find
``kvstore_block_handoff_lookups_total`` counter blocks a hand-off lookup (a decode instance's) found there
``kvstore_block_read_hits_total``    counter block reads served from the tier
``kvstore_block_read_misses_total``  counter block reads the tier could not serve
``kvstore_lookup_hit_ratio``         gauge   the node's reuse: blocks found / blocks looked up (reuse lookups)
``kvstore_read_success_ratio``       gauge   the node's reads: blocks served / blocks read
``kvstore_block_evictions_total``    counter blocks evicted from the tier (demoted or dropped)
``kvstore_block_demotions_total``    counter blocks moved down to the next tier
``kvstore_block_promotions_total``   counter blocks copied up from the tier on a hit
``kvstore_integrity_failures_total`` counter blocks failing their checksum, or lost with a damaged SSD
``kvstore_tier_quarantines_total``   counter times the tier found its storage damaged and replaced it
``kvstore_leases``                   gauge   read leases lent to same-host / remote readers
``kvstore_reservations``             gauge   write slots lent to same-host writers
``kvstore_node_info``                gauge   1, with ``version``
==================================== ======= ===============================================

Per tenant (``namespace`` label; where the pool keeps tenant books, kvstore/pool/tenants.py):
``kvstore_namespace_bytes``, ``kvstore_namespace_blocks``, ``kvstore_namespace_quota_bytes``,
``kvstore_namespace_tier_bytes`` (with ``tier``) are gauges; ``kvstore_namespace_lookup_hits_total``,
``kvstore_namespace_lookup_misses_total``, ``kvstore_namespace_read_hits_total``,
``kvstore_namespace_read_misses_total``, ``kvstore_namespace_quota_evictions_total``,
``kvstore_namespace_rejected_puts_total`` counters. A namespace is a hash of a tenant's API
key (scheduler/routing/tenancy.py), never the key, or of a vLLM ``cache_salt`` the front door did not
set (engines/vllm/layout.py), never the salt, so the labels name no secret; there is one series
set per tenant.

Observed as calls end (:class:`StoreMetrics`):

==================================== ========= =============================================
``kvstore_put_seconds``              histogram a gRPC ``Put`` stream, first chunk to reply
``kvstore_get_seconds``              histogram a gRPC ``Get`` stream, request to last chunk
``kvstore_dataplane_op_seconds``     histogram a data plane control op in the node (``plane``:
                                               local, remote; ``op``: lease, reserve, commit);
                                               the bytes move in the client's process
==================================== ========= =============================================
"""
from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore import __version__
from kvstore.config import StoreConfig
from kvstore.metrics_http import MetricsServer
from kvstore.pool.pool import KVPool
from kvstore.pool.types import lookup_hit_ratio, read_success_ratio

# Seconds: a same-host control op takes tens of microseconds, a gRPC stream of many MiB
# seconds.
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SERVICE = "/kvstore.v1.KVStore/"

# (metric name, TierStats field, help): gauges, then counters (their family adds ``_total``).
TIER_GAUGES = (
    ("kvstore_tier_capacity_bytes", "capacity_bytes", "Bytes the tier may hold"),
    ("kvstore_tier_used_bytes", "used_bytes", "Bytes the tier holds, puts in flight included"),
    ("kvstore_tier_reserved_bytes", "reserved_bytes", "Bytes reserved by puts in flight"),
    ("kvstore_tier_leased_bytes", "leased_bytes", "Bytes of blocks under an unexpired read lease"),
    ("kvstore_tier_pinned_bytes", "pinned_bytes", "Bytes of pinned blocks (hard or soft)"),
    ("kvstore_tier_blocks", "blocks", "Committed blocks in the tier"),
)
TIER_COUNTERS = (
    ("kvstore_block_lookup_hits", "lookup_hits",
     "Blocks a reuse lookup found, their fastest copy in the tier (docs/metrics.md)"),
    ("kvstore_block_lookup_misses", "lookup_misses",
     "Blocks a reuse lookup reached the tier with and did not find there (past the held prefix: every tier)"),
    ("kvstore_block_handoff_lookups", "handoff_lookups",
     "Blocks a hand-off lookup (a decode instance after its prefill's blocks) found, fastest copy in the tier"),
    ("kvstore_block_read_hits", "hits", "Block reads served from the tier"),
    ("kvstore_block_read_misses", "misses", "Block reads the tier could not serve"),
    ("kvstore_block_evictions", "evictions", "Blocks evicted from the tier (demoted or dropped)"),
    ("kvstore_block_demotions", "demotions", "Blocks moved down to the next tier"),
    ("kvstore_block_promotions", "promotions", "Blocks copied up from the tier on a hit"),
    ("kvstore_integrity_failures", "integrity_failures",
     "Blocks that failed their checksum or were lost with damaged storage"),
    ("kvstore_tier_quarantines", "quarantines", "Times the tier found its storage damaged and replaced it"),
)


UNATTRIBUTED = "_unattributed"   # the namespace label of blocks put without a tenant
NAMESPACE_SERIES = (   # (name, NamespaceStats field, help, family)
    ("kvstore_namespace_bytes", "bytes", "Bytes the namespace holds (each block once)", GaugeMetricFamily),
    ("kvstore_namespace_blocks", "blocks", "Blocks the namespace holds", GaugeMetricFamily),
    ("kvstore_namespace_quota_bytes", "quota_bytes", "The namespace's hard byte quota (no sample: none)",
     GaugeMetricFamily),
    ("kvstore_namespace_lookup_hits", "lookup_hits", "Blocks of the namespace a reuse lookup found",
     CounterMetricFamily),
    ("kvstore_namespace_lookup_misses", "lookup_misses", "Blocks of the namespace's chains a reuse lookup did not "
     "find", CounterMetricFamily),
    ("kvstore_namespace_read_hits", "hits", "Reads that found a block of the namespace", CounterMetricFamily),
    ("kvstore_namespace_read_misses", "misses", "Reads of a block the namespace no longer holds",
     CounterMetricFamily),
    ("kvstore_namespace_quota_evictions", "evictions", "The namespace's blocks evicted to keep it under its quota",
     CounterMetricFamily),
    ("kvstore_namespace_rejected_puts", "rejected_puts", "Puts refused by the namespace's quota", CounterMetricFamily),
)


class PoolCollector(Collector):
    """The pool's figures (:meth:`KVPool.stats`) as metric families, read at each scrape.
    ``lent``: callables returning (leases, reservations) lent out, one per data plane, by
    ``plane`` name (``local``: the same-host Unix socket; ``remote``: the transfer engine's
    TCP control channel)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.lent: dict[str, Callable[[], tuple[int, int]]] = {}

    def collect(self) -> Iterable[Metric]:
        node = self.pool.node_id
        stats = self.pool.stats()
        for name, field, text in TIER_GAUGES:
            g = GaugeMetricFamily(name, text, labels=["node", "tier"])
            for s in stats:
                g.add_metric([node, s.name], getattr(s, field))
            yield g
        for name, field, text in TIER_COUNTERS:
            c = CounterMetricFamily(name, text, labels=["node", "tier"])
            for s in stats:
                c.add_metric([node, s.name], getattr(s, field))
            yield c
        for name, ratio, text in (
                ("kvstore_lookup_hit_ratio", lookup_hit_ratio(stats),
                 "The node's reuse: blocks reuse lookups found / blocks they looked up (no sample: none yet)"),
                ("kvstore_read_success_ratio", read_success_ratio(stats),
                 "The node's reads: blocks served / blocks read (no sample: none yet)")):
            g = GaugeMetricFamily(name, text, labels=["node"])
            if ratio is not None:
                g.add_metric([node], ratio)
            yield g
        leases = GaugeMetricFamily("kvstore_leases", "Read leases lent out by a data plane",
                                   labels=["node", "plane"])
        slots = GaugeMetricFamily("kvstore_reservations", "Write slots lent out by a data plane",
                                  labels=["node", "plane"])
        for plane, lent in self.lent.items():
            n_leases, n_slots = lent()
            leases.add_metric([node, plane], n_leases)
            slots.add_metric([node, plane], n_slots)
        yield leases
        yield slots
        info = GaugeMetricFamily("kvstore_node_info", "The node's build", labels=["node", "version"])
        info.add_metric([node, __version__], 1)
        yield info
        yield from self._namespaces(node)

    def _namespaces(self, node: str) -> Iterable[Metric]:
        """Per-tenant series from the pool's tenant books (kvstore/pool/tenants.py, where this
        build has them): ``namespace`` is the block's tenant, :data:`UNATTRIBUTED` for
        blocks put without one."""
        try:
            tenants = importlib.import_module("kvstore.pool.tenants")
        except ImportError:
            return
        per = tenants.namespace_stats(self.pool)
        labels = ["node", "namespace"]
        for name, field, text, family in NAMESPACE_SERIES:
            f = family(name, text, labels=labels)
            for ns, st in sorted(per.items()):
                v = getattr(st, field)
                if v is not None:        # quota_bytes of a namespace without a quota
                    f.add_metric([node, ns or UNATTRIBUTED], v)
            yield f
        f = GaugeMetricFamily("kvstore_namespace_tier_bytes", "Bytes of the namespace's copies in the tier",
                              labels=["node", "namespace", "tier"])
        for ns, st in sorted(per.items()):
            for tier, nbytes in sorted(st.tier_bytes.items()):
                f.add_metric([node, ns or UNATTRIBUTED, tier], nbytes)
        yield f


class StoreMetrics:
    """A store node's registry: the pool's collector and the latency histograms the service
    observes. Hook it up with :meth:`interceptor` (gRPC ``Put`` / ``Get``) and
    :meth:`watch_dataplane` (same-host control ops, leases and reservations lent)."""

    def __init__(self, pool: KVPool) -> None:
        self.registry = CollectorRegistry()
        self.pool = pool
        self.collector = PoolCollector(pool)
        self.registry.register(self.collector)
        node, r = [pool.node_id], self.registry
        self.put_seconds = Histogram("kvstore_put_seconds", "A gRPC Put stream, first chunk to reply",
                                     ["node"], buckets=LATENCY_BUCKETS, registry=r).labels(*node)
        self.get_seconds = Histogram("kvstore_get_seconds", "A gRPC Get stream, request to last chunk",
                                     ["node"], buckets=LATENCY_BUCKETS, registry=r).labels(*node)
        self.dataplane_seconds = Histogram(
            "kvstore_dataplane_op_seconds", "A same-host data plane control op in the node (lease, reserve, "
            "commit); the block bytes move in the client's process", ["node", "plane", "op"],
            buckets=LATENCY_BUCKETS, registry=r)

    def interceptor(self) -> grpc.ServerInterceptor:
        """A server interceptor timing the KVStore service's ``Put`` and ``Get`` calls
        (place it after the token check: refused calls are not timed)."""
        return _TimingInterceptor({_SERVICE + "Put": self.put_seconds, _SERVICE + "Get": self.get_seconds})

    def watch_dataplane(self, host: Any, plane: str = "local") -> None:
        """Count what ``host`` lends out (a :class:`kvstore.dataplane.host.DataPlaneHost`'s
        ``lent()``, or that of the host a wrapper such as
        :class:`kvstore.transfer.staging.StagedReads` holds as ``host``) and time its control
        ops: the ``lease_flat``, ``reserve`` and ``commit`` it has are replaced, on this
        instance only, by timed calls of the same methods."""
        lent = getattr(host, "lent", None) or getattr(getattr(host, "host", None), "lent", None)
        if lent is not None:
            self.collector.lent[plane] = lent
        for op, method in (("lease", "lease_flat"), ("reserve", "reserve"), ("commit", "commit")):
            if callable(getattr(host, method, None)):
                hist = self.dataplane_seconds.labels(self.pool.node_id, plane, op)
                setattr(host, method, _timed(getattr(host, method), hist))


def serve_metrics(cfg: StoreConfig, pool: KVPool) -> tuple[StoreMetrics, MetricsServer]:
    """The node's metrics and their port (``cfg.host``, ``cfg.metrics_port``; 0: a free one),
    taking ``cfg.auth_token`` when set. Raises OSError when the port cannot be bound."""
    metrics = StoreMetrics(pool)
    return metrics, MetricsServer(metrics.registry, cfg.host, cfg.metrics_port or 0, cfg.auth_token,
                                  f"store node {cfg.node_id}")


def _timed(fn: Callable[..., Any], hist: Any) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            hist.observe(time.perf_counter() - t0)
    return call


class _TimingInterceptor(grpc.ServerInterceptor):
    """Observes the wall time of the listed methods: a client-streamed call until the
    handler returns, a server-streamed one until its last message is taken (or the stream
    is cancelled)."""

    def __init__(self, histograms: dict[str, Any]) -> None:
        self.histograms = histograms

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        hist = self.histograms.get(handler_call_details.method)
        if handler is None or hist is None:
            return handler
        if handler.unary_stream is not None:
            stream = handler.unary_stream

            def unary_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                t0 = time.perf_counter()
                try:
                    yield from stream(request, context)
                finally:
                    hist.observe(time.perf_counter() - t0)
            return handler._replace(unary_stream=unary_stream)
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_timed(handler.stream_unary, hist))
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_timed(handler.unary_unary, hist))
        return handler
