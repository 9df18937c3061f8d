"""Mooncake's trace format (FAST'25 release, data/traces/README.md) and its mapping to token ids.

A trace line is one request: ``timestamp`` (ms from the start), ``input_length`` and
``output_length`` (tokens), ``hash_ids`` (one id per 512-token block of the prompt; equal ids
at equal positions are a shared prefix). Replay scales a 512-token trace block down to
``tokens_per_block`` token ids, so that a CPU model can serve it:

* hash id ``h`` ↦ ``numpy.random.default_rng([seed, h]).integers(first_id, vocab_size,
  tokens_per_block)`` — the same tokens in every process, whatever ``PYTHONHASHSEED`` is;
* the prompt is the concatenation of its blocks, cut to
  ``round(input_length · tokens_per_block / 512)`` tokens (Python's ``round``), clamped into
  ``[(len(hash_ids) − 1) · tokens_per_block + 1, len(hash_ids) · tokens_per_block]`` so that
  every hash id keeps at least one token.

Hit ratios are counted in trace blocks: hit blocks / ``len(hash_ids)``, summed over requests
(the last block of a prompt, usually partial, counts in the denominator, as in the trace's
published figure of 0.366).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.errors import InvalidArgument

TRACE_BLOCK_TOKENS = 512     # tokens per hash id in the trace
DEFAULT_SEED = 20250225      # FAST'25


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace line. ``timestamp_ms``: arrival (ms from the trace start)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests (all when None) of a JSONL trace, in file order.
    Raises InvalidArgument naming the line that is malformed."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                req = TraceRequest(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                   tuple(int(h) for h in d["hash_ids"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidArgument(f"{path}:{lineno}: not a trace record ({exc})") from None
            if not req.hash_ids:
                raise InvalidArgument(f"{path}:{lineno}: empty hash_ids")
            out.append(req)
    return out


class TraceMapping:
    """Maps trace requests to prompts of token ids (see the module docstring).

    Args:
        tokens_per_block: token ids per trace block (> 0); a multiple of the engines' block
            size keeps trace blocks aligned with cache blocks.
        vocab_size: ids are drawn from ``[first_id, vocab_size)``.
        first_id: the least id drawn (default 3: skips pad, bos and eos of the byte tokenizer).
        seed: the mapping's seed; the same seed gives the same tokens everywhere.
    """

    def __init__(self, tokens_per_block: int = 16, vocab_size: int = 512, first_id: int = 3,
                 seed: int = DEFAULT_SEED) -> None:
        if tokens_per_block <= 0:
            raise InvalidArgument(f"tokens_per_block must be > 0, got {tokens_per_block}")
        if not 0 <= first_id < vocab_size:
            raise InvalidArgument(f"need 0 <= first_id < vocab_size, got {first_id} and {vocab_size}")
        self.tokens_per_block = tokens_per_block
        self.vocab_size = vocab_size
        self.first_id = first_id
        self.seed = seed
        self._blocks: dict[int, np.ndarray] = {}

    def block_tokens(self, hash_id: int) -> np.ndarray:
        """The ``tokens_per_block`` token ids of trace block ``hash_id`` (int64, read-only)."""
        block = self._blocks.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self.seed, hash_id])
            block = rng.integers(self.first_id, self.vocab_size, self.tokens_per_block, dtype=np.int64)
            block.flags.writeable = False
            self._blocks[hash_id] = block
        return block

    def prompt_length(self, req: TraceRequest) -> int:
        """Tokens of the mapped prompt (see the module docstring)."""
        tpb, n = self.tokens_per_block, len(req.hash_ids)
        scaled = round(req.input_length * tpb / TRACE_BLOCK_TOKENS)
        return min(max(scaled, (n - 1) * tpb + 1), n * tpb)

    def prompt(self, req: TraceRequest) -> list[int]:
        """The token ids of the request's prompt, ``prompt_length(req)`` of them."""
        ids = np.concatenate([self.block_tokens(h) for h in req.hash_ids])
        return ids[:self.prompt_length(req)].tolist()


def best_possible_hit_blocks(requests: Iterable[TraceRequest],
                             mapping: TraceMapping | None = None) -> list[int]:
    """Per request, in order, the trace blocks an infinite cache could serve.

    A block hits when the request's hash ids up to and including it were all the prefix of an
    earlier request (every earlier request caches its whole chain). With ``mapping``, the hit
    is also capped at what an engine may reuse: never the last prompt token (docs/key-spec.md §1),
    so block ``i`` counts only if all its tokens lie before the last one, i.e. at most
    ``(prompt_length − 1) // tokens_per_block`` blocks — the same rule as
    :func:`kvstore.index.keys.usable_prefix_tokens` at trace-block granularity. Without
    ``mapping`` the count is uncapped (the trace's published figure).
    """
    children: dict[tuple[int, int], int] = {}   # (parent node, hash id) -> node; root is 0
    out: list[int] = []
    for req in requests:
        node, hit, matching = 0, 0, True
        for h in req.hash_ids:
            nxt = children.get((node, h))
            if nxt is None:
                matching = False
                nxt = children[(node, h)] = len(children) + 1
            elif matching:
                hit += 1
            node = nxt
        if mapping is not None:
            hit = min(hit, (mapping.prompt_length(req) - 1) // mapping.tokens_per_block)
        out.append(hit)
    return out


def conversation_key(req: TraceRequest, index: int) -> tuple[int, ...] | tuple[str, int]:
    """The conversation a request belongs to: its first two hash ids (every request of the
    vendored trace starts with hash id 0, a shared system prompt, so one block names no
    conversation; a later turn's prompt extends an earlier one's, so it keeps them). A
    request of one block is a conversation of its own (``("single", index)``)."""
    return req.hash_ids[:2] if len(req.hash_ids) > 1 else ("single", index)


def select_window(requests: Sequence[TraceRequest], start: int, count: int,
                  window_s: float | None) -> list[TraceRequest]:
    """The part of a trace a replay sends, in trace order.

    ``window_s`` None: the ``count`` requests from index ``start`` on (file order). Else the
    requests arriving within ``window_s`` trace seconds of request ``start``, grouped into
    conversations (:func:`conversation_key`); whole conversations are taken, most turns in
    the window first (ties: the one that starts first), until ``count`` requests (the last
    one taken keeps its first turns). That keeps the trace's own reuse — a later turn
    extends an earlier turn's prompt — in a replay of a few dozen requests, which no run of
    consecutive requests has: the conversations interleave, a turn follows its predecessor
    about 400 requests later (median), so the best possible hit ratio of 100 consecutive
    requests is at most 0.15 anywhere in the vendored trace, against 0.366 for all of it.

    Raises InvalidArgument for a ``start`` outside the trace, a ``count`` < 1 or a
    ``window_s`` <= 0."""
    if not 0 <= start < len(requests):
        raise InvalidArgument(f"start {start} is outside the trace (requests 0 to {len(requests) - 1})")
    if count < 1:
        raise InvalidArgument(f"count must be >= 1, got {count}")
    if window_s is None:
        return list(requests[start:start + count])
    if not window_s > 0:
        raise InvalidArgument(f"window_s must be > 0 s, got {window_s}")
    end_ms = requests[start].timestamp_ms + window_s * 1000.0
    groups: dict[tuple[int, ...] | tuple[str, int], list[int]] = {}
    for i in range(start, len(requests)):
        if requests[i].timestamp_ms >= end_ms:
            break
        groups.setdefault(conversation_key(requests[i], i), []).append(i)
    picked: list[int] = []
    for turns in sorted(groups.values(), key=lambda g: (-len(g), g[0])):
        if len(picked) >= count:
            break
        picked.extend(turns[:count - len(picked)])
    return [requests[i] for i in sorted(picked)]


def best_possible_hit_ratio(requests: Sequence[TraceRequest], mapping: TraceMapping | None = None) -> float:
    """Best possible hit blocks / all trace blocks of ``requests`` (0.0 when empty)."""
    total = sum(len(r.hash_ids) for r in requests)
    return sum(best_possible_hit_blocks(requests, mapping)) / total if total else 0.0
