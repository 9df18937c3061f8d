"""The simulator's workload: trace requests (read by :mod:`scheduler.trace`, the reader the
live replay uses) with their block keys and per-run outcome fields.

Block keys are the real key spec (:func:`kvstore.index.keys.block_keys`, chained SHA-256)
over a cheap deterministic mapping of the trace: trace block ``i`` of a request (512 tokens
in the trace) becomes the one token id ``hash_ids[i]``, keyed with ``block_size=1``. Equal
hash-id chains therefore get equal keys, a different parent gives a different key, and the
real :class:`kvstore.index.prefix_index.PrefixIndex` answers every hit. A simulated cache
block is one trace block (512 tokens, ``512 × kv_bytes_per_token`` bytes); only the
``input_length // 512`` full blocks of a prompt are keyed, and at most
``(input_length − 1) // 512`` can be reused (never the last prompt token, docs/key-spec.md §1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.index.keys import KeyExtras, block_keys
from scheduler.policy.views import Decision
from scheduler.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_trace

SIM_EXTRAS = KeyExtras(model="sim", namespace="sim")
_KEY_CACHE: dict[tuple[str, int | None], tuple[list[TraceRequest], list[tuple[bytes, ...]]]] = {}


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request of a simulation run: the trace fields (``arrival_s`` already divided by the
    speed), its keys, and what happened to it (times in virtual seconds).

    ``status``: "pending", "ok", "rejected_early" (before prefill) or "rejected_late" (after
    prefill, at decode). ``tbt_runs``: ``(interval_s, count)`` runs of its token intervals
    (the first one from the first token to the first decode step)."""

    rid: int
    arrival_s: float
    prompt: int
    output: int
    keys: tuple[bytes, ...]
    trace: TraceRequest
    status: str = "pending"
    reason: str = ""
    decision: Decision | None = None
    max_load_blocks: int | None = None   # the decision's limit on fetched prefix blocks
    prefill_id: str = ""
    decode_id: str = ""
    pred_prefill_s: float = 0.0
    prefill_start_s: float = -1.0
    prefill_s: float = 0.0           # instance-seconds spent prefilling (transfer included)
    compute_s: float = 0.0           # of which computing
    hit_blocks: int = 0
    cached_tokens: int = 0
    first_token_s: float = -1.0
    ready_s: float = -1.0            # KV reached the decode instance
    wait_until_s: float = 0.0        # late rejection if still waiting for decode room then
    join_step: int = 0
    finish_s: float = -1.0
    tbt_runs: list[tuple[float, int]] = field(default_factory=list)

    @property
    def trace_blocks(self) -> int:
        return len(self.trace.hash_ids)

    @property
    def usable_blocks(self) -> int:
        return max(0, (self.prompt - 1) // TRACE_BLOCK_TOKENS)

    @property
    def ttft_s(self) -> float | None:
        return self.first_token_s - self.arrival_s if self.first_token_s >= 0 else None


def trace_keys(trace: list[TraceRequest]) -> list[tuple[bytes, ...]]:
    """Per request, the keys of its full trace blocks (see the module docstring)."""
    out = []
    for req in trace:
        full = min(len(req.hash_ids), req.input_length // TRACE_BLOCK_TOKENS)
        ids = np.asarray(req.hash_ids[:full], dtype=np.uint32)
        out.append(tuple(block_keys(ids, 1, SIM_EXTRAS)))
    return out


def load_workload(path: str | Path, limit: int | None = None) -> tuple[list[TraceRequest], list[tuple[bytes, ...]]]:
    """The first ``limit`` trace requests and their keys, memoised per (path, limit): several
    runs of one process (policies, a speed sweep) key the trace once."""
    cache_key = (str(Path(path).resolve()), limit)
    hit = _KEY_CACHE.get(cache_key)
    if hit is None:
        trace = load_trace(path, limit)
        hit = _KEY_CACHE[cache_key] = (trace, trace_keys(trace))
    return hit


def make_requests(trace: list[TraceRequest], keys: list[tuple[bytes, ...]], speed: float) -> list[SimRequest]:
    """Fresh per-run request objects, arrivals scaled by ``speed`` (> 0) from the first one."""
    t0 = min((r.timestamp_ms for r in trace), default=0)
    return [SimRequest(i, (r.timestamp_ms - t0) / 1000.0 / speed, r.input_length, max(1, r.output_length), k, r)
            for i, (r, k) in enumerate(zip(trace, keys))]
