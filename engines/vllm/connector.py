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
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from engines.checkpoint_identity import adapter_identity
from engines.kv import block_bytes
from engines.vllm.connector_obs import ConnectorObservability
from engines.vllm.layout import PagedBlocks, PagedLayout
from engines.vllm.pool_link import ConnectorConfig, PoolLink
from kvstore.errors import InvalidArgument
from kvstore.identity import TAG_BYTES, IdentityCheck, seal, tag_buffer
from kvstore.index.keys import usable_prefix_tokens
from kvstore.tiers.buffers import Segments

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks of one request to load or save: ``keys[i]`` ↔ vLLM block ``block_ids[i]``,
    whose stored bytes end with the identity tag ``tags[i]`` (kvstore/identity.py);
    ``parent``: the key the first block extends (None for a prompt's head); ``namespace``:
    the tenant a save names to the pool (the request's ``cache_salt``, PagedLayout.namespace)."""

    request_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    parent: bytes | None = None
    tags: tuple[bytes, ...] = ()
    namespace: str | None = None


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker: blocks to load before the forward pass, blocks to
    save after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    preempted: frozenset[str] = frozenset()


@dataclass(slots=True)
class _Tracked:
    """The scheduler's book on one request: its prompt's block keys, the vLLM block ids it
    holds (in order), the blocks ``[0, saved)`` that are in the pool or already sent there,
    and the block-aligned tokens vLLM had computed locally at the last lookup."""

    keys: list[bytes]
    tags: list[bytes]
    prompt_len: int
    namespace: str | None = None
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    local_tokens: int = 0
    sent_saves: bool = False


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


class KVStoreConnector(ConnectorObservability, KVConnectorBase_V1):
    """kvstore's KV connector for vLLM (see the module docstring; its metrics and KV events:
    engines/vllm/connector_obs.py). Raises InvalidArgument at
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
        self._obs_init(vllm_config, role)
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

    # -- scheduler side -------------------------------------------------------------------
    def _track(self, request: Request) -> _Tracked | None:
        tr = self._tracked.get(request.request_id)
        if tr is None:
            prompt = request.prompt_token_ids
            if not prompt or getattr(request, "mm_features", None):
                return None  # prompt embeddings, or images whose placeholder tokens are alike: not keyed
            adapter = adapter_identity(getattr(request, "lora_request", None))   # a LoRA's KV is its own
            tr = _Tracked(list(self.paged.keys(prompt, request.cache_salt, adapter=adapter)),
                          self.paged.tags(prompt, request.cache_salt, adapter), len(prompt),
                          self.paged.namespace(request.cache_salt))
            self._tracked[request.request_id] = tr
        return tr

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` (vLLM's own block-aligned hit) whose
        KV the pool holds: whole blocks of the longest cached prefix, never the last prompt
        token. One lookup; 0 when the pool cannot be reached. Loads are synchronous."""
        tr = self._track(request)
        if tr is None:
            return 0, False
        found = self.link.lookup(tr.keys, self.lookup_purpose, tr.namespace)
        self.stats.lookups += 1
        self._obs_looked_up(request, tr.keys)
        tr.saved = min(found, len(tr.keys))
        tr.local_tokens = num_computed_tokens
        usable = usable_prefix_tokens(found, self.block_size, tr.prompt_len) // self.block_size
        extra = usable * self.block_size - num_computed_tokens
        return (extra, False) if extra > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Record the load of the ``num_external_tokens`` tokens after vLLM's local hit
        into the blocks vLLM just allocated for them."""
        if num_external_tokens <= 0:
            self._loads.pop(request.request_id, None)
            return
        tr = self._tracked[request.request_id]
        start = tr.local_tokens // self.block_size
        count = num_external_tokens // self.block_size
        ids = blocks.get_block_ids()[0]
        self._loads[request.request_id] = BlockTransfer(request.request_id, tuple(tr.keys[start:start + count]),
                                                        tuple(ids[start:start + count]),
                                                        tags=tuple(tr.tags[start:start + count]))
        self.stats.hit_blocks += count
        self._obs_loading(request.request_id, start, count)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        """This step's loads (every load recorded since the last step) and saves (the full
        prompt blocks this step completes that the pool lacks)."""
        meta = KVStoreConnectorMetadata(loads=list(self._loads.values()),
                                        preempted=frozenset(scheduler_output.preempted_req_ids or ()))
        self._loads.clear()
        if not self.saves:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for req in scheduler_output.scheduled_new_reqs:
            tr = self._tracked.get(req.req_id)
            if tr is not None:
                tr.block_ids = list(req.block_ids[0])
                self._save_done(req.req_id, tr, req.num_computed_tokens + scheduled.get(req.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tr = self._tracked.get(req_id)
            if tr is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tr.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tr.block_ids.extend(new_ids[0])
            self._save_done(req_id, tr, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
        return meta

    def _save_done(self, req_id: str, tr: _Tracked, computed: int, meta: KVStoreConnectorMetadata) -> None:
        done = min(min(computed, tr.prompt_len) // self.block_size, len(tr.keys), len(tr.block_ids))
        if done > tr.saved:
            a = tr.saved
            self._obs_saving(req_id, tr.keys[a:done], a, tr.keys[a - 1] if a else None)
            meta.saves.append(BlockTransfer(req_id, tuple(tr.keys[a:done]), tuple(tr.block_ids[a:done]),
                                            tr.keys[a - 1] if a else None, tuple(tr.tags[a:done]), tr.namespace))
            tr.saved = done
            tr.sent_saves = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. True (vLLM keeps its blocks until ``get_finished`` names it)
        when saves of it may still be running on the worker's background thread."""
        tr = self._tracked.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._obs_finished(request.request_id)
        return bool(self.async_saves and tr is not None and tr.sent_saves), None

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Map vLLM's paged KV tensors as pool blocks (engines/vllm/layout.py). Raises
        InvalidArgument when the tensors do not match the layout the keys name."""
        num_blocks = self._kv_cache_config.num_blocks
        self._blocks = PagedBlocks(kv_caches, num_blocks)
        lay = self.paged.layout
        itemsize = next(iter(kv_caches.values())).element_size()
        want = lay.num_layers * 2 * lay.num_kv_heads * lay.block_size * lay.head_dim * itemsize
        if self._blocks.block_bytes != want:
            raise InvalidArgument(f"vLLM's KV blocks hold {self._blocks.block_bytes} bytes, the layout "
                                  f"{lay.to_json()} makes {want}")
        log.info("kvstore connector: %d KV blocks of %d bytes on %s (layer slice %s)", num_blocks,
                 self._blocks.block_bytes, self._blocks.device, self._blocks.layer_shape)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's blocks into the paged tensors before the forward pass; a block
        not loaded whole and verified is reported as a load error (vLLM recomputes it and
        the rest of its request's prefix)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata) and self._blocks is not None
        for load in meta.loads:
            t0 = time.perf_counter()
            read_tags = [tag_buffer() for _ in load.block_ids]
            outs = [Segments([*self._blocks.segments(b).parts, t]) for b, t in zip(load.block_ids, read_tags)]
            n = self.link.load(load.keys, outs)
            mismatch = False
            for i in range(n):  # a block of other tokens under a colliding key is a load error
                if not self.identity.verify(load.keys[i], read_tags[i], load.tags[i]):
                    n, mismatch = i, True
                    break
            self._obs_loaded(load.keys, n, mismatch, time.perf_counter() - t0)
            self.stats.identity_mismatches = self.identity.mismatches
            self.stats.load_s += time.perf_counter() - t0
            self.stats.loaded_blocks += n
            if n < len(load.keys):
                self.stats.load_errors += len(load.keys) - n
                self._load_errors.update(load.block_ids[n:])
                log.info("kvstore connector: %s: %d of %d blocks not loaded; vLLM recomputes them",
                         load.request_id, len(load.keys) - n, len(load.keys))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are saved whole, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        """Put the blocks this step completed, straight from the paged tensors: here (a
        producer), or on the background thread (``kv_both``)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata) and self._blocks is not None
        for save in meta.saves:
            if not self.async_saves:
                self._save(save)
                continue
            if self._saver is None:
                self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
            self._pending.setdefault(save.request_id, []).append(self._saver.submit(self._save, save))

    def _save(self, save: BlockTransfer) -> None:
        assert self._blocks is not None
        t0 = time.perf_counter()
        blocks = [(k, seal(self._blocks.segments(b), t)) for k, b, t in zip(save.keys, save.block_ids, save.tags)]
        saved = self.link.save(blocks, save.parent, save.namespace)
        self._obs_saved(save.keys, saved, time.perf_counter() - t0)
        with self._stats_lock:
            self.stats.saved_blocks += saved
            self.stats.save_s += time.perf_counter() - t0

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before vLLM reuses a preempted request's blocks: wait for its saves."""
        assert isinstance(kv_connector_metadata, KVStoreConnectorMetadata)
        for req_id in kv_connector_metadata.preempted:
            for fut in self._pending.get(req_id, ()):
                fut.result()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose background saves are all done (vLLM may free their
        blocks now); loads are synchronous, so none are reported."""
        self._finishing.update(r for r in finished_req_ids if r in self._pending)
        done = {r for r in self._finishing if all(f.done() for f in self._pending[r])}
        for r in done:
            self._finishing.discard(r)
            del self._pending[r]
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        self.link.close()
