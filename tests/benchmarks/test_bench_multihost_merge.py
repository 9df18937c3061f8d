"""benchmarks/bench_multihost.py ``--only vllm``: the part's figures go into the existing
results without losing the others' figures or the run that measured them."""
from __future__ import annotations

from benchmarks import bench_multihost


def test_a_part_merged_keeps_the_other_parts_figures_and_their_run() -> None:
    old = {"cross_host_get_16MiB_vs_mooncake": 1.05, "faults": {"link_cut": {}}, "ttft_hit_remote_vs_recompute": None,
           "not_measured": {"ttft_hit_remote_vs_recompute": "not run"}, "run": {"commit": "old"}}
    new = bench_multihost.vllm_figures({"ttft_hit_remote_vs_recompute": 0.2, "hit_tokens": 96})
    report = bench_multihost.merge(old, new, ["vllm"])
    assert report["cross_host_get_16MiB_vs_mooncake"] == 1.05 and report["faults"] == {"link_cut": {}}
    assert report["ttft_hit_remote_vs_recompute"] == 0.2 and report["vllm_remote_hits"] == {"hit_tokens": 96}
    assert report["runs"]["reads"] == report["runs"]["faults"] == {"commit": "old"}
    assert report["runs"]["vllm"]["commit"] != "old" and "run" not in report and "not_measured" not in report
