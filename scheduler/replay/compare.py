"""Pool on against pool off: two replays of the same requests on the same stack, side by side
(``kvstore up --replay``'s report). "Pool off" is the recompute baseline: every request sent
with ``"prefix_cache": false``, so its prefill computes every prompt token and no cache —
neither the engine's own nor the pool — is read or written (scheduler/frontdoor/openai_api.py,
protos/engine.proto ``PrefillRequest.recompute``)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tabulate import tabulate

from scheduler.replay.report import Report, token_rows_note

# (JSON name, what it compares, how to read it from a Report)
RATIOS: tuple[tuple[str, Callable[[Report], float | None]], ...] = (
    ("ttft_p50_pool_vs_recompute", lambda r: r.ttft_p50_s),
    ("ttft_p99_pool_vs_recompute", lambda r: r.ttft_p99_s),
    ("tbt_p99_pool_vs_recompute", lambda r: r.tbt_p99_s),
    ("prefill_tokens_pool_vs_recompute", lambda r: float(r.prefill_tokens)),
    ("goodput_pool_vs_recompute", lambda r: r.goodput_rps),
    ("wall_pool_vs_recompute", lambda r: r.wall_s),
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


@dataclass(frozen=True)
class Comparison:
    """``pool``: the replay with the pool on; ``recompute``: the same requests with it off;
    ``settings``: what was replayed (trace, window, mapping, SLOs)."""

    pool: Report
    recompute: Report
    settings: dict[str, Any] = field(default_factory=dict)

    def ratios(self) -> dict[str, float | None]:
        """Pool on / pool off of each figure in :data:`RATIOS` (None when either is missing
        or off is 0): below 1 for TTFT and prefill tokens means the pool saved that share."""
        return {name: _ratio(get(self.pool), get(self.recompute)) for name, get in RATIOS}

    def to_dict(self) -> dict[str, Any]:
        """``{"pool": Report, "recompute": Report, "ratios": ..., "settings": ...}`` as JSON-able dicts."""
        return {"pool": self.pool.to_dict(), "recompute": self.recompute.to_dict(), "ratios": self.ratios(),
                "settings": self.settings}


def format_comparison(c: Comparison) -> str:
    """The two runs side by side, with on/off ratios (a plain-text table, tabulate)."""
    p, r = c.pool, c.recompute
    ratios = c.ratios()

    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f} s"

    def rat(name: str) -> str:
        v = ratios[name]
        return "-" if v is None else f"{v:.3f}"

    def count(rep: Report) -> str:
        return f"{rep.completed} / {rep.requests_sent}"

    def troubles(rep: Report) -> str:
        return f"{rep.rejected} / {rep.failed} / {rep.skipped}"

    rows = [
        ("completed / sent", count(p), count(r), ""),
        ("rejected / failed / skipped", troubles(p), troubles(r), ""),
        ("prefix hit ratio (blocks)", f"{p.hit_ratio:.3f} (best {p.best_possible_hit_ratio:.3f})",
         f"{r.hit_ratio:.3f}", ""),
        ("prefill tokens computed", str(p.prefill_tokens), str(r.prefill_tokens),
         rat("prefill_tokens_pool_vs_recompute")),
        ("cached / prompt tokens", f"{p.cached_tokens} / {p.prompt_tokens}",
         f"{r.cached_tokens} / {r.prompt_tokens}", ""),
        ("TTFT p50", sec(p.ttft_p50_s), sec(r.ttft_p50_s), rat("ttft_p50_pool_vs_recompute")),
        ("TTFT p99", sec(p.ttft_p99_s), sec(r.ttft_p99_s), rat("ttft_p99_pool_vs_recompute")),
        ("TBT p99", sec(p.tbt_p99_s), sec(r.tbt_p99_s), rat("tbt_p99_pool_vs_recompute")),
        ("met both SLOs", f"{p.met_slo} of {p.requests_sent}", f"{r.met_slo} of {r.requests_sent}", ""),
        ("goodput", f"{p.goodput_rps:.3f} req/s", f"{r.goodput_rps:.3f} req/s", rat("goodput_pool_vs_recompute")),
        ("wall time", f"{p.wall_s:.2f} s", f"{r.wall_s:.2f} s", rat("wall_pool_vs_recompute")),
    ]
    table = tabulate(rows, headers=["", "pool on", "pool off (recompute)", "on / off"], disable_numparse=True)
    note = token_rows_note(p, r)
    return (f"{table}\nSLOs: TTFT <= {p.ttft_slo_s:g} s, mean TBT of a request <= {p.tbt_slo_s:g} s"
            + (f"\n{note}" if note else ""))
