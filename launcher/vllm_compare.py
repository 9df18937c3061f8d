"""``kvstore up --replay`` over vLLM: the set-ups of launcher/vllm_setups.py run one after
another on the same trace requests, each replayed through its own front door once its services
are up and stopped before the next starts; then the side-by-side report, its JSON
(``--json``) and PNGs (``--plots``: the TTFT CDF of the set-ups, the hit ratio over the
replay)."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.config import parse_bytes
from kvstore.errors import KVStoreError, Unavailable
from launcher.vllm_setups import COMPARED, SETUPS, RunningSetup, instance_metrics, replay_kwargs, start_setup


def kv_bytes_per_token(model_dir: str) -> int:
    """Bytes of KV one token takes in every layer, keys and values, float32 as the instances
    run: the layout the connector keys (:class:`scheduler.vllm.instances.VLLMModel`)."""
    from kvstore.index.keys import block_bytes
    from scheduler.vllm.instances import VLLMModel
    return block_bytes(VLLMModel.from_dir(model_dir, dtype="float32").paged.layout, 1, 4)


def provenance() -> dict[str, Any]:
    """When, on what and from which commit a figure was measured (:func:`launcher.run_info.run_info`)."""
    from launcher.run_info import run_info
    run = run_info()
    return {"date": run["time_utc"], "commit": run["commit"], "machine": run["machine"]["summary"]}


def _run_one(args: argparse.Namespace, name: str, model: str, http_port: int, tokens: dict[str, str],
             keys_file: str | None, step: str):
    from scheduler.replay.compare_setups import SetupRun, cache_hits
    from scheduler.replay.run import run_setup_replay
    setup = SETUPS[name]
    print(f"== {step} {setup.label}: {setup.what}", flush=True)
    running: RunningSetup = start_setup(args, setup, model, http_port, tokens, keys_file,
                                        os.path.join(args.data_dir, "logs", name))
    try:
        print(f"   started in {running.startup_s:.1f} s; replaying", flush=True)
        report, before, after = asyncio.run(run_setup_replay(
            running.url, args.replay, lambda: instance_metrics(running), **replay_kwargs(args)))
    finally:
        running.stop()
    b, a = cache_hits(before), cache_hits(after)
    run = SetupRun(name, setup.label, setup.what, report, {k: a[k] - b[k] for k in a}, dict(running.memory),
                   running.startup_s)
    print(f"   {report.completed} of {report.requests_sent} completed in {report.wall_s:.1f} s, "
          f"TTFT p50 {report.ttft_p50_s or 0:.3f} s", flush=True)
    return run


def compare_setups(args: argparse.Namespace, model: str, http_port: int, tokens: dict[str, str],
                   keys_file: str | None) -> int:
    """Run the set-ups of ``--setups`` (default: every one of :data:`COMPARED`) on
    ``--replay``'s requests and print them side by side. Returns 0, 1 when a set-up could not
    run or completed no request."""
    from scheduler.replay.compare_setups import SetupComparison, format_setups
    t0 = time.monotonic()
    runs = []
    names = getattr(args, "setups", None) or COMPARED
    try:
        for i, name in enumerate(names):
            step = f"set-up {i + 1} of {len(names)}:"
            runs.append(_run_one(args, name, model, http_port, tokens, keys_file, step))
    except (RuntimeError, Unavailable, KVStoreError, OSError) as exc:
        print(f"kvstore up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopped all services", flush=True)
    first = runs[0].report.settings
    per_token = kv_bytes_per_token(model)
    kv_tokens = parse_bytes(args.vllm_kv_cache) // per_token
    settings = {**{k: v for k, v in first.items() if k != "target"}, "model": model,
                "kv_bytes_per_token": per_token, "instances": args.prefill_instances + args.decode_instances,
                "topology_kvstore": args.topology, "instance_kv_tokens": kv_tokens,
                "instance_kv_vs_working_set": (kv_tokens / first["working_set_tokens"]
                                               if first.get("working_set_tokens") else None),
                "wall_s_all_setups": time.monotonic() - t0, **provenance()}
    comparison = SetupComparison(tuple(runs), settings)
    print(format_setups(comparison), flush=True)
    if settings["instance_kv_vs_working_set"]:
        print(f"each instance's own KV cache holds {kv_tokens:,} tokens: "
              f"{settings['instance_kv_vs_working_set']:.0%} of the replay's working set "
              f"({first['working_set_tokens']:,} tokens)", flush=True)
        if settings["instance_kv_vs_working_set"] >= 1:
            print("  each instance's own cache holds the whole working set: the pool adds no capacity in this "
                  "run (more --requests, or a smaller --vllm-kv-cache, shows what it adds)", flush=True)
    print(f"{len(runs)} set-ups in {settings['wall_s_all_setups']:.0f} s", flush=True)
    if getattr(args, "json", None):
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(comparison.to_dict(), indent=2) + "\n")
        print(f"report written to {path}", flush=True)
    if getattr(args, "plots", None):
        from scheduler.replay.plots import write_plots
        for png in write_plots(comparison, args.plots):
            print(f"plot written to {png}", flush=True)
    return 0 if all(r.report.completed for r in runs) else 1
