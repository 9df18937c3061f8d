"""The simulator's experiments by name (``kvstore simulate --preset NAME``): each is a list of
runs, the set-ups of Mooncake's experiments that ``benchmarks/bench_simulate.py`` reports,
so that every row of docs/simulator.md's table is one command. Every preset runs on 8xA800 nodes
serving LLaMA3-70B (``configs/``), TTFT SLO 30 s, the whole conversation trace at its own
rate unless said otherwise (a flag a preset sets itself is refused with a message; fig5 and
fig5-hbm take ``--speed``); the engines' variance and the learned predictors are the
defaults of :class:`scheduler.sim.config.SimConfig` (``--oracle`` swaps the predictors).

* ``fig5`` — prefill scheduling (FAST'25 Fig. 5): 8 prefill + 8 decode instances, no shared
  pool; each prefill node's own local prefix cache holds 3M tokens, as Mooncake's do (its
  HBM's KV room, then its DRAM, read back over PCIe; FAST'25 §5.3.1: ~1 TB of a node's DRAM,
  "about 3 million tokens"; §5.3.2: "each node ... has a 3M token capacity"); the Conductor
  may fetch a prefix from a peer's; every policy (the paper's baselines, the peer routers of
  docs/routers.md: NVIDIA Dynamo's KV router, llm-d's scheduler, SGLang's cache_aware);
  average TTFT; at the trace's own rate, or ``--speed``'s (the 1.2× run: ``--preset fig5 --speed 1.2``).
* ``fig5-hbm`` — ``fig5`` with each prefill node's cache in its HBM alone (1.33M tokens on
  8xA800: the KV room beside the weights), for comparison.
* ``colocated`` — disaggregated (8P + 8D, a pool of 1 TiB DRAM per prefill node) against
  colocated (16 instances each prefilling and decoding, a prefill pausing decode), and
  colocated with 512-token chunked prefill; the Conductor; TBT SLO 100 ms.
* ``overload`` — the trace 2× faster, decode the bottleneck (14 prefill + 2 decode, a decode
  batch of at most 32, no pool): no rejection at all, rejection only after prefill when
  decode is full or too slow ("late": Table 3's baseline, arXiv 2407.00079 §7.3), early
  rejection on the decode load now ("current"), and on the load predicted for when the
  request reaches decode ("predictive", §7.3).
* ``capacity`` — hit ratio against pool capacity: the Conductor on ``colocated``'s
  disaggregated cluster with no HBM prefix cache (the pool is the only cache), pool DRAM of
  1e5 … 1e8 tokens and unbounded.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from engines.cost_model import CostModel, load_model, load_profile
from kvstore.errors import InvalidArgument
from scheduler.sim.config import ADMISSIONS, SimConfig

TIB_TOKENS = 2**40 // 327_680          # 1 TiB of DRAM in LLaMA3-70B KV tokens (configs/models)
# A Mooncake prefill node's local prefix cache, in tokens (FAST'25 §5.3.1: "reserving
# approximately 1 TB of DRAM for local caching ... supports storage for about 3 million
# tokens" of LLaMA3-70B; §5.3.2: "each node in the local cache setup has a 3M token capacity").
LOCAL_CACHE_TOKENS = 3_000_000
# The paper's baselines, the routers users deploy instead (docs/routers.md), then the Conductor.
PEER_ROUTER_POLICIES = ("dynamo_kv", "llmd", "sglang_cache_aware")
FIG5_POLICIES = ("random", "round_robin", "least_loaded", "local_cache_aware", *PEER_ROUTER_POLICIES, "conductor")
POOL_CAPACITIES = (10**5, 10**6, 10**7, 10**8, None)


def local_dram_tokens(base: SimConfig, cache_tokens: int = LOCAL_CACHE_TOKENS) -> int:
    """The DRAM a prefill node of ``base`` keeps below its HBM cache so that the two hold
    ``cache_tokens`` (tokens; 0 when its HBM holds that much already)."""
    hbm = base.hbm_cache_tokens
    if hbm is None:
        hbm = CostModel(load_model(base.model), load_profile(base.profile)).kv_capacity_tokens()
    return max(0, cache_tokens - hbm)


def fig5_hbm(base: SimConfig) -> list[SimConfig]:
    cfg = dataclasses.replace(base, topology="disaggregated", instances=16, prefill_instances=8,
                              pool_dram_tokens=0, local_dram_tokens=0, admission="none")
    return [dataclasses.replace(cfg, policy=p) for p in FIG5_POLICIES]


def fig5(base: SimConfig) -> list[SimConfig]:
    dram = local_dram_tokens(base)
    return [dataclasses.replace(cfg, local_dram_tokens=dram) for cfg in fig5_hbm(base)]


def colocated(base: SimConfig) -> list[SimConfig]:
    dis = dataclasses.replace(base, policy="conductor", topology="disaggregated", instances=16, prefill_instances=8,
                              pool_dram_tokens=8 * TIB_TOKENS, tbt_slo_s=0.1, admission="none")
    col = dataclasses.replace(dis, topology="colocated", pool_dram_tokens=0, prefill_instances=None)
    return [dis, col, dataclasses.replace(col, chunked_prefill_tokens=512)]


def overload(base: SimConfig) -> list[SimConfig]:
    cfg = dataclasses.replace(base, policy="conductor", topology="disaggregated", instances=16, prefill_instances=14,
                              max_running=32, speed=2.0, pool_dram_tokens=0)
    return [dataclasses.replace(cfg, admission=a) for a in ADMISSIONS]


def capacity(base: SimConfig) -> list[SimConfig]:
    dis = colocated(base)[0]
    return [dataclasses.replace(dis, pool_dram_tokens=c, hbm_cache_tokens=0) for c in POOL_CAPACITIES]


PRESETS: dict[str, Callable[[SimConfig], list[SimConfig]]] = {
    "fig5": fig5, "fig5-hbm": fig5_hbm, "colocated": colocated, "overload": overload, "capacity": capacity}


def preset_runs(name: str, base: SimConfig | None = None) -> list[SimConfig]:
    """The runs of preset ``name`` on ``base`` (its noise, seed, predictors; default
    :class:`SimConfig`). Raises InvalidArgument listing the presets."""
    try:
        make = PRESETS[name]
    except KeyError:
        raise InvalidArgument(f"unknown preset {name!r}; valid: {sorted(PRESETS)}") from None
    return make(base or SimConfig())


def describe(name: str, runs: list[SimConfig]) -> str:
    """The set-up of a preset, printed with its results: its summary line and, per run, the
    settings that differ from :class:`SimConfig`'s defaults."""
    doc = __doc__ or ""
    line = next((x.strip().replace("``", "") for x in doc.split("* ``")[1:] if x.startswith(name + "``")), name)
    line = " ".join(line.split())
    default = SimConfig()
    out = [f"preset {line}"]
    for cfg in runs:
        diff = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                if f.name == "policy" or getattr(cfg, f.name) != getattr(default, f.name)}
        out.append("  run: " + ", ".join(f"{k}={v}" for k, v in diff.items()) if diff else "  run: defaults")
    return "\n".join(out)
