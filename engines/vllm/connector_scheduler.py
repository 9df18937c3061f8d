"""The scheduler side of kvstore's vLLM connector (engines/vllm/connector.py): the prompt's
block keys, one pool lookup per request, and each step's metadata (the blocks to load and to
save) for the workers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from engines.checkpoint_identity import adapter_identity
from kvstore.index.keys import usable_prefix_tokens

NULL_BLOCK_ID = 0   # vLLM's null block (vllm/v1/attention/backends/utils.py): never loaded, saved or pinned

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from engines.vllm.connector import ConnectorStats
    from engines.vllm.layout import KVGroup, PagedLayout
    from engines.vllm.pool_link import PoolLink


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Blocks of one request and one KV-cache group to load or save: ``keys[r][i]`` is rank
    ``r``'s key of vLLM block ``block_ids[i]`` (each tensor-parallel rank holds its own
    shard), whose stored bytes end with the identity tag ``tags[r][i]`` (kvstore/identity.py);
    ``parents[r]``: rank ``r``'s key the first block extends (None for a prompt's head);
    ``namespace``: the tenant a save names to the pool (the request's ``cache_salt``,
    PagedLayout.namespace); ``group``: the KV-cache group's index."""

    request_id: str
    keys: tuple[tuple[bytes, ...], ...]
    block_ids: tuple[int, ...]
    parents: tuple[bytes | None, ...] = ()
    tags: tuple[tuple[bytes, ...], ...] = ()
    namespace: str | None = None
    job: int = -1   # a save's job id: its blocks stay pinned until every rank reports it done
    group: int = 0


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker: blocks to load before the forward pass, blocks to
    save after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class KVStoreWorkerMeta(KVConnectorWorkerMetadata):
    """A worker's answer to the scheduler, each step: ``done`` maps a save job to the number
    of ranks that finished it (put, failed or skipped: a job is always reported, so its pins
    are always released); vLLM adds the ranks' answers up with :meth:`aggregate`."""

    done: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVStoreWorkerMeta:
        assert isinstance(other, KVStoreWorkerMeta)
        for job, count in other.done.items():
            self.done[job] = self.done.get(job, 0) + count
        return self


@dataclass(slots=True)
class _Tracked:
    """The scheduler's book on one request: its prompt's block keys and tags per KV-cache
    group and rank (``keys[g][r][i]``), the vLLM block ids it holds per group (in order), the
    blocks ``[0, saved)`` that are in the pool or already sent there, and the block-aligned
    tokens vLLM had computed locally at the last lookup."""

    keys: list[list[list[bytes]]]
    tags: list[list[list[bytes]]]
    prompt_len: int
    namespace: str | None = None
    block_ids: list[list[int]] = field(default_factory=list)
    saved: int = 0
    local_tokens: int = 0
    found_tiers: tuple[str, ...] = ()   # the tiers of the blocks the last lookup found

    @property
    def num_blocks(self) -> int:
        return len(self.keys[0][0])

    def transfer(self, req_id: str, g: int, a: int, b: int, ids: list[int], **kw: Any) -> BlockTransfer:
        """Blocks ``[a, b)`` of group ``g`` (vLLM ids ``ids``) for every rank."""
        keys, tags = self.keys[g], self.tags[g]
        return BlockTransfer(req_id, tuple(tuple(k[a:b]) for k in keys), tuple(ids),
                             tuple(k[a - 1] if a else None for k in keys), tuple(tuple(t[a:b]) for t in tags),
                             self.namespace, group=g, **kw)


class SchedulerSide:
    """The scheduler-role methods of :class:`~engines.vllm.connector.KVStoreConnector`."""

    paged: PagedLayout
    groups: list[KVGroup]
    link: PoolLink
    stats: ConnectorStats
    block_size: int
    saves: bool
    async_saves: bool
    lookup_purpose: str
    tp_size: int
    max_pinned_blocks: int
    _tracked: dict[str, _Tracked]
    _loads: dict[str, list[BlockTransfer]]
    _block_pool: Any
    _kv_transfer_config: Any
    _pins: dict[int, tuple[list[int], int]]   # save job -> (pinned vLLM block ids, ranks yet to report)
    _pinned: int
    _next_job: int

    # -- scheduler side -------------------------------------------------------------------
    def _track(self, request: Request) -> _Tracked | None:
        tr = self._tracked.get(request.request_id)
        if tr is None:
            prompt = request.prompt_token_ids
            if not prompt or getattr(request, "mm_features", None):
                return None  # prompt embeddings, or images whose placeholder tokens are alike: not keyed
            adapter = adapter_identity(getattr(request, "lora_request", None))   # a LoRA's KV is its own
            salt = request.cache_salt
            ranks = [[g.paged.for_rank(r) for r in range(self.tp_size)] for g in self.groups]
            tr = _Tracked([[p.keys(prompt, salt, adapter=adapter) for p in g] for g in ranks],
                          [[p.tags(prompt, salt, adapter) for p in g] for g in ranks], len(prompt),
                          self.paged.namespace(salt))
            self._tracked[request.request_id] = tr
        return tr

    def _lookup(self, keys: list[list[bytes]], tr: _Tracked) -> int:
        """Blocks of the longest prefix every rank's chain has in the pool."""
        return min(self.link.lookup(k, self.lookup_purpose, tr.namespace).blocks for k in keys)

    def _hit_blocks(self, tr: _Tracked) -> tuple[int, int]:
        """Blocks of the prompt's head the pool holds for every group and rank: the longest
        prefix of each full-attention group's chains; a sliding-window group needs only the
        blocks of its window before the hit's end (vLLM recomputes none before them), else
        the hit shrinks to its own chains' prefix. Never the last prompt token's block. Also
        the blocks known to be held in every group (not to be saved again)."""
        full = [g for g in self.groups if g.kind == "full"]
        found = min((self._lookup(tr.keys[i], tr) for i, g in enumerate(self.groups) if g in full),
                    default=tr.num_blocks)
        tr.found_tiers = self.link.last_tiers[:found] if full else ()   # before a window's lookups below
        hit = usable_prefix_tokens(found, self.block_size, tr.prompt_len) // self.block_size
        for i, g in enumerate(self.groups):
            need = g.window_blocks()
            if need is None or hit == 0:
                continue
            lo = max(0, hit - need)
            if self._lookup([k[lo:hit] for k in tr.keys[i]], tr) < hit - lo:
                hit = min(hit, self._lookup([k[:hit] for k in tr.keys[i]], tr))
        return hit, (found if len(full) == len(self.groups) else hit)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` (vLLM's own block-aligned hit) whose
        KV the pool holds for every KV-cache group and tensor-parallel rank: whole blocks,
        never the last prompt token. 0 when the pool cannot be reached. Loads are synchronous."""
        tr = self._track(request)
        if tr is None:
            return 0, False
        hit, tr.saved = self._hit_blocks(tr)
        self.stats.lookups += 1
        self._obs_looked_up(request, tr.keys[0][0], tr.found_tiers)   # type: ignore[attr-defined]
        tr.local_tokens = num_computed_tokens
        extra = hit * self.block_size - num_computed_tokens
        return (extra, False) if extra > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Record the load of the ``num_external_tokens`` tokens after vLLM's local hit
        into the blocks vLLM just allocated for them, in every group (a sliding-window
        group's blocks before its window are vLLM's null block: not loaded)."""
        if num_external_tokens <= 0:
            self._loads.pop(request.request_id, None)
            return
        tr = self._tracked[request.request_id]
        start = tr.local_tokens // self.block_size
        count = num_external_tokens // self.block_size
        all_ids = blocks.get_block_ids()
        loads = []
        for i, g in enumerate(self.groups):
            ids = all_ids[g.idx][start:start + count]
            first = next((j for j, b in enumerate(ids) if b != NULL_BLOCK_ID), len(ids))
            if first < len(ids):
                loads.append(tr.transfer(request.request_id, i, start + first, start + count, ids[first:]))
        self._loads[request.request_id] = loads
        self.stats.hit_blocks += count
        self._obs_loading(request.request_id, start, count)   # type: ignore[attr-defined]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        """This step's loads (every load recorded since the last step) and saves (the full
        prompt blocks this step completes that the pool lacks, in every group)."""
        meta = KVStoreConnectorMetadata(loads=[t for loads in self._loads.values() for t in loads])
        self._loads.clear()
        if not self.saves:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for req in scheduler_output.scheduled_new_reqs:
            tr = self._tracked.get(req.req_id)
            if tr is not None:
                tr.block_ids = [list(req.block_ids[g.idx]) for g in self.groups]
                self._save_done(req.req_id, tr, req.num_computed_tokens + scheduled.get(req.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tr = self._tracked.get(req_id)
            if tr is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tr.block_ids = [list(new_ids[g.idx]) if new_ids else [] for g in self.groups]
            elif new_ids:
                for mine, g in zip(tr.block_ids, self.groups):
                    mine.extend(new_ids[g.idx])
            self._save_done(req_id, tr, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
        return meta

    def _save_done(self, req_id: str, tr: _Tracked, computed: int, meta: KVStoreConnectorMetadata) -> None:
        done = min(min(computed, tr.prompt_len) // self.block_size, tr.num_blocks,
                   min(len(ids) for ids in tr.block_ids))
        if done <= tr.saved:
            return
        a, tr.saved = tr.saved, done
        events = tr.keys[0][0]    # the events name rank 0's keys of the first group
        self._obs_saving(req_id, events[a:done], a, events[a - 1] if a else None)   # type: ignore[attr-defined]
        for i, ids in enumerate(tr.block_ids):
            first = next((j for j in range(a, done) if ids[j] != NULL_BLOCK_ID), done)   # past a window: null
            if first < done and (job := self._pin(ids[first:done])) is not None:
                meta.saves.append(tr.transfer(req_id, i, first, done, ids[first:done], job=job))
    def _pin(self, block_ids: list[int]) -> int | None:
        """Take a reference on the vLLM blocks a save reads, so that vLLM cannot hand them to
        another request (after the request finishes, is preempted, or slides them out of its
        window) before every rank has copied them out; the job's id, or None when other
        pins are held and this job's would pass ``kvstore.max_pinned_fraction`` of vLLM's
        blocks (the save is dropped: a later miss, never a stall). A job alone is always
        taken, however long its prompt: its blocks are its running request's anyway."""
        ids = [b for b in block_ids if b != NULL_BLOCK_ID]
        if self._pinned and self._pinned + len(ids) > self.max_pinned_blocks:
            self.stats.saves_dropped += len(block_ids)
            self.recorder.dropped(len(ids))   # type: ignore[attr-defined]
            return None
        job, self._next_job = self._next_job, self._next_job + 1
        if self._block_pool is not None and ids:
            self._block_pool.touch([self._block_pool.blocks[b] for b in ids])
            self._pins[job] = (ids, self.tp_size)
            self._pinned += len(ids)
        return job

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Release the pins of the save jobs every rank has reported done (tail first, as
        vLLM frees a request's blocks)."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVStoreWorkerMeta):
            return
        for job, count in meta.done.items():
            pinned = self._pins.get(job)
            if pinned is None:
                continue
            ids, left = pinned[0], pinned[1] - count
            if left > 0:
                self._pins[job] = (ids, left)
                continue
            del self._pins[job]
            self._pinned -= len(ids)
            self._block_pool.free_blocks(self._block_pool.blocks[b] for b in reversed(ids))

    def has_pending_push_work(self) -> bool:
        """Keep vLLM's engine stepping while saves hold pins: their completions come back
        only with a step's worker output."""
        return bool(self._pins)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._block_pool = gpu_block_pool

    @property
    def requires_kv_delivery(self) -> bool:
        """Only a ``kv_producer`` hands KV off (its decode instance needs every block); a
        ``kv_both`` save is a cache fill, and one dropped is a later miss."""
        return bool(self._kv_transfer_config.kv_role == "kv_producer")

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; False: vLLM frees its blocks now (the blocks its saves still
        read stay pinned, not the request)."""
        self._tracked.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` of a hybrid model (vLLM's ``SupportsHMA``)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: forget every request's keys,
        lookups and pending loads. The pool's blocks stay (other instances share them; an
        operator drops them with kvctl), and so do the pins of saves in flight (their copies
        still read those blocks)."""
        self._tracked.clear()
        self._loads.clear()
        return True
