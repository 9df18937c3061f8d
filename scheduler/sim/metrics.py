"""What a simulation run measured: per-request outcomes folded into one row of the table
(docs/architecture.md §5), with the percentile and Mooncake-TBT definitions of
:mod:`scheduler.stats` that the live replay report shares."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from scheduler.sim.config import SimConfig
from scheduler.sim.workload import SimRequest
from scheduler.stats import mean, mooncake_tbt_runs, percentile
from scheduler.trace import TRACE_BLOCK_TOKENS, TraceMapping, best_possible_hit_blocks


@dataclass(frozen=True)
class SimResult:
    """One run. Times in seconds (virtual, except ``wall_s``). ``met_slo``: completed
    requests with TTFT <= ``ttft_slo_s`` and Mooncake TBT <= ``tbt_slo_s``; ``goodput_rps``:
    those per second of the makespan (first arrival to last completion, as the live replay
    report counts wall time); ``effective_capacity``: their fraction of
    all requests; ``throughput_tok_s``: tokens generated per second of the makespan (first
    arrival to last completion). ``hit_ratio``: trace blocks loaded from a cache / trace
    blocks of the prefilled requests; ``best_possible_hit_ratio``: an infinite cache over the
    same requests, same rule (never the last prompt token). ``wasted_prefill_gpu_s``:
    prefill GPU-seconds (instance-seconds × GPUs) spent on requests that did not meet both
    SLOs (late rejections included); ``late_rejected_prefill_gpu_s``: the part of it spent on
    requests rejected after their prefill. ``prefill_log_error_mean``/``_sd``: mean and
    standard deviation of ``ln(observed / predicted)`` prefill seconds, the scheduler's
    T_prefill predictor against the engines (None when not measured).
    ``ttft_no_queue_p99_s``: the p99 of TTFT less each request's wait before its prefill
    started (what its load, prefill and hand-off took alone): ``ttft_p99_s`` minus it is what
    queueing added to the tail."""

    policy: str
    topology: str
    admission: str
    speed: float
    requests: int
    completed: int
    rejected_early: int
    rejected_late: int
    met_slo: int
    goodput_rps: float
    effective_capacity: float
    throughput_tok_s: float
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tbt_p90_s: float | None
    tbt_p99_s: float | None
    ttft_violations: int
    tbt_violations: int
    hit_ratio: float
    best_possible_hit_ratio: float
    wasted_prefill_gpu_s: float
    late_rejected_prefill_gpu_s: float
    prefill_gpu_s: float
    makespan_s: float
    wall_s: float
    prefill_log_error_mean: float | None = None
    prefill_log_error_sd: float | None = None
    ttft_no_queue_p99_s: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    ttfts: tuple[float, ...] = field(default=(), repr=False)

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_samples:
            d.pop("ttfts")
        return d


def summarize(cfg: SimConfig, reqs: Sequence[SimRequest], wall_s: float, gpus: int,
              prefill_log_error: tuple[float, float] | None = None) -> SimResult:
    """Fold a finished run's requests into a :class:`SimResult`; ``prefill_log_error``: the
    policy's T_prefill predictor's error over the run
    (:attr:`scheduler.policy.costing.PrefillModel.log_error`)."""
    ok = [r for r in reqs if r.status == "ok"]
    prefilled = [r for r in reqs if r.first_token_s >= 0]
    ttfts = [r.first_token_s - r.arrival_s for r in ok]
    tbts = {r.rid: mooncake_tbt_runs(r.tbt_runs) for r in ok}
    met = ttft_bad = tbt_bad = 0
    wasted = 0.0
    for r in prefilled:
        good = False
        if r.status == "ok":
            t_ok = r.first_token_s - r.arrival_s <= cfg.ttft_slo_s
            tbt = tbts[r.rid]
            b_ok = tbt is None or tbt <= cfg.tbt_slo_s
            ttft_bad += not t_ok
            tbt_bad += not b_ok
            good = t_ok and b_ok
            met += good
        if not good:
            wasted += r.prefill_s
    blocks = sum(r.trace_blocks for r in prefilled)
    best = sum(best_possible_hit_blocks([r.trace for r in prefilled], TraceMapping(TRACE_BLOCK_TOKENS)))
    arrivals = [r.arrival_s for r in reqs]
    end = max((r.finish_s for r in ok), default=0.0)
    makespan = end - min(arrivals, default=0.0)
    tbt_values = [v for v in tbts.values() if v is not None]
    return SimResult(
        policy=cfg.policy, topology=cfg.topology, admission=cfg.admission, speed=cfg.speed,
        requests=len(reqs), completed=len(ok),
        rejected_early=sum(r.status == "rejected_early" for r in reqs),
        rejected_late=sum(r.status == "rejected_late" for r in reqs),
        met_slo=met, goodput_rps=met / makespan if makespan > 0 else 0.0,
        effective_capacity=met / len(reqs) if reqs else 0.0,
        throughput_tok_s=sum(r.output for r in ok) / makespan if makespan > 0 else 0.0,
        ttft_mean_s=mean(ttfts), ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99), tbt_p90_s=percentile(tbt_values, 90),
        tbt_p99_s=percentile(tbt_values, 99), ttft_violations=ttft_bad, tbt_violations=tbt_bad,
        hit_ratio=sum(r.hit_blocks for r in prefilled) / blocks if blocks else 0.0,
        best_possible_hit_ratio=best / blocks if blocks else 0.0,
        wasted_prefill_gpu_s=wasted * gpus,
        late_rejected_prefill_gpu_s=sum(r.prefill_s for r in reqs if r.status == "rejected_late") * gpus,
        prefill_gpu_s=sum(r.prefill_s for r in prefilled) * gpus,
        makespan_s=makespan, wall_s=wall_s,
        prefill_log_error_mean=None if prefill_log_error is None else prefill_log_error[0],
        prefill_log_error_sd=None if prefill_log_error is None else prefill_log_error[1],
        ttft_no_queue_p99_s=percentile([r.first_token_s - max(r.arrival_s, r.prefill_start_s) for r in ok], 99),
        settings=asdict(cfg), ttfts=tuple(ttfts))
