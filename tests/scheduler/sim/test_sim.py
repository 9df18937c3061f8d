"""The cluster simulator (scheduler/sim/): determinism, hit accounting against the best
possible, disaggregated vs colocated TBT, every policy, admission splits, the CLI. Small
slices of the conversation trace keep it fast; no timing assertions."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from launcher.cli import main
from scheduler.policy.baselines import POLICIES
from scheduler.sim import SimConfig, Simulator, simulate
from scheduler.sim.workload import load_workload, make_requests
from scheduler.stats import mooncake_tbt, mooncake_tbt_runs
from scheduler.trace import TraceMapping, best_possible_hit_ratio, load_trace

TRACE = str(Path(__file__).resolve().parents[3] / "data" / "traces" / "conversation_trace.jsonl")


def _run(cfg: SimConfig, limit: int):
    trace, keys = load_workload(TRACE, limit)
    sim = Simulator(cfg, make_requests(trace, keys, cfg.speed))
    reqs = sim.run()
    return reqs, sim.summarize(reqs, 0.0)


def _strip(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "wall_s"}


def test_mooncake_tbt() -> None:
    # 20 intervals: the longest 10% are the two largest
    intervals = [0.02] * 18 + [0.5, 0.3]
    assert mooncake_tbt(intervals) == pytest.approx(0.4)
    assert mooncake_tbt_runs([(0.02, 18), (0.5, 1), (0.3, 1)]) == pytest.approx(0.4)
    assert mooncake_tbt_runs([(0.05, 3), (0.01, 97)]) == pytest.approx((3 * 0.05 + 7 * 0.01) / 10)
    assert mooncake_tbt([]) is None and mooncake_tbt_runs([]) is None


def test_same_seed_same_result() -> None:
    cfg = SimConfig(policy="random", speed=2.0, seed=7)
    a = simulate(cfg, TRACE, 300).to_dict(with_samples=True)
    b = simulate(cfg, TRACE, 300).to_dict(with_samples=True)
    assert _strip(a) == _strip(b)


def test_unbounded_pool_reaches_best_possible_hit_ratio() -> None:
    """One prefill instance serves in arrival order, so with an unbounded pool every block
    an earlier request computed is there: the hit ratio is the best possible one, counted
    independently by scheduler.trace over the same requests."""
    cfg = SimConfig(policy="conductor", instances=2, prefill_instances=1, speed=0.5, pool_dram_tokens=None)
    reqs, res = _run(cfg, 1500)
    assert res.completed == 1500
    best = best_possible_hit_ratio(load_trace(TRACE, 1500), TraceMapping(512))
    assert res.best_possible_hit_ratio == pytest.approx(best, abs=1e-12)
    assert res.hit_ratio == pytest.approx(best, abs=1e-12)
    assert best > 0.2


def test_small_pool_hits_less() -> None:
    base = SimConfig(policy="conductor", instances=4, prefill_instances=2, hbm_cache_tokens=0)
    big = _run(dataclasses.replace(base, pool_dram_tokens=None), 800)[1]
    small = _run(dataclasses.replace(base, pool_dram_tokens=20 * 512), 800)[1]
    assert small.hit_ratio < big.hit_ratio <= big.best_possible_hit_ratio + 1e-12


def test_local_dram_cache_holds_what_hbm_evicts_and_is_read_over_pcie() -> None:
    # No pool, and least-loaded never fetches from a peer: every load is from the
    # instance's own DRAM, where blocks its small HBM cache evicted were demoted.
    base = SimConfig(policy="least_loaded", instances=4, prefill_instances=2, pool_dram_tokens=0,
                     hbm_cache_tokens=20 * 512)
    _, hbm_only = _run(base, 800)
    reqs, with_dram = _run(dataclasses.replace(base, local_dram_tokens=None), 800)
    assert hbm_only.hit_ratio < with_dram.hit_ratio <= with_dram.best_possible_hit_ratio + 1e-12
    loaded = [r for r in reqs if r.prefill_s - r.compute_s > 0]
    assert loaded and all(r.hit_blocks > 0 for r in loaded)
    with pytest.raises(InvalidArgument, match="local_dram_tokens"):
        SimConfig(local_dram_tokens=-1)


def test_disaggregated_keeps_tbt_colocated_does_not() -> None:
    base = SimConfig(policy="conductor", instances=8, speed=1.0, tbt_slo_s=0.1)
    _, dis = _run(base, 1000)
    _, col = _run(dataclasses.replace(base, topology="colocated"), 1000)
    assert dis.completed == col.completed == 1000
    assert dis.tbt_violations <= 0.01 * dis.completed
    assert col.tbt_violations > 5 * max(1, dis.tbt_violations)
    assert dis.effective_capacity > col.effective_capacity
    assert col.tbt_p90_s > dis.tbt_p90_s


@pytest.mark.parametrize("topology,chunk", [("disaggregated", None), ("colocated", None), ("colocated", 1024)])
def test_token_intervals_add_up(topology: str, chunk: int | None) -> None:
    """Every completed request's recorded intervals span first token → last token."""
    cfg = SimConfig(policy="least_loaded", topology=topology, instances=4, speed=2.0, chunked_prefill_tokens=chunk)
    reqs, res = _run(cfg, 400)
    assert res.completed == 400
    for r in reqs:
        if r.output > 1:
            total = sum(v * c for v, c in r.tbt_runs)
            assert sum(c for _, c in r.tbt_runs) == r.output - 1
            assert total == pytest.approx(r.finish_s - r.first_token_s, rel=1e-9, abs=1e-9)
            assert all(v > 0 for v, _ in r.tbt_runs)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("topology", ["disaggregated", "colocated"])
def test_every_policy_runs(policy: str, topology: str) -> None:
    res = simulate(SimConfig(policy=policy, topology=topology, instances=4, speed=2.0), TRACE, 150)
    assert res.policy == policy and res.completed == 150
    assert res.ttft_p50_s is not None and res.ttft_p50_s > 0
    assert 0 <= res.hit_ratio <= res.best_possible_hit_ratio + 1e-12


@pytest.mark.parametrize("topology", ["disaggregated", "colocated"])
def test_instances_are_cost_model_engines_and_end_idle(topology: str) -> None:
    from engines.cost_model import CostModelEngine
    from engines.types import EngineLoad, PrefillBackend

    cfg = SimConfig(policy="conductor", topology=topology, instances=4, speed=2.0)
    trace, keys = load_workload(TRACE, 200)
    sim = Simulator(cfg, make_requests(trace, keys, cfg.speed))
    reqs = sim.run()
    assert all(r.status == "ok" for r in reqs)
    for inst in {i.name: i for i in sim.prefill + sim.decode}.values():
        assert isinstance(inst.engine, CostModelEngine) and isinstance(inst.engine, PrefillBackend)
        assert inst.engine.load() == EngineLoad(0, 0, 0)
    for pool in [*sim.hbm.values(), sim.pool]:
        if pool is not None:
            pool.check_integrity()
    sim.index.check_integrity()


@pytest.mark.parametrize("admission", ["current", "predictive"])
def test_overload_rejects_early_and_late(admission: str) -> None:
    cfg = SimConfig(policy="conductor", instances=6, prefill_instances=5, max_running=8, speed=3.0,
                    admission=admission, pool_dram_tokens=0)
    reqs, res = _run(cfg, 600)
    assert res.requests == res.completed + res.rejected_early + res.rejected_late
    assert res.rejected_early + res.rejected_late > 0
    assert res.wasted_prefill_gpu_s >= res.late_rejected_prefill_gpu_s
    for r in reqs:
        assert r.status in ("ok", "rejected_early", "rejected_late")
        if r.status == "rejected_early":
            assert r.prefill_start_s < 0          # no prefill was spent on it
        if r.status == "rejected_late":
            assert r.first_token_s >= 0


def test_late_admission_rejects_only_after_prefill_and_early_rejection_saves_that_prefill() -> None:
    """"late" is Table 3's baseline (arXiv 2407.00079 §7.3): nothing is turned away before
    its prefill, so every rejection spent its prefill; early rejection on the same slice turns
    some of them away before any prefill is spent."""
    cfg = SimConfig(policy="conductor", instances=6, prefill_instances=5, max_running=8, speed=3.0,
                    admission="late", pool_dram_tokens=0)
    reqs, res = _run(cfg, 600)
    assert res.rejected_early == 0 and res.rejected_late > 0
    assert res.requests == res.completed + res.rejected_late
    assert all(r.first_token_s >= 0 for r in reqs if r.status == "rejected_late")
    assert res.late_rejected_prefill_gpu_s > 0
    _, early = _run(dataclasses.replace(cfg, admission="current"), 600)
    assert early.rejected_early > 0
    assert early.late_rejected_prefill_gpu_s < res.late_rejected_prefill_gpu_s


def test_config_errors_list_valid_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidArgument, match="valid"):
        SimConfig(topology="mesh")
    with pytest.raises(InvalidArgument, match="valid"):
        SimConfig(admission="maybe")
    with pytest.raises(InvalidArgument, match="valid"):
        simulate(SimConfig(policy="oracle"), TRACE, 5)
    assert main(["simulate", "--trace", TRACE, "--requests", "5", "--policies", "oracle"]) == 2
    assert "unknown scheduling policy" in capsys.readouterr().err


def test_cli_simulate_table_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--trace", TRACE, "--requests", "120", "--policies", "conductor,random",
               "--topology", "disaggregated,colocated", "--instances", "4", "--json", str(out),
               "--plots", str(tmp_path / "plots"), "--sweep-speeds", "1,2", "--sweep-pool-tokens", "5000,inf"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "conductor" in printed and "colocated" in printed and "goodput" in printed
    assert "predictors: learned" in printed and "seed 0" in printed     # its set-up, as a preset prints it
    data = json.loads(out.read_text())
    assert len(data["results"]) == 4
    for name in ("ttft_cdf", "goodput_vs_rate", "hit_vs_capacity"):
        assert Path(data["files"][name]).stat().st_size > 1000
    assert not math.isnan(data["results"][0]["goodput_rps"])


def test_accounting_pool_evicts_tails_first_demotes_and_keeps_index_true() -> None:
    """The simulator's caches are real KVPools over accounting tiers (sizes, no bytes)."""
    from kvstore.index.prefix_index import PrefixIndex
    from scheduler.sim.cache import accounting_pool, hold_chain, touch_chain

    index = PrefixIndex()
    pool = accounting_pool(index, "pool", [("dram", 3), ("ssd", None)], 10)
    hold_chain(pool, [b"a", b"b", b"c"], 10)
    hold_chain(pool, [b"x"], 10)                  # evicts the tail of a-b-c, not its head
    dram, ssd = pool.tier("dram"), pool.tier("ssd")
    assert not dram.contains(b"c") and dram.contains(b"a") and ssd.contains(b"c")
    m = index.match([b"a", b"b", b"c"], nodes=["pool"])
    assert m.per_node["pool"] == ("dram", "dram", "ssd")
    assert dram.usage().blocks == 3 and dram.used_bytes == 30
    touch_chain(pool, [b"a", b"b", b"c"])
    hold_chain(pool, [b"y", b"z", b"w", b"v"], 10)   # longer than the tier: its head is kept
    assert dram.contains(b"y") and dram.contains(b"w") and not dram.contains(b"v")
    pool.check_integrity()
    index.check_integrity()
    assert accounting_pool(index, "none", [("hbm", 0)], 10) is None


@pytest.mark.parametrize("eviction", ["lru", "fifo", "lfu", "s3fifo"])
def test_eviction_strategies_run_on_a_small_pool(eviction: str) -> None:
    cfg = SimConfig(policy="conductor", instances=4, pool_dram_tokens=50 * 512, hbm_cache_tokens=0, eviction=eviction)
    reqs, res = _run(cfg, 300)
    assert res.completed == 300 and 0 < res.hit_ratio < res.best_possible_hit_ratio


def test_no_queue_p99_takes_out_each_wait_before_prefill() -> None:
    """One prefill instance at 4x the trace's rate: requests queue, so the p99 with their waits
    taken out is under the p99 TTFT, and it is each request's first token less its prefill's
    start (recounted here from the requests)."""
    cfg = SimConfig(policy="least_loaded", instances=2, prefill_instances=1, speed=4.0)
    reqs, res = _run(cfg, 400)
    ok = [r for r in reqs if r.status == "ok"]
    assert any(r.prefill_start_s - r.arrival_s > 1.0 for r in ok)
    alone = sorted(r.first_token_s - r.prefill_start_s for r in ok)
    assert res.ttft_no_queue_p99_s == pytest.approx(float(np.percentile(alone, 99)))
    assert res.ttft_p99_s is not None and res.ttft_no_queue_p99_s < res.ttft_p99_s
