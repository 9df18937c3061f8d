"""The simulator measures the Conductor as it would run live: engines with seeded variance
(engines/cost_model.py Variance), predictors seeded from a profiling pass and learned online
(scheduler/sim/profiling.py) — or the oracle's exact frozen means — and the experiments as
named presets (scheduler/sim/presets.py), one command each."""
from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from engines.cost_model import CostModel, CostModelEngine, Variance, load_model, load_profile
from kvstore.errors import InvalidArgument
from scheduler.sim import SimConfig, Simulator
from scheduler.sim.presets import PRESETS, describe, preset_runs
from scheduler.sim.profiling import exact_profiles, profiled
from scheduler.sim.workload import load_workload, make_requests

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"
COST = CostModel(load_model("llama3-70b"), load_profile("8xA800"))


def prefill_seconds(variance: Variance, n: int = 200, name: str = "P0") -> list[float]:
    engine = CostModelEngine(COST, name, "prefill", 512, variance)
    out = []
    for i in range(n):
        out.append(engine.prefill(f"r{i}", range(8192)).prefill_s)
        engine.prefill_done()
    return out


def test_variance_is_seeded_has_the_cost_models_mean_and_stragglers_as_documented():
    noisy = Variance(prefill_cv=0.1, seed=7)
    a, b = prefill_seconds(noisy), prefill_seconds(noisy)
    assert a == b                                             # seeded: a run is reproducible
    assert prefill_seconds(Variance(prefill_cv=0.1, seed=8)) != a
    # common random numbers: a request's prefill factor is its own, whichever engine runs it
    # and whatever that engine ran before (policies compared on one seed see the same noise)
    assert prefill_seconds(noisy, name="P1") == a
    other = CostModelEngine(COST, "P2", "prefill", 512, noisy)
    for i in (5, 3):                                           # another order, other requests first
        other.prefill(f"x{i}", range(100))
        assert other.prefill(f"r{i}", range(8192)).prefill_s == a[i]
    assert len(set(a)) == len(a)                               # and requests differ
    mean = COST.prefill_s(8192)
    assert statistics.fmean(a) == pytest.approx(mean, rel=0.03)
    assert statistics.pstdev(a) / mean == pytest.approx(0.1, rel=0.25)
    assert prefill_seconds(Variance(), 3) == [mean] * 3        # none: the deterministic model
    assert prefill_seconds(Variance(straggler_prob=1.0, straggler_factor=3.0), 3) == [pytest.approx(3 * mean)] * 3
    engine = CostModelEngine(COST, "D0", "decode", 512, Variance(decode_cv=0.2, seed=1))
    steps = [engine.sample_decode_step_s(8, 40_000) for _ in range(400)]
    assert engine.decode_step_s(8, 40_000) == COST.decode_step_s(8, 40_000)   # the mean, for predictions
    assert statistics.fmean(steps) == pytest.approx(COST.decode_step_s(8, 40_000), rel=0.05)
    for bad in ({"prefill_cv": -0.1}, {"straggler_prob": 1.5}, {"straggler_factor": 0.5}):
        with pytest.raises(InvalidArgument):
            Variance(**bad)
    with pytest.raises(InvalidArgument):
        SimConfig(decode_cv=-1.0)


def test_the_profiling_pass_seeds_close_to_the_truth_but_not_with_it():
    exact_p, exact_d = exact_profiles(COST)
    seed_p, seed_d = profiled(COST, Variance(prefill_cv=0.1, decode_cv=0.05, seed=0))
    assert not exact_p.learn and not exact_d.learn and seed_p.learn and seed_d.learn
    assert seed_p.s_per_token_context != exact_p.s_per_token_context      # measured, not handed over
    from scheduler.policy.costing import PrefillModel
    truth, guess = PrefillModel(exact_p), PrefillModel(seed_p)
    for n, p in ((4096, 0), (32768, 8192), (100_000, 50_000)):
        assert guess.predict(n, p) == pytest.approx(truth.predict(n, p), rel=0.15)


def run_sim(cfg: SimConfig, limit: int = 600) -> Simulator:
    trace, keys = load_workload(TRACE, limit)
    sim = Simulator(cfg, make_requests(trace, keys, cfg.speed))
    sim.run()
    return sim


def test_the_conductor_learns_online_from_noisy_observations_and_the_oracle_does_not():
    cfg = preset_runs("fig5")[-1]                   # the default noise: CV 0.1 / 0.05, 1% stragglers
    assert cfg.policy == "conductor" and not cfg.oracle and cfg.straggler_prob > 0
    learned = run_sim(cfg, 1500)
    model = learned.policy.prefill_model
    assert model.samples > 100 and model.fit.fitted
    assert model.fit.coefficients != model.fit.seed                       # the online fit took over
    # Fitted by relative error, short prompts are predicted as well as the long ones that
    # make TTFT (each within ~1% here, up to 4% unweighted; 2.5% allows for a straggler in
    # the fit's ~200-observation memory, decay 0.995).
    for n, p in ((2048, 1024), (8192, 0), (8192, 6144), (60_000, 20_000), (100_000, 0)):
        assert model.predict(n, p) == pytest.approx(COST.prefill_s(n, p), rel=0.025), (n, p)
    assert learned.policy.tbt_model.samples > 0 and learned.policy.tbt_model.fit.fitted
    oracle = run_sim(dataclasses.replace(cfg, oracle=True), 1500)
    assert oracle.policy.prefill_model.samples == 0 and oracle.policy.tbt_model.samples == 0
    assert oracle.policy.prefill_model.predict(8192) == pytest.approx(COST.prefill_s(8192), rel=1e-9)
    # Learned, the predictor's error is the oracle's: the engines' own noise (CV 0.1 and 1%
    # stragglers at 3x: a log-error deviation of ~0.15), centred on 0.
    (lm, lsd), (om, osd) = model.log_error, oracle.policy.prefill_model.log_error
    assert abs(lm) < 0.03 and abs(om) < 0.03 and 0.1 < osd < 0.2 and lsd < osd * 1.2
    # The same noisy engines under both: the draws are the run's, not the predictor's.
    again = run_sim(cfg, 1500)
    assert [r.prefill_s for r in again.requests] == [r.prefill_s for r in learned.requests]


def test_presets_are_the_readme_experiments():
    assert sorted(PRESETS) == ["capacity", "colocated", "fig5", "fig5-hbm", "overload"]
    fig5 = preset_runs("fig5")
    assert [c.policy for c in fig5] == ["random", "round_robin", "least_loaded", "local_cache_aware", "dynamo_kv",
                                         "llmd", "sglang_cache_aware", "conductor"]
    assert all(c.pool_dram_tokens == 0 and c.n_prefill == 8 and c.instances == 16 for c in fig5)
    # Each prefill node's local cache holds Mooncake's 3M tokens (FAST'25 §5.3.1-5.3.2): its
    # HBM's KV room (1,326,904 LLaMA3-70B tokens on 8xA800), then DRAM below it.
    assert COST.kv_capacity_tokens() == 1_326_904
    assert all(c.local_dram_tokens == 3_000_000 - 1_326_904 for c in fig5)
    hbm = preset_runs("fig5-hbm")
    assert [dataclasses.replace(c, local_dram_tokens=0) for c in fig5] == hbm
    assert all(c.local_dram_tokens == 0 for c in hbm)
    # A smaller HBM cache given on the command line leaves more of the 3M to DRAM.
    assert preset_runs("fig5", SimConfig(hbm_cache_tokens=1_000_000))[0].local_dram_tokens == 2_000_000
    ovl = preset_runs("overload", SimConfig(oracle=True, seed=3))
    assert [c.admission for c in ovl] == ["none", "late", "current", "predictive"]
    assert all(c.oracle and c.seed == 3 and c.speed == 2.0 and c.n_prefill == 14 and c.max_running == 32
               for c in ovl)
    col = preset_runs("colocated")
    assert [c.topology for c in col] == ["disaggregated", "colocated", "colocated"]
    assert col[2].chunked_prefill_tokens == 512
    assert [c.pool_dram_tokens for c in preset_runs("capacity")][-1] is None
    assert "pool_dram_tokens=0" in describe("fig5", fig5) and describe("fig5", fig5).startswith("preset fig5 —")
    # fig5 takes --speed (the 1.2x run is one command); overload sets its own
    busier = preset_runs("fig5", SimConfig(speed=1.2))
    assert {c.speed for c in busier} == {1.2} and "speed=1.2" in describe("fig5", busier)
    assert {c.speed for c in preset_runs("overload", SimConfig(speed=1.2))} == {2.0}
    with pytest.raises(InvalidArgument, match="valid"):
        preset_runs("fig7")


def test_kvstore_simulate_preset_prints_its_set_up_with_its_results():
    out = subprocess.run([sys.executable, "-m", "launcher", "simulate", "--preset", "overload", "--requests", "300",
                          "--speed", "1", "--admission", "late"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("preset overload — the trace 2× faster")
    # what the preset fixes is said to be unused, not silently dropped
    assert "--preset overload sets --admission, --speed itself; the values given are not used" in out.stderr
    assert "run: policy=conductor," in out.stdout
    assert "predictors: learned" in out.stdout and "prefill CV 0.1" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("| conductor")]
    assert [row.split("|")[3].strip() for row in rows] == ["none", "late", "current", "predictive"]
    bad = subprocess.run([sys.executable, "-m", "launcher", "simulate", "--preset", "fig7"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "fig7" in bad.stderr
    sweep = subprocess.run([sys.executable, "-m", "launcher", "simulate", "--requests", "50", "--plots", "plots-x",
                            "--sweep-speeds", "a,b"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           check=False)   # refused before anything runs, naming the flag
    assert sweep.returncode == 2 and "--sweep-speeds is a comma list of numbers" in sweep.stderr
    assert "arrivals" not in sweep.stderr and not (ROOT / "plots-x").exists()


def test_a_preset_sweeps_its_own_cluster_and_names_every_flag_it_sets(tmp_path):
    # The plots' sweeps of a preset run on the preset's cluster: overload's "none" run at
    # speed 2 and the sweep's point at speed 2 are one configuration (not the default 8P+8D
    # cluster with a pool).
    out = tmp_path / "sim.json"
    run = subprocess.run([sys.executable, "-m", "launcher", "simulate", "--preset", "overload", "--requests", "200",
                          "--plots", str(tmp_path / "plots"), "--sweep-speeds", "2", "--sweep-pool-tokens", "inf",
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    import json
    doc = json.loads(out.read_text())
    none = next(r for r in doc["results"] if r["admission"] == "none")
    assert doc["goodput_sweep"]["conductor"][0][1] == pytest.approx(none["goodput_rps"], rel=1e-12)
    # A value the preset sets itself is named even when it is SimConfig's default (0), and a
    # token count that is no whole number is one line naming its flag, not a traceback.
    zero = subprocess.run([sys.executable, "-m", "launcher", "simulate", "--preset", "fig5", "--requests", "20",
                           "--local-dram-tokens", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert zero.returncode == 0 and "--preset fig5 sets --local-dram-tokens itself" in zero.stderr
    for flag, value in (("--hbm-cache-tokens", "1e400"), ("--pool-dram-tokens", "abc")):
        bad = subprocess.run([sys.executable, "-m", "launcher", "simulate", flag, value], cwd=ROOT,
                             capture_output=True, text=True, timeout=120, check=False)
        assert bad.returncode == 2 and f"argument {flag}: {value!r}" in bad.stderr and "Traceback" not in bad.stderr


def test_the_policy_sees_decode_work_as_the_router_books_it_never_the_engines_true_finish():
    """As live (``Router.cluster_view``, ``Router.decode_progress``), a decode instance's
    requests are shown at the span their decision predicted, re-timed as their prefill ran;
    a running one, from its first decode token, at its tokens to come at its mean pace since
    its first token; one held past its finish shown just ending (``held_work``), counted now
    and gone for a later arrival. Never the engine's finish step at its current step time."""
    from scheduler.policy.tbt import load_at
    from scheduler.policy.views import OVERDUE_S, DecodeView, DecodeWork, decoding_finish, held_work

    w = DecodeWork(100, 0.0, 5.0)
    assert held_work(w, 4.0) is w
    late = held_work(w, 7.0)
    view = DecodeView("d", (late,))
    assert late.finish_s == pytest.approx(7.0 + OVERDUE_S)
    assert load_at(view, 7.0).running == 1 and load_at(view, 8.0).running == 0
    assert decoding_finish(10.0, 100, 40, 0.05) == pytest.approx(13.0)

    cfg = preset_runs("overload")[-1]                     # predictive admission reads the view
    assert cfg.predicts_decode_load
    trace, keys = load_workload(TRACE, 1500)
    sim = Simulator(cfg, make_requests(trace, keys, cfg.speed))
    seen = {"running": 0, "paced": 0, "differs": 0, "overdue": 0}
    real = sim._decode_view

    def checked(inst, now):
        v = real(inst, now)
        step = inst.step_at(now)
        expected = []
        for rid, (kv, start, finish) in inst.incoming.items():
            req = inst.running.get(rid)
            if req is not None:
                seen["running"] += 1
                f = req.join_step + req.output - 1
                last = min(step, f)
                done = last - req.join_step
                if done >= 1:
                    seen["paced"] += 1
                    at = inst.time_of(last)
                    finish = at + (f - last) * (at - req.first_token_s) / done
                    seen["differs"] += abs(finish - inst.finish_time(f)) > 1e-6
            seen["overdue"] += finish <= now
            expected.append(held_work(DecodeWork(kv, start, finish), now))
        got = sorted(v.work)
        assert [(x.kv_tokens, x.start_s) for x in got] == [(x.kv_tokens, x.start_s) for x in sorted(expected)]
        assert [x.finish_s for x in got] == pytest.approx([x.finish_s for x in sorted(expected)], abs=2 * OVERDUE_S)
        return v

    sim._decode_view = checked
    sim.run()
    assert seen["paced"] > 10_000 and seen["paced"] > 0.9 * seen["running"]
    assert seen["differs"] > 0.5 * seen["paced"]            # its pace so far, not the engine's step now
    assert seen["overdue"] > 0
