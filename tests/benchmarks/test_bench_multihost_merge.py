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


def test_front_door_part_counts_hits_saved_by_the_other_instance() -> None:
    from benchmarks.multihost_frontdoor import _figures, _mark_saved_by
    rec = [{"prompt": "g0p0", "group": 0, "instance": "vllm-0", "cached_tokens": 0, "latency_ms": 100.0},
           {"prompt": "g0p1", "group": 0, "instance": "vllm-1", "cached_tokens": 1024, "latency_ms": 30.0},
           {"prompt": "g0p0", "group": 0, "instance": "vllm-0", "cached_tokens": 1248, "latency_ms": 20.0}]
    _mark_saved_by(rec)
    assert [r.get("saved_by") for r in rec] == [None, "vllm-0", "vllm-0"]
    got = _figures(rec, {"pool_dram": 2272.0, "instance": 0.0}, {"remote_leases": 2.0})
    assert got["requests_completed"] == 3 and got["requests_by_instance"] == {"vllm-0": 2, "vllm-1": 1}
    assert got["hits_saved_by_other_instance"] == 1 and got["cached_tokens_saved_by_other_instance"] == 1024
    assert got["cached_tokens_by_source"] == {"pool_dram": 2272.0}
    assert got["ttft_ms_p50"] == {"hit": 25.0, "miss": 100.0}
    new = bench_multihost.frontdoor_figures(got)
    report = bench_multihost.merge({"runs": {"vllm": {"commit": "old"}}}, new, ["frontdoor"])
    assert report["frontdoor_ttft_hit_vs_miss"] == 0.25 and report["runs"]["vllm"] == {"commit": "old"}
    assert report["runs"]["frontdoor"]["commit"] != "old"
