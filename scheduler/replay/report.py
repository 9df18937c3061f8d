"""The result of a trace replay: what each request saw, and the summary a person reads
(goodput beside hit ratio, TTFT/TBT percentiles and rejections, docs/architecture.md §5)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from scheduler.stats import mean, percentile


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One replayed request, measured by the client. ``status``: "ok", "rejected", "failed"
    or "skipped" (never sent: longer than the model's limit); ``code``: the rejection
    reason, the failure (HTTP status or error kind) or why it was skipped;
    ``ttft_s``: send to first token (seconds); ``tbt_s``: gaps between later tokens
    (seconds); ``cached_tokens``: the answer's ``usage.prompt_tokens_details.cached_tokens``,
    prompt tokens its prefill did not compute because they were cached (the front door's one
    definition in every topology, never the prefill-to-decode hand-off: docs/metrics.md);
    ``cached_blocks``/``trace_blocks``: trace blocks served from cache / in all;
    ``token_ids``: the tokens generated (kept for comparing set-ups, not reported)."""

    status: str
    code: str = ""
    ttft_s: float | None = None
    tbt_s: tuple[float, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cached_blocks: int = 0
    trace_blocks: int = 0
    token_ids: tuple[int, ...] = field(default=(), repr=False)

    def meets(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        """Served within both SLOs: TTFT <= ``ttft_slo_s`` and mean TBT <= ``tbt_slo_s``
        (a request of one token has no TBT and meets that SLO)."""
        if self.status != "ok" or self.ttft_s is None or self.ttft_s > ttft_slo_s:
            return False
        gap = mean(self.tbt_s) if self.tbt_s else None
        return gap is None or gap <= tbt_slo_s


@dataclass(frozen=True)
class Report:
    """Summary of a replay; every time in seconds. Hit ratios are trace blocks served from a
    cache / trace blocks of all requests sent (``best_possible_hit_ratio``: an infinite cache
    that never serves a prompt's last token, over the same requests). ``goodput_rps``:
    completed requests meeting both SLOs per second of ``wall_s``. ``prefill_tokens``:
    prompt tokens computed (not loaded from a cache) for the completed requests. Skipped
    requests (``skipped``, by reason) were never sent and count nowhere else.
    ``outcomes`` (arrival order, skipped ones included) and ``best_blocks`` (per request
    sent, the best possible hit in trace blocks) are kept for plots, not written by
    :meth:`to_dict`."""

    requests_sent: int
    completed: int
    rejected: int
    failed: int
    rejected_by_reason: dict[str, int]
    failed_by_code: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    hit_ratio: float
    best_possible_hit_ratio: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tbt_p50_s: float | None
    tbt_p99_s: float | None
    ttft_slo_s: float
    tbt_slo_s: float
    slo_rule: str
    met_slo: int
    goodput_rps: float
    wall_s: float
    settings: dict[str, Any] = field(default_factory=dict)
    skipped: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    prefill_tokens: int = 0
    outcomes: tuple[RequestOutcome, ...] = field(default=(), repr=False, compare=False)
    best_blocks: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field but ``outcomes`` and ``best_blocks``."""
        out = asdict(self)
        del out["outcomes"], out["best_blocks"]
        return out


def _count(items: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def summarize(outcomes: Sequence[RequestOutcome], best_hit_blocks: int, wall_s: float,
              ttft_slo_s: float, tbt_slo_s: float, settings: dict[str, Any] | None = None,
              best_blocks: Sequence[int] = ()) -> Report:
    """Fold per-request outcomes into a :class:`Report`; ``best_hit_blocks`` is the best possible
    hit (trace blocks) summed over the requests sent (``best_blocks``: the same, per request
    sent, in order; optional)."""
    every = tuple(outcomes)
    skipped = [o for o in every if o.status == "skipped"]
    outcomes = [o for o in every if o.status != "skipped"]
    ok = [o for o in outcomes if o.status == "ok"]
    blocks = sum(o.trace_blocks for o in outcomes)
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    tbts = [t for o in ok for t in o.tbt_s]
    met = sum(o.meets(ttft_slo_s, tbt_slo_s) for o in ok)
    return Report(
        requests_sent=len(outcomes), completed=len(ok),
        rejected=sum(o.status == "rejected" for o in outcomes),
        failed=sum(o.status == "failed" for o in outcomes),
        rejected_by_reason=_count([o.code for o in outcomes if o.status == "rejected"]),
        failed_by_code=_count([o.code for o in outcomes if o.status == "failed"]),
        prompt_tokens=sum(o.prompt_tokens for o in outcomes), cached_tokens=sum(o.cached_tokens for o in ok),
        completion_tokens=sum(o.completion_tokens for o in ok),
        hit_ratio=sum(o.cached_blocks for o in ok) / blocks if blocks else 0.0,
        best_possible_hit_ratio=best_hit_blocks / blocks if blocks else 0.0,
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        tbt_p50_s=percentile(tbts, 50), tbt_p99_s=percentile(tbts, 99),
        ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s,
        slo_rule="TTFT <= ttft_slo_s and mean TBT of the request <= tbt_slo_s",
        met_slo=met, goodput_rps=met / wall_s if wall_s > 0 else 0.0, wall_s=wall_s,
        settings=dict(settings or {}), skipped=len(skipped),
        skipped_by_reason=_count([o.code for o in skipped]),
        prefill_tokens=sum(o.prompt_tokens - o.cached_tokens for o in ok),
        outcomes=every, best_blocks=tuple(best_blocks))


def format_report(report: Report) -> str:
    """A plain-text table for people."""
    def s(v: float | None, unit: str = " s") -> str:
        return "-" if v is None else f"{v:.4f}{unit}"

    sent = max(1, report.requests_sent)
    rows = [
        ("requests sent", str(report.requests_sent)),
        ("completed", str(report.completed)),
        ("rejected (429)", f"{report.rejected} ({report.rejected / sent:.1%})"
         + (f" {report.rejected_by_reason}" if report.rejected_by_reason else "")),
        ("failed", str(report.failed) + (f" {report.failed_by_code}" if report.failed_by_code else "")),
        ("skipped (not sent)", str(report.skipped) + (f" {report.skipped_by_reason}" if report.skipped else "")),
        ("prefix hit ratio (blocks)", f"{report.hit_ratio:.3f}"),
        ("best possible hit ratio", f"{report.best_possible_hit_ratio:.3f}"),
        ("cached / prompt tokens", f"{report.cached_tokens} / {report.prompt_tokens}"),
        ("prefill tokens computed", str(report.prefill_tokens)),
        ("TTFT p50 / p99", f"{s(report.ttft_p50_s)} / {s(report.ttft_p99_s)}"),
        ("TBT p50 / p99", f"{s(report.tbt_p50_s)} / {s(report.tbt_p99_s)}"),
        ("SLOs", f"TTFT <= {report.ttft_slo_s:g} s, mean TBT <= {report.tbt_slo_s:g} s"),
        ("met both SLOs", f"{report.met_slo} of {report.requests_sent}"),
        ("goodput", f"{report.goodput_rps:.3f} req/s"),
        ("wall time", f"{report.wall_s:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    note = token_rows_note(report)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows) + (f"\n{note}" if note else "")


def token_rows_note(*reports: Report) -> str | None:
    """The line under a report's table when some request sent did not complete: its token
    rows then count different requests (prompt tokens: every request sent; cached and
    computed tokens: the completed ones), so they do not add up. None when all completed."""
    if all(r.completed == r.requests_sent for r in reports):
        return None
    return "token rows: prompt tokens of every request sent; cached and prefill tokens of the completed ones"
