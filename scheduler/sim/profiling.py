"""What the simulated Conductor knows before the first request: its predictors' seeds.

Live, the router's T_prefill and TBT predictors start from a profile fitted to the pass its
engines run at start (engines/profiling.py, :mod:`scheduler.policy.profiles`) and learn online from
what the engines report. The simulator
does the same, so that the Conductor is measured as it would run:

* learned (default): a *profiling pass* measures a few prefills and decode steps on a
  cost-model engine of the run's hardware and model, with the run's variance
  (:class:`engines.cost_model.Variance`) — what a deployment does before it serves — and a
  least-squares fit of those measurements seeds the profiles (:mod:`scheduler.policy.profiles`,
  the live router's fit of its engines' own pass at start); the online fits then refine
  them from every prefill and decode segment the run observes (noisy, stragglers included);
* ``oracle``: the cost model's exact mean coefficients, frozen (no learning) — the perfect
  predictors, for comparison.
"""
from __future__ import annotations

from engines.cost_model import CostModel, CostModelEngine, Variance
from scheduler.policy.admission import AdmissionConfig
from scheduler.policy.conductor import ConductorConfig
from scheduler.policy.costing import Bandwidths, PrefillProfile
from scheduler.policy.profiles import fit_decode, fit_prefill
from scheduler.policy.tbt import DecodeProfile
from scheduler.sim.config import SimConfig

# The profiling pass: prompt lengths (tokens), each measured PROFILE_REPEATS times; decode
# steps at these (batch, mean context) points. A handful of points, as a profiling script has.
PROFILE_PROMPTS = (512, 2048, 8192, 32768, 98304)
PROFILE_REPEATS = 2
PROFILE_DECODE = ((1, 1024), (8, 4096), (32, 8192), (128, 8192), (64, 32768))


def variance_of(cfg: SimConfig) -> Variance:
    return Variance(cfg.prefill_cv, cfg.decode_cv, cfg.straggler_prob, cfg.straggler_factor, cfg.seed)


def exact_profiles(cost: CostModel) -> tuple[PrefillProfile, DecodeProfile]:
    """The cost model's mean coefficients in the predictors' form, frozen (the oracle)."""
    m, hw = cost.model, cost.profile
    prefill = PrefillProfile(fixed_s=0.0, s_per_token=m.layers * m.linear_coeff * m.hidden ** 2 / cost.flops_per_s,
                             s_per_token_context=2 * m.layers * m.attn_coeff * m.hidden / cost.flops_per_s,
                             floor_tokens_per_s=1.0, min_prefill_s=0.0, learn=False)
    decode = DecodeProfile(step_s=hw.step_overhead_s + m.weight_bytes / cost.hbm_bytes_per_s, s_per_request=0.0,
                           s_per_kv_token=m.kv_bytes_per_token / cost.hbm_bytes_per_s, learn=False)
    return prefill, decode


def profiled(cost: CostModel, variance: Variance) -> tuple[PrefillProfile, DecodeProfile]:
    """Seeds fitted (:mod:`scheduler.policy.profiles`, as the live router fits the engines' own pass)
    from a profiling pass on a noisy engine (module docstring); they learn."""
    engine = CostModelEngine(cost, "profiler", "colocated", 512, variance)
    prefills = []
    for n in PROFILE_PROMPTS:
        for i in range(PROFILE_REPEATS):
            r = engine.prefill(f"profile-{n}-{i}", range(n))   # its own noise (keyed by request)
            engine.prefill_done()
            prefills.append((n, r.prefill_s))
    steps = [(batch, batch * context, engine.sample_decode_step_s(batch, batch * context))
             for batch, context in PROFILE_DECODE]
    prefill = fit_prefill(prefills, PrefillProfile(floor_tokens_per_s=1.0, min_prefill_s=0.0))
    decode = fit_decode(steps, DecodeProfile())
    assert prefill is not None and decode is not None   # five lengths, five points
    return prefill, decode


def conductor_config(cfg: SimConfig, cost: CostModel) -> ConductorConfig:
    """The scheduler's settings for a run: SLOs and admission from ``cfg``; the predictors'
    seeds (:func:`profiled`, or :func:`exact_profiles` with ``cfg.oracle``); the tier
    bandwidths of the hardware profile."""
    hw = cost.profile
    adm = AdmissionConfig(ttft_slo_s=cfg.ttft_slo_s, tbt_slo_s=cfg.tbt_slo_s, max_inflight=1 << 30,
                          early_rejection=cfg.rejects_early, predicted_decode_load=cfg.predicts_decode_load)
    prefill, decode = exact_profiles(cost) if cfg.oracle else profiled(cost, variance_of(cfg))
    bw = Bandwidths(hbm=hw.gpus * hw.hbm_bw_per_gpu, dram=hw.gpus * hw.pcie_bw_per_gpu, ssd=hw.ssd_bw,
                    network=hw.network_bw, fetch_latency_s=0.0)
    return ConductorConfig(admission=adm, peer_fetch=cfg.peer_fetch and cfg.topology == "disaggregated",
                           prefill=prefill, decode=decode, bandwidths=bw, seed=cfg.seed)
