"""The policy's online fits: the non-negative least-squares fit (scheduler/policy/fit.py) and
the T_prefill and TBT models that learn with it (scheduler/policy/costing.py,
scheduler/policy/tbt.py)."""
from __future__ import annotations

import random
from dataclasses import replace
from itertools import combinations

import numpy as np
import pytest

from scheduler.policy.costing import PrefillModel, PrefillProfile
from scheduler.policy.fit import OnlineFit
from scheduler.policy.tbt import DecodeProfile, TBTModel


def test_online_fit_recovers_a_model_and_keeps_coefficients_non_negative():
    fit = OnlineFit((1.0, 1.0, 1.0), min_samples=4)
    for n in range(1, 40):
        fit.observe((1.0, n, n * n), 0.01 + 0.002 * n)     # no quadratic part
    c = fit.coefficients
    assert all(x >= 0 for x in c)
    assert c[0] == pytest.approx(0.01, abs=1e-6) and c[1] == pytest.approx(0.002, rel=1e-4) and c[2] < 1e-8
    down = OnlineFit((0.0, 1.0), min_samples=2)
    for n in range(1, 10):
        down.observe((1.0, n), 1.0 - 0.05 * n)              # would need a negative slope
    assert all(x >= 0 for x in down.coefficients)


def _exhaustive_nonneg_fit(fit: OnlineFit) -> tuple[float, ...]:
    """The reference: every non-empty subset of features solved, the best non-negative kept."""
    k = len(fit.seed)
    scale = np.sqrt(np.maximum(np.diag(fit._xtx), 1e-300))
    a, b = fit._xtx / np.outer(scale, scale), fit._xty / scale
    best, best_rss = None, np.inf
    for size in range(k, 0, -1):
        for idx in map(list, combinations(range(k), size)):
            sol = np.linalg.solve(a[np.ix_(idx, idx)] + 1e-9 * np.eye(size), b[idx])
            if (sol < 0).any():
                continue
            coef = np.zeros(k)
            coef[idx] = sol
            rss = coef @ a @ coef - 2 * coef @ b
            if rss < best_rss - 1e-12:
                best, best_rss = coef, rss
    return fit.seed if best is None else tuple(float(c) for c in best / scale)


@pytest.mark.parametrize("seed", range(40))
def test_online_fit_is_the_best_non_negative_least_squares_fit(seed: int):
    # Solving the full system first (and the subsets only when it goes negative) gives what
    # solving every subset gives, whether the unconstrained fit is non-negative or not.
    rng = random.Random(seed)
    truth = [rng.choice((0.0, rng.uniform(0, 2))) for _ in range(3)]
    slope = rng.uniform(-1, 1)
    fit = OnlineFit((1.0, 1.0, 1.0), min_samples=3)
    for _ in range(30):
        x = (1.0, rng.uniform(1, 50), rng.uniform(1, 2500))
        y = sum(c * v for c, v in zip(truth, x)) + slope * x[1] + rng.gauss(0, 1)
        fit.observe(x, y)
    assert fit.coefficients == pytest.approx(_exhaustive_nonneg_fit(fit), rel=1e-6, abs=1e-9)
    assert all(c >= 0 for c in fit.coefficients)


def test_prefill_and_tbt_models_learn_online():
    model = PrefillModel(PrefillProfile(min_samples=4))
    for n, p in [(100, 0), (400, 0), (400, 300), (1000, 200), (2000, 0), (2000, 1500)]:
        c = n - p
        model.observe(n, p, 0.003 + 2e-5 * c + 1e-8 * c * (n + p) / 2)
    assert model.predict(1500, 500) == pytest.approx(0.003 + 2e-5 * 1000 + 1e-8 * 1000 * 1000, rel=1e-3)
    tbt = TBTModel(DecodeProfile(min_samples=4))
    for b, kv in [(1, 100), (4, 1000), (8, 5000), (16, 20000), (2, 300)]:
        tbt.observe(b, kv, 0.002 + 0.001 * b + 1e-7 * kv)
    assert tbt.predict(10, 8000) == pytest.approx(0.002 + 0.01 + 8e-4, rel=1e-3)


def test_before_the_fit_is_in_use_the_profile_is_scaled_to_the_prefills_observed():
    """The built-in seed has the shape of a prefill's cost but not this engine's speed: one
    observed prefill sets the scale of every prediction until the fit is in use, the geometric
    mean of the observed ratios thereafter; a frozen model (``learn=False``) and a model that
    has observed nothing predict the profile as it is, and once fitted the fit alone rules."""
    profile = PrefillProfile()
    raw = PrefillModel(profile).predict
    model = PrefillModel(profile)
    assert model.predict(1446, 32) == raw(1446, 32)
    model.observe(128, 0, 40.0 * raw(128))                      # an engine 40 times slower
    assert model.predict(1446, 32) == pytest.approx(40.0 * raw(1446, 32), rel=1e-9)
    model.observe_group([(458, 0), (964, 32)], 10.0 * (raw(458) + raw(964, 32)))   # then 10 times
    assert model.predict(2000) == pytest.approx(20.0 * raw(2000), rel=1e-9)      # sqrt(40 · 10)
    frozen = PrefillModel(replace(profile, learn=False))
    frozen.observe(128, 0, 40.0 * raw(128))
    assert frozen.predict(1446) == raw(1446)
    wild = PrefillModel(profile)
    wild.observe(128, 0, 1e200)                                  # nonsense: bounded, never inf
    assert wild.predict(1446) == pytest.approx(1000.0 * raw(1446), rel=1e-9)
    flat = PrefillModel(PrefillProfile(fixed_s=0.0, s_per_token=0.0, s_per_token_context=0.0, min_prefill_s=0.1))
    for _ in range(5):
        flat.observe(100, 0, 0.1)                                # a profile of 0 s: nothing to scale
    assert flat.predict(100) == 0.1
    fitted = PrefillModel(replace(profile, min_samples=3))
    for n in (100, 400, 1000, 2000):
        fitted.observe(n, 0, 0.01 + 1e-3 * n)
    assert fitted.predict(1500) == pytest.approx(0.01 + 1.5, rel=1e-3)
