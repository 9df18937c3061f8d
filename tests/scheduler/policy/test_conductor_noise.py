"""The Conductor under noisy engines: T_prefill's measured error (the optimistic TTFT that
rejects a request no instance can serve within its SLO, stragglers kept out of the fit),
decode stays reserved at the TBT of the load joined, and decode work re-timed as prefills
start and end (router and simulator alike)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from scheduler.policy.admission import AdmissionConfig, Rejection
from scheduler.policy.backlog import PrefillBacklog
from scheduler.policy.conductor import Conductor, ConductorConfig
from scheduler.policy.costing import PrefillModel, PrefillProfile
from scheduler.policy.views import NO_HIT, ClusterView, Decision, DecodeView, DecodeWork, PrefillView, RequestView
from scheduler.routing.router import Router
from scheduler.sim import SimConfig, Simulator
from scheduler.sim.workload import SimRequest

BS = 16
BLOCK_BYTES = 4096


def request(n_tokens: int, max_tokens: int = 8) -> RequestView:
    return RequestView("r", n_tokens, (), max_tokens, BS)


def cluster(prefill: tuple[PrefillView, ...], decode: tuple[DecodeView, ...] | None = None,
            now: float = 0.0) -> ClusterView:
    return ClusterView(now, prefill, decode or (DecodeView("d0"),))


def conductor(**kw) -> Conductor:
    admission = kw.pop("admission", AdmissionConfig())
    return Conductor(BLOCK_BYTES, ConductorConfig(admission=admission, **kw))


# -- unattainable TTFT: the measured error of T_prefill -------------------------------------
def test_an_idle_instance_rejects_a_prompt_whose_optimistic_ttft_misses_the_slo():
    policy = conductor(admission=AdmissionConfig(ttft_slo_s=2.0))
    for i in range(60):   # a measured engine: 1 ms per token, within +-5%
        n = (1200, 2400, 4800)[i % 3]
        policy.observe_prefill(n, 0, n / 1000 * (1.05 if i % 2 else 0.95))
    assert policy.prefill_model.optimistic(4.0, 2.0) == pytest.approx(4.0 * (1 - 2 * 0.05), rel=0.1)
    r = policy.decide(request(4800), cluster((PrefillView("p0"), PrefillView("p1"))))
    assert isinstance(r, Rejection) and r.reason == "ttft_slo" and "cannot meet" in r.message
    # within its error of the SLO it is admitted; and k = inf keeps the old rule
    assert isinstance(policy.decide(request(2100), cluster((PrefillView("p0"),))), Decision)
    never = conductor(admission=AdmissionConfig(ttft_slo_s=2.0, unattainable_k=math.inf))
    for i in range(60):
        never.observe_prefill((1200, 2400, 4800)[i % 3], 0, (1.2, 2.4, 4.8)[i % 3])
    assert isinstance(never.decide(request(4800), cluster((PrefillView("p0"),))), Decision)


def test_the_optimistic_prefill_needs_residuals_in_its_octave():
    model = PrefillModel(PrefillProfile(min_samples=8))
    for _ in range(20):
        model.observe(1500, 0, 1.5)
    assert model.optimistic(1.5, 2.0) == pytest.approx(1.5, rel=0.01)   # measured exact: no margin
    assert model.optimistic(16.0, 2.0) is None       # nothing measured near 16 s
    noisy = PrefillModel(PrefillProfile(min_samples=8))
    for i in range(60):                              # +-10%: the margin is about 2 x 10%
        noisy.observe(1500, 0, 1.5 * (1.1 if i % 2 else 0.9))
    assert noisy.optimistic(1.5, 2.0) == pytest.approx(1.5 * 0.8, rel=0.05)


def test_a_straggler_is_kept_out_of_the_fit():
    model = PrefillModel(PrefillProfile(min_samples=8))
    for i in range(60):
        n = (1000, 2000, 4000)[i % 3]
        model.observe(n, 0, n / 1000 * (1.02 if i % 2 else 0.98))
    before = model.predict(4000)
    model.observe(4000, 0, 3 * 4.0)                       # a 3x straggler on the largest prefill
    assert model.outliers == 1
    assert model.predict(4000) < before * 1.02            # folded in at its cap, not at 3x
    assert model.outlier_cap(4.0) == pytest.approx(4.0 * (1 + 3 * 0.05), rel=0.05)
    unfit = PrefillModel()
    assert unfit.outlier_cap(1.0) == math.inf             # nothing measured: nothing is an outlier


def test_a_decode_stay_is_reserved_at_the_tbt_of_the_load_it_joins():
    # 1 running now until t=100; 30 more join at t=0.3 (predicted), within its ~0.5-s stay
    now = 0.0
    work = (DecodeWork(100, -1.0, 100.0),) + tuple(DecodeWork(100, 0.3, 200.0) for _ in range(30))
    policy = conductor(admission=AdmissionConfig(ttft_slo_s=100.0, tbt_slo_s=10.0))
    d = policy.decide(request(64, max_tokens=101), cluster((PrefillView("p0"),), (DecodeView("d0", work, 64),), now))
    assert isinstance(d, Decision)
    tbt = policy.tbt_model.predict
    joined = tbt(2, 100 + 64 + 101)                       # the load at arrival: 1 running + it
    assert d.tbt_s == pytest.approx(tbt(32, 3100 + 165))  # judged at the peak: 31 + it
    assert d.decode_finish_s - d.decode_start_s == pytest.approx(100 * joined)


def test_the_router_retimes_decode_work_when_a_prefill_starts():
    backlog = PrefillBacklog()
    backlog.add("a", 2.0)
    backlog.add("b", 3.0)
    decode = {"d0": SimpleNamespace(work={"a": DecodeWork(10, 2.0, 12.0), "b": DecodeWork(10, 5.0, 15.0)})}
    fake = SimpleNamespace(decode=decode)
    Router._advance(fake, backlog, 0.0)                   # a starts at 0: ends at 2 as predicted
    assert decode["d0"].work["a"] == DecodeWork(10, 2.0, 12.0)
    backlog.remove("a")
    Router._advance(fake, backlog, 4.0)                   # a ended late, at 4: b starts then
    assert backlog.predicted_end("b") == 7.0
    assert decode["d0"].work["b"] == DecodeWork(10, 7.0, 17.0)   # joins at 7, same 10-s stay


def test_the_simulator_retimes_incoming_decode_work_as_the_router_does():
    sim = Simulator(SimConfig(instances=2, prefill_instances=1), [])
    d = sim.decode[0]
    req = SimpleNamespace(rid=7, decode_id=d.name)
    d.incoming[7] = (100, 10.0, 20.0)
    sim._retime(req, 12.5)        # type: ignore[arg-type]
    assert d.incoming[7] == (100, 12.5, 22.5) and d.view_dirty
    d.incoming.pop(7)
    sim._retime(req, 30.0)        # type: ignore[arg-type]   # joined already: nothing to re-time
    assert 7 not in d.incoming
    assert SimRequest  # the type the simulator re-times


# -- T_prefill fitted by relative error ------------------------------------------------------
def test_t_prefill_is_fitted_by_relative_error_so_short_prefills_are_predicted_as_well_as_long():
    """Multiplicative noise (a prefill varies by a share of itself): an unweighted fit in
    seconds lets the long prefills set the coefficients and over-predicts short ones; the
    fit weighted by 1 / predicted² keeps both within a few percent, and the measured error
    is the engine's own noise."""
    import random
    rng = random.Random(0)
    k1, k2 = 1e-4, 4e-9                    # seconds per computed token, per token·context token

    def truth(n: int, p: int) -> float:
        return k1 * (n - p) + k2 * (n * n - p * p) / 2

    model = PrefillModel(PrefillProfile(fixed_s=0.05, s_per_token=5e-5, s_per_token_context=8e-9,
                                        floor_tokens_per_s=1.0, min_prefill_s=0.0))
    for _ in range(3000):
        n = int(math.exp(rng.uniform(math.log(512), math.log(120_000))))
        p = int(n * rng.choice((0.0, 0.5, 0.9, 0.98)))
        model.observe(n, p, truth(n, p) * math.exp(rng.gauss(-0.005, 0.1)))
    for n, p in ((1024, 768), (4096, 3584), (20_000, 0), (110_000, 0), (110_000, 100_000)):
        assert model.predict(n, p) == pytest.approx(truth(n, p), rel=0.04), (n, p)
    mean, sd = model.log_error
    assert abs(mean) < 0.02 and 0.08 < sd < 0.13


def test_t_prefill_ignores_reports_that_are_not_a_usable_number_of_seconds():
    """An engine's report is not trusted blindly: infinite, NaN, negative, or so far from the
    prediction that the ratio is not a finite number > 0 — ignored, not a crash or a poisoned
    fit; the error statistic stays finite."""
    from kvstore.errors import InvalidArgument
    from scheduler.policy.fit import OnlineFit
    model = PrefillModel(PrefillProfile(fixed_s=0.0, s_per_token=1e-4, s_per_token_context=0.0))
    for i in range(20):
        model.observe(1000 + i, 0, (1000 + i) * 1e-4)
    before = model.fit.coefficients
    for bad in (math.inf, math.nan, -1.0, 0.0, 5e-324):
        model.observe(100_000, 0, bad)
    assert model.fit.coefficients == before and model.residuals == 20
    mean, sd = model.log_error
    assert math.isfinite(mean) and math.isfinite(sd)
    model.observe(1000, 0, 1e300)           # finite and huge: capped as a straggler, no overflow
    assert all(math.isfinite(c) for c in model.fit.coefficients)
    assert model.predict(1010) == pytest.approx(0.101, rel=0.05)
    with pytest.raises(InvalidArgument, match="weight"):
        OnlineFit((1.0,)).observe((1.0,), 1.0, math.nan)


def test_t_prefill_beyond_the_prompts_it_has_measured_is_bounded_by_the_floor_speed():
    """Fitted on short prompts only, the attention coefficient is noise; squared up to a long
    prompt it predicted minutes for a prefill of half a second, and a busy instance answered
    429. Beyond the prompts measured the prediction is at most the profile's floor speed's;
    within them, and once long prompts were measured, it is the fit's."""
    import random
    rng = random.Random(1)
    profile = PrefillProfile()             # the tiny CPU model's: 2,000 tokens/s at worst
    model = PrefillModel(profile)
    for _ in range(40):
        model.observe(rng.randint(1, 20), 0, 0.006 * rng.uniform(0.8, 1.25))
    k0, k1, k2 = model.fit.coefficients
    unbounded = k0 + k1 * 4000 + k2 * 4000 * 4000 / 2
    assert unbounded > 5.0                 # what the fit alone says: the defect
    assert model.predict(4000) == pytest.approx(profile.fixed_s + 4000 / profile.floor_tokens_per_s)
    assert model.predict(20) == pytest.approx(k0 + k1 * 20 + k2 * 200)   # measured sizes: the fit
    c = conductor(prefill=profile, admission=AdmissionConfig(ttft_slo_s=30.0))
    c.prefill_model = model
    busy = (PrefillView("p0", 0.3, 2, NO_HIT),)
    assert not isinstance(c.decide(request(4000), cluster(busy)), Rejection)
    for _ in range(10):                    # long prompts measured: the fit takes over there
        model.observe(4000, 0, 0.5 * rng.uniform(0.9, 1.1))
    assert model.predict(4000) == pytest.approx(0.5, rel=0.1)


def _vllm_cpu_seconds(n: int) -> float:
    """A 512-hidden, 8-layer Llama prefilled by vLLM on one CPU core, measured live: 1,680
    tokens 2.4 s, 3,119 tokens 6.2 s, 7,540 tokens 24.4 s — superlinear in the prompt."""
    return 9.1e-4 * n + 3.1e-7 * n * n


def test_t_prefill_beyond_the_prompts_measured_runs_no_faster_per_token_than_the_longest_did():
    """Fitted on prompts of up to 2,000 tokens, a 7,540-token prompt was predicted at the
    profile's floor speed, 3.8 s, where it took 24 s, and the router queued three requests
    behind it. The bound beyond the prompts measured is now the speed the fit gives the
    longest one (per computed token, a longer prompt costs at least that): still below the
    truth, since attention grows with the context, but no longer a constant the profile guessed."""
    import random
    rng = random.Random(3)
    model = PrefillModel(PrefillProfile())        # floor: 2,000 tokens/s
    for _ in range(40):
        n = rng.randint(100, 2000)
        model.observe(n, 0, _vllm_cpu_seconds(n) * rng.uniform(0.9, 1.1))
    floor_bound = PrefillProfile().fixed_s + 7540 / PrefillProfile().floor_tokens_per_s
    per_token_at_edge = model.predict(2000) / 2000
    assert model.predict(7540) >= 0.9 * 7540 * per_token_at_edge
    assert model.predict(7540) > 2.5 * floor_bound
    assert model.predict(7540) <= _vllm_cpu_seconds(7540)
    assert model.predict(1500) == pytest.approx(_vllm_cpu_seconds(1500), rel=0.1)   # measured sizes: the fit


def test_prefills_run_together_teach_the_fit_what_each_costs():
    """Groups of prefills an engine ran in the same steps, each group's seconds the sum of its
    members': the fit (linear in its features) predicts each prompt alone as if measured alone."""
    import random
    rng = random.Random(4)
    model = PrefillModel(PrefillProfile(floor_tokens_per_s=1.0))
    for _ in range(60):
        group = [(rng.randint(100, 3000), 0) for _ in range(rng.randint(1, 3))]
        model.observe_group(group, sum(_vllm_cpu_seconds(n) for n, _ in group) * rng.uniform(0.95, 1.05))
    for n, rel in ((200, 0.2), (1000, 0.1), (2500, 0.1)):    # as close as prefills measured alone come
        assert model.predict(n) == pytest.approx(_vllm_cpu_seconds(n), rel=rel)
    before = model.residuals
    model.observe_group([(100, 0), (50, 50)], 1.0)     # a member that computes nothing: nonsense, ignored
    model.observe_group([], 1.0)
    assert model.residuals == before


def test_t_prefill_beyond_the_prompts_measured_follows_the_models_flops_from_the_longest_one():
    """With the model's FLOPs known (the vLLM front door reads them from the checkpoint), a
    prompt longer than any measured is the longest one's prediction scaled by the FLOPs:
    attention's share grows with the context, as the engine's seconds do."""
    import random

    from scheduler.policy.costing import attention_ratio
    rho = attention_ratio(512, 8, 8, 64, 1408)            # the bench checkpoint
    assert rho == pytest.approx(3.19e-4, rel=0.01)
    rng = random.Random(3)
    model = PrefillModel(PrefillProfile(attention_ratio=rho))
    bounded = PrefillModel(PrefillProfile())
    for _ in range(40):
        n = rng.randint(100, 2000)
        seconds = _vllm_cpu_seconds(n) * rng.uniform(0.9, 1.1)
        model.observe(n, 0, seconds)
        bounded.observe(n, 0, seconds)
    truth = _vllm_cpu_seconds(7540)
    assert 0.7 * truth <= model.predict(7540) <= 1.1 * truth
    assert model.predict(7540) > 1.3 * bounded.predict(7540)
    assert model.predict(1500) == pytest.approx(bounded.predict(1500), rel=0.01)   # measured sizes: the fit
    from kvstore.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="attention_ratio"):
        PrefillProfile(attention_ratio=-1.0)
