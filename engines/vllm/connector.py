"""kvstore as vLLM's KV pool: a KV connector (vLLM's ``KVConnectorBase_V1``, vLLM 0.32),
loaded out of tree::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "engines.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvstore.store": "127.0.0.1:50051"}}'

Roles: ``kv_both`` (load hits, save new blocks: one prefix cache shared by many instances),
``kv_producer`` (a prefill instance: saves, and loads prefix hits too) and ``kv_consumer``
(a decode instance: loads only).

Scheduler side (vLLM's scheduler process): the prompt's block keys are kvstore's key spec
over vLLM's block-size chunks (engines/vllm/layout.py), the namespace is the request's
``cache_salt``; one pool lookup per request finds the longest cached prefix, never counting
the last prompt token (vLLM must compute it for logits). The step's metadata names, per
request, the blocks to load (key → vLLM block id) and the full prompt blocks the step
completes that the pool lacks (including ones vLLM served from its own prefix cache after
the pool evicted them, so the two never drift apart).

Worker side: loads copy each block from the pool straight into vLLM's paged KV tensors
(one copy out of the mapped DRAM slab on the store's host, no staging buffer) in
``start_load_kv``, before the forward pass (synchronous: the forward reads them). Saves copy
each completed block from the paged tensors straight into the pool after the forward pass,
whole blocks of every layer in one batched put per request (per-layer saves would cut each
block into one pool entry per layer). A ``kv_producer`` saves in ``wait_for_save`` itself,
so its blocks are in the pool when vLLM answers (the consumer's hand-off); ``kv_both``
(a cache: a save that lands late is only a later hit) saves on a background thread, off the
step's critical path — vLLM then keeps a finished request's blocks until
``get_finished`` reports its saves done, and ``handle_preemptions`` waits for a preempted
request's saves before vLLM may reuse its blocks. A block that misses, fails its checksum or outlives
its lease is reported through ``get_block_ids_with_load_errors`` and recomputed by vLLM
(``kvstore.on_load_error``, default ``recompute``, is set as vLLM's
``kv_load_failure_policy``): never wrong KV. A pool that cannot be reached is a miss.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from engines.kv import block_bytes
from engines.vllm.connector_scheduler import BlockTransfer, KVStoreConnectorMetadata, SchedulerSide, _Tracked
from engines.vllm.connector_worker import WorkerSide
from engines.vllm.layout import PagedBlocks, PagedLayout
from engines.vllm.pool_link import ConnectorConfig, PoolLink
from kvstore.identity import TAG_BYTES, IdentityCheck

__all__ = ["BlockTransfer", "ConnectorStats", "KVStoreConnector", "KVStoreConnectorMetadata"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ConnectorStats:
    """Counters of one connector (blocks and seconds since start). ``load_errors``: blocks
    vLLM was told to recompute (a miss, a failed checksum, an expired lease, a pool down, or
    ``identity_mismatches``: a block holding another token sequence's KV under a colliding key)."""

    lookups: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    load_errors: int = 0
    identity_mismatches: int = 0
    load_s: float = 0.0
    saved_blocks: int = 0
    save_s: float = 0.0


class KVStoreConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1):
    """kvstore's KV connector for vLLM (see the module docstring). Raises InvalidArgument at
    start for bad ``kvstore.*`` settings or a layout it does not serve (tensor or pipeline
    parallelism above 1)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        self.paged = PagedLayout.from_vllm(vllm_config)
        self.block_size = self.paged.block_size
        self.saves = bool(tc.is_kv_producer)
        # A kv_consumer (decode) instance looks for what its prefill just stored: a hand-off,
        # which the pool's lookup books keep apart from reuse (docs/metrics.md).
        self.lookup_purpose = "reuse" if self.saves else "handoff"
        # kv_both is a cache: its saves run beside the next steps; a producer's hand-off is
        # complete when vLLM answers.
        self.async_saves = self.saves and bool(tc.is_kv_consumer) and self.cfg.async_save
        # A failed load must be recomputed, not fail the request (vLLM's default is "fail").
        tc.kv_load_failure_policy = self.cfg.on_load_error
        self.link = PoolLink(self.cfg)
        if role == KVConnectorRole.SCHEDULER:   # one probe per instance: a wrong token stops vLLM here
            lay = self.paged.layout
            dtype = getattr(torch, lay.dtype, None)   # an fp8 cache dtype name: 1 byte
            itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 1
            self.link.probe(block_bytes(lay, lay.block_size, itemsize) + TAG_BYTES)
        self.stats = ConnectorStats()
        self.identity = IdentityCheck("kvstore connector")
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._loads: dict[str, BlockTransfer] = {}
        # worker side
        self._blocks: PagedBlocks | None = None
        self._load_errors: set[int] = set()
        self._saver: ThreadPoolExecutor | None = None
        self._pending: dict[str, list[Future]] = {}   # request -> its saves not yet reported
        self._finishing: set[str] = set()              # finished requests whose saves may run
        self._stats_lock = threading.Lock()
        log.info("kvstore connector (%s, role %s): pool %s, model %s, layout %s", role.name.lower(),
                 tc.kv_role, self.link.target, self.paged.model_id, self.paged.layout.to_json())
