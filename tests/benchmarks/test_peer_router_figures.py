"""benchmarks/peer_router_figures.py: the Conductor against the best peer router of a seed."""
from __future__ import annotations

import pytest

from benchmarks.peer_router_figures import peer_ratios, sweep_figures


def _runs(conductor_p99: float) -> dict[str, dict[str, float]]:
    return {"conductor": {"ttft_mean_s": 1.5, "ttft_p99_s": conductor_p99, "ttft_no_queue_p99_s": 18.0,
                          "rejected": 0, "hit_ratio": 0.35},
            "dynamo_kv": {"ttft_mean_s": 2.0, "ttft_p99_s": 22.0, "ttft_no_queue_p99_s": 20.0, "rejected": 0,
                          "hit_ratio": 0.22},
            "llmd": {"ttft_mean_s": 3.0, "ttft_p99_s": 20.0, "ttft_no_queue_p99_s": 19.0, "rejected": 2,
                     "hit_ratio": 0.34},
            "sglang_cache_aware": {"ttft_mean_s": 4.0, "ttft_p99_s": 40.0, "ttft_no_queue_p99_s": 19.0,
                                   "rejected": 1, "hit_ratio": 0.34}}


def test_best_peer_is_taken_per_figure_and_the_no_queue_p99_against_it() -> None:
    r = peer_ratios(_runs(19.0))
    assert r["best_peer_router_avg_ttft"] == "dynamo_kv" and r["best_peer_router_p99_ttft"] == "llmd"
    assert r["conductor_vs_best_peer_router_avg_ttft"] == pytest.approx(0.75)
    assert r["conductor_vs_best_peer_router_p99_ttft"] == pytest.approx(19.0 / 20.0)
    assert r["conductor_no_queue_vs_best_peer_router_p99_ttft"] == pytest.approx(18.0 / 20.0)
    assert r["conductor_rejected_minus_fewest_peer"] == 0


def test_sweep_spreads_each_ratio_and_figure_over_the_seeds() -> None:
    got = {("fig5", s, p): v for s, p99 in ((0, 19.0), (1, 21.0)) for p, v in _runs(p99).items()}
    f = sweep_figures(got, (0, 1))
    assert f["ratios"]["conductor_vs_best_peer_router_p99_ttft"] == pytest.approx(
        {"mean": 1.0, "min": 0.95, "max": 1.05})
    assert f["figures"]["dynamo_kv_hit_ratio"]["mean"] == pytest.approx(0.22)
    assert f["best_peer_seeds"]["best_peer_router_p99_ttft"] == {"dynamo_kv": 0, "llmd": 2, "sglang_cache_aware": 0}
