"""PNG plots of simulation results (matplotlib, headless): TTFT CDF per policy, goodput
against request rate, hit ratio against pool capacity."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.sim.metrics import SimResult


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def ttft_cdf(results: Sequence[SimResult], path: str | Path) -> Path:
    """One CDF line of completed requests' TTFT per (policy, topology, admission)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if not r.ttfts:
            continue
        x = np.sort(np.asarray(r.ttfts))
        y = np.arange(1, len(x) + 1) / len(x)
        ax.plot(x, y, label=f"{r.policy} ({r.topology}, {r.admission}) mean {r.ttft_mean_s:.2f} s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_title("TTFT CDF per policy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, plt, path)


def goodput_vs_rate(sweep: dict[str, list[tuple[float, float]]], path: str | Path) -> Path:
    """``sweep``: label → [(request rate req/s, goodput req/s)]."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in sweep.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    lo = min(x for pts in sweep.values() for x, _ in pts)
    hi = max(x for pts in sweep.values() for x, _ in pts)
    ax.plot([lo, hi], [lo, hi], color="grey", linestyle=":", label="offered load")
    ax.set_xlabel("request rate (req/s; replay speed × trace rate)")
    ax.set_ylabel("goodput (req/s meeting both SLOs)")
    ax.set_title("Goodput against request rate")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, plt, path)


def hit_vs_capacity(points: list[tuple[float | None, float]], best: float, path: str | Path) -> Path:
    """``points``: [(pool DRAM capacity in tokens or None for unbounded, hit ratio)]; the
    unbounded point is drawn one decade right of the largest bounded one. ``best``: the best
    possible hit ratio."""
    bounded = [c for c, _ in points if c is not None] or [1.0]
    points = [(c if c is not None else 10 * max(bounded), h) for c, h in points]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs, ys = zip(*sorted(points))
    ax.plot(xs, ys, marker="o", label="simulated hit ratio")
    ax.axhline(best, color="grey", linestyle=":", label=f"best possible ({best:.3f})")
    ax.set_xscale("log")
    ax.set_xlabel("pool DRAM capacity (tokens, log scale; the last point: unbounded)")
    ax.set_ylabel("prefix hit ratio (trace blocks)")
    ax.set_title("Hit ratio against pool capacity")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, plt, path)


def save_figure(fig: Any, plt: Any, path: str | Path) -> Path:
    """Write a matplotlib figure to ``path`` as PNG (110 dpi; parents made) and close it;
    the simulator's and the replay's plots (scheduler/replay/plots.py) both go through it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
