"""PNG plots of replays side by side (:class:`scheduler.replay.compare.Comparison`, pool on / off;
:class:`scheduler.replay.compare_setups.SetupComparison`, the set-ups over vLLM; matplotlib,
headless): the TTFT CDF of each run, and the hit ratio over the replay."""
from __future__ import annotations

from itertools import accumulate
from pathlib import Path
from typing import Any

from scheduler.replay.compare import Comparison
from scheduler.replay.compare_setups import SetupComparison
from scheduler.replay.report import Report
from scheduler.sim.plots import save_figure

Runs = list[tuple[str, Report]]      # (label, report), drawn in this order


def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _title(c: Comparison | SetupComparison) -> str:
    s = c.settings
    return (f"{s.get('requests', '?')} trace requests, {s.get('tokens_per_block', '?')} tokens per trace block, "
            f"speed {s.get('speed', '?')}")


def _runs(c: Comparison | SetupComparison) -> Runs:
    if isinstance(c, SetupComparison):
        return [(r.label, r.report) for r in c.runs]
    return [("pool on", c.pool), ("pool off (recompute)", c.recompute)]


def ttft_cdf(c: Comparison | SetupComparison, path: str | Path) -> Path:
    """One CDF line of the completed requests' TTFT (seconds, log scale) per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rep in _runs(c):
        xs = sorted(o.ttft_s for o in rep.outcomes if o.status == "ok" and o.ttft_s is not None)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        p50 = "-" if rep.ttft_p50_s is None else f"{rep.ttft_p50_s:.3f}"
        ax.step(xs, ys, where="post", label=f"{label}: p50 {p50} s, hit ratio {rep.hit_ratio:.2f}")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale; client-side, send to first token)")
    ax.set_ylabel("fraction of completed requests")
    what = " against ".join(label for label, _ in _runs(c))
    ax.set_title(f"TTFT CDF, {what}\n{_title(c)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return save_figure(fig, plt, path)


def _cumulative_hit(rep: Report, unit: str) -> list[float]:
    """After each request sent (arrival order), what was served from a cache so far / what was
    sent so far, in trace blocks (``unit`` "blocks") or prompt tokens ("tokens")."""
    sent = [o for o in rep.outcomes if o.status != "skipped"]
    ok = [o.status == "ok" for o in sent]
    if unit == "blocks":
        hits, total = [o.cached_blocks for o in sent], [o.trace_blocks for o in sent]
    else:
        hits, total = [o.cached_tokens for o in sent], [o.prompt_tokens for o in sent]
    return [h / b if b else 0.0 for h, b in zip(accumulate(h if k else 0 for h, k in zip(hits, ok)),
                                                 accumulate(total))]


def hit_ratio_over_replay(c: Comparison | SetupComparison, path: str | Path) -> Path:
    """The cumulative hit ratio after each request (arrival order) of every run, beside the
    best possible (an infinite cache over the same requests)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    runs = _runs(c)
    # trace blocks where the outcomes carry them (a live replay); prompt tokens for a report
    # read back from its JSON, whose requests keep their tokens only
    unit = "blocks" if any(o.trace_blocks for _, rep in runs for o in rep.outcomes) else "tokens"
    for label, rep in runs:
        ys = _cumulative_hit(rep, unit)
        ax.plot(range(1, len(ys) + 1), ys, linewidth=2.5,
                label=f"{label}: {ys[-1] if ys else 0.0:.3f} at the end")
    first = runs[0][1]
    sent = [o for o in first.outcomes if o.status != "skipped"]
    if unit == "blocks" and first.best_blocks and len(first.best_blocks) == len(sent):   # on top: a run may reach it
        best = [h / b if b else 0.0 for h, b in zip(accumulate(first.best_blocks),
                                                     accumulate(o.trace_blocks for o in sent))]
        ax.plot(range(1, len(best) + 1), best, color="black", linestyle="--", linewidth=1,
                label=f"best possible (infinite cache): {first.best_possible_hit_ratio:.3f}")
    ax.set_xlabel("requests sent (arrival order)")
    ax.set_ylabel(f"prefix hit ratio so far ({'trace blocks' if unit == 'blocks' else 'prompt tokens'})")
    ax.set_ylim(-0.02, 1.0)
    ax.set_title(f"Hit ratio over the replay\n{_title(c)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return save_figure(fig, plt, path)


def write_plots(c: Comparison | SetupComparison, out_dir: str | Path, prefix: str = "demo") -> list[Path]:
    """Both plots as ``<out_dir>/<prefix>_ttft_cdf.png`` and ``<prefix>_hit_ratio.png``."""
    out = Path(out_dir)
    return [ttft_cdf(c, out / f"{prefix}_ttft_cdf.png"), hit_ratio_over_replay(c, out / f"{prefix}_hit_ratio.png")]
