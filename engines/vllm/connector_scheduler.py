"""The scheduler side of kvstore's vLLM connector (engines/vllm/connector.py): the prompt's
block keys, one pool lookup per request, and each step's metadata (the blocks to load and to
save) for the workers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from engines.checkpoint_identity import adapter_identity
from kvstore.index.keys import usable_prefix_tokens

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from engines.vllm.connector import ConnectorStats
    from engines.vllm.layout import PagedLayout
    from engines.vllm.pool_link import PoolLink


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


class SchedulerSide:
    """The scheduler-role methods of :class:`~engines.vllm.connector.KVStoreConnector`."""

    paged: PagedLayout
    link: PoolLink
    stats: ConnectorStats
    block_size: int
    saves: bool
    async_saves: bool
    lookup_purpose: str
    _tracked: dict[str, _Tracked]
    _loads: dict[str, BlockTransfer]

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
            meta.saves.append(BlockTransfer(req_id, tuple(tr.keys[a:done]), tuple(tr.block_ids[a:done]),
                                            tr.keys[a - 1] if a else None, tuple(tr.tags[a:done]), tr.namespace))
            tr.saved = done
            tr.sent_saves = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. True (vLLM keeps its blocks until ``get_finished`` names it)
        when saves of it may still be running on the worker's background thread."""
        tr = self._tracked.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return bool(self.async_saves and tr is not None and tr.sent_saves), None

