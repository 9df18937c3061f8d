"""The profiling pass an engine runs at start, before it serves: a few prefills and decode
steps of random tokens timed on this engine's model and device, which the scheduler's router
fits to seed its T_prefill and TBT predictors (:mod:`scheduler.policy.profiles`) before any request
has been observed — as a deployment profiles its engines before it serves, and as the
simulator's Conductor is seeded (``scheduler/sim/profiling.py``).

The pass computes only: it reads neither the engine's own cache nor the pool and writes
neither, and no request is counted in the engine's metrics. Its prompts are sized by
``L`` = min(the engine's ``max_model_len``, :data:`MAX_PROFILED_LEN`): prefills of
``L/256``, ``L/64``, ``L/16``, ``L/4`` and ``L/2`` tokens, each :data:`PREFILL_REPEATS`
times after one untimed warm-up; decode steps at (batch, context per request) =
(1, ``L/64``), (1, ``L/2``), (2, ``L/64``), (2, ``L/4``), the batch interleaved one
request per forward as :class:`engines.decode.DecodeEngine` serves it, so the seconds
between one request's tokens are a whole round of the batch. On the tiny CPU model
(``L`` = 4096) the pass takes 0.1–0.4 s (2 cores, idle to busy). The cap keeps a
checkpoint served at 128k tokens from prefilling 64k-token prompts on a CPU for minutes
before it serves (the fit extrapolates past ``L``), and no point is started once the pass
has run :data:`BUDGET_S` seconds: it keeps those it has (the shortest come first; a fit
needs three lengths or decode points, :mod:`scheduler.policy.profiles`). Prefills and decode
steps run as the engines run them (:func:`engines.model.run`: the last position's logits
only; each step's token chosen from them, which waits for the device as the engine's
sampler does). The timings are what the machine gave at that moment: an engine profiled
beside other work is seeded slow, and the online fits correct that from the first
requests it serves.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator, Sequence

import torch

from engines.kv import build_cache
from engines.model import LoadedModel, run
from engines.types import ProfilePoint

log = logging.getLogger(__name__)

PREFILL_FRACTIONS = (256, 64, 16, 4, 2)        # prompt = sized length // each
PREFILL_REPEATS = 2
DECODE_POINTS = ((1, 64), (1, 2), (2, 64), (2, 4))   # (batch, context = sized length // each)
DECODE_STEPS = 4                               # rounds of the batch timed per point
MAX_PROFILED_LEN = 8192                        # tokens: the pass sizes by min(max_model_len, this)
BUDGET_S = 30.0                                # seconds: no point is started after this
LOCK_WAIT_S = 120.0                            # seconds an engine waits for --profile-lock


class _Budget:
    """The pass's clock: :meth:`spent` once :data:`BUDGET_S` (or ``seconds``) has passed."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.t0 = seconds, time.perf_counter()

    def spent(self, what: str) -> bool:
        over = time.perf_counter() - self.t0 >= self.seconds
        if over:
            log.warning("profiling pass past its %.0f s budget: %s left out", self.seconds, what)
        return over


def _sized(max_model_len: int) -> int:
    return min(max_model_len, MAX_PROFILED_LEN)


def _timed_prefill(lm: LoadedModel, ids: list[int]) -> tuple[float, object]:
    cache = build_cache([], lm.layout, lm.dtype, lm.device)
    _sync(lm)
    t0 = time.perf_counter()
    with torch.inference_mode():
        int(run(lm, ids, cache).argmax())   # the first token, as the engine chooses it
    return time.perf_counter() - t0, cache


def _sync(lm: LoadedModel) -> None:
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)


def _tokens(lm: LoadedModel, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, lm.vocab_size, (n,), generator=gen).tolist()


def prefill_lengths(max_model_len: int) -> list[int]:
    """The prompt lengths (tokens) of the pass, ascending, distinct, each >= 1."""
    return sorted({max(1, _sized(max_model_len) // f) for f in PREFILL_FRACTIONS})


def profile_prefill(lm: LoadedModel, seed: int = 0, budget_s: float = BUDGET_S) -> tuple[ProfilePoint, ...]:
    """Time prefills of :func:`prefill_lengths` random prompts, :data:`PREFILL_REPEATS` each,
    after one untimed warm-up of each length (a first forward pays lazy initialisation, and
    a first of a shape the kernels' choice for it); no length is started after ``budget_s``
    seconds."""
    gen = torch.Generator().manual_seed(seed)
    budget = _Budget(budget_s)
    points = []
    for n in prefill_lengths(lm.max_model_len):
        if budget.spent(f"prefills of {n} tokens and longer"):
            break
        _timed_prefill(lm, _tokens(lm, n, gen))
        for _ in range(PREFILL_REPEATS):
            seconds, _ = _timed_prefill(lm, _tokens(lm, n, gen))
            points.append(ProfilePoint(1, n, seconds))
    return tuple(points)


def decode_points(max_model_len: int) -> list[tuple[int, int]]:
    """The (batch, context tokens per request) points of the pass; each context leaves room
    for the steps timed."""
    room = max(1, max_model_len - DECODE_STEPS - 1)
    sized = _sized(max_model_len)
    return [(b, max(1, min(room, sized // f))) for b, f in DECODE_POINTS]


def profile_decode(lm: LoadedModel, seed: int = 0, budget_s: float = BUDGET_S) -> tuple[ProfilePoint, ...]:
    """Time decode steps at :func:`decode_points`: per point, ``batch`` random prompts of the
    context are prefilled (untimed), then :data:`DECODE_STEPS` rounds of one step per
    request are timed, each step's token chosen from its logits and fed to the next; a
    point's seconds are a round's mean (one request's TBT). No point is started after
    ``budget_s`` seconds."""
    gen = torch.Generator().manual_seed(seed)
    budget = _Budget(budget_s)
    points = []
    for batch, context in decode_points(lm.max_model_len):
        if budget.spent(f"the decode point of {batch} x {context} tokens and those after it"):
            break
        caches = [_timed_prefill(lm, _tokens(lm, context, gen))[1] for _ in range(batch)]
        tokens = [0] * batch
        with torch.inference_mode():
            int(run(lm, [0], caches[0]).argmax())   # warm-up step (untimed)
            t0 = time.perf_counter()
            for _ in range(DECODE_STEPS):
                for i, cache in enumerate(caches):
                    tokens[i] = int(run(lm, [tokens[i]], cache).argmax())
        points.append(ProfilePoint(batch, batch * context, (time.perf_counter() - t0) / DECODE_STEPS))
    return tuple(points)


def profile_engine(lm: LoadedModel, role: str, lock: str | None = None) -> tuple[ProfilePoint, ...]:
    """The pass for an engine of ``role``: prefill points for "prefill", decode points for
    "decode" (:class:`engines.types.ProfilePoint`). ``lock``: a file path; the pass runs
    holding an exclusive ``flock`` on it (the file created, mode 0600, if missing; waited
    for up to :data:`LOCK_WAIT_S` seconds, then run without), so the engines of one host
    given one path profile one at a time rather than slow one another's timings
    (``kvstore up`` gives its engines one). Raises OSError when ``lock`` cannot be
    opened (or is a symbolic link: one planted in a shared directory is not followed)."""
    with _exclusive(lock):
        return profile_prefill(lm) if role == "prefill" else profile_decode(lm)


@contextlib.contextmanager
def _exclusive(path: str | None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the block, waiting up to
    :data:`LOCK_WAIT_S` seconds for it; past that (a hung engine, or another user's process,
    holding it) the pass runs without it, logged, rather than keep the engine from serving."""
    if path is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)   # a planted link is refused
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("profiling lock %s still held after %.0f s: profiling without it", path,
                                LOCK_WAIT_S)
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)   # releases the lock


def describe(points: Sequence[ProfilePoint]) -> str:
    """``batch x tokens:milliseconds`` per point, for a log line."""
    return ", ".join(f"{p.batch}x{p.tokens}:{p.seconds * 1e3:.2f}ms" for p in points)
