"""The same stopwatch around any vLLM KV connector, for benchmarks/bench_vllm.py.

``TimedConnector`` is a subclass, made at import time, of the connector class named by the
environment variable ``BENCH_VLLM_BASE_CONNECTOR`` (``"module:Class"``); vLLM builds it from
``kv_transfer_config = {"kv_connector": "TimedConnector", "kv_connector_module_path":
"benchmarks.vllm_timing", ...}`` and the base class never knows. It changes no behaviour; it
adds up, in the module-level :data:`STATS` (one process: the benchmark runs vLLM with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so scheduler, worker and caller share it):

* ``load_blocking_s``: wall time inside the worker-side ``start_load_kv`` and
  ``wait_for_layer_load`` calls, i.e. what the forward pass waits for. Calls made while an
  asynchronous load is in flight go to ``load_blocking_in_flight_s`` instead (they are
  already inside the in-flight time below, and are not counted twice);
* ``load_in_flight_s``: for loads the connector declared asynchronous
  (``get_num_new_matched_tokens`` → ``(n, True)``), the time from the scheduler's
  ``update_state_after_alloc`` (blocks allocated, load scheduled) to the step whose
  ``get_transfer_results`` reports the request in ``finished_recving``;
* ``load_blocks``: ``num_external_tokens / block_size`` of every request's first
  ``update_state_after_alloc`` with external tokens;
* ``store_blocking_s``: wall time inside ``save_kv_layer`` and ``wait_for_save``;
* ``store_tail_s`` / ``store_tail_requests``: for connectors that keep a finished request's
  blocks while they save them (``request_finished`` → ``(True, ...)``), the time from that call
  to the request's ``finished_sending``; other connectors' background saves are not visible
  through the connector API and are not in any figure;
* ``holds_s``: per finished request, the time from ``request_finished`` (or
  ``request_finished_all_groups``) until every vLLM block it held is free again (reference
  count 0 in vLLM's block pool), checked at each scheduler step: what a save that holds a
  request's blocks (or pins them) keeps from other requests. Needs the engine to keep
  stepping after a request ends, as a server's engine loop does (benchmarks/vllm_worker.py
  steps it until the scheduler has nothing left);
* ``lookup_s`` / ``lookups``: wall time inside the scheduler-side
  ``get_num_new_matched_tokens`` calls;
* ``load_error_blocks``: blocks reported by ``get_block_ids_with_load_errors``.

Nothing here imports kvstore: it also runs in the LMCache venv.
"""
from __future__ import annotations

import importlib
import os
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

BASE_ENV = "BENCH_VLLM_BASE_CONNECTOR"


@dataclass
class ConnectorStats:
    """Running totals (see the module docstring); :meth:`snapshot` is a plain dict."""

    load_blocking_s: float = 0.0
    load_blocking_in_flight_s: float = 0.0
    load_in_flight_s: float = 0.0
    async_loads: int = 0
    load_blocks: float = 0.0
    load_requests: int = 0
    store_blocking_s: float = 0.0
    store_tail_s: float = 0.0
    store_tail_requests: int = 0
    lookup_s: float = 0.0
    lookups: int = 0
    load_error_blocks: int = 0
    block_size: int = 0
    base: str = ""
    holds_s: list[float] = field(default_factory=list)
    _finished: dict[str, tuple[float, list[int]]] = field(default_factory=dict, repr=False)
    _block_pool: Any = field(default=None, repr=False)
    _async_pending: dict[str, float] = field(default_factory=dict, repr=False)
    _async_declared: set[str] = field(default_factory=set, repr=False)
    _alloc_seen: set[str] = field(default_factory=set, repr=False)
    _store_pending: dict[str, float] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {f.name: list(v) if isinstance(v := getattr(self, f.name), list) else v
                    for f in fields(self) if not f.name.startswith("_")}

    def reset(self) -> None:
        """Zero the totals (after the warm-up); ``block_size`` and ``base`` stay."""
        with self._lock:
            for f in fields(self):
                if not f.name.startswith("_") and f.name not in ("block_size", "base"):
                    setattr(self, f.name, [] if f.name == "holds_s" else f.default)
            self._async_pending.clear()
            self._async_declared.clear()
            self._alloc_seen.clear()
            self._store_pending.clear()
            self._finished.clear()

    def finished(self, req_id: str, block_ids: Any) -> None:
        """A request ended holding ``block_ids`` (a list, or one list per KV-cache group)."""
        flat = [b for ids in block_ids for b in ids] if block_ids and isinstance(block_ids[0], list) else block_ids
        with self._lock:
            self._finished[req_id] = (time.perf_counter(), [b for b in flat if b])   # 0: vLLM's null block

    def check_holds(self) -> None:
        """Close the holds of the finished requests whose blocks are all free now."""
        pool = self._block_pool
        if pool is None or not self._finished:
            return
        now = time.perf_counter()
        with self._lock:
            for req_id, (t0, ids) in list(self._finished.items()):
                if all(pool.blocks[b].ref_cnt == 0 for b in ids):
                    del self._finished[req_id]
                    self.holds_s.append(now - t0)


STATS = ConnectorStats()


def _timed(total: str):
    """A method wrapper adding its wall time to ``STATS.<total>``; load calls made while an
    asynchronous load is in flight go to ``load_blocking_in_flight_s``."""
    def wrap(method):
        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with STATS._lock:
                    name = total
                    if total == "load_blocking_s" and STATS._async_pending:
                        name = "load_blocking_in_flight_s"
                    setattr(STATS, name, getattr(STATS, name) + dt)
        timed.__name__ = method.__name__
        return timed
    return wrap


class HoldWatch:
    """Scheduler-side hooks of :class:`TimedConnector` that close the holds of finished
    requests (``STATS.holds_s``) at every step; mixed in before the connector class."""

    def bind_gpu_block_pool(self, gpu_block_pool):
        STATS._block_pool = gpu_block_pool
        return super().bind_gpu_block_pool(gpu_block_pool)  # type: ignore[misc]

    def build_connector_meta(self, scheduler_output):
        STATS.check_holds()
        return super().build_connector_meta(scheduler_output)  # type: ignore[misc]

    def update_connector_output(self, connector_output):
        result = super().update_connector_output(connector_output)  # type: ignore[misc]
        STATS.check_holds()
        return result


def make_timed(base: type) -> type:
    """The timing subclass of connector class ``base``."""

    class TimedConnector(HoldWatch, base):  # type: ignore[misc, valid-type]
        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            STATS.block_size = vllm_config.cache_config.block_size
            STATS.base = f"{base.__module__}.{base.__qualname__}"

        # worker side
        start_load_kv = _timed("load_blocking_s")(base.start_load_kv)
        wait_for_layer_load = _timed("load_blocking_s")(base.wait_for_layer_load)
        save_kv_layer = _timed("store_blocking_s")(base.save_kv_layer)
        wait_for_save = _timed("store_blocking_s")(base.wait_for_save)

        def get_transfer_results(self, finished_req_ids):
            results = super().get_transfer_results(finished_req_ids)
            now = time.perf_counter()
            with STATS._lock:
                for req_id in results.finished_recving or ():
                    t0 = STATS._async_pending.pop(req_id, None)
                    if t0 is not None:
                        STATS.load_in_flight_s += now - t0
                for req_id in results.finished_sending or ():
                    t0 = STATS._store_pending.pop(req_id, None)
                    if t0 is not None:
                        STATS.store_tail_s += now - t0
                        STATS.store_tail_requests += 1
            return results

        def get_block_ids_with_load_errors(self):
            bad = super().get_block_ids_with_load_errors()
            STATS.load_error_blocks += len(bad)
            return bad

        # scheduler side
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            t0 = time.perf_counter()
            n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
            with STATS._lock:
                STATS.lookup_s += time.perf_counter() - t0
                STATS.lookups += 1
                if n and is_async:
                    STATS._async_declared.add(request.request_id)
            return n, is_async

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            req_id = request.request_id
            with STATS._lock:
                if num_external_tokens > 0 and req_id not in STATS._alloc_seen:
                    STATS._alloc_seen.add(req_id)
                    STATS.load_requests += 1
                    STATS.load_blocks += num_external_tokens / max(1, STATS.block_size)
                    if req_id in STATS._async_declared:
                        STATS.async_loads += 1
                        STATS._async_pending[req_id] = time.perf_counter()
            return super().update_state_after_alloc(request, blocks, num_external_tokens)

        def request_finished(self, request, block_ids):
            delay, params = super().request_finished(request, block_ids)
            STATS.finished(request.request_id, block_ids)
            if delay:
                with STATS._lock:
                    STATS._store_pending.setdefault(request.request_id, time.perf_counter())
            return delay, params

    if hasattr(base, "request_finished_all_groups"):
        def request_finished_all_groups(self, request, block_ids):
            delay, params = base.request_finished_all_groups(self, request, block_ids)
            STATS.finished(request.request_id, block_ids)
            if delay:
                with STATS._lock:
                    STATS._store_pending.setdefault(request.request_id, time.perf_counter())
            return delay, params
        TimedConnector.request_finished_all_groups = request_finished_all_groups

    TimedConnector.__qualname__ = TimedConnector.__name__ = "TimedConnector"
    return TimedConnector


def _base_class() -> type:
    module, _, name = os.environ[BASE_ENV].partition(":")
    return getattr(importlib.import_module(module), name)


if os.environ.get(BASE_ENV):
    TimedConnector = make_timed(_base_class())
