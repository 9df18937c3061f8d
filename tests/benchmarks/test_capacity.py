"""benchmarks/bench_capacity.py's arithmetic: a set-up's capacity at an SLO-attainment goal is the
highest swept rate before its attainment first falls below the goal, interpolated to the first
rate that misses it; a set-up that holds the goal everywhere has a lower bound, one that never
does has none; kvstore's ratio says which."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_capacity", ROOT / "benchmarks" / "bench_capacity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_capacity_is_interpolated_where_attainment_first_falls_below_the_goal(bench):
    rates = [0.5, 1.0, 1.5, 2.0]
    # 0.95 at 1.0, 0.75 at 1.5: the goal 0.9 is crossed a quarter of the way, at 1.125;
    # the recovery at 2.0 does not count (the first fall decides)
    assert bench.capacity(rates, [1.0, 0.95, 0.75, 0.92], 0.9) == {"rate_rps": pytest.approx(1.125),
                                                                     "lower_bound": False}
    assert bench.capacity(rates, [0.85, 0.95, 0.95, 0.95], 0.9) == {"rate_rps": None, "lower_bound": False}
    assert bench.capacity(rates, [1.0, 1.0, 0.95, 0.9], 0.9) == {"rate_rps": 2.0, "lower_bound": True}


def test_the_ratio_is_none_where_vllm_alone_has_no_upper_figure_and_flagged_where_kvstore_has_a_bound(bench):
    caps = {"kvstore": {"0.8": {"rate_rps": 2.0, "lower_bound": True}, "0.9": {"rate_rps": 1.2, "lower_bound": False}},
            "vllm": {"0.8": {"rate_rps": 1.0, "lower_bound": False}, "0.9": {"rate_rps": 1.5, "lower_bound": True}}}
    out = bench.ratios(caps, [0.8, 0.9])
    assert out["capacity_kvstore_vs_vllm_at_80"] == 2.0 and out["capacity_kvstore_vs_vllm_at_80_lower_bound"]
    assert out["capacity_kvstore_vs_vllm_at_90"] is None and not out["capacity_kvstore_vs_vllm_at_90_lower_bound"]


def test_repeats_pool_the_counts_and_average_the_latencies(bench):
    """A rate's repeats: the attainment is that of the pooled requests (not a mean of shares),
    each repeat's kept; latencies and goodput are averaged over the repeats that have one."""
    def one(met: int, sent: int, p99: float | None) -> dict:
        return {"attainment": met / sent, "met_slo": met, "requests": sent, "rejected": 1, "ttft_missed": 2,
                "itl_missed": 0, "not_completed": 1, "ttft_p50_s": 0.5, "ttft_p99_s": p99, "itl_p99_s": 0.1,
                "goodput_rps": 1.0}
    out = bench.pooled([one(76, 100, 4.0), one(86, 100, None), one(9, 10, 2.0)])
    assert out["met_slo"] == 171 and out["requests"] == 210 and out["rejected"] == 3
    assert out["attainment"] == pytest.approx(171 / 210)
    assert out["attainments"] == [0.76, 0.86, 0.9]
    assert out["ttft_p99_s"] == pytest.approx(3.0) and out["ttft_p50_s"] == pytest.approx(0.5)
