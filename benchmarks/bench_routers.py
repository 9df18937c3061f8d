"""The Conductor against the routers users deploy instead, live: the same replay through the
front door over vLLM under each scheduling policy (docs/routers.md).

Set-up: the demo's (``make demo``, launcher/vllm_setups.py): one store node (``kvstore serve``,
DRAM 2 GiB), two vLLM ``kv_both`` instances of the ``bench`` checkpoint of
engines/vllm/checkpoint.py (``--checkpoint tiny``: the smallest), each pinned to cores of its own
(:func:`launcher.vllm_setups.cpu_sets`: one core each on a 2-core host) with a 320 MiB KV cache,
vLLM's prefix caching on and its KV events published (the router sees each instance's own
cache), the front door over them (colocated) with ``config.policy`` set to each policy in turn:
the Conductor, the paper's
baselines (least-loaded, local cache-aware) and the peer routers (``dynamo_kv``, ``llmd``,
``sglang_cache_aware``). Each policy replays the same trace requests (``--requests`` of
Mooncake's conversation trace: the conversations with the most turns within ``--window-s``
trace seconds of request ``--start``, so that later turns reuse earlier ones; open loop at
``--speed`` × their timestamps — the demo's 4 by default —, output capped at
``--max-output-tokens``; the demo's SLOs: TTFT 2 s, TBT 0.2 s) with
:func:`scheduler.replay.run.run_replay`. The instances and the store stay up across policies, so
each replay maps the trace's blocks to tokens of its own (a seed per replay) — same lengths,
same sharing, same timing, nothing cached by an earlier replay. The machine is shared and
drifts over minutes, so the policies run ``--rounds`` times, in the listed order and then
reversed, alternately, and each policy's figures pool its rounds' requests. ``--warmup``
replays (least-loaded routing, counted for no policy) come first: the instances' first
requests after their start may be slower (first touch of their KV caches and of the pool's
memory), and the first policy of round one would carry it.

Reported per policy: TTFT p50/p99, goodput (requests/s meeting the TTFT and TBT SLOs), hit
ratio, rejections, each round's TTFT p50; ``ratios.conductor_vs_best_peer_router_ttft_p50_live`` (target <= 0.9: the
Conductor's TTFT p50 over the least TTFT p50 among the peer routers) and its p99 and goodput
counterparts. Other work on the host shifts every figure, so the JSON's ``load`` holds the
1-, 5- and 15-minute load averages before and after the run. Writes
``benchmarks/results/routers.json``.

    PYTHONPATH=. python benchmarks/bench_routers.py [--requests 60 --window-s 120 --speed 4 --rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run_info import write_results  # noqa: E402
from engines.vllm.checkpoint import write_checkpoint  # noqa: E402
from engines.vllm.launch import VLLMServerSpec, ipc_endpoints, start_servers  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402
from launcher.vllm_setups import cpu_sets  # noqa: E402
from scheduler.config import FrontdoorConfig  # noqa: E402
from scheduler.policy.admission import AdmissionConfig  # noqa: E402
from scheduler.replay.report import Report  # noqa: E402
from scheduler.replay.run import run_replay  # noqa: E402
from scheduler.sim.presets import PEER_ROUTER_POLICIES  # noqa: E402
from scheduler.stats import percentile  # noqa: E402
from scheduler.vllm.app import start_vllm_frontdoor  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"
POLICIES = ("conductor", "least_loaded", "local_cache_aware", *PEER_ROUTER_POLICIES)
BS = 32


def start_store(work: Path) -> tuple[subprocess.Popen, str]:
    """A store node on a free port (DRAM 2 GiB, no SSD)."""
    port = free_port()
    log = open(work / "store.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--port", str(port), "--dram", "2GiB",
                             "--ssd", "0", "--data-dir", str(work / "store"), "--transfer-engine", "off"],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return proc, f"127.0.0.1:{port}"


def replay_policy(policy: str, seed: int, model: str, store: str, urls: list[str], events: list[str],
                  args: argparse.Namespace, work: Path) -> Report:
    """One policy's replay through a front door of its own over the running instances."""
    async def main():
        cfg = FrontdoorConfig(model_dir=model, policy=policy,
                              admission=AdmissionConfig(ttft_slo_s=args.admit_ttft_s, max_inflight=64))
        door = await start_vllm_frontdoor(model, (), (), store, config=cfg, topology="colocated",
                                          colocated_urls=urls, block_size=BS, kv_events=events)
        try:
            return await run_replay(door.url, TRACE, requests=args.requests, start=args.start, speed=args.speed,
                                    max_output_tokens=args.max_output_tokens, tokens_per_block=BS,
                                    ttft_slo_s=args.ttft_slo_s, tbt_slo_s=args.tbt_slo_s, seed=seed,
                                    window_s=args.window_s, json_path=work / f"replay-{policy}-{seed}.json")
        finally:
            await door.stop()
    r = asyncio.run(main())
    print(f"  {policy:>20}: {r.completed}/{r.requests_sent} completed, TTFT p50 {r.ttft_p50_s} p99 {r.ttft_p99_s}, "
          f"goodput {r.goodput_rps:.3f} rps, hit {r.hit_ratio:.3f} (best possible {r.best_possible_hit_ratio:.3f})",
          flush=True)
    return r


def pooled(reports: list[Report]) -> dict[str, Any]:
    """One policy's figures over its rounds: TTFT and TBT percentiles over every request,
    goodput as requests meeting both SLOs over the rounds' wall seconds."""
    ok = [o for r in reports for o in r.outcomes if o.status == "ok"]
    ttft = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    gaps = sorted(t for o in ok for t in o.tbt_s)
    blocks = sum(o.trace_blocks for r in reports for o in r.outcomes)
    return {"completed": len(ok), "rejected": sum(r.rejected for r in reports),
            "failed": sum(r.failed for r in reports), "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "tbt_p50_s": percentile(gaps, 50), "tbt_p99_s": percentile(gaps, 99),
            "met_slo": sum(r.met_slo for r in reports),
            "goodput_rps": sum(r.met_slo for r in reports) / max(1e-9, sum(r.wall_s for r in reports)),
            "hit_ratio": sum(o.cached_blocks for r in reports for o in r.outcomes) / max(1, blocks),
            "best_possible_hit_ratio": statistics.fmean(r.best_possible_hit_ratio for r in reports),
            "ttft_p50_s_by_round": [r.ttft_p50_s for r in reports], "wall_s": sum(r.wall_s for r in reports)}


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The Conductor against the best peer router (least TTFT p50; least p99; most goodput)."""
    c = results["conductor"]
    peers = {p: results[p] for p in PEER_ROUTER_POLICIES if p in results and results[p]["ttft_p50_s"] is not None}
    if c["ttft_p50_s"] is None or not peers:
        return {}
    p50 = min(peers, key=lambda p: peers[p]["ttft_p50_s"])
    p99 = min(peers, key=lambda p: peers[p]["ttft_p99_s"])
    good = max(peers, key=lambda p: peers[p]["goodput_rps"])
    return {"conductor_vs_best_peer_router_ttft_p50_live": c["ttft_p50_s"] / peers[p50]["ttft_p50_s"],
            "best_peer_router_ttft_p50_live": p50,
            "conductor_vs_best_peer_router_ttft_p99_live": c["ttft_p99_s"] / peers[p99]["ttft_p99_s"],
            "best_peer_router_ttft_p99_live": p99,
            "conductor_vs_best_peer_router_goodput_live": c["goodput_rps"] / max(1e-9, peers[good]["goodput_rps"]),
            "best_peer_router_goodput_live": good,
            "conductor_rejected_minus_fewest_peer": c["rejected"] - min(r["rejected"] for r in peers.values())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=60, help="trace requests each policy replays")
    p.add_argument("--start", type=int, default=0, help="first trace request")
    p.add_argument("--window-s", type=float, default=120.0,
                   help="take the conversations with the most turns within this many trace seconds of --start")
    p.add_argument("--rounds", type=int, default=2, help="replays per policy (the order reversed every other round)")
    p.add_argument("--warmup", type=int, default=1,
                   help="replays before the first round, measured by no policy (least-loaded routing; their own "
                        "tokens): the instances' first requests pay one-off costs the first policy would carry")
    p.add_argument("--speed", type=float, default=4.0, help="replay speed (× the trace's timestamps)")
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tbt-slo-s", type=float, default=0.2)
    p.add_argument("--admit-ttft-s", type=float, default=60.0, help="the front door's admission bound on TTFT")
    p.add_argument("--checkpoint", choices=("tiny", "bench"), default="bench")
    p.add_argument("--kv-cache-mib", type=int, default=320, help="each instance's own paged KV cache (MiB)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="pin each instance to cores of its own (launcher.vllm_setups.cpu_sets)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (the Conductor and a peer "
                   "at least for the ratios)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    work = Path(tempfile.mkdtemp(prefix="bench-routers-"))
    load_before = os.getloadavg()
    model = write_checkpoint(str(work / f"{args.checkpoint}-llama"), args.checkpoint, max_model_len=16384)
    cores = cpu_sets(2) if args.pin else [()] * 2
    events_dir = work / "kv-events"
    events_dir.mkdir(mode=0o700)
    store_proc, store = start_store(work)
    specs = [VLLMServerSpec(model, free_port(), "kv_both", store, block_size=BS, kv_cache_bytes=args.kv_cache_mib << 20,
                            max_model_len=8192, prefix_caching=True, cpus=cores[i],
                            kv_events=ipc_endpoints(events_dir, f"vllm-{i}")) for i in range(2)]
    servers = []
    reports: dict[str, list[Report]] = {p: [] for p in policies}
    t0 = time.monotonic()
    try:
        time.sleep(3)
        servers = start_servers(specs, work / "logs", [f"vllm-{i}" for i in range(2)], timeout_s=600)
        urls = [s.url for s in servers]
        events = [",".join(s.kv_events) for s in specs if s.kv_events]
        seed = 1000
        for n in range(args.warmup):
            print(f"== warm-up {n + 1} of {args.warmup} (not counted)", flush=True)
            replay_policy("least_loaded", 900 + n, model, store, urls, events, args, work)
        for rnd in range(args.rounds):
            print(f"== round {rnd + 1} of {args.rounds}", flush=True)
            for policy in policies if rnd % 2 == 0 else policies[::-1]:
                seed += 1
                reports[policy].append(replay_policy(policy, seed, model, store, urls, events, args, work))
    finally:
        for s in servers:
            s.stop()
        store_proc.terminate()
        store_proc.wait(timeout=30)
    results = {p: pooled(r) for p, r in reports.items() if r}
    out = {"settings": {**vars(args), "checkpoint": args.checkpoint, "tokens_per_block": BS,
                        "instances": "2 vLLM kv_both (colocated), prefix caching and KV events on, one store node",
                        "cores": [list(c) for c in cores], "wall_s": time.monotonic() - t0},
           "load": {"before": list(load_before), "after": list(os.getloadavg()), "cpus": os.cpu_count()},
           "targets": {"conductor_vs_best_peer_router_ttft_p50_live": "<= 0.9"},
           "ratios": ratios(results) if "conductor" in results else {}, "results": results}
    write_results(RESULTS / "routers.json", out)
    print(json.dumps(out["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
