"""The connector's figures in vLLM's ``/metrics`` (vLLM 0.32's ``KVConnectorStats`` and
``KVConnectorPromMetrics``) and in vLLM's per-source cache-hit metric.

Each step, both connector objects of an instance hand vLLM the figures of the step just
gone (:meth:`StatsRecorder.take`): the scheduler side its hits by tier (the tier the pool's
lookup named for each block vLLM chose to load) and the seconds the pool was unavailable;
each worker its loads and saves. vLLM adds them up across ranks and the two roles
(:meth:`KVStoreConnectorStats.aggregate`), ships them to its API server as the plain dict
``data`` and feeds them to :class:`KVStorePromMetrics`, which exports (labels ``model_name``,
``engine``, and the one named):

=============================================  =====================================================
``vllm:kvstore_hit_tokens_total{tier}``        prompt tokens loaded from the pool, by the tier that
                                               held them (``hbm``, ``dram``, ``ssd``)
``vllm:kvstore_hit_blocks_total{tier}``        the same in blocks
``vllm:kvstore_lookups_total``                 pool lookups (one per request vLLM asks about)
``vllm:kvstore_load_seconds``                  histogram: one request's load (all its blocks)
``vllm:kvstore_load_bytes_total``              bytes copied out of the pool into vLLM's KV cache
``vllm:kvstore_save_seconds``                  histogram: one save (a request's new blocks)
``vllm:kvstore_save_bytes_total``              bytes of the blocks the pool now holds from saves
``vllm:kvstore_saves_dropped_blocks_total``    blocks not saved because the saves in flight
                                               already pinned ``kvstore.max_pinned_fraction`` of
                                               vLLM's KV blocks (a later miss, never a stall)
``vllm:kvstore_load_errors_total{cause}``      blocks vLLM was told to recompute, by cause: ``miss``
                                               (gone, or failed its checksum: the store client
                                               returns such a block as a miss), ``lease_expired``,
                                               ``pool_unavailable``, ``identity_mismatch``
``vllm:kvstore_pool_unavailable_seconds_total`` seconds from a failed pool call to the next one
                                               that succeeded (the link's back-off included)
=============================================  =====================================================

Under tensor parallelism the bytes and seconds are every rank's, summed.

vLLM's own ``vllm:prompt_tokens_cached_by_source{source}`` gets the pool's hits by tier
(:func:`hit_sources`): ``dram`` → ``host``, ``ssd`` → ``disk``, ``hbm`` (a store node's
device memory, not this instance's) → ``p2p``, anything else → ``external_unspecified``.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

SOURCE_OF_TIER = {"hbm": CacheHitSource.P2P, "dram": CacheHitSource.HOST, "ssd": CacheHitSource.DISK}
LOAD_ERROR_CAUSES = ("miss", "lease_expired", "pool_unavailable", "identity_mismatch")
# figures that add up; the by-label ones are dicts of label -> count
_COUNTS = ("lookups", "load_bytes", "loaded_blocks", "save_bytes", "saved_blocks", "saves_dropped",
           "pool_unavailable_s")
_BY_LABEL = ("hit_tokens", "hit_blocks", "load_errors")
_SERIES = ("load_s", "save_s")
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def hit_sources(tiers: Sequence[str], block_size: int, num_tokens: int) -> dict[CacheHitSource, int]:
    """``num_tokens`` loaded from the pool split by vLLM's cache-hit sources, from the tier
    of each loaded block in order (``tiers``, one per block): block ``i`` covers tokens
    ``[i * block_size, (i + 1) * block_size)``; tokens past the listed blocks are
    ``external_unspecified``. The counts sum to ``num_tokens`` (what vLLM requires)."""
    out: dict[CacheHitSource, int] = {}
    left = max(0, num_tokens)
    for tier in tiers:
        if left <= 0:
            break
        take = min(left, block_size)
        source = SOURCE_OF_TIER.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
        out[source] = out.get(source, 0) + take
        left -= take
    if left > 0:
        out[CacheHitSource.EXTERNAL_UNSPECIFIED] = out.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + left
    return out


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {k: 0 for k in _COUNTS}
    data.update({k: {} for k in _BY_LABEL})
    data.update({k: [] for k in _SERIES})
    return data


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """One interval's figures (module docstring): ``data`` holds plain numbers, dicts and
    lists only (vLLM ships it between processes)."""

    def __post_init__(self) -> None:
        base = _empty()
        base.update(self.data or {})
        self.data = base

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        d = self.data
        return not any(d.get(k) for k in (*_COUNTS, *_BY_LABEL, *_SERIES))

    def aggregate(self, other: KVConnectorStats) -> KVStoreConnectorStats:
        """Add ``other``'s figures to these (another rank's, the other role's, a later step's)."""
        for k in _COUNTS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        for k in _BY_LABEL:
            mine = self.data.setdefault(k, {})
            for label, n in (other.data.get(k) or {}).items():
                mine[label] = mine.get(label, 0) + n
        for k in _SERIES:
            self.data.setdefault(k, []).extend(other.data.get(k) or ())
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval in one line of vLLM's log: counts, and mean/p90 milliseconds."""
        d = self.data
        out: dict[str, int | float] = {"lookups": d["lookups"]}
        for tier, n in sorted(d["hit_blocks"].items()):
            out[f"hit_blocks_{tier}"] = n
        out["loaded_blocks"] = d["loaded_blocks"]
        out["saved_blocks"] = d["saved_blocks"]
        if d["saves_dropped"]:
            out["saves_dropped_blocks"] = d["saves_dropped"]
        for cause, n in sorted(d["load_errors"].items()):
            out[f"load_errors_{cause}"] = n
        for k in _SERIES:
            series = sorted(d[k])
            if series:
                out[f"{k[:-2]}_ms_avg"] = round(1000 * sum(series) / len(series), 3)
                out[f"{k[:-2]}_ms_p90"] = round(1000 * series[min(len(series) - 1, int(0.9 * len(series)))], 3)
        if d["pool_unavailable_s"]:
            out["pool_unavailable_s"] = round(d["pool_unavailable_s"], 3)
        return out


class StatsRecorder:
    """The running interval of one connector object, filled by the threads that load, save
    and look up, emptied by :meth:`take` once a step. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()

    def _add(self, key: str, n: float, label: str | None = None) -> None:
        with self._lock:
            if label is None:
                self._data[key] += n
            else:
                self._data[key][label] = self._data[key].get(label, 0) + n

    def lookup(self) -> None:
        self._add("lookups", 1)

    def hits(self, tiers: Sequence[str], block_size: int) -> None:
        """vLLM chose to load blocks held in ``tiers`` (one per block)."""
        with self._lock:
            for tier in tiers:
                for key, n in (("hit_blocks", 1), ("hit_tokens", block_size)):
                    self._data[key][tier] = self._data[key].get(tier, 0) + n

    def load(self, seconds: float, blocks: int, nbytes: int, errors: int = 0, cause: str = "") -> None:
        with self._lock:
            self._data["load_s"].append(seconds)
            self._data["loaded_blocks"] += blocks
            self._data["load_bytes"] += nbytes
            if errors:
                self._data["load_errors"][cause] = self._data["load_errors"].get(cause, 0) + errors

    def save(self, seconds: float, blocks: int, nbytes: int) -> None:
        with self._lock:
            self._data["save_s"].append(seconds)
            self._data["saved_blocks"] += blocks
            self._data["save_bytes"] += nbytes

    def dropped(self, blocks: int) -> None:
        """A save of ``blocks`` was dropped: its pins would pass ``kvstore.max_pinned_fraction``."""
        self._add("saves_dropped", blocks)

    def unavailable(self, seconds: float) -> None:
        if seconds > 0:
            self._add("pool_unavailable_s", seconds)

    def take(self) -> KVStoreConnectorStats | None:
        """The interval's figures (None when nothing happened), and a fresh interval."""
        with self._lock:
            data, self._data = self._data, _empty()
        stats = KVStoreConnectorStats(data=data)
        return None if stats.is_empty() else stats


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics (module docstring), registered once per API server
    through vLLM's metric classes; one child per (engine, label) made on first use."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls    # vLLM's Histogram class (TypeVar-typed in vLLM)
        names = list(labelnames)
        self._metrics: dict[str, Any] = {
            "hit_tokens": counter(name="vllm:kvstore_hit_tokens_total", labelnames=[*names, "tier"],
                                  documentation="Prompt tokens loaded from the kvstore pool, by tier."),
            "hit_blocks": counter(name="vllm:kvstore_hit_blocks_total", labelnames=[*names, "tier"],
                                  documentation="KV blocks loaded from the kvstore pool, by the tier holding them."),
            "lookups": counter(name="vllm:kvstore_lookups_total", labelnames=names,
                               documentation="Lookups of prompts in the kvstore pool."),
            "load_s": histogram(name="vllm:kvstore_load_seconds", labelnames=names, buckets=list(_SECONDS_BUCKETS),
                                documentation="Seconds one request's blocks took to load from the kvstore pool."),
            "load_bytes": counter(name="vllm:kvstore_load_bytes_total", labelnames=names,
                                  documentation="Bytes loaded from the kvstore pool into vLLM's KV cache."),
            "save_s": histogram(name="vllm:kvstore_save_seconds", labelnames=names, buckets=list(_SECONDS_BUCKETS),
                                documentation="Seconds one save of new blocks into the kvstore pool took."),
            "save_bytes": counter(name="vllm:kvstore_save_bytes_total", labelnames=names,
                                  documentation="Bytes of blocks saved into the kvstore pool."),
            "load_errors": counter(name="vllm:kvstore_load_errors_total", labelnames=[*names, "cause"],
                                   documentation="Blocks vLLM recomputed because they did not load from the "
                                                 "kvstore pool, by cause."),
            "saves_dropped": counter(name="vllm:kvstore_saves_dropped_blocks_total", labelnames=names,
                                     documentation="KV blocks not saved into the kvstore pool because the saves "
                                                   "in flight already pinned kvstore.max_pinned_fraction of "
                                                   "vLLM's blocks."),
            "pool_unavailable_s": counter(name="vllm:kvstore_pool_unavailable_seconds_total", labelnames=names,
                                          documentation="Seconds the kvstore pool could not be reached."),
        }
        self._children: dict[tuple[str, int, str], Any] = {}

    def _child(self, metric: str, engine_idx: int, label: str | None = None) -> Any:
        key = (metric, engine_idx, label or "")
        child = self._children.get(key)
        if child is None:
            values = list(self.per_engine_labelvalues[engine_idx]) + ([label] if label is not None else [])
            child = self._children[key] = self._metrics[metric].labels(*values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data or {}
        for metric in ("lookups", "load_bytes", "save_bytes", "saves_dropped", "pool_unavailable_s"):
            if data.get(metric):
                self._child(metric, engine_idx).inc(data[metric])
        for metric in _BY_LABEL:
            for label, n in (data.get(metric) or {}).items():
                if n:
                    self._child(metric, engine_idx, str(label)).inc(n)
        for metric in _SERIES:
            for seconds in data.get(metric) or ():
                self._child(metric, engine_idx).observe(seconds)
