"""The profiling pass an engine runs at start, before it serves: a few prefills and decode
steps of random tokens timed on this engine's model and device, which the scheduler's router
fits to seed its T_prefill and TBT predictors (:mod:`scheduler.profiles`) before any request
has been observed — as a deployment profiles its engines before it serves, and as the
simulator's Conductor is seeded (``scheduler/sim/profiling.py``).

The pass computes only: it reads neither the engine's own cache nor the pool and writes
neither, and no request is counted in the engine's metrics. Its prompts are sized by the
engine's ``max_model_len`` (``L``): prefills of ``L/256``, ``L/64``, ``L/16``, ``L/4`` and
``L/2`` tokens, each :data:`PREFILL_REPEATS` times after one untimed warm-up; decode steps at (batch,
context per request) = (1, ``L/64``), (1, ``L/2``), (2, ``L/64``), (2, ``L/4``), the batch
interleaved one request per forward as :class:`engines.decode.DecodeEngine` serves it, so
the seconds between one request's tokens are a whole round of the batch. On the tiny CPU
model (``L`` = 4096) the pass takes 0.1–0.4 s (2 cores, idle to busy). Its timings are
what the machine gave at that moment: an engine profiled beside other work is seeded slow,
and the online fits correct that from the first requests it serves.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engines.kv import build_cache
from engines.model import LoadedModel
from engines.types import ProfilePoint

PREFILL_FRACTIONS = (256, 64, 16, 4, 2)        # prompt = max_model_len // each
PREFILL_REPEATS = 2
DECODE_POINTS = ((1, 64), (1, 2), (2, 64), (2, 4))   # (batch, context = max_model_len // each)
DECODE_STEPS = 4                               # rounds of the batch timed per point


def _forward(lm: LoadedModel, ids: list[int], cache: object) -> None:
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([ids], dtype=torch.long, device=lm.device),
                 past_key_values=cache, use_cache=True)


def _sync(lm: LoadedModel) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)


def _tokens(lm: LoadedModel, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, lm.vocab_size, (n,), generator=gen).tolist()


def _timed_prefill(lm: LoadedModel, ids: list[int]) -> tuple[float, object]:
    cache = build_cache([], lm.layout, lm.dtype, lm.device)
    _sync(lm)
    t0 = time.perf_counter()
    _forward(lm, ids, cache)
    _sync(lm)
    return time.perf_counter() - t0, cache


def prefill_lengths(max_model_len: int) -> list[int]:
    """The prompt lengths (tokens) of the pass, ascending, distinct, each >= 1."""
    return sorted({max(1, max_model_len // f) for f in PREFILL_FRACTIONS})


def profile_prefill(lm: LoadedModel, seed: int = 0) -> tuple[ProfilePoint, ...]:
    """Time prefills of :func:`prefill_lengths` random prompts, :data:`PREFILL_REPEATS` each,
    after one untimed warm-up of each length (a first forward pays lazy initialisation, and
    a first of a shape the kernels' choice for it)."""
    gen = torch.Generator().manual_seed(seed)
    points = []
    for n in prefill_lengths(lm.max_model_len):
        _timed_prefill(lm, _tokens(lm, n, gen))
        for _ in range(PREFILL_REPEATS):
            seconds, _ = _timed_prefill(lm, _tokens(lm, n, gen))
            points.append(ProfilePoint(1, n, seconds))
    return tuple(points)


def decode_points(max_model_len: int) -> list[tuple[int, int]]:
    """The (batch, context tokens per request) points of the pass; each context leaves room
    for the steps timed."""
    room = max(1, max_model_len - DECODE_STEPS - 1)
    return [(b, max(1, min(room, max_model_len // f))) for b, f in DECODE_POINTS]


def profile_decode(lm: LoadedModel, seed: int = 0) -> tuple[ProfilePoint, ...]:
    """Time decode steps at :func:`decode_points`: per point, ``batch`` random prompts of the
    context are prefilled (untimed), then :data:`DECODE_STEPS` rounds of one step per
    request are timed; a point's seconds are a round's mean (one request's TBT)."""
    gen = torch.Generator().manual_seed(seed)
    points = []
    for batch, context in decode_points(lm.max_model_len):
        caches = [_timed_prefill(lm, _tokens(lm, context, gen))[1] for _ in range(batch)]
        _forward(lm, [0], caches[0])   # warm-up step (untimed)
        _sync(lm)
        t0 = time.perf_counter()
        for _ in range(DECODE_STEPS):
            for cache in caches:
                _forward(lm, _tokens(lm, 1, gen), cache)
        _sync(lm)
        points.append(ProfilePoint(batch, batch * context, (time.perf_counter() - t0) / DECODE_STEPS))
    return tuple(points)


def profile_engine(lm: LoadedModel, role: str) -> tuple[ProfilePoint, ...]:
    """The pass for an engine of ``role``: prefill points for "prefill", decode points for
    "decode" (:class:`engines.types.ProfilePoint`)."""
    return profile_prefill(lm) if role == "prefill" else profile_decode(lm)


def describe(points: Sequence[ProfilePoint]) -> str:
    """``batch x tokens:milliseconds`` per point, for a log line."""
    return ", ".join(f"{p.batch}x{p.tokens}:{p.seconds * 1e3:.2f}ms" for p in points)
