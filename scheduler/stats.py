"""Latency statistics shared by the live replay report (:mod:`scheduler.replay.report`) and the
simulator (:mod:`scheduler.sim`): percentiles and Mooncake's TBT, one definition each.

Mooncake's TBT of a request (FAST'25, §8.1): the mean of the longest 10% of its token
intervals — a request meets the TBT SLO when that mean is within it, so a few long stalls
count even when the average interval is small.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

TBT_TAIL_FRACTION = 0.1


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0–100, linear interpolation) of ``values``; None when empty."""
    return float(np.percentile(values, q)) if len(values) else None


def mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def mooncake_tbt(intervals: Sequence[float], tail: float = TBT_TAIL_FRACTION) -> float | None:
    """Mean of the longest ``ceil(tail · n)`` of ``n`` token intervals (seconds); None when
    there is none (a one-token request)."""
    if not intervals:
        return None
    m = max(1, math.ceil(tail * len(intervals)))
    return float(np.mean(sorted(intervals, reverse=True)[:m]))


def mooncake_tbt_runs(runs: Iterable[tuple[float, int]], tail: float = TBT_TAIL_FRACTION) -> float | None:
    """:func:`mooncake_tbt` of intervals given as ``(interval_s, count)`` runs, without
    expanding them (a simulator records equal steps as one run)."""
    runs = sorted(((v, c) for v, c in runs if c > 0), reverse=True)
    n = sum(c for _, c in runs)
    if n == 0:
        return None
    m = max(1, math.ceil(tail * n))
    total, left = 0.0, m
    for v, c in runs:
        take = min(c, left)
        total += v * take
        left -= take
        if left == 0:
            break
    return total / m
