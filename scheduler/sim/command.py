"""``kvstore simulate``: several policies × topologies × admissions in one run — or a named
experiment (``--preset``, :mod:`scheduler.sim.presets`) — one table, optional JSON and PNG
plots (TTFT CDF; goodput against request rate; hit ratio against pool capacity)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from engines.cost_model import load_model
from kvstore.config import positive_int
from kvstore.errors import InvalidArgument
from kvstore.pool.eviction import POLICIES as EVICTION_POLICIES
from scheduler.policy.registry import DEFAULT_POLICY, POLICIES
from scheduler.sim import plots, simulate
from scheduler.sim.config import ADMISSIONS, TOPOLOGIES, SimConfig
from scheduler.sim.metrics import SimResult
from scheduler.sim.presets import PRESETS, describe, preset_runs
from scheduler.sim.workload import load_workload

log = logging.getLogger(__name__)


def all_policies() -> str:
    """Every scheduling policy registered now, comma-joined, the default (the Conductor)
    last: the baselines, then it. Read when the parser is built, so a policy registered
    before then is in ``--policies``'s default."""
    return ",".join(sorted(POLICIES, key=lambda name: name == DEFAULT_POLICY))


def _tokens(text: str) -> int | None:
    """A token count (>= 0; ``1e6`` style allowed), or None for "inf"/"unbounded". Raises
    argparse.ArgumentTypeError saying what is wrong (argparse names the flag)."""
    if text.lower() in ("inf", "unbounded", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens (or inf)") from None
    if not math.isfinite(value) or value < 0 or value >= 2**63:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of tokens is a whole number >= 0 (or inf)")
    return int(value)


def _pool_tokens(text: str) -> int | str | None:
    """``--pool-dram-tokens``: "auto" or :func:`_tokens`'s."""
    return "auto" if text == "auto" else _tokens(text)


# Token flags a preset may set itself: no default here (argparse.SUPPRESS), so that a value
# given — 0 included, which is also SimConfig's — is told apart from none given.
_PRESETTABLE_TOKENS = ("pool_ssd_tokens", "hbm_cache_tokens", "local_dram_tokens")


def add_simulate_flags(p: argparse.ArgumentParser, default_trace: str) -> None:
    p.add_argument("--trace", default=default_trace, help="Mooncake-format JSONL trace")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="run a named experiment (its set-up is printed with its results; it fixes the cluster, "
                        "policies, admission and pool flags); see docs/simulator.md")
    p.add_argument("--oracle", action="store_true",
                   help="the Conductor's predictors are the cost model's exact means, frozen (default: seeded "
                        "from a profiling pass and learned online from noisy observations)")
    p.add_argument("--prefill-cv", type=float, default=0.1, help="engines' noise: CV of a prefill's seconds")
    p.add_argument("--decode-cv", type=float, default=0.05, help="engines' noise: CV of a decode segment's step time")
    p.add_argument("--straggler-prob", type=float, default=0.01, help="probability a prefill is a straggler")
    p.add_argument("--straggler-factor", type=float, default=3.0,
                   help="a straggler prefill takes this many times as long")
    p.add_argument("--requests", type=positive_int, default=None, help="simulate the first N requests (default: all)")
    p.add_argument("--policies", default=all_policies(), help="comma list of scheduling policies")
    p.add_argument("--topology", default=TOPOLOGIES[0], help=f"comma list: {', '.join(TOPOLOGIES)}")
    p.add_argument("--admission", default="none",
                   help="comma list of admission modes: " + "; ".join(f"{k}: {v}" for k, v in ADMISSIONS.items()))
    p.add_argument("--instances", type=int, help="instances in all (each one node of --profile; default 16)")
    p.add_argument("--prefill-instances", type=int, help="disaggregated: prefill instances (None: half)")
    p.add_argument("--profile", default="8xA800", help="hardware profile (configs/hardware/NAME.toml or a path)")
    p.add_argument("--model", default="llama3-70b", help="model config (configs/models/NAME.toml or a path)")
    p.add_argument("--ttft-slo-s", type=float, default=30.0, help="TTFT SLO (seconds)")
    p.add_argument("--tbt-slo-s", type=float, default=0.1, help="TBT SLO on Mooncake's TBT (mean of the longest 10%%)")
    p.add_argument("--speed", type=float, help="replay speed (arrival times are divided by it; default 1)")
    p.add_argument("--pool-dram-tokens", type=_pool_tokens, default="auto",
                   help="pool DRAM capacity in tokens (auto: 1 TiB per prefill node; inf; 0: no pool)")
    p.add_argument("--pool-ssd-tokens", type=_tokens, default=argparse.SUPPRESS,
                   help="pool SSD capacity in tokens (inf, or 0: none, the default)")
    p.add_argument("--hbm-cache-tokens", type=_tokens, default=argparse.SUPPRESS,
                   help="per-instance HBM prefix cache in tokens (default: the KV room beside the weights; "
                        "half of it colocated)")
    p.add_argument("--local-dram-tokens", type=_tokens, default=argparse.SUPPRESS,
                   help="per-prefill-instance DRAM cache below its HBM cache, in tokens (a Mooncake node's "
                        "local cache holds about 3M LLaMA3-70B tokens in ~1 TB of DRAM, and --preset fig5 gives "
                        "each prefill node 3M less its HBM's; inf; 0: none, the default)")
    p.add_argument("--max-running", type=int, help="decode batch limit per instance (default 256)")
    p.add_argument("--no-peer-fetch", action="store_true", help="the Conductor may not fetch from peers' caches")
    p.add_argument("--chunked-prefill-tokens", type=int, help="colocated: chunked prefill of this many tokens per step")
    p.add_argument("--eviction", default=SimConfig.eviction, choices=EVICTION_POLICIES,
                   help="cache eviction strategy")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the engines' noise, the predictors' profiling pass and the random policy")
    p.add_argument("--json", metavar="PATH", help="also write every result as JSON here")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots here (runs a speed and a pool-capacity sweep)")
    p.add_argument("--sweep-speeds", default="0.5,1,2,3,4", help="replay speeds of the goodput plot")
    p.add_argument("--sweep-pool-tokens", default="1e5,1e6,1e7,1e8,inf", help="pool capacities of the hit plot")


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# Flags left unset (None) take SimConfig's default, so that a preset can tell which were given.
def _given(args: argparse.Namespace) -> dict[str, Any]:
    given = {k: getattr(args, k) for k in ("instances", "speed", "max_running") if getattr(args, k) is not None}
    given.update({k: getattr(args, k) for k in _PRESETTABLE_TOKENS if hasattr(args, k)})
    return given


def base_config(args: argparse.Namespace) -> SimConfig:
    d = SimConfig()
    instances = args.instances if args.instances is not None else d.instances
    cfg = SimConfig(instances=instances, prefill_instances=args.prefill_instances, profile=args.profile,
                    model=args.model)
    pool: int | None
    if args.pool_dram_tokens == "auto":
        pool = cfg.n_prefill * (2**40 // load_model(args.model).kv_bytes_per_token)
    else:
        pool = args.pool_dram_tokens
    given = _given(args)
    return SimConfig(instances=instances, prefill_instances=args.prefill_instances, profile=args.profile,
                     model=args.model, speed=given.get("speed", d.speed), ttft_slo_s=args.ttft_slo_s,
                     tbt_slo_s=args.tbt_slo_s,
                     pool_dram_tokens=pool, pool_ssd_tokens=given.get("pool_ssd_tokens", d.pool_ssd_tokens),
                     hbm_cache_tokens=given.get("hbm_cache_tokens", d.hbm_cache_tokens),
                     local_dram_tokens=given.get("local_dram_tokens", d.local_dram_tokens),
                     max_running=given.get("max_running", d.max_running),
                     peer_fetch=not args.no_peer_fetch, chunked_prefill_tokens=args.chunked_prefill_tokens,
                     eviction=args.eviction, seed=args.seed, prefill_cv=args.prefill_cv,
                     decode_cv=args.decode_cv, straggler_prob=args.straggler_prob,
                     straggler_factor=args.straggler_factor, oracle=args.oracle)


def run_matrix(base: SimConfig, trace: str, limit: int | None, policies: Sequence[str],
               topologies: Sequence[str], admissions: Sequence[str]) -> list[SimResult]:
    """Every (topology, admission, policy) of the lists on ``base``, in that order."""
    return run_all([dataclasses.replace(base, policy=policy, topology=topology, admission=admission)
                    for topology in topologies for admission in admissions for policy in policies], trace, limit)


def run_all(configs: Sequence[SimConfig], trace: str, limit: int | None) -> list[SimResult]:
    """Each run of ``configs`` in order, progress on stderr."""
    out = []
    for cfg in configs:
        def progress(done: int, total: int, cfg: SimConfig = cfg) -> None:
            print(f"  {cfg.policy}/{cfg.topology}/{cfg.admission}: {done}/{total} arrivals",
                  file=sys.stderr, flush=True)
        r = simulate(cfg, trace, limit, progress)
        print(f"{cfg.policy:>18} {cfg.topology:>13} {cfg.admission:>10}: {r.requests} requests in "
              f"{r.wall_s:.1f} s wall", file=sys.stderr, flush=True)
        out.append(r)
    return out


def _mtokens(tokens: int) -> str:
    """A token count for the table: 26.8M, 0.1M."""
    return f"{tokens / 1e6:.3g}M"


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _log_error(r: SimResult) -> str:
    if r.prefill_log_error_mean is None or r.prefill_log_error_sd is None:
        return "-"
    return f"{r.prefill_log_error_mean:+.3f}±{r.prefill_log_error_sd:.3f}"


def format_table(results: Sequence[SimResult]) -> str:
    """One row per run (times in seconds; TBT in ms; ``T_prefill ln err``: mean ±
    standard deviation of ln(observed / predicted) prefill seconds, the scheduler's
    predictor against the engines)."""
    rows = []
    for r in results:
        cfg = SimConfig(**r.settings) if r.settings else None
        shape = "" if cfg is None else (f" {cfg.instances}C" if cfg.topology == "colocated"
                                        else f" {cfg.n_prefill}P+{cfg.instances - cfg.n_prefill}D")
        if cfg is not None and cfg.chunked_prefill_tokens:
            shape += f" chunk {cfg.chunked_prefill_tokens}"
        if cfg is not None and cfg.pool_dram_tokens != 0:
            shape += " pool " + ("inf" if cfg.pool_dram_tokens is None else _mtokens(cfg.pool_dram_tokens))
        if cfg is not None and cfg.local_dram_tokens != 0:
            shape += " local DRAM " + ("inf" if cfg.local_dram_tokens is None else _mtokens(cfg.local_dram_tokens))
        rows.append([r.policy + (" (oracle)" if cfg is not None and cfg.oracle else ""), r.topology + shape,
                     r.admission, f"{r.speed:g}", r.requests, r.completed,
                     f"{r.rejected_early}/{r.rejected_late}", f"{r.goodput_rps:.3f}", f"{r.effective_capacity:.3f}",
                     f"{r.throughput_tok_s:.0f}", _f(r.ttft_mean_s), _f(r.ttft_p50_s), _f(r.ttft_p90_s),
                     _f(r.ttft_p99_s), _f(r.tbt_p90_s and r.tbt_p90_s * 1e3, 1),
                     _f(r.tbt_p99_s and r.tbt_p99_s * 1e3, 1),
                     f"{r.hit_ratio:.3f}/{r.best_possible_hit_ratio:.3f}", f"{r.wasted_prefill_gpu_s:.0f}",
                     _log_error(r), f"{r.wall_s:.1f}"])
    head = ["policy", "topology", "admission", "speed", "reqs", "done", "rej early/late", "goodput r/s",
            "eff. capacity", "tok/s", "TTFT mean", "p50", "p90", "p99", "TBT p90 ms", "p99 ms",
            "hit/best", "wasted GPU-s", "T_prefill ln err", "wall s"]
    return tabulate(rows, headers=head, tablefmt="github")


def make_plots(results: Sequence[SimResult], base: SimConfig, args: argparse.Namespace,
               out_dir: str | Path) -> dict[str, Any]:
    """The three plots; the sweeps run on ``base`` (with a preset: its first run's cluster)
    with the first topology and admission of the results."""
    out_dir = Path(out_dir)
    trace, limit = args.trace, args.requests
    files = {"ttft_cdf": str(plots.ttft_cdf(results, out_dir / "ttft_cdf.png"))}
    reqs, _ = load_workload(trace, limit)
    span = (max(r.timestamp_ms for r in reqs) - min(r.timestamp_ms for r in reqs)) / 1000.0
    rate = len(reqs) / span if span > 0 else 0.0
    first = results[0]
    sweep: dict[str, list[tuple[float, float]]] = {}
    for policy in sorted({r.policy for r in results}, key=[r.policy for r in results].index):
        for speed in (float(s) for s in _split(args.sweep_speeds)):
            cfg = dataclasses.replace(base, policy=policy, topology=first.topology, admission=first.admission,
                                      speed=speed)
            r = simulate(cfg, trace, limit)
            sweep.setdefault(policy, []).append((rate * speed, r.goodput_rps))
    files["goodput_vs_rate"] = str(plots.goodput_vs_rate(sweep, out_dir / "goodput_vs_rate.png"))
    points: list[tuple[float | None, float]] = []
    best = 0.0
    for cap in (_tokens(c) for c in _split(args.sweep_pool_tokens)):
        cfg = dataclasses.replace(base, policy="conductor", topology="disaggregated", admission=first.admission,
                                  pool_dram_tokens=cap)
        r = simulate(cfg, trace, limit)
        points.append((cap, r.hit_ratio))
        best = r.best_possible_hit_ratio
    files["hit_vs_capacity"] = str(plots.hit_vs_capacity(points, best, out_dir / "hit_vs_capacity.png"))
    return {"files": files, "goodput_sweep": sweep, "hit_sweep": points}


def _check_sweeps(args: argparse.Namespace) -> None:
    """The sweeps' lists are read before anything runs. Raises InvalidArgument naming the flag."""
    for flag, text, parse in (("--sweep-speeds", args.sweep_speeds, float),
                              ("--sweep-pool-tokens", args.sweep_pool_tokens, _tokens)):
        try:
            values = [parse(x) for x in _split(text)]
        except (ValueError, argparse.ArgumentTypeError):
            raise InvalidArgument(f"{flag} is a comma list of numbers, got {text!r}") from None
        if not values or any(v is not None and not v > 0 for v in values):
            raise InvalidArgument(f"{flag} needs numbers > 0, got {text!r}")


def preset_overrides(args: argparse.Namespace, base: SimConfig, runs: Sequence[SimConfig]) -> list[str]:
    """The flags given on the command line that the preset's runs set otherwise (they are
    not used: a preset is one experiment)."""
    given = [flag for flag, value, default in (("--policies", args.policies, all_policies()),
                                               ("--topology", args.topology, TOPOLOGIES[0]),
                                               ("--admission", args.admission, "none"))
             if value != default]
    if args.pool_dram_tokens != "auto" and any(r.pool_dram_tokens != base.pool_dram_tokens for r in runs):
        given.append("--pool-dram-tokens")
    default = SimConfig()
    explicit = _given(args)
    for f in dataclasses.fields(SimConfig):
        if f.name in ("pool_dram_tokens", "policy", "topology", "admission"):
            continue
        if (f.name in explicit or getattr(base, f.name) != getattr(default, f.name)) and any(
                getattr(r, f.name) != getattr(base, f.name) for r in runs):
            given.append("--" + f.name.replace("_", "-"))
    return given


def simulate_command(args: argparse.Namespace) -> int:
    """The ``kvstore simulate`` subcommand (see :func:`add_simulate_flags`)."""
    try:
        base = base_config(args)
        if args.plots:
            _check_sweeps(args)
        if args.preset:
            runs = preset_runs(args.preset, base)
            ignored = preset_overrides(args, base, runs)
            if ignored:
                print(f"kvstore simulate: --preset {args.preset} sets {', '.join(ignored)} itself; the values "
                      f"given are not used (drop --preset to set them)", file=sys.stderr, flush=True)
            results = run_all(runs, args.trace, args.requests)
            print(describe(args.preset, runs))
        else:
            results = run_matrix(base, args.trace, args.requests, _split(args.policies), _split(args.topology),
                                 _split(args.admission))
        predictors = "oracle (exact, frozen)" if base.oracle else "learned (profiled, online)"
        print(f"  predictors: {predictors}; noise: prefill CV {base.prefill_cv}, decode CV {base.decode_cv}, "
              f"stragglers {base.straggler_prob} x{base.straggler_factor}; seed {base.seed}")
    except InvalidArgument as exc:
        print(f"kvstore simulate: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    extra: dict[str, Any] = {}
    if args.plots:
        extra = make_plots(results, runs[0] if args.preset else base, args, args.plots)
        for name, path in extra["files"].items():
            print(f"plot {name}: {path}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"results": [r.to_dict() for r in results], **extra}, indent=2) + "\n")
    return 0
