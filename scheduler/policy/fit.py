"""Online least squares with non-negative coefficients: the fitting behind the prefill-time
and TBT predictors (:mod:`scheduler.policy.costing`, :mod:`scheduler.policy.tbt`).

``y ≈ Σ_j c_j · x_j`` with every ``c_j >= 0``, fitted from observations ``(x, y)`` through the
normal equations (``XᵀX``, ``Xᵀy``, kept with an exponential forgetting factor so that the
fit follows an engine whose speed drifts). Until ``min_samples`` observations exist the
seed coefficients (a profile) are used. Non-negativity is exact for the few features used
here (at most 4): when the least-squares solution over every feature has a negative
coefficient, every smaller subset of features is solved and the best non-negative one kept
(the unconstrained optimum, when it is non-negative, is the constrained one). Pure and
synchronous; O(k³) per refit when the fit is non-negative, O(k³ · 2ᵏ) when it is not;
refitted lazily on the next prediction. (Solving all 2ᵏ − 1 subsets at every refit would
take a fifth of the Conductor's whole-trace fig5 run.)
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations

import numpy as np

from kvstore.errors import InvalidArgument


class OnlineFit:
    """Invariant: ``coefficients`` are all >= 0 and have the length of ``seed``."""

    def __init__(self, seed: Sequence[float], min_samples: int = 8, decay: float = 0.995) -> None:
        if not seed or any(c < 0 for c in seed):
            raise InvalidArgument(f"seed coefficients must be a non-empty list of numbers >= 0, got {seed!r}")
        if min_samples < 1:
            raise InvalidArgument(f"min_samples must be >= 1, got {min_samples}")
        if not 0 < decay <= 1:
            raise InvalidArgument(f"decay must be in (0, 1], got {decay}")
        self.seed = tuple(float(c) for c in seed)
        self.min_samples = min_samples
        self.decay = decay
        k = len(seed)
        self._xtx = np.zeros((k, k))
        self._xty = np.zeros(k)
        self._yy = 0.0
        self.samples = 0
        self._coef = self.seed
        self._dirty = False

    @property
    def fitted(self) -> bool:
        """True once the fit (not the seed) is in use."""
        return self.samples >= self.min_samples

    @property
    def coefficients(self) -> tuple[float, ...]:
        if self._dirty:
            self._coef = self._solve()
            self._dirty = False
        return self._coef

    def predict(self, x: Sequence[float]) -> float:
        c = self.coefficients
        return sum(a * b for a, b in zip(c, x))

    def observe(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        """Fold in one observation (``x`` of the seed's length; ``y`` the measured value;
        ``weight``: its weight in the squared error, a finite number >= 0). Raises
        InvalidArgument for another weight."""
        if not (weight >= 0 and math.isfinite(weight)):
            raise InvalidArgument(f"weight must be a finite number >= 0, got {weight!r}")
        v = np.asarray(x, dtype=float)
        d = self.decay
        self._xtx = d * self._xtx + weight * np.outer(v, v)
        self._xty = d * self._xty + weight * v * y
        self._yy = d * self._yy + weight * y * y
        self.samples += 1
        self._dirty = self.fitted

    def _solve(self) -> tuple[float, ...]:
        k = len(self.seed)
        scale = np.sqrt(np.maximum(np.diag(self._xtx), 1e-300))
        a = self._xtx / np.outer(scale, scale)
        b = self._xty / scale
        full = _solve_on(a, b, list(range(k)))
        if full is not None and not (full < 0).any():
            return tuple(float(c) for c in full / scale)
        best, best_rss = None, np.inf
        for size in range(k - 1, 0, -1):
            for subset in combinations(range(k), size):
                idx = list(subset)
                sol = _solve_on(a, b, idx)
                if sol is None or (sol < 0).any():
                    continue
                coef = np.zeros(k)
                coef[idx] = sol
                rss = coef @ a @ coef - 2 * coef @ b
                if rss < best_rss - 1e-12:
                    best, best_rss = coef, rss
        if best is None:
            return self.seed
        return tuple(float(c) for c in best / scale)


def _solve_on(a: np.ndarray, b: np.ndarray, idx: list[int]) -> np.ndarray | None:
    """The least-squares coefficients of the features ``idx`` alone (normal equations ``a``,
    ``b``, a 1e-9 ridge against singular ones); None when still singular."""
    try:
        return np.linalg.solve(a[np.ix_(idx, idx)] + 1e-9 * np.eye(len(idx)), b[idx])
    except np.linalg.LinAlgError:
        return None
