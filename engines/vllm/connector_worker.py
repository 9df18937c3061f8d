"""The worker side of kvstore's vLLM connector (engines/vllm/connector.py): loads into and
saves out of vLLM's paged KV tensors, one per tensor-parallel rank."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from engines.vllm.connector_scheduler import BlockTransfer, KVStoreConnectorMetadata
from engines.vllm.layout import PagedBlocks
from kvstore.errors import InvalidArgument
from kvstore.identity import IdentityCheck, seal, tag_buffer
from kvstore.tiers.buffers import Segments

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import ForwardContext

    from engines.vllm.connector import ConnectorStats
    from engines.vllm.layout import PagedLayout
    from engines.vllm.pool_link import PoolLink

log = logging.getLogger(__name__)


class WorkerSide:
    """The worker-role methods of :class:`~engines.vllm.connector.KVStoreConnector`."""

    paged: PagedLayout
    link: PoolLink
    stats: ConnectorStats
    identity: IdentityCheck
    async_saves: bool
    _kv_cache_config: Any
    _blocks: PagedBlocks | None
    _load_errors: set[int]
    _saver: ThreadPoolExecutor | None
    _pending: dict[str, list[Future]]
    _finishing: set[str]
    _stats_lock: threading.Lock

    _get_connector_metadata: Callable[[], KVConnectorMetadata]   # KVConnectorBase_V1's

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
            for i in range(n):  # a block of other tokens under a colliding key is a load error
                if not self.identity.verify(load.keys[i], read_tags[i], load.tags[i]):
                    n = i
                    break
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
