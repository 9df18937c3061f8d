"""Disaggregated against colocated vLLM behind the Conductor, on this machine's CPU cores.

The same model (the ``bench`` checkpoint of engines/vllm/checkpoint.py: 8 layers, hidden
512), the same trace requests (the first ``--requests`` of Mooncake's conversation trace,
32 tokens per trace block, output capped at ``--max-output-tokens``, ``ignore_eos``) sent open
loop at ``--speed`` × the trace's timestamps through the front door over vLLM, one store node:

* disaggregated: 1 prefill (kv_producer) + 1 decode (kv_consumer) instance, each pinned to a
  core of its own (CPU affinity and vLLM's OpenMP threads);
* colocated: 2 kv_both instances, both on both cores.

Reported per topology: ITL (gaps between streamed tokens, every request pooled) p50/p99,
TTFT p50/p99, goodput (requests/s meeting TTFT <= ``--ttft-slo-s`` and Mooncake's TBT —
the mean of a request's longest 10% of token gaps — <= ``--tbt-slo-s``), output tokens/s,
rejections; ``ratios``: ``itl_p99_disagg_vs_colocated`` (target <= 0.5),
``goodput_disagg_vs_colocated`` (target >= 1.2), ``throughput_disagg_vs_colocated`` (no
target). Writes ``benchmarks/results/vllm_pd.json`` and ``vllm_pd_itl_cdf.png``.

    PYTHONPATH=. python benchmarks/bench_vllm_pd.py [--requests 40 --speed 0.3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run_info import write_results  # noqa: E402
from engines.vllm.checkpoint import write_checkpoint  # noqa: E402
from engines.vllm.launch import VLLMServerSpec, start_servers  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402
from scheduler.config import FrontdoorConfig  # noqa: E402
from scheduler.policy.admission import AdmissionConfig  # noqa: E402
from scheduler.replay.report import summarize  # noqa: E402
from scheduler.replay.run import _one  # noqa: E402
from scheduler.stats import percentile  # noqa: E402
from scheduler.trace import TraceMapping, best_possible_hit_blocks, load_trace  # noqa: E402
from scheduler.vllm.app import start_vllm_frontdoor  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"
BS = 32


def mooncake_tbt(gaps) -> float:
    """The mean of the longest 10% of a request's token gaps (at least one)."""
    top = sorted(gaps, reverse=True)[:max(1, len(gaps) // 10)]
    return sum(top) / len(top)


async def drive(url: str, requests, mapping: TraceMapping, speed: float, max_out: int):
    bodies = [{"prompt": mapping.prompt(r), "max_tokens": max(1, min(r.output_length, max_out)),
               "stream": True, "ignore_eos": True, "temperature": 0} for r in requests]
    t0_ms = requests[0].timestamp_ms
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=900)) as session:
        start = time.perf_counter()

        async def at(req, body):
            delay = start + (req.timestamp_ms - t0_ms) / 1000.0 / speed - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await _one(session, url + "/v1/completions", body, {}, BS, len(req.hash_ids))

        outcomes = await asyncio.gather(*(at(r, b) for r, b in zip(requests, bodies)))
        return outcomes, time.perf_counter() - start


def run_topology(name: str, model: str, store: str, args, log_dir: Path) -> dict:
    if name == "disaggregated":
        roles = [("kv_producer", (0,)), ("kv_consumer", (1,))]
    else:
        roles = [("kv_both", (0, 1)), ("kv_both", (0, 1))]
    specs = [VLLMServerSpec(model, free_port(), role, store, kv_cache_bytes=512 << 20, max_model_len=8192,
                            cpus=c) for role, c in roles]
    servers = start_servers(specs, log_dir, [f"{name}-{i}" for i in range(len(specs))], timeout_s=600)
    requests = load_trace(TRACE, args.requests)
    mapping = TraceMapping(BS, 512)
    try:
        async def main():
            cfg = FrontdoorConfig(model_dir=model, admission=AdmissionConfig(ttft_slo_s=args.admit_ttft_s,
                                                                             max_inflight=64))
            if name == "disaggregated":
                door = await start_vllm_frontdoor(model, [servers[0].url], [servers[1].url], store, config=cfg)
            else:
                door = await start_vllm_frontdoor(model, (), (), store, config=cfg, topology="colocated",
                                                  colocated_urls=[s.url for s in servers])
            try:
                return await drive(door.url, requests, mapping, args.speed, args.max_output_tokens)
            finally:
                await door.stop()
        outcomes, wall = asyncio.run(main())
    finally:
        for s in servers:
            s.stop()
    report = summarize(outcomes, sum(best_possible_hit_blocks(requests, mapping)), wall,
                       args.ttft_slo_s, args.tbt_slo_s)
    ok = [o for o in outcomes if o.status == "ok"]
    gaps = sorted(t for o in ok for t in o.tbt_s)
    met = sum(1 for o in ok if o.ttft_s <= args.ttft_slo_s and (not o.tbt_s or mooncake_tbt(o.tbt_s) <= args.tbt_slo_s))
    return {"completed": len(ok), "rejected": report.rejected, "failed": report.failed,
            "rejected_by_reason": report.rejected_by_reason,
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "ttft_p50_s": report.ttft_p50_s, "ttft_p99_s": report.ttft_p99_s,
            "itl_violations": sum(1 for o in ok if o.tbt_s and mooncake_tbt(o.tbt_s) > args.tbt_slo_s),
            "ttft_violations": sum(1 for o in ok if o.ttft_s > args.ttft_slo_s),
            "met_slos": met, "goodput_rps": met / wall, "output_tokens_per_s": report.completion_tokens / wall,
            "cached_tokens": report.cached_tokens, "prompt_tokens": report.prompt_tokens, "wall_s": wall,
            "itl_sorted_s": gaps}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        gaps = r["itl_sorted_s"]
        if gaps:
            ax.plot([g * 1000 for g in gaps], [(i + 1) / len(gaps) for i in range(len(gaps))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of token gaps")
    ax.set_title("vLLM behind the Conductor: ITL CDF")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--speed", type=float, default=0.3)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--ttft-slo-s", type=float, default=5.0)
    p.add_argument("--tbt-slo-s", type=float, default=0.1)
    p.add_argument("--admit-ttft-s", type=float, default=30.0)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-pd-"))
    model = write_checkpoint(str(work / "bench-llama"), "bench", max_model_len=8192)
    store_port = free_port()
    store_log = open(work / "store.log", "wb")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    store_proc = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--port", str(store_port),
                                   "--dram", "2GiB", "--ssd", "0", "--data-dir", str(work / "store"),
                                   "--transfer-engine", "off"], stdout=store_log, stderr=subprocess.STDOUT, env=env)
    store = f"127.0.0.1:{store_port}"
    try:
        time.sleep(3)
        results = {name: run_topology(name, model, store, args, work / "logs")
                   for name in ("disaggregated", "colocated")}
    finally:
        store_proc.terminate()
        store_proc.wait(timeout=30)
        store_log.close()
    d, c = results["disaggregated"], results["colocated"]

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    ratios = {"itl_p99_disagg_vs_colocated": ratio(d["itl_p99_s"], c["itl_p99_s"]),
              "goodput_disagg_vs_colocated": ratio(d["goodput_rps"], c["goodput_rps"]),
              "throughput_disagg_vs_colocated": ratio(d["output_tokens_per_s"], c["output_tokens_per_s"])}
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, RESULTS / "vllm_pd_itl_cdf.png")
    out = {"settings": {**vars(args), "model": "bench (8 layers, hidden 512)", "tokens_per_block": BS,
                        "goodput_rule": "TTFT <= ttft_slo_s and mean of the longest 10% token gaps <= tbt_slo_s"},
           "targets": {"itl_p99_disagg_vs_colocated": "<= 0.5", "goodput_disagg_vs_colocated": ">= 1.2"},
           "ratios": ratios,
           "results": {k: {kk: vv for kk, vv in v.items() if kk != "itl_sorted_s"} for k, v in results.items()}}
    write_results(RESULTS / "vllm_pd.json", out)
    print(f"{'':24}{'disaggregated':>16}{'colocated':>16}")
    for key in ("completed", "rejected", "failed", "itl_p50_s", "itl_p99_s", "ttft_p50_s", "ttft_p99_s",
                "itl_violations", "ttft_violations", "goodput_rps", "output_tokens_per_s"):
        fmt = (lambda v: f"{v:16.4f}") if isinstance(d[key], float) else (lambda v: f"{v!s:>16}")
        print(f"{key:24}{fmt(d[key])}{fmt(c[key])}")
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
