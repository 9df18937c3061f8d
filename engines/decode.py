"""The decode engine: loads the prompt's blocks from the pool, appends the tail KV handed over
by prefill, and continues generation token by token, greedy or sampled as the request's
:class:`~engines.types.SamplingParams` say (engines/sampling.py; docs/architecture.md §4)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from engines.kv import append, build_cache, to_tensor
from engines.model import LoadedModel, run
from engines.prefill import read_prefix, validate_prompt
from engines.sampling import Sampler, logprobs_of
from engines.types import GREEDY, DecodeStep, EngineLoad, SamplingParams, extras_for
from kvstore.block_store import BlockStore
from kvstore.errors import InvalidArgument
from kvstore.identity import IdentityCheck, block_tags

log = logging.getLogger(__name__)


class DecodeEngine:
    """Runs many requests at once, interleaved one model step at a time (a lock around the
    model). Output is greedy and token-identical to an uninterrupted ``generate``."""

    role = "decode"

    def __init__(self, lm: LoadedModel, store: BlockStore | None, engine_id: str = "decode-0") -> None:
        self.lm = lm
        self.store = store
        self.engine_id = engine_id
        self.block_size = lm.layout.block_size
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._running = 0
        self.recomputed_tokens = 0
        self.identity = IdentityCheck(engine_id)   # blocks read whose tokens were not the prompt's
        # Called once per decode with what its prompt's KV cost (engines/metrics.py sets it):
        # (seconds reading the pool, bytes read, tokens loaded from the pool or handed over as
        # the tail, tokens recomputed).
        self.on_load: Callable[[float, int, int, int], None] | None = None

    def load(self) -> EngineLoad:
        return EngineLoad(0, self._running, 0)

    def decode(self, request_id: str, prompt: Sequence[int], first_token: int,
               block_keys: Sequence[bytes], tail_kv: bytes, max_tokens: int,
               stop_token_ids: Sequence[int] = (),
               is_cancelled: Callable[[], bool] = lambda: False,
               namespace: str = "default", sampling: SamplingParams = GREEDY,
               top_logprobs: int | None = None) -> Iterator[DecodeStep]:
        """Yield ``max_tokens`` tokens at most (index 0 is ``first_token``), stopping early at a
        stop token; token ``i`` is chosen as ``sampling`` says for index ``i`` (the prefill
        engine chose index 0 with the same parameters); with ``top_logprobs`` each step after
        the first carries the token's log probabilities. Blocks missing from the pool — or
        holding another token sequence's KV (their identity tags, computed from ``prompt``
        and ``namespace``, differ; counted in ``identity.mismatches``) — are recomputed from
        the prompt (and counted in ``recomputed_tokens``), never a failed request. Raises
        InvalidArgument for a bad request."""
        if max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be > 0, got {max_tokens}")
        validate_prompt(prompt, self.lm, max_tokens)
        if not 0 <= first_token < self.lm.vocab_size:
            raise InvalidArgument(f"first_token {first_token} outside the vocabulary [0, {self.lm.vocab_size})")
        if len(block_keys) != len(prompt) // self.block_size:
            raise InvalidArgument(f"{len(block_keys)} block keys for a prompt of {len(prompt)} tokens "
                                  f"(block size {self.block_size})")
        with self._stats_lock:
            self._running += 1
        try:
            yield from self._decode(list(prompt), first_token, list(block_keys), tail_kv,
                                    max_tokens, set(stop_token_ids), is_cancelled, namespace,
                                    Sampler(sampling), top_logprobs)
        finally:
            with self._stats_lock:
                self._running -= 1

    def _decode(self, prompt: list[int], first: int, keys: list[bytes], tail_kv: bytes,
                max_tokens: int, stops: set[int], is_cancelled: Callable[[], bool],
                namespace: str, sampler: Sampler, top_logprobs: int | None) -> Iterator[DecodeStep]:
        lm, bs = self.lm, self.block_size
        tail = to_tensor(tail_kv, lm.layout, lm.dtype) if tail_kv else None
        tail_tokens = 0 if tail is None else tail.shape[3]
        if tail_tokens > len(prompt) or (len(prompt) - tail_tokens) % bs:
            raise InvalidArgument(f"tail KV of {tail_tokens} tokens does not end a prompt of "
                                  f"{len(prompt)} tokens on a block boundary (block size {bs})")
        want = (len(prompt) - tail_tokens) // bs    # blocks the pool holds before the tail
        tags = block_tags(prompt, bs, extras_for(lm.model_id, lm.revision, lm.layout, namespace))
        t_load = time.perf_counter()
        blocks = read_prefix(self.store, keys[:want], tags[:want], self.identity)
        load_s = time.perf_counter() - t_load
        recomputed = 0
        with self._lock:
            cache = build_cache(blocks, lm.layout, lm.dtype, lm.device)
            have = len(blocks) * bs
            if len(blocks) < want or (tail is None and have < len(prompt)):
                # Missing blocks: recompute the rest of the prompt's KV (the last position's
                # logits alone are computed, and unused: the first token came from prefill).
                with torch.inference_mode():
                    run(lm, prompt[have:], cache)
                recomputed = len(prompt) - have
                self.recomputed_tokens += recomputed
                log.warning("request: %d prompt tokens recomputed (blocks missing from the pool)", recomputed)
            elif tail is not None:
                append(cache, [tail], lm.device)
        if cache.get_seq_length() != len(prompt):
            raise InvalidArgument(f"KV for {cache.get_seq_length()} tokens, prompt has {len(prompt)}")
        if self.on_load is not None:
            self.on_load(load_s, sum(len(b) for b in blocks), len(prompt) - recomputed, recomputed)
        token, lp = first, None
        for index in range(max_tokens):
            finished = token in stops or index == max_tokens - 1
            reason = ("stop" if token in stops else "length") if finished else ""
            yield DecodeStep(token, index, finished, reason, lp)
            if finished or is_cancelled():
                return
            with self._lock, torch.inference_mode():
                logits = run(lm, [token], cache)
            token = sampler.choose(logits, index + 1)
            if top_logprobs is not None:
                lp = logprobs_of(logits, token, top_logprobs)
