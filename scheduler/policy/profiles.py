"""Seeds of the Conductor's predictors from a profiling pass: a least-squares fit of measured
prefills and decode steps, the same for the live router (the engines' own pass at start,
engines/profiling.py, reported in ``Info``) and the simulator (a pass on a cost-model engine,
scheduler/sim/profiling.py).

T_prefill's coefficients are fitted by relative error, as the online fit is
(:mod:`scheduler.policy.costing`), but weighing each prefill by 1 / observed² since there is no
prediction yet (biased low by ~1.5σ², ~1.5% at a CV of 0.1, in a seed the online fit soon
replaces); TBT's by absolute error on ``(1, batch, kv_tokens)``. Both non-negative
(:class:`scheduler.policy.fit.OnlineFit`). The online fits then refine the seeds from every
prefill and decode the router observes.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

from engines.types import EngineInfo
from kvstore.errors import InvalidArgument
from scheduler.policy.conductor import ConductorConfig
from scheduler.policy.costing import PrefillModel, PrefillProfile
from scheduler.policy.fit import OnlineFit
from scheduler.policy.tbt import DecodeProfile

log = logging.getLogger(__name__)


MIN_SECONDS = 1e-7            # no forward of a model takes less: a shorter timing is nonsense
MAX_SECONDS = 1e6
MAX_TOKENS = 1 << 24          # past any model's context: a larger count is nonsense


def _usable(n: float, seconds: float, tokens: float | None = None) -> bool:
    """A point a fit may use: ``n`` (prompt tokens, or a decode batch) in [1, MAX_TOKENS],
    ``tokens`` (resident KV tokens, when given) in [0, MAX_TOKENS], ``seconds`` in
    [MIN_SECONDS, MAX_SECONDS]. An engine reports its profile over gRPC, and one buggy or
    hostile point must not make a seed of 1/seconds² = inf (nor raise in the router)."""
    return (1 <= n <= MAX_TOKENS and MIN_SECONDS <= seconds <= MAX_SECONDS
            and (tokens is None or 0 <= tokens <= MAX_TOKENS))


def _fit(rows: Iterable[tuple[tuple[float, float, float], float, float]]) -> tuple[float, ...] | None:
    """Non-negative least squares over ``(features, seconds, weight)`` rows, in order; None
    when the solve fails or gives a coefficient that is not finite."""
    fit = OnlineFit((0.0, 0.0, 0.0), min_samples=1, decay=1.0)
    try:
        for x, seconds, weight in rows:
            fit.observe(x, seconds, weight)
        coefficients = fit.coefficients
    except (ArithmeticError, ValueError, InvalidArgument, np.linalg.LinAlgError) as exc:
        log.warning("profile fit failed (%s)", exc)
        return None
    return coefficients if all(math.isfinite(c) for c in coefficients) else None


def fit_prefill(points: Iterable[tuple[int, float]], base: PrefillProfile) -> PrefillProfile | None:
    """``base`` with ``fixed_s``, ``s_per_token`` and ``s_per_token_context`` fitted to
    ``points`` ((prompt tokens, all computed; seconds), in order); None when the usable
    points (:func:`_usable`: others are left out) span fewer than three prompt lengths (three
    coefficients: with two, the split between the per-token and the per-token-context cost
    is the fit's guess, and a profiling pass cut short by its budget can leave two), or
    when the fit fails."""
    usable = [(n, s) for n, s in points if _usable(n, s)]
    if len({n for n, _ in usable}) < 3:
        return None
    fitted = _fit((PrefillModel.features(n, 0), s, 1.0 / s ** 2) for n, s in usable)
    if fitted is None:
        return None
    k0, k1, k2 = fitted
    return replace(base, fixed_s=k0, s_per_token=k1, s_per_token_context=k2)


def fit_decode(points: Iterable[tuple[int, int, float]], base: DecodeProfile) -> DecodeProfile | None:
    """``base`` with ``step_s``, ``s_per_request`` and ``s_per_kv_token`` fitted to ``points``
    ((batch, resident KV tokens, seconds between a request's tokens), in order); None with
    fewer than three usable points (:func:`_usable`: others are left out) or when the fit
    fails."""
    usable = [(b, kv, s) for b, kv, s in points if _usable(b, s, kv)]
    if len(usable) < 3:
        return None
    fitted = _fit(((1.0, float(b), float(kv)), s, 1.0) for b, kv, s in usable)
    if fitted is None:
        return None
    d0, d1, d2 = fitted
    return replace(base, step_s=d0, s_per_request=d1, s_per_kv_token=d2)


def seeded_from_engines(config: ConductorConfig, infos: Sequence[EngineInfo]) -> ConductorConfig:
    """``config`` with its T_prefill seed fitted to the prefill engines' profiling passes and
    its TBT seed to the decode engines' (their ``Info.profile``; every engine of a role pooled:
    they run one model), logged; a role whose engines reported too little to fit
    (:func:`fit_prefill`, :func:`fit_decode`; an engine started with ``--no-profile``) keeps
    the seed it had, and says so."""
    prefill_points = [(p.tokens, p.seconds) for i in infos if i.role == "prefill" for p in i.profile]
    decode_points = [(p.batch, p.tokens, p.seconds) for i in infos if i.role == "decode" for p in i.profile]
    prefill = fit_prefill(prefill_points, config.prefill)
    decode = fit_decode(decode_points, config.decode)
    if prefill is None:
        log.info("T_prefill: built-in seed (the prefill engines reported too little of a profiling pass to fit)")
    else:
        log.info("T_prefill seeded from %d profiled prefills: %.3g s + %.3g s/token + %.3g s/(token · context token)",
                 sum(_usable(n, s) for n, s in prefill_points), prefill.fixed_s, prefill.s_per_token,
                 prefill.s_per_token_context)
    if decode is None:
        log.info("TBT: built-in seed (the decode engines reported too little of a profiling pass to fit)")
    else:
        log.info("TBT seeded from %d profiled decode points: %.3g s + %.3g s/request + %.3g s/KV token",
                 sum(_usable(b, s, kv) for b, kv, s in decode_points), decode.step_s, decode.s_per_request,
                 decode.s_per_kv_token)
    return replace(config, prefill=prefill or config.prefill, decode=decode or config.decode)
