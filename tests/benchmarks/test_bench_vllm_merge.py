"""benchmarks/bench_vllm.py ``--merge``: a run of some set-ups (the TP 2 rows) goes into the
existing results without losing the other rows or the run each was measured in; the hold
figure and its target come from the kvstore row."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks")]

import bench_vllm  # noqa: E402


def test_merged_rows_keep_their_own_runs_and_ratios_are_recomputed_only_where_measured() -> None:
    old = {"run": {"date": "2026-01-01", "commit": "old"}, "ratios": {"ttft_hit_vs_mooncake_connector": 0.49},
           "setups": {"mooncake": {"ttft_reuse_p50_ms": 200.0}, "kvstore": {"ttft_reuse_p50_ms": 99.0}}}
    new = {"kvstore": {"ttft_reuse_p50_ms": 100.0, "hold_ms_p99_after_finish": 12.0},
           "recompute_tp2": {"ttft_reuse_p50_ms": 400.0}, "kvstore_tp2": {"ttft_reuse_p50_ms": 120.0}}
    report = bench_vllm.merged(old, dict(new), dict(new), 0.0)
    assert report["setups"]["mooncake"]["run"] == old["run"]               # an old row keeps its provenance
    assert report["setups"]["kvstore"]["run"]["commit"] != "old"          # a new row carries this run's
    assert report["setups"]["kvstore"]["ttft_reuse_p50_ms"] == 100.0
    assert report["ratios"]["ttft_hit_tp2_vs_recompute_tp2"] == 0.3
    assert report["ratios"]["ttft_hit_vs_mooncake_connector"] == 0.5      # recomputed from the merged rows
    assert report["hold_ms_p99_after_finish"] == 12.0
    assert report["met"]["hold_ms_p99_after_finish"] and report["met"]["ttft_hit_tp2_vs_recompute_tp2"]
