"""The set-ups' side-by-side report (scheduler/replay/compare_setups.py): hit tokens by source from
vLLM's Prometheus counters, kvstore's ratios against vLLM alone and recompute, and the greedy
output check."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from scheduler.replay.compare_setups import SetupComparison, SetupRun, cache_hits, format_setups, outputs_equal
from scheduler.replay.report import RequestOutcome, summarize


def vllm_metrics(local: int, pool: int, prompt: int) -> str:
    """Exposition text with vLLM's counter names and labels, as a vLLM 0.32 server writes them."""
    registry = CollectorRegistry()
    for name, value in (("vllm:prefix_cache_hits", local), ("vllm:external_prefix_cache_hits", pool),
                        ("vllm:prompt_tokens", prompt), ("vllm:prefix_cache_queries", prompt)):
        Counter(name, "tokens", ["model_name", "engine"], registry=registry).labels("m", "0").inc(value)
    return generate_latest(registry).decode()


def test_cache_hits_sums_each_source_over_the_instances() -> None:
    hits = cache_hits([vllm_metrics(100, 0, 1000), vllm_metrics(30, 200, 500)])
    assert hits == {"local": 130.0, "pool": 200.0, "prompt": 1500.0}
    assert cache_hits([]) == {"local": 0.0, "pool": 0.0, "prompt": 0.0}


def report(ttfts: list[float], cached: int, tokens: tuple[int, ...] = (5, 6)) -> object:
    outcomes = [RequestOutcome("ok", "", t, (0.01,), 100, cached, 2, cached // 32, 4, tokens) for t in ttfts]
    return summarize(outcomes, 4, 10.0, 2.0, 0.2)


def comparison() -> SetupComparison:
    runs = (SetupRun("vllm", "vLLM alone", "apc", report([1.0, 2.0, 3.0], 32), {"local": 96, "pool": 0, "prompt": 300},
                     {"instances_kv": 1 << 20}),
            SetupRun("kvstore", "kvstore", "pool", report([0.5, 0.5, 1.0], 64, (5, 7)),
                     {"local": 96, "pool": 96, "prompt": 300}, {"instances_kv": 1 << 20, "pool_dram": 2 << 20}),
            SetupRun("recompute", "recompute", "none", report([2.0, 4.0, 5.0], 0),
                     {"local": 0, "pool": 0, "prompt": 300}, {"instances_kv": 1 << 20}))
    return SetupComparison(runs, {"requests": 3})


def test_ratios_divide_kvstore_by_each_baseline() -> None:
    c = comparison()
    r = c.ratios()
    assert r["ttft_p50_kvstore_vs_vllm"] == pytest.approx(0.5 / 2.0)
    assert r["ttft_p50_kvstore_vs_recompute"] == pytest.approx(0.5 / 4.0)
    assert r["prefill_tokens_kvstore_vs_vllm"] == pytest.approx((3 * 36) / (3 * 68))
    assert r["goodput_kvstore_vs_vllm"] == pytest.approx(3 / 2)   # vLLM alone's 3 s TTFT misses the 2 s SLO
    assert c.get("kvstore").hit_ratio("pool") == pytest.approx(96 / 300)
    assert c.get("recompute").hit_ratio("local") == 0.0


def test_output_match_counts_requests_whose_tokens_equal_recomputes() -> None:
    c = comparison()
    assert c.output_match() == {"vllm": 1.0, "kvstore": 0.0, "recompute": 1.0}
    failed = summarize([RequestOutcome("failed", "x")], 0, 1.0, 2.0, 0.2)
    assert outputs_equal(failed, c.get("vllm").report) is None


def test_the_table_and_the_json_name_every_setup_and_ratio() -> None:
    c = comparison()
    text = format_setups(c)
    for word in ("vLLM alone", "kvstore / vLLM", "kvstore / recompute", "hit ratio, pool (tokens)", "0.250",
                 "greedy output equal to recompute's: vllm 100%, kvstore 0%"):
        assert word in text, word
    d = c.to_dict()
    assert list(d["setups"]) == ["vllm", "kvstore", "recompute"]
    assert d["setups"]["kvstore"]["memory_bytes_total"] == 3 << 20
    assert d["setups"]["kvstore"]["hit_ratio_pool"] == pytest.approx(0.32)
    assert "outcomes" not in d["setups"]["vllm"]["report"]


def test_a_comparison_comes_back_from_its_json_with_what_the_plots_need() -> None:
    c = comparison()
    back = SetupComparison.from_dict(c.to_dict())
    assert [r.name for r in back.runs] == ["vllm", "kvstore", "recompute"]
    assert back.ratios() == c.ratios()
    assert [o.ttft_s for o in back.get("kvstore").report.outcomes] == [0.5, 0.5, 1.0]
