"""The worker side of kvstore's vLLM connector (engines/vllm/connector.py): loads into and
saves out of vLLM's paged KV tensors, one per tensor-parallel rank."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

from engines.vllm.connector_scheduler import BlockTransfer, KVStoreConnectorMetadata, KVStoreWorkerMeta
from engines.vllm.layout import PagedBlocks
from kvstore.errors import InvalidArgument
from kvstore.identity import IdentityCheck, seal, tag_buffer
from kvstore.tiers.buffers import Segments

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import ForwardContext

    from engines.vllm.connector import ConnectorStats
    from engines.vllm.layout import KVGroup, PagedLayout
    from engines.vllm.pool_link import ConnectorConfig, PoolLink

log = logging.getLogger(__name__)


class WorkerSide:
    """The worker-role methods of :class:`~engines.vllm.connector.KVStoreConnector`."""

    paged: PagedLayout
    cfg: ConnectorConfig
    link: PoolLink
    stats: ConnectorStats
    identity: IdentityCheck
    async_saves: bool
    _kv_cache_config: Any
    groups: list[KVGroup]
    _blocks: list[PagedBlocks]   # per KV-cache group
    _rank: int
    _load_errors: set[int]
    _saver: ThreadPoolExecutor | None
    _done_jobs: list[int]
    _stats_lock: threading.Lock

    _get_connector_metadata: Callable[[], KVConnectorMetadata]   # KVConnectorBase_V1's

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Map vLLM's paged KV tensors as pool blocks, one view per KV-cache group over its
        layers (engines/vllm/layout.py), for this worker's tensor-parallel rank. Raises
        InvalidArgument when the tensors do not match the layout the keys name."""
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            self._rank = get_tensor_model_parallel_rank()
        except (AssertionError, AttributeError):   # no model-parallel group: one rank
            self._rank = 0
        num_blocks = self._kv_cache_config.num_blocks
        itemsize = next(iter(kv_caches.values())).element_size()
        self._blocks = []
        for g in self.groups:
            names = g.layer_names
            blocks = PagedBlocks({n: t for n, t in kv_caches.items() if names is None or n in names}, num_blocks)
            lay = g.paged.layout
            want = lay.num_layers * 2 * lay.num_kv_heads * lay.block_size * lay.head_dim * itemsize
            if blocks.block_bytes != want:
                raise InvalidArgument(f"vLLM's KV blocks of group {g.idx} hold {blocks.block_bytes} bytes, the "
                                      f"layout {lay.to_json()} makes {want}")
            self._blocks.append(blocks)
        log.info("kvstore connector: rank %d of %d, %d KV blocks of %s bytes on %s (layer slice %s)", self._rank,
                 self.paged.tp_size, num_blocks, "+".join(str(b.block_bytes) for b in self._blocks),
                 self._blocks[0].device, self._blocks[0].layer_shape)
        self.link.attach()   # the slab's page tables before the first request, not on it

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's blocks (this rank's shard) into the paged tensors before the
        forward pass; a block not loaded whole and verified is reported as a load error: vLLM
        recomputes it and the rest of its request's prefix, on every rank (it joins the
        ranks' errors), so no block ever mixes shards of two computations."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata) and self._blocks
        for load in meta.loads:
            t0 = time.perf_counter()
            keys, tags, paged = load.keys[self._rank], load.tags[self._rank], self._blocks[load.group]
            read_tags = [tag_buffer() for _ in load.block_ids]
            outs = [Segments([*paged.segments(b).parts, t]) for b, t in zip(load.block_ids, read_tags)]
            n = self.link.load(keys, outs)
            mismatch = False
            for i in range(n):  # a block of other tokens under a colliding key is a load error
                if not self.identity.verify(keys[i], read_tags[i], tags[i]):
                    n, mismatch = i, True
                    break
            self._obs_loaded(load.keys[0], n, mismatch, time.perf_counter() - t0,   # type: ignore[attr-defined]
                             paged.block_bytes, events=load.group == 0)
            self.stats.identity_mismatches = self.identity.mismatches
            self.stats.load_s += time.perf_counter() - t0
            self.stats.loaded_blocks += n
            if n < len(keys):
                self.stats.load_errors += len(keys) - n
                self._load_errors.update(load.block_ids[n:])
                log.info("kvstore connector: %s: %d of %d blocks not loaded; vLLM recomputes them",
                         load.request_id, len(keys) - n, len(keys))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are saved whole, all layers at once, in wait_for_save

    def wait_for_save(self) -> None:
        """Put the blocks this step completed, straight from the paged tensors: here (a
        producer: its decode instance needs them when vLLM answers), or on the background
        thread (``kv_both``: the blocks stay pinned by the scheduler until it is done), which
        the step waits for up to ``kvstore.save_wait_s``."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata) and self._blocks
        running = []
        for save in meta.saves:
            if not self.async_saves:
                self._save(save)
                continue
            if self._saver is None:
                self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-save")
            running.append(self._saver.submit(self._save, save))
        if running and self.cfg.save_wait_s > 0:   # a bounded wait: the saves get the CPU now
            wait(running, timeout=self.cfg.save_wait_s)

    def _save(self, save: BlockTransfer) -> None:
        """One save job; reported done whatever happens to it, so that its pins are released."""
        t0 = time.perf_counter()
        saved = 0
        try:
            r, paged = self._rank, self._blocks[save.group]
            blocks = [(k, seal(paged.segments(b), t)) for k, b, t in zip(save.keys[r], save.block_ids, save.tags[r])]
            saved = self.link.save(blocks, save.parents[r], save.namespace)
            self._obs_saved(save.keys[0], saved, time.perf_counter() - t0,   # type: ignore[attr-defined]
                            paged.block_bytes, events=save.group == 0)
        except Exception:   # a bug here must not leave vLLM's blocks pinned for ever
            log.exception("kvstore connector: a save of %d blocks of %s failed", len(save.block_ids),
                          save.request_id)
        finally:
            with self._stats_lock:
                self.stats.saved_blocks += saved
                self.stats.save_s += time.perf_counter() - t0
                self._done_jobs.append(save.job)

    def build_connector_worker_meta(self) -> KVStoreWorkerMeta | None:
        """The save jobs this rank finished since the last step (the scheduler unpins their
        blocks once every rank has)."""
        with self._stats_lock:
            done, self._done_jobs = self._done_jobs, []
        return KVStoreWorkerMeta({job: 1 for job in done}) if done else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.shutdown(wait=True)
        self.link.close()
