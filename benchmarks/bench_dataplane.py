"""Same-host data plane, two processes, against Mooncake Store and Redis in one run; writes
benchmarks/results/dataplane.json.

Every system runs as a real deployment does: the store in one process, the client (this
benchmark) in another.

- **kvstore**: ``kvstore serve`` (DRAM tier only) in a child process; this process is a
  :class:`kvstore.client.StoreClient` that picks the same-host path: it maps the node's
  shared-memory slab, and a Unix socket with struct-packed frames carries the leases and
  reservations (kvstore/dataplane). ``get`` = ``get_into`` (lease, one copy into the
  caller's array, deadline + xxh3 check, release); ``put`` = ``put_blocks`` (reserve, one
  copy into the slab and xxh3 of the slot, commit carrying the checksum).
- **Mooncake Store**: ``mooncake_master`` (HTTP metadata server) + a child process holding
  the global segment; this process is a ``MooncakeDistributedStore`` client with protocol
  ``tcp`` and no segment of its own, zero-copy ``put_from`` / ``get_into`` (``batch_*`` for
  the 64 KiB batch) on registered buffers.
- **Redis**: a private ``redis-server`` (no persistence), ``redis`` + ``hiredis``, SET/GET
  pipelined over a whole round; a GET's value is copied into the same output array.
- **np.copyto** of the same bytes between the same arrays in this process (the limit).

Blocks: 64 KiB (a batch of 256 per call), 1 MiB (64 blocks, one per call), 16 MiB (8 blocks,
one per call). Ratios compare like with like: against Mooncake Store, one block per call on
both sides (``put_from`` / ``get_into``; ``batch_*`` for 64 KiB); against Redis, which
pipelines the 64 blocks of a round in one round trip, kvstore moves them in one batched
call (``*_1MiB_vs_redis``), and the harsher one-call-per-block figures are reported too
(``*_1MiB_single_vs_redis_pipelined``). The systems are interleaved round by round; each
figure is the best of ``--rounds`` rounds after a warm-up round (a shared machine only slows
a round down). Every put uses fresh keys.

The cross-host path over loopback (``te_tcp_get_16MiB_vs_mooncake``): the same kvstore node
runs a Mooncake Transfer Engine (tcp), and each round this process also reads the 16 MiB
blocks with ``TransferEngineTransport.get_into`` (lease over the node's TCP control channel,
engine read into the registered output arena, xxh3 check, release), one block per call as
Mooncake Store's ``get_into``, interleaved with it. benchmarks/te_probe.py's figures (raw
engine read, gRPC stream) are added under ``te_probe`` when that module is present.

Run: ``.venv/bin/python benchmarks/bench_dataplane.py`` (about 1 minute; ``make bench``).
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
from dataplane_peers import KIB, MIB, Case, CopyTo, KVStore, Mooncake, Processes, Redis  # noqa: E402

from benchmarks.run_info import write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "dataplane.json"
CASES = [("64KiB", 64 * KIB, 256, True), ("1MiB", MIB, 64, False), ("16MiB", 16 * MIB, 8, False)]
TARGETS = {"get_1MiB_vs_mooncake": 3.0, "put_1MiB_vs_mooncake": 3.0, "get_16MiB_vs_mooncake": 3.0,
           "get_1MiB_vs_redis": 5.0, "put_1MiB_vs_redis": 5.0, "get_1MiB_vs_copyto": 0.4,
           "batch_64KiB_vs_mooncake": 5.0, "te_tcp_get_16MiB_vs_mooncake": 1.0}

def te_probe() -> dict[str, Any]:
    """benchmarks/te_probe.py's figures for one 16 MiB block from a node process of its own
    (transfer-engine ``get_into`` and ``get_blocks``, the raw engine read, the gRPC stream;
    GB/s, best and median of 7), or ``{"error": why}``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import te_probe as probe
        return probe.measure(16 * MIB)
    except Exception as exc:  # noqa: BLE001 — a failed probe is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


Best = dict[tuple[str, str, str], float]


def _timed(best: Best, key: tuple[str, str, str], rnd: int, fn: Callable[..., object], *args: Any,
           **kw: Any) -> None:
    """Run ``fn(*args, **kw)`` and keep its time in ``best[key]`` when it is the fastest of
    the measured rounds (round 0 is the warm-up)."""
    t0 = time.perf_counter()
    fn(*args, **kw)
    dt = time.perf_counter() - t0
    if rnd:
        best[key] = min(best.get(key, dt), dt)


def _kvstore_extras(sysm: Any, case: Case, keys: list[str], te_case: Case, rnd: int, best: Best,
                    checks: dict[str, bool]) -> None:
    """kvstore's further paths on the same keys: the transfer engine (on the blocks just put),
    the 1 MiB and 16 MiB blocks in one call each (as Redis gets them, pipelined), and a get
    without the checksum (its share of a get)."""
    if case is te_case:
        _timed(best, ("kvstore-te", case.label, "get"), rnd, sysm.get_te, case, keys)
        if rnd == 0:
            checks[f"kvstore-te/{case.label}"] = case.check()
    if not case.batch:
        bkeys = [k + "-b" for k in keys]
        for op in ("put", "get"):
            _timed(best, ("kvstore-batched", case.label, op), rnd, getattr(sysm, op), case, bkeys, batch=True)
    plane = sysm.client._local()
    plane.verify = False
    _timed(best, ("kvstore-noverify", case.label, "get"), rnd, sysm.get, case, keys)
    plane.verify = True


def _measure(systems: list[Any], cases: list[Case], te_case: Case, rounds: int,
             started: float) -> tuple[Best, dict[str, bool]]:
    """Each system's put and get of each case, ``rounds`` times after a warm-up round: the
    best seconds per (system, block, op), and whether each system gave the bytes back whole."""
    best: Best = {}
    checks: dict[str, bool] = {}
    for rnd in range(rounds + 1):
        for case in cases:
            for sysm in systems:
                keys = case.keys(sysm.name, rnd)
                for op in ("put", "get"):
                    fn: Callable[[Case, list[str]], None] = getattr(sysm, op)
                    _timed(best, (sysm.name, case.label, op), rnd, fn, case, keys)
                if rnd == 0:
                    checks[f"{sysm.name}/{case.label}"] = case.check()
                if sysm.name == "kvstore":
                    _kvstore_extras(sysm, case, keys, te_case, rnd, best, checks)
                sysm.clear(case, keys)
        print(f"  round {rnd}{' (warm-up)' if rnd == 0 else ''} done ({time.perf_counter() - started:.0f} s)",
              flush=True)
    return best, checks


def run(rounds: int) -> dict:
    started = time.perf_counter()
    procs = Processes()
    tmp = tempfile.mkdtemp(prefix="kvstore-bench-dp-")
    cases = [Case(*c) for c in CASES]
    systems: list[Any] = []
    try:
        systems = [KVStore(procs, tmp), Mooncake(procs, tmp, cases), Redis(procs, tmp), CopyTo()]
        kv_path = systems[0].path
        te_case = next(c for c in cases if c.label == "16MiB")
        systems[0].open_te(te_case)
        print(f"started kvstore ({kv_path}), Mooncake Store, Redis in {time.perf_counter() - started:.1f} s",
              flush=True)
        best, checks = _measure(systems, cases, te_case, rounds, started)
    finally:
        for sysm in systems:
            try:
                sysm.close()
            except Exception:  # noqa: BLE001 — keep stopping the rest
                pass
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return _report(best, checks, cases, rounds, kv_path, started)


def _report(best: Best, checks: dict[str, bool], cases: list[Case], rounds: int, kv_path: str,
            started: float) -> dict:
    """The benchmark's JSON: a row per (system, block, op), the ratios the targets name."""
    rows = []
    for (name, label, op), secs in sorted(best.items()):
        case = next(c for c in cases if c.label == label)
        rows.append({"system": name, "block": label, "block_bytes": case.size, "blocks": case.n,
                     "mode": "pipelined" if name == "redis" else "batch" if case.batch or name.endswith("batched")
                     else "te-tcp" if name == "kvstore-te" else "single", "op": op, "best_seconds": secs,
                     "GB_per_s": case.size * case.n / secs / 1e9, "blocks_per_s": case.n / secs})

    def gbps(name: str, label: str, op: str) -> float:
        return next(r["GB_per_s"] for r in rows if (r["system"], r["block"], r["op"]) == (name, label, op))

    probe = te_probe()
    mc_get16 = gbps("mooncake", "16MiB", "get")
    ratios = {
        "get_1MiB_vs_mooncake": gbps("kvstore", "1MiB", "get") / gbps("mooncake", "1MiB", "get"),
        "put_1MiB_vs_mooncake": gbps("kvstore", "1MiB", "put") / gbps("mooncake", "1MiB", "put"),
        "get_16MiB_vs_mooncake": gbps("kvstore", "16MiB", "get") / mc_get16,
        "put_16MiB_vs_mooncake": gbps("kvstore", "16MiB", "put") / gbps("mooncake", "16MiB", "put"),
        # Redis pipelines the 64 blocks in one round trip; so does a batched kvstore call.
        "get_1MiB_vs_redis": gbps("kvstore-batched", "1MiB", "get") / gbps("redis", "1MiB", "get"),
        "put_1MiB_vs_redis": gbps("kvstore-batched", "1MiB", "put") / gbps("redis", "1MiB", "put"),
        "get_1MiB_single_vs_redis_pipelined": gbps("kvstore", "1MiB", "get") / gbps("redis", "1MiB", "get"),
        "put_1MiB_single_vs_redis_pipelined": gbps("kvstore", "1MiB", "put") / gbps("redis", "1MiB", "put"),
        "batch_64KiB_vs_mooncake": gbps("kvstore", "64KiB", "get") / gbps("mooncake", "64KiB", "get"),
        "batch_put_64KiB_vs_mooncake": gbps("kvstore", "64KiB", "put") / gbps("mooncake", "64KiB", "put"),
        "get_1MiB_vs_copyto": gbps("kvstore", "1MiB", "get") / gbps("np.copyto", "1MiB", "get"),
        "put_1MiB_vs_copyto": gbps("kvstore", "1MiB", "put") / gbps("np.copyto", "1MiB", "put"),
        "get_16MiB_vs_copyto": gbps("kvstore", "16MiB", "get") / gbps("np.copyto", "16MiB", "get"),
        "get_1MiB_noverify_vs_copyto": gbps("kvstore-noverify", "1MiB", "get") / gbps("np.copyto", "1MiB", "get"),
        "put_1MiB_batched_vs_mooncake": gbps("kvstore-batched", "1MiB", "put") / gbps("mooncake", "1MiB", "put"),
        "te_tcp_get_16MiB_vs_mooncake": gbps("kvstore-te", "16MiB", "get") / mc_get16,
    }
    return {
        "benchmark": "same-host data plane, two processes (store + client), kvstore vs Mooncake Store vs Redis",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "platform": platform.platform()},
        "kvstore_path": kv_path, "rounds": rounds, "results": rows, "ratios": ratios, "targets": TARGETS,
        "met": {k: (ratios[k] is not None and ratios[k] >= v) for k, v in TARGETS.items()},
        "byte_identical": checks, "te_probe": probe,
        "wall_s": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="measured rounds after a warm-up (default 9)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the children on a kill, too
    report = run(args.rounds)
    write_results(RESULTS, report)
    print(f"\n{'system':17s} {'block':6s} {'mode':9s} {'op':4s} {'GB/s':>7s} {'blocks/s':>10s}")
    for r in report["results"]:
        print(f"{r['system']:17s} {r['block']:6s} {r['mode']:9s} {r['op']:4s} {r['GB_per_s']:7.2f} "
              f"{r['blocks_per_s']:10,.0f}")
    print("\nratios:")
    for k, v in report["ratios"].items():
        shown = "   null" if v is None else f"{v:7.2f}"
        target = f"  (target >= {TARGETS[k]}: {'met' if report['met'][k] else 'NOT met'})" if k in TARGETS else ""
        print(f"  {k:30s} {shown}{target}")
    probe = report["te_probe"]
    if "error" in probe:
        print(f"  (te_probe failed: {probe['error']})")
    else:
        print(f"  te_probe (16 MiB, own node with a staging area, best GB/s): "
              f"get_into {probe['te_tcp_get_into_best_gbps']:.2f}, raw engine read"
              f" {probe['te_raw_read_best_gbps']:.2f}, gRPC stream {probe['grpc_stream_get_best_gbps']:.2f}")
    bad = [k for k, ok in report["byte_identical"].items() if not ok]
    print(f"\nbyte-identical round trips: {'all' if not bad else 'FAILED for ' + ', '.join(bad)}")
    print(f"wrote {RESULTS.relative_to(ROOT)} in {report['wall_s']:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
