"""The Conductor against the routers users deploy instead (docs/routers.md), on the fig5
preset: NVIDIA Dynamo's KV router (``dynamo_kv``), llm-d's inference scheduler (``llmd``) and
SGLang's ``cache_aware`` (``sglang_cache_aware``), with the same noise and learned predictors
as the Conductor and the paper's baselines. ``bench_simulate.py`` runs them in its seed sweep
and reports, per seed, the Conductor's average and p99 TTFT over the *best* peer router's of
that seed (the peer with the least average TTFT, and separately the least p99: the strictest
comparison), each peer's own figures, and the rejections of each (fig5 admits everything, so
the Conductor must reject no more than any peer)."""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from scheduler.sim.presets import PEER_ROUTER_POLICIES

PEERS = PEER_ROUTER_POLICIES
RATIOS = ("conductor_vs_best_peer_router_avg_ttft", "conductor_vs_best_peer_router_p99_ttft")


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def peer_ratios(runs: Mapping[str, Mapping[str, float]]) -> dict[str, float | str]:
    """One seed's figures from ``runs`` (policy → ``ttft_mean_s``, ``ttft_p99_s``,
    ``rejected``, optionally ``ttft_no_queue_p99_s``; the Conductor's and every peer's): the
    ratios to the best peer and which peer that was, the ratios to each peer, the Conductor's
    rejections minus the fewest any peer rejected (``conductor_rejected_minus_fewest_peer``:
    <= 0 when it rejects no more) and, with ``ttft_no_queue_p99_s``, the Conductor's p99 with
    every wait in a queue taken out over the best peer's p99
    (``conductor_no_queue_vs_best_peer_router_p99_ttft``: the least p99 ratio a better order of
    the same prefills could reach)."""
    c = runs["conductor"]
    best_avg = min(PEERS, key=lambda p: runs[p]["ttft_mean_s"])
    best_p99 = min(PEERS, key=lambda p: runs[p]["ttft_p99_s"])
    return {
        "conductor_vs_best_peer_router_avg_ttft": c["ttft_mean_s"] / runs[best_avg]["ttft_mean_s"],
        "conductor_vs_best_peer_router_p99_ttft": c["ttft_p99_s"] / runs[best_p99]["ttft_p99_s"],
        "best_peer_router_avg_ttft": best_avg,
        "best_peer_router_p99_ttft": best_p99,
        "conductor_rejected_minus_fewest_peer": c["rejected"] - min(runs[p]["rejected"] for p in PEERS),
        # the Conductor's p99 had no request waited in a queue: how far routing alone could go
        **({"conductor_no_queue_vs_best_peer_router_p99_ttft": c["ttft_no_queue_p99_s"] / runs[best_p99]["ttft_p99_s"]}
           if c.get("ttft_no_queue_p99_s") else {}),
        **{f"conductor_vs_{p}_avg_ttft": c["ttft_mean_s"] / runs[p]["ttft_mean_s"] for p in PEERS},
        **{f"conductor_vs_{p}_p99_ttft": c["ttft_p99_s"] / runs[p]["ttft_p99_s"] for p in PEERS},
    }


def sweep_figures(got: Mapping[tuple[str, int, str], Mapping[str, float]], seeds: Sequence[int],
                  setup: str = "fig5", no_peer_fetch: str = "fig5_no_peer_fetch") -> dict[str, Any]:
    """The seed sweep's peer-router figures: per seed, and mean [min, max] over ``seeds`` of
    each ratio and of each policy's average TTFT, p99 TTFT and rejections; with the
    Conductor's runs without peer fetch (``no_peer_fetch``) in ``got``, its ratios too."""
    policies = (*PEERS, "conductor")
    per_seed = {str(s): peer_ratios({p: got[(setup, s, p)] for p in policies}) for s in seeds}
    numeric = [k for k, v in per_seed[str(seeds[0])].items() if not isinstance(v, str)]
    figures = {f"{p}_{k}": spread([got[(setup, s, p)][k] for s in seeds])
               for p in policies for k in ("ttft_mean_s", "ttft_p99_s", "ttft_no_queue_p99_s", "rejected", "hit_ratio")
               if all(got[(setup, s, p)].get(k) is not None for s in seeds)}
    best = {k: {p: sum(1 for s in seeds if per_seed[str(s)][k] == p) for p in PEERS}
            for k in ("best_peer_router_avg_ttft", "best_peer_router_p99_ttft")}
    if all((no_peer_fetch, s, "conductor") in got for s in seeds):
        # the Conductor as the live router runs it (no prefix fetched from a peer prefill node's
        # cache: the peers fetch none either), against the same best peer
        for s in seeds:
            runs = {**{p: got[(setup, s, p)] for p in PEERS}, "conductor": got[(no_peer_fetch, s, "conductor")]}
            per_seed[str(s)].update({f"{k}_no_peer_fetch": v for k, v in peer_ratios(runs).items() if k in RATIOS})
        numeric += [f"{k}_no_peer_fetch" for k in RATIOS]
    return {"per_seed": per_seed,
            "ratios": {k: spread([float(per_seed[str(s)][k]) for s in seeds]) for k in numeric},
            "figures": figures, "best_peer_seeds": best}


def seed0_ratios(results: Mapping[str, Any]) -> dict[str, float]:
    """Seed 0's single-run ratios from fig5's :class:`SimResult` rows (policy → result)."""
    runs = {p: {"ttft_mean_s": r.ttft_mean_s, "ttft_p99_s": r.ttft_p99_s, "ttft_no_queue_p99_s": r.ttft_no_queue_p99_s,
                "rejected": r.rejected_early + r.rejected_late}
            for p, r in results.items() if p in (*PEERS, "conductor")}
    return {k: float(v) for k, v in peer_ratios(runs).items() if k in RATIOS or k.startswith("conductor_no_queue")}


def print_sweep(fig: Mapping[str, Any]) -> None:
    print("fig5: the Conductor against the peer routers (docs/routers.md), learned, mean [min, max]:")
    for k, v in {**fig["ratios"], **fig["figures"]}.items():
        print(f"  {k}: {v['mean']:.3f} [{v['min']:.3f}, {v['max']:.3f}]")
    print(f"  best peer per seed: {fig['best_peer_seeds']}")
