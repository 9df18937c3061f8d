"""The prefill engine: keys the prompt, loads the longest cached prefix (its own HBM cache
first, then the pool), computes only the rest, publishes the new full blocks to the pool and
hands the first token, the block keys and the tail KV to decode (docs/architecture.md §4)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from engines.kv import append, build_cache, slice_bytes, to_tensor
from engines.local_cache import LocalBlockCache
from engines.model import LoadedModel, run
from engines.sampling import Sampler, logprobs_of
from engines.types import GREEDY, EngineLoad, PrefillResult, SamplingParams, extras_for
from kvstore.block_store import BlockStore
from kvstore.errors import Cancelled, InvalidArgument, KVStoreError, QuotaExceeded
from kvstore.events.channel import EventChannel
from kvstore.events.publisher import PublishingIndex
from kvstore.identity import IdentityCheck, block_tags, seal
from kvstore.index.keys import block_keys, usable_prefix_tokens
from kvstore.pool.quotas import accounting_namespace

log = logging.getLogger(__name__)
CANCEL_POLL_S = 0.05   # how often a prefill waiting for the model asks whether its caller is still there


def validate_prompt(prompt: Sequence[int], lm: LoadedModel, extra_tokens: int = 0) -> None:
    """Raises InvalidArgument for an empty prompt, ids outside the vocabulary, or a prompt
    (plus ``extra_tokens`` to generate) longer than the model's limit."""
    if not prompt:
        raise InvalidArgument("prompt is empty")
    bad = [t for t in prompt if not 0 <= t < lm.vocab_size]
    if bad:
        raise InvalidArgument(f"token id {bad[0]} outside the vocabulary [0, {lm.vocab_size})")
    if len(prompt) + extra_tokens > lm.max_model_len:
        raise InvalidArgument(f"prompt of {len(prompt)} tokens + {extra_tokens} to generate exceeds "
                              f"the model's limit of {lm.max_model_len} tokens")


def read_prefix(store: BlockStore | None, keys: Sequence[bytes], tags: Sequence[bytes],
                check: IdentityCheck) -> list[bytes]:
    """Bytes of the longest prefix of ``keys`` the pool returns (one batched, streamed get
    that stops at the first miss) whose blocks carry the identity ``tags`` of the tokens
    they stand for (kvstore/identity.py; a block of other tokens under a colliding key is a
    miss, counted by ``check``). A pool that cannot be reached is a miss, logged."""
    if not keys or store is None:
        return []
    try:
        got = store.get_blocks(list(keys), stop_at_miss=True)
    except KVStoreError as exc:
        log.warning("pool unavailable, recomputing: %s", exc)
        return []
    return check.prefix(keys, got, tags)


class PrefillEngine:
    """Serves prefills one at a time (a lock around the model); ``load()`` reports the queue."""

    role = "prefill"

    def __init__(self, lm: LoadedModel, store: BlockStore | None, engine_id: str = "prefill-0",
                 local_cache_blocks: int = 4096, events: EventChannel | None = None) -> None:
        self.lm = lm
        self.store = store
        self.engine_id = engine_id
        self.block_size = lm.layout.block_size
        # With an event channel the cache publishes what it holds (kvstore/events): the
        # scheduler's index replica reads it there.
        index = PublishingIndex(engine_id, events) if events is not None else None
        self.local = LocalBlockCache(local_cache_blocks, index, engine_id)
        self.identity = IdentityCheck(engine_id)   # blocks read whose tokens were not the prompt's
        self.restored_blocks = 0   # blocks put back into the pool from the local cache
        self._lock = threading.Lock()  # one prefill on the model at a time
        self._stats_lock = threading.Lock()
        self._queued = 0
        self._queued_tokens = 0
        self._running = 0

    def load(self) -> EngineLoad:
        return EngineLoad(self._queued, self._running, self._queued_tokens)

    def prefill(self, request_id: str, prompt: Sequence[int], namespace: str,
                max_load_blocks: int | None = None, sampling: SamplingParams = GREEDY,
                top_logprobs: int | None = None, recompute: bool = False,
                cancelled: Callable[[], bool] | None = None) -> PrefillResult:
        """Prefill ``prompt``, loading from the pool at most the prefix of ``max_load_blocks``
        blocks (the scheduler's decision to recompute the rest; None: any hit — the
        engine's own cache is never limited); the first token is chosen as ``sampling``
        says (token index 0), and with ``top_logprobs`` (alternatives, 0 or more) the result
        carries its log probabilities. ``recompute``: pool off — every prompt token is
        computed, neither this engine's own cache nor the pool is read or written, and the
        whole prompt's KV goes to decode in ``tail_kv`` (``cached_tokens`` is 0). Raises
        InvalidArgument for a bad prompt. A pool that cannot be reached is a miss (the
        prefix is recomputed), never a failed request. ``cancelled``: polled while the
        request waits for the model (every :data:`CANCEL_POLL_S`) and once more when it gets
        it; True there raises :class:`Cancelled` and nothing is computed, so a queue of
        prefills whose callers hung up drains at once (a prefill already on the model runs
        to its end)."""
        if max_load_blocks is not None and max_load_blocks < 0:
            raise InvalidArgument(f"max_load_blocks must be >= 0, got {max_load_blocks}")
        validate_prompt(prompt, self.lm)
        with self._stats_lock:
            self._queued += 1
            self._queued_tokens += len(prompt)
        try:
            self._take_model(request_id, cancelled)
        except BaseException:
            with self._stats_lock:
                self._queued -= 1
                self._queued_tokens -= len(prompt)
            raise
        try:
            with self._stats_lock:
                self._queued -= 1
                self._queued_tokens -= len(prompt)
                self._running += 1
            try:
                if recompute:
                    return self._recompute(request_id, list(prompt), namespace, sampling, top_logprobs)
                return self._prefill(request_id, list(prompt), namespace, max_load_blocks, sampling,
                                     top_logprobs)
            finally:
                with self._stats_lock:
                    self._running -= 1
        finally:
            self._lock.release()

    def _take_model(self, request_id: str, cancelled: Callable[[], bool] | None) -> None:
        """Acquire the model's lock; raises Cancelled (the lock not held) once ``cancelled()``."""
        if cancelled is None:
            self._lock.acquire()
            return
        while not self._lock.acquire(timeout=CANCEL_POLL_S):
            if cancelled():
                raise Cancelled(f"prefill {request_id}: the caller left while it waited for the model")
        try:
            gone = cancelled()
        except BaseException:
            self._lock.release()      # never leave the model locked, whatever cancelled() raised
            raise
        if gone:
            self._lock.release()
            raise Cancelled(f"prefill {request_id}: the caller left before it began")

    def _prefill(self, request_id: str, prompt: list[int], namespace: str,
                 max_load_blocks: int | None, sampling: SamplingParams,
                 top_logprobs: int | None) -> PrefillResult:
        t0 = time.perf_counter()
        lm, bs = self.lm, self.block_size
        extras = extras_for(lm.model_id, lm.revision, lm.layout, namespace)
        keys = block_keys(prompt, bs, extras)
        tags = block_tags(prompt, bs, extras)
        local_ids = [k + t for k, t in zip(keys, tags)]  # the local cache checks identity too
        want = -(-usable_prefix_tokens(len(keys), bs, len(prompt)) // bs)  # blocks worth loading
        tensors = self.local.prefix(local_ids[:want])
        from_local = len(tensors)
        upto = want if max_load_blocks is None else min(want, max(from_local, max_load_blocks))
        t_load = time.perf_counter()
        tenant = accounting_namespace(namespace) if namespace else None
        pooled, raw, tier = self._fetch(keys, tags, from_local, upto, tenant)
        load_s = time.perf_counter() - t_load if raw else 0.0
        load_bytes = sum(len(b) for b in raw)
        fetched = [to_tensor(b, lm.layout, lm.dtype) for b in raw]
        tensors += fetched
        loaded = len(tensors)
        cached = usable_prefix_tokens(loaded, bs, len(prompt))
        cache = build_cache([], lm.layout, lm.dtype, lm.device)
        if tensors:
            append(cache, tensors, lm.device)
            excess = cache.get_seq_length() - cached
            if excess:  # never reuse the last prompt token: it must be computed for logits
                cache.crop(-excess)
        with torch.inference_mode():
            logits = run(lm, prompt[cached:], cache)
        first = Sampler(sampling).choose(logits, 0)
        first_lp = None if top_logprobs is None else logprobs_of(logits, first, top_logprobs)
        n_full = len(prompt) // bs
        new = [(keys[i], slice_bytes(cache, i * bs, (i + 1) * bs)) for i in range(loaded, n_full)]
        # What this engine served from its own cache but the pool has lost goes back, so
        # decode (which reads the pool) reuses it as prefill did instead of recomputing it.
        back = [(keys[i], slice_bytes(cache, i * bs, (i + 1) * bs)) for i in range(pooled, from_local)]
        sealed = [(k, seal(b, tags[i])) for i, (k, b) in enumerate(back, pooled)]
        sealed_new = [(k, seal(b, tags[i])) for i, (k, b) in enumerate(new, loaded)]
        if back and loaded == from_local:   # one chain: the restored blocks, then the new ones
            fresh, held = self._publish(sealed + sealed_new, keys[pooled - 1] if pooled else None, namespace)
        else:
            fresh, held = self._publish(sealed, keys[pooled - 1] if pooled else None, namespace)
            fresh2, held2 = self._publish(sealed_new, keys[loaded - 1] if loaded else None, namespace)
            fresh, held = fresh | fresh2, held | held2 | set(keys[from_local:loaded])
        restored = sum(1 for k, _ in back if k in fresh)
        if restored:
            self.restored_blocks += restored
            log.info("%s: %d blocks served from the local cache were missing from the pool, put back",
                     request_id, restored)
        stored = len(fresh) - restored
        # Decode reads the blocks the pool holds; the KV past them goes with the result, so
        # decode recomputes nothing prefill computed or reused, even when a put failed.
        in_pool = n_full if self.store is None else pooled
        while in_pool < n_full and keys[in_pool] in held:
            in_pool += 1
        # Blocks fetched from the pool stay here too: hot prefixes spread by themselves.
        self.local.put_chain([(local_ids[i], keys[i], t) for i, t in enumerate(fetched, from_local)]
                             + [(local_ids[i], k, to_tensor(b, lm.layout, lm.dtype))
                                for i, (k, b) in enumerate(new, loaded)])
        return PrefillResult(request_id, first, tuple(keys), cached, len(prompt) - cached,
                             slice_bytes(cache, in_pool * bs, len(prompt)), len(prompt) - in_pool * bs,
                             time.perf_counter() - t0, loaded, stored, load_s, load_bytes,
                             tier if load_bytes else "", first_lp)

    def _recompute(self, request_id: str, prompt: list[int], namespace: str, sampling: SamplingParams,
                   top_logprobs: int | None) -> PrefillResult:
        """Pool off: the whole prompt computed, nothing read from or written to a cache; its
        KV goes to decode whole (the block keys are still returned: decode checks them)."""
        t0 = time.perf_counter()
        lm = self.lm
        keys = block_keys(prompt, self.block_size, extras_for(lm.model_id, lm.revision, lm.layout, namespace))
        cache = build_cache([], lm.layout, lm.dtype, lm.device)
        with torch.inference_mode():
            logits = run(lm, prompt, cache)
        first = Sampler(sampling).choose(logits, 0)
        first_lp = None if top_logprobs is None else logprobs_of(logits, first, top_logprobs)
        return PrefillResult(request_id, first, tuple(keys), 0, len(prompt), slice_bytes(cache, 0, len(prompt)),
                             len(prompt), time.perf_counter() - t0, 0, 0, first_logprobs=first_lp)

    def _fetch(self, keys: Sequence[bytes], tags: Sequence[bytes], have: int, upto: int,
               tenant: str | None = None) -> tuple[int, list[bytes], str]:
        """One pool lookup of ``keys[:upto]``, of which this engine holds the first ``have``
        blocks itself. Returns how many leading blocks of those ``have`` the pool still
        holds (fewer: the pool lost them; 0 when it cannot be reached), the bytes (tags
        stripped) of the pool's blocks carrying ``tags`` that extend ``keys[have:upto]`` as
        far as they go, and the tier most of them came from ("" when unknown). ``tenant``:
        the namespace the lookups name (the pool's per-tenant lookup books)."""
        if self.store is None or upto <= 0:
            return have, [], ""
        try:
            found = self.store.lookup(list(keys[:upto]), "reuse", tenant)
            pooled = min(found.blocks, have)
            if found.blocks >= have:
                tiers, ext = list(found.tiers[have:found.blocks]), list(keys[have:found.blocks])
            elif have < upto:      # the pool lost part of the local prefix: ask past it
                more = self.store.lookup(list(keys[have:upto]), "probe")   # counted by the first
                tiers, ext = list(more.tiers[:more.blocks]), list(keys[have:have + more.blocks])
            else:
                tiers, ext = [], []
        except KVStoreError as exc:   # the pool cannot tell what it holds: count none of it
            log.warning("pool unavailable, recomputing the prefix: %s", exc)
            return 0, [], ""
        tier = max(set(tiers), key=tiers.count) if tiers else ""
        return pooled, read_prefix(self.store, ext, tags[have:have + len(ext)], self.identity), tier

    def _publish(self, blocks: list[tuple[bytes, bytes]], parent: bytes | None,
                 namespace: str) -> tuple[set[bytes], set[bytes]]:
        """Put ``blocks`` as one chain extending ``parent`` (so the pool evicts the chain's
        tail before its head), for tenant ``namespace`` (the string the keys are salted
        with: the pool's per-tenant books and quota; kvstore/pool/tenants.py). Returns the keys
        newly stored and the keys the pool holds after the put (new or existing); a pool
        that cannot be reached, or a tenant over its quota, holds none of them as far as
        this request counts (decode then recomputes from the KV sent with the result)."""
        if not blocks or self.store is None:
            return set(), set()
        try:
            results = self.store.put_blocks(blocks, chain=True, parent=parent,
                                            namespace=accounting_namespace(namespace) if namespace else None)
        except QuotaExceeded as exc:
            log.info("namespace %r over its pool quota, %d blocks not published: %s", namespace, len(blocks), exc)
            return set(), set()
        except KVStoreError as exc:
            log.warning("pool unavailable, %d blocks not published: %s", len(blocks), exc)
            return set(), set()
        pairs = list(zip(blocks, results))
        return ({key for (key, _), r in pairs if r.ok and not r.existed},
                {key for (key, _), r in pairs if r.ok})
