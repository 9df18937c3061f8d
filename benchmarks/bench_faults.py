"""Benchmark of the stack under overload and under failure; writes benchmarks/results/faults.json.

A real ``kvstore up`` (processes as a user starts them, the tiny model on the CPU), driven by
aiohttp streaming clients (benchmarks/faults.py sorts every answer: ok, rejected = 429 with
``Retry-After``, clean = another error in OpenAI's shape, cut/refused = the connection,
unclean = anything else).

1. ``burst``: 256 streaming clients at once against ``--max-inflight 64``, then 256 clients
   each sending one request after the other for ``--seconds``: every answer must be ok or a
   429 with Retry-After — zero 5xx, zero unclean.
2. ``kill``: under a steady load of 8 streaming clients, ``kill -9`` of ``decode-0``, then of
   ``prefill-0``: seconds until a request sent after the kill succeeds ("serving again"),
   seconds until ``/health`` says ``ok`` again (the engine restarted by ``kvstore up`` and
   back in routing), and the requests that failed meanwhile, each of them a clean error.
   Run on a stack of 2 prefill + 2 decode engines (requests on the dead engine move to the
   other) and on 1 + 1 (nothing to move to: clean 503s until it is back).
3. ``vllm``: the same kill cycle on ``kvstore up --engine vllm`` with 2 prefill + 2 decode
   vLLM instances: ``kill -9`` of ``vllm-decode-0``, then of ``vllm-prefill-0`` (requests
   the dead one failed before anything was sent move to the other; ``kvstore up`` restarts
   it on its port). ``--no-vllm`` skips it.

Run: ``.venv/bin/python benchmarks/bench_faults.py`` (about 8 minutes; ``make bench``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.faults import UNCLEAN, UpStack, burst, clients, failed_in_flight, recovery_s  # noqa: E402
from benchmarks.run_info import write_results  # noqa: E402


def health_status(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return json.loads(resp.read())["status"]
    except Exception as exc:  # noqa: BLE001 - a 503 or a refused connection alike
        body = getattr(exc, "read", lambda: b"")()
        try:
            return json.loads(body)["status"]
        except (ValueError, KeyError, TypeError):
            return "unreachable"


def overload(stack: UpStack, seconds: float) -> dict:
    once, burst_s = asyncio.run(burst(stack.url, 256))
    steady = asyncio.run(clients(stack.url, 256, seconds, max_tokens=8))
    five = sum(v for k, v in {**once, **steady}.items() if k in ("clean", "unclean", "cut", "refused"))
    return {"burst_256": dict(once), "burst_256_s": round(burst_s, 2),
            f"steady_256_clients_{seconds:.0f}s": dict(steady), "non_429_failures": five}


def kill_cycle(stack: UpStack, victim: str, settle_s: float = 3.0, wait_s: float = 90.0) -> dict:
    log: list[tuple[float, float, str]] = []
    stop = threading.Event()
    load = threading.Thread(target=lambda: asyncio.run(clients(stack.url, 8, 600, 8, log, stop)), daemon=True)
    load.start()
    time.sleep(settle_s)
    old = stack.kill9(victim)
    killed_at = time.monotonic()
    back_in_routing = float("inf")
    while time.monotonic() - killed_at < wait_s:
        pid = stack.children().get(victim)
        if pid not in (None, old) and health_status(stack.url) == "ok":
            back_in_routing = time.monotonic() - killed_at
            break
        time.sleep(0.1)
    time.sleep(2)
    stop.set()
    load.join(120)
    in_flight = sum(1 for start, end, _ in log if start < killed_at <= end)
    return {"victim": victim, "serving_again_s": round(recovery_s(log, killed_at), 2),
            "back_in_routing_s": round(back_in_routing, 2), "in_flight_at_kill": in_flight,
            "failed_after_kill": dict(failed_in_flight(log, killed_at)),
            "requests_after_kill": sum(1 for start, end, _ in log if end >= killed_at)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="steady overload phase")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "faults.json"))
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip the vLLM stack's kill cycle")
    ap.add_argument("--no-builtin", dest="builtin", action="store_false",
                    help="skip the built-in engines' stacks (overload and kill cycles)")
    args = ap.parse_args()
    results: dict = {}
    for shape in ((2, 2), (1, 1)) if args.builtin else ():
        name = f"{shape[0]}p{shape[1]}d"
        with tempfile.TemporaryDirectory(prefix="kvstore-faults-") as tmp:
            stack = UpStack(f"{tmp}/up", ("--prefill-instances", str(shape[0]), "--decode-instances",
                                          str(shape[1]), "--max-inflight", "64")).start()
            try:
                if shape == (2, 2):
                    results["overload"] = overload(stack, args.seconds)
                    print("overload:", json.dumps(results["overload"]), flush=True)
                for victim in ("decode-0", "prefill-0"):
                    r = kill_cycle(stack, victim)
                    results[f"kill9_{victim}_{name}"] = r
                    print(f"{name} kill -9 {victim}:", json.dumps(r), flush=True)
            finally:
                results[f"stop_s_{name}"] = round(stack.stop(), 2)
    if args.vllm:
        with tempfile.TemporaryDirectory(prefix="kvstore-faults-") as tmp:
            stack = UpStack(f"{tmp}/up", ("--engine", "vllm", "--prefill-instances", "2", "--decode-instances",
                                          "2", "--max-inflight", "64")).start(timeout_s=900)
            try:
                for victim in ("vllm-decode-0", "vllm-prefill-0"):
                    r = kill_cycle(stack, victim, settle_s=10.0, wait_s=300.0)
                    results[f"kill9_{victim}_vllm_2p2d"] = r
                    print(f"vllm 2p2d kill -9 {victim}:", json.dumps(r), flush=True)
            finally:
                results["stop_s_vllm_2p2d"] = round(stack.stop(), 2)
    results["unclean_details"] = dict(UNCLEAN)
    bad = Counter()
    for key, r in results.items():
        if key.startswith("kill9_"):
            bad.update({k: v for k, v in r["failed_after_kill"].items() if k not in ("clean", "rejected")})
    results["unclean_total"] = sum(bad.values()) + results.get("overload", {}).get("non_429_failures", 0)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_results(args.json, results)
    print(f"written to {args.json}; unclean or 5xx answers: {results['unclean_total']}")
    return 0 if results["unclean_total"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
