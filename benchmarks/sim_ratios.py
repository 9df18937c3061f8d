"""The ratios benchmarks/bench_simulate.py reports from its simulated runs: the Conductor's
average TTFT against the paper's baselines, and the rejection pairings of Mooncake's Table 3."""
from __future__ import annotations


def cache_ratios(avg_ttft: dict[str, float]) -> dict[str, float]:
    """The Conductor's average TTFT against least-loaded's and local cache-aware's."""
    return {"conductor_vs_least_loaded_avg_ttft": avg_ttft["conductor"] / avg_ttft["least_loaded"],
            "conductor_vs_local_cache_aware_avg_ttft": avg_ttft["conductor"] / avg_ttft["local_cache_aware"]}


def rejection_ratios(late: dict, cur: dict, pre: dict) -> dict[str, float]:
    """Predictive against current-load early rejection: rejected requests, wasted prefill;
    and both against rejection after prefill only ("late", Table 3's baseline)."""
    return {"rejected_predictive_vs_current": pre["rejected"] / max(1, cur["rejected"]),
            "wasted_prefill_predictive_vs_current":
                pre["wasted_prefill_gpu_s"] / max(1e-9, cur["wasted_prefill_gpu_s"]),
            "rejected_predictive_vs_late": pre["rejected"] / max(1, late["rejected"]),
            "rejected_current_vs_late": cur["rejected"] / max(1, late["rejected"])}


def ratios_of(f5: dict, ovl: dict, oracle: bool) -> dict[str, float]:
    late, cur, pre = ovl["late"], ovl["current"], ovl["predictive"]
    return {
        "oracle": 1 if oracle else 0,
        "wall_s_full_trace_conductor": f5["conductor"].wall_s,
        **cache_ratios({p: r.ttft_mean_s for p, r in f5.items()}),
        **rejection_ratios(late, cur, pre),
        "late_rejected_prefill_predictive_vs_current": pre["late_rejected_prefill_gpu_s"]
        / max(1e-9, cur["late_rejected_prefill_gpu_s"]),
    }
