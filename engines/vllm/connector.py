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
``cache_salt``; one pool lookup per request (per tensor-parallel rank and KV-cache group)
finds the longest cached prefix, never counting the last prompt token (vLLM must compute it
for logits). The step's metadata names, per request, the blocks to load (key → vLLM block
id) and the full prompt blocks the step completes that the pool lacks (including ones vLLM
served from its own prefix cache after the pool evicted them, so the two never drift apart).
Under tensor parallelism each rank's shard has keys of its own (``PagedLayout.for_rank``) and
a prefix counts only as far as every rank holds it; a hybrid model's KV-cache groups are
stored apart, a sliding-window group loading only its window (``kv_groups``).

Worker side: loads copy each block from the pool straight into vLLM's paged KV tensors
(one copy out of the mapped DRAM slab on the store's host, no staging buffer) in
``start_load_kv``, before the forward pass (synchronous: the forward reads them). Saves copy
each completed block from the paged tensors straight into the pool after the forward pass,
whole blocks of every layer in one batched put per request (per-layer saves would cut each
block into one pool entry per layer). A ``kv_producer`` saves in ``wait_for_save`` itself,
so its blocks are in the pool when vLLM answers (the consumer's hand-off); ``kv_both``
(a cache: a save that lands late is only a later hit) saves on a background thread, off the
step's critical path. Saves never hold a request: the scheduler pins the vLLM blocks a save
job reads (a reference in vLLM's block pool) and releases them when every rank reports the
job done (``build_connector_worker_meta`` → ``update_connector_output``), so a finished or
preempted request's blocks are freed at once except the ones still being copied out, and
``request_finished`` always answers False. Pins are capped at ``kvstore.max_pinned_fraction``
of vLLM's blocks (past it a save is dropped: a later miss, never a stall). A block that
misses, fails its checksum or outlives its lease is reported through
``get_block_ids_with_load_errors`` and recomputed by vLLM (``kvstore.on_load_error``,
default ``recompute``, is set as vLLM's ``kv_load_failure_policy``): never wrong KV. A pool
that cannot be reached is a miss.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA

from engines.vllm.connector_obs import ConnectorObservability
from engines.vllm.connector_scheduler import BlockTransfer, KVStoreConnectorMetadata, SchedulerSide, _Tracked
from engines.vllm.connector_worker import WorkerSide
from engines.vllm.layout import PagedBlocks, PagedLayout, kv_groups
from engines.vllm.log_setup import log_through_vllm
from engines.vllm.pool_link import ConnectorConfig, PoolLink
from kvstore.identity import TAG_BYTES, IdentityCheck
from kvstore.index.keys import block_bytes

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
    saves_dropped: int = 0   # blocks not saved: pins would pass kvstore.max_pinned_fraction


class KVStoreConnector(ConnectorObservability, SchedulerSide, WorkerSide, KVConnectorBase_V1, SupportsHMA):
    """kvstore's KV connector for vLLM (see the module docstring). Raises InvalidArgument at
    start for bad ``kvstore.*`` settings or a layout it does not serve (pipeline parallelism,
    more tensor-parallel ranks than KV heads, latent attention, a KV-cache group other than
    full or sliding-window attention)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        log_through_vllm()
        tc = self._kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        self.paged = PagedLayout.from_vllm(vllm_config)   # rank 0's; each rank keys its own shard
        self.groups = kv_groups(self.paged, kv_cache_config)
        self.tp_size = self.paged.tp_size
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
        # the scheduler side only looks blocks up: it builds no page tables for the slab
        self.link = PoolLink(self.cfg, moves_bytes=role != KVConnectorRole.SCHEDULER)
        if role == KVConnectorRole.SCHEDULER:   # one probe per instance: a wrong token stops vLLM here
            dtype = getattr(torch, self.paged.layout.dtype, None)   # an fp8 cache dtype name: 1 byte
            itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 1
            self.link.probe(max(block_bytes(g.paged.layout, self.block_size, itemsize) for g in self.groups)
                            + TAG_BYTES)
        self.stats = ConnectorStats()
        self.identity = IdentityCheck("kvstore connector")
        self._obs_init(vllm_config, role)     # metrics and KV events (engines/vllm/connector_obs.py)
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._loads: dict[str, list[BlockTransfer]] = {}
        self._block_pool: Any = None
        self._pins: dict[int, tuple[list[int], int]] = {}
        self._pinned = 0
        self._next_job = 0
        num_blocks = getattr(kv_cache_config, "num_blocks", 0) or 0
        self.max_pinned_blocks = int(self.cfg.max_pinned_fraction * num_blocks) if num_blocks else 1 << 62
        # worker side
        self._blocks: list[PagedBlocks] = []   # per KV-cache group
        self._rank = 0
        self._load_errors: set[int] = set()
        self._saver: ThreadPoolExecutor | None = None
        self._done_jobs: list[int] = []   # save jobs finished since the last step
        self._stats_lock = threading.Lock()
        log.info("kvstore connector (%s, role %s): pool %s, model %s, layout %s", role.name.lower(),
                 tc.kv_role, self.link.target, self.paged.model_id, self.paged.layout.to_json())
        if len(self.groups) > 1 or self.tp_size > 1:
            log.info("kvstore connector: %d tensor-parallel ranks, KV-cache groups %s", self.tp_size,
                     ", ".join(f"{g.idx} {g.kind}{'' if g.window is None else f' window {g.window}'} "
                               f"({g.paged.layout.num_layers} layers)" for g in self.groups))
