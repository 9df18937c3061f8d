"""What the connector tells vLLM besides KV: its figures (engines/vllm/connector_metrics.py),
its per-source cache hits, and its KV events (engines/vllm/connector_events.py) — vLLM
0.32's ``get_kv_connector_stats``, ``build_kv_connector_stats``, ``build_prom_metrics``,
``get_external_cache_hit_sources``, ``get_kv_connector_kv_cache_events``,
``update_connector_output`` and ``take_events``, as a mixin of
:class:`engines.vllm.connector.KVStoreConnector`, fed by the ``_obs_*`` calls the
connector makes where it looks up, loads and saves.

Events are made only when vLLM publishes them (``--kv-events-config`` with
``enable_kv_cache_events``); the figures always (vLLM reads them when it logs stats: ``vllm
serve`` does by default, ``LLM()`` only with ``disable_log_stats=False``). The seconds the
pool was unavailable are the scheduler side's: its lookups ask the pool for every request.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from engines.checkpoint_identity import adapter_identity
from engines.vllm.connector_events import KVStoreKVEvents, PoolEventBook, lost, saved
from engines.vllm.connector_metrics import KVStoreConnectorStats, KVStorePromMetrics, StatsRecorder, hit_sources

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

LOSSES = ("miss", "identity_mismatch")    # load errors that mean the pool does not hold the block whole


class ConnectorObservability:
    """The mixin (module docstring). The connector sets ``link`` and ``block_size``
    before the hooks run, and calls :meth:`_obs_init` in its
    ``__init__``."""

    link: Any
    block_size: int

    def _obs_init(self, vllm_config: Any, role: KVConnectorRole) -> None:
        self.recorder = StatsRecorder()
        events = getattr(vllm_config, "kv_events_config", None)
        self.events_on = bool(events is not None and events.enable_kv_cache_events)
        self.scheduler_role = role == KVConnectorRole.SCHEDULER
        self.event_book: PoolEventBook | None = None
        if self.events_on and self.scheduler_role:
            self.event_book = PoolEventBook(self.block_size, self.link.put_tier)
        self._found_tiers: dict[str, tuple[str, ...]] = {}     # request -> tiers of its found blocks
        self._load_tiers: dict[str, tuple[str, ...]] = {}      # request -> tiers of the blocks it loads
        self._prompts: dict[str, tuple[list[int], str | None, str | None]] = {}   # request -> tokens, salt, adapter
        self._worker_events: list[KVCacheEvent] = []
        self._events_lock = threading.Lock()

    # -- called by the connector -------------------------------------------------------------
    def _obs_looked_up(self, request: Request, keys: list[bytes], tiers: tuple[str, ...]) -> None:
        """A lookup of ``request``'s block ``keys`` just ran and found ``len(tiers)`` of them,
        in those tiers."""
        self.recorder.lookup()
        self._found_tiers[request.request_id] = tiers
        if self.event_book is not None:
            adapter = adapter_identity(getattr(request, "lora_request", None))
            prompt = (request.prompt_token_ids or [], request.cache_salt, adapter)
            self._prompts[request.request_id] = prompt
            self.event_book.looked_up(keys, tiers, prompt[0], prompt[1], adapter)

    def _obs_loading(self, request_id: str, start: int, count: int) -> None:
        """vLLM chose to load blocks ``[start, start + count)`` of the request from the pool."""
        tiers = self._found_tiers.get(request_id, ())[start:start + count]
        tiers += ("",) * (count - len(tiers))
        self._load_tiers[request_id] = tiers
        self.recorder.hits([t or "unknown" for t in tiers], self.block_size)

    def _obs_saving(self, request_id: str, keys: list[bytes], first: int, parent: bytes | None) -> None:
        """Blocks ``first ..`` (``keys``) of the request are sent to the pool this step."""
        prompt = self._prompts.get(request_id)
        if self.event_book is not None and prompt is not None:
            self.event_book.saving(keys, first, prompt[0], parent, prompt[1], prompt[2])

    def _obs_finished(self, request_id: str) -> None:
        self._found_tiers.pop(request_id, None)
        self._load_tiers.pop(request_id, None)
        self._prompts.pop(request_id, None)

    def _obs_loaded(self, keys: tuple[bytes, ...], n: int, identity_failed: bool, seconds: float,
                    block_bytes: int, events: bool = True) -> None:
        """A load of ``keys`` gave ``n`` whole, verified blocks (``identity_failed``: block
        ``n`` held another sequence's KV) of ``block_bytes`` each; ``events``: this load's
        keys are the ones the events name (rank 0's, the first KV-cache group's)."""
        cause = "identity_mismatch" if identity_failed else (self.link.last_load_error or "miss")
        errors = len(keys) - n
        self.recorder.load(seconds, n, n * block_bytes, errors, cause if errors else "")
        if errors and events and self.events_on and cause in LOSSES:
            with self._events_lock:
                self._worker_events.append(lost(keys[n:n + 1]))

    def _obs_saved(self, keys: tuple[bytes, ...], n: int, seconds: float, block_bytes: int,
                   events: bool = True) -> None:
        """A save of ``keys`` left ``n`` of them in the pool (on the saving thread)."""
        self.recorder.save(seconds, n, n * block_bytes)
        if n and events and self.events_on:
            with self._events_lock:
                self._worker_events.append(saved(keys[:n], self.block_size))

    def _obs_reset(self) -> None:
        """vLLM's ``reset_cache``: the connector's own books, never the pool's blocks."""
        self._found_tiers.clear()
        self._load_tiers.clear()
        self._prompts.clear()
        if self.event_book is not None:
            self.event_book.reset()

    # -- vLLM's hooks --------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._obs_finished(request.request_id)
        return super().request_finished(request, block_ids)  # type: ignore[misc]

    def reset_cache(self) -> bool:
        self._obs_reset()
        return bool(super().reset_cache())  # type: ignore[misc]

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The pool's hit split by tier (connector_metrics.py ``hit_sources``)."""
        if num_external_tokens <= 0:
            return {}
        tiers = self._load_tiers.get(request.request_id, ())
        return hit_sources(tiers, self.block_size, num_external_tokens)

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        if self.scheduler_role:
            self.recorder.unavailable(self.link.take_unavailable_s())
        return self.recorder.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreConnectorStats:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVStorePromMetrics:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_kv_cache_events(self) -> KVStoreKVEvents | None:
        """This step's reports of this rank (one object every step, even empty: vLLM counts
        the ranks that reported)."""
        if not self.events_on:
            return None
        with self._events_lock:
            events, self._worker_events = self._worker_events, []
        out = KVStoreKVEvents()
        out.add_events(events)
        return out

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)  # type: ignore[misc]
        if self.event_book is not None:
            self.event_book.reported(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self.event_book is not None:
            yield from self.event_book.take()
