"""The simulator's comparison of the Conductor with the routers users deploy instead, alone: the
part of ``benchmarks/bench_simulate.py``'s seed sweep that its headline ratios against the peer
routers and Table 3's rejection pairings come from, without the rest (the fig5-hbm, oracle,
no-peer-fetch, colocated, capacity and goodput runs), for a machine that cannot spend the full
sweep's ~230 runs.

Runs, learned predictors, each over seeds 0–9 (:data:`benchmarks.bench_simulate.SEEDS`),
two processes at a time at the lowest CPU priority the caller gives them (``nice``):

* ``--preset fig5``: the Conductor, least-loaded, local cache-aware and the three peer routers
  (``dynamo_kv``, ``llmd``, ``sglang_cache_aware``; docs/routers.md);
* ``--preset overload``: rejection after prefill only (``late``), on the decode load now
  (``current``) and on the predicted one (``predictive``).

Writes ``benchmarks/results/simulate.json`` with ``scope`` saying which runs it holds;
``ratios`` holds each ratio's mean over the seeds (``conductor_vs_best_peer_router_avg_ttft``,
``conductor_vs_best_peer_router_p99_ttft``, ``conductor_vs_least_loaded_avg_ttft``,
``conductor_vs_local_cache_aware_avg_ttft``, ``rejected_predictive_vs_late``,
``rejected_predictive_vs_current``, …) and ``seeds`` each one's min and max and every seed's
figures. Each run is keyed as ``bench_simulate.py --resume`` keys it, so ``--resume DIR`` here
and there share the runs.

    PYTHONPATH=. nice -n 10 python benchmarks/bench_simulate_peers.py [--resume DIR] [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import peer_router_figures as peers  # noqa: E402
from benchmarks.bench_simulate import SEEDS, _one  # noqa: E402
from benchmarks.run_info import write_results  # noqa: E402
from benchmarks.sim_ratios import cache_ratios, rejection_ratios  # noqa: E402
from scheduler.sim import SimConfig  # noqa: E402
from scheduler.sim.presets import describe, preset_runs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BASELINES = ("least_loaded", "local_cache_aware")
FIG5 = (*BASELINES, *peers.PEERS, "conductor")
ADMISSIONS = ("late", "current", "predictive")


def jobs(seeds: tuple[int, ...], fig5: tuple[str, ...] = FIG5) -> list[tuple[tuple[str, int, str], SimConfig]]:
    """((setup, seed, policy or admission), config) of every run, in the order they run: first
    what the ratios to the peer routers and Table 3's pairings need, then the paper's baselines
    (so that a sweep cut short by ``--resume`` holds whole seeds of the first)."""
    out = []
    for seed in seeds:
        base = SimConfig(seed=seed)
        out += [(("fig5", seed, c.policy), c) for c in preset_runs("fig5", base) if c.policy in fig5
                and c.policy not in BASELINES]
        out += [(("overload", seed, c.admission), c) for c in preset_runs("overload", base)
                if c.admission in ADMISSIONS]
    for seed in seeds:
        out += [(("fig5", seed, c.policy), c) for c in preset_runs("fig5", SimConfig(seed=seed)) if c.policy in fig5
                and c.policy in BASELINES]
    return out


def figures(got: dict[tuple[str, int, str], dict[str, float]], seeds: tuple[int, ...],
            fig5: tuple[str, ...] = FIG5) -> dict[str, Any]:
    """Per seed the ratios, and over the seeds each ratio's and each run's mean, min and max
    (the ratios to least-loaded and local cache-aware only when ``fig5`` holds them)."""
    per_seed: dict[str, dict[str, float]] = {}
    for s in seeds:
        late, cur, pre = (got[("overload", s, a)] for a in ADMISSIONS)
        per_seed[str(s)] = rejection_ratios(late, cur, pre)
        if all(p in fig5 for p in BASELINES):
            per_seed[str(s)].update(cache_ratios({p: got[("fig5", s, p)]["ttft_mean_s"]
                                                  for p in (*BASELINES, "conductor")}))
    peer = peers.sweep_figures(got, seeds)
    for s in seeds:
        per_seed[str(s)].update({k: float(v) for k, v in peer["per_seed"][str(s)].items() if not isinstance(v, str)})
    keys = list(per_seed[str(seeds[0])])
    ratios = {k: peers.spread([per_seed[str(s)][k] for s in seeds]) for k in keys}
    runs = {f"{setup}.{name}.{k}": peers.spread([got[(setup, s, name)][k] for s in seeds])
            for setup, names in (("fig5", fig5), ("overload", ADMISSIONS)) for name in names
            for k in ("ttft_mean_s", "ttft_p99_s", "rejected", "wasted_prefill_gpu_s", "hit_ratio")}
    return {"seeds": list(seeds), "ratios": ratios, "runs": runs, "per_seed": per_seed,
            "best_peer_seeds": peer["best_peer_seeds"],
            "per_seed_best_peer": {s: {k: v for k, v in peer["per_seed"][s].items() if isinstance(v, str)}
                                   for s in peer["per_seed"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="first 2,000 requests and seeds 0-1 only (a smoke test)")
    ap.add_argument("--resume", metavar="DIR", help="keep each run's figures in DIR and read back those there")
    ap.add_argument("--workers", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--policies", default=",".join(FIG5), help="fig5's policies to run (the Conductor and the "
                    "peer routers at least)")
    args = ap.parse_args(argv)
    if args.resume:
        os.makedirs(args.resume, exist_ok=True)
    limit = 2000 if args.quick else None
    seeds = SEEDS[:2] if args.quick else SEEDS
    fig5 = tuple(p for p in FIG5 if p in args.policies.split(","))
    if not {"conductor", *peers.PEERS} <= set(fig5):
        ap.error(f"--policies needs the Conductor and {', '.join(peers.PEERS)}")
    todo = jobs(seeds, fig5)
    print(f"== {len(todo)} runs (fig5: {', '.join(fig5)}; overload: {', '.join(ADMISSIONS)}) over seeds "
          f"{seeds[0]}-{seeds[-1]}, {args.workers} at a time", flush=True)
    t0 = time.monotonic()
    with ProcessPoolExecutor(args.workers) as pool:
        got = dict(zip([k for k, _ in todo], pool.map(_one, [(c, limit, args.resume) for _, c in todo])))
    fig = figures(got, seeds, fig5)
    out: dict[str, Any] = {
        "setups": __doc__, "quick": args.quick,
        "scope": f"fig5 ({', '.join(fig5)}) and overload (late, current, predictive), learned predictors, seeds "
                 f"{seeds[0]}-{seeds[-1]}: benchmarks/bench_simulate_peers.py; not run: the oracle, fig5-hbm, "
                 "no-peer-fetch, colocated, capacity and goodput runs of benchmarks/bench_simulate.py",
        "presets": {n: describe(n, preset_runs(n)) for n in ("fig5", "overload")},
        "wall_s": time.monotonic() - t0,
        "ratios": {k: v["mean"] for k, v in fig["ratios"].items()},
        "seeds": fig}
    write_results(RESULTS / "simulate.json", out, default=str)
    print(f"over seeds {seeds[0]}-{seeds[-1]}: mean [min, max]")
    for k, v in {**fig["ratios"], **fig["runs"]}.items():
        print(f"  {k}: {v['mean']:.3f} [{v['min']:.3f}, {v['max']:.3f}]")
    print(f"  best peer per seed: {fig['best_peer_seeds']}")
    print(f"wrote benchmarks/results/simulate.json ({len(todo)} runs, "
          f"{out['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
