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
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstore.client import StoreClient  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "dataplane.json"
BIN = Path(sys.executable).parent
KIB, MIB = 1 << 10, 1 << 20
CASES = [("64KiB", 64 * KIB, 256, True), ("1MiB", MIB, 64, False), ("16MiB", 16 * MIB, 8, False)]
TARGETS = {"get_1MiB_vs_mooncake": 3.0, "put_1MiB_vs_mooncake": 3.0, "get_16MiB_vs_mooncake": 3.0,
           "get_1MiB_vs_redis": 5.0, "put_1MiB_vs_redis": 5.0, "get_1MiB_vs_copyto": 0.4,
           "batch_64KiB_vs_mooncake": 5.0, "te_tcp_get_16MiB_vs_mooncake": 1.0}

HOLDER = r"""
import sys, mooncake.store as ms
name, meta, master, seg = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
s = ms.MooncakeDistributedStore()
rc = s.setup(name, meta, seg, 16 << 20, "tcp", "", master)
print("READY", rc, flush=True)
sys.stdin.read()
s.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start on port {port}") from None
            time.sleep(0.05)


class Case:
    """One block size: source blocks and output arrays carved from two arenas (so Mooncake
    can register them once), fresh keys per round."""

    def __init__(self, label: str, size: int, n: int, batch: bool) -> None:
        self.label, self.size, self.n, self.batch = label, size, n, batch
        self.src_arena = np.frombuffer(np.random.default_rng(size).bytes(size * n), dtype=np.uint8)
        self.dst_arena = np.ones(size * n, dtype=np.uint8)  # touched: no first-touch page faults
        self.src = [self.src_arena[i * size:(i + 1) * size] for i in range(n)]
        self.dst = [self.dst_arena[i * size:(i + 1) * size] for i in range(n)]

    def keys(self, system: str, rnd: int) -> list[str]:
        return [f"{system}-{self.label}-r{rnd}-{i}" for i in range(self.n)]

    def check(self) -> bool:
        ok = all(d.tobytes() == s.tobytes() for d, s in zip(self.dst, self.src))
        self.dst_arena[:] = 1
        return ok


class Processes:
    """Every child process this benchmark starts; all are stopped in :meth:`stop`."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        proc = subprocess.Popen(argv, **kw)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class KVStore:
    name = "kvstore"

    def __init__(self, procs: Processes, tmp: str, verify: bool = True) -> None:
        port = free_port()
        self.socket_path = os.path.join(tmp, "kvstore.sock")
        cfg = os.path.join(tmp, "store.toml")
        Path(cfg).write_text(f'node_id = "bench"\nport = {port}\ndram_bytes = "2GiB"\nssd_bytes = 0\n'
                             f'data_dir = "{tmp}/store"\ntransfer_engine = "tcp"\n'
                             # the whole slab registered, as Mooncake Store registers its segment;
                             # te_probe below measures the default (a staging area) beside it
                             f'te_staging_bytes = 0\n'
                             f'dataplane_socket = "{self.socket_path}"\n')
        self.proc = procs.start([sys.executable, "-m", "launcher", "--log-level", "WARNING", "serve",
                                 "--config", cfg], cwd=ROOT, stdout=subprocess.DEVNULL)
        wait_port(port, self.proc, "kvstore serve")
        self.client = StoreClient(f"127.0.0.1:{port}")
        self.client.wait_ready(30)
        self.path = self.client.data_path_in_use
        if not self.path.startswith("same-host"):
            raise RuntimeError(f"kvstore client did not pick the same-host path ({self.path})")
        self.client._local().verify = verify
        self.address = f"127.0.0.1:{port}"
        self.te: Any = None

    def open_te(self, case: Case) -> None:
        """The cross-host reader of this node (its transfer engine over loopback), with
        ``case``'s output arena registered as Mooncake's is."""
        from kvstore.transfer import TransferEngineTransport
        self.te = TransferEngineTransport(self.address)
        if self.te.control is None:
            raise RuntimeError("the kvstore node announced no TCP control channel")
        self.te.register(case.dst_arena)

    def get_te(self, case: Case, keys: list[str]) -> None:
        got = [self.te.get_into([k.encode()], [d])[0] for k, d in zip(keys, case.dst)]
        assert all(g == case.size for g in got), got[:2]
        assert self.te.grpc_reads == 0, "transfer-engine reads fell back to gRPC"

    def put(self, case: Case, keys: list[str], batch: bool = False) -> None:
        bkeys = [k.encode() for k in keys]
        if case.batch or batch:
            rs = self.client.put_blocks(list(zip(bkeys, case.src)))
        else:
            rs = [self.client.put_blocks([(k, s)])[0] for k, s in zip(bkeys, case.src)]
        assert all(r.ok for r in rs), rs[:2]

    def get(self, case: Case, keys: list[str], batch: bool = False) -> None:
        bkeys = [k.encode() for k in keys]
        if case.batch or batch:
            got = self.client.get_into(bkeys, case.dst)
        else:
            got = [self.client.get_into([k], [d])[0] for k, d in zip(bkeys, case.dst)]
        assert all(g == case.size for g in got), got[:2]

    def clear(self, case: Case, keys: list[str]) -> None:
        self.client.evict("dram", 1 << 40)  # as Mooncake's remove: the next round reuses the space

    def close(self) -> None:
        if self.te is not None:
            self.te.close()
        self.client.close()


class Mooncake:
    name = "mooncake"

    def __init__(self, procs: Processes, tmp: str, cases: list[Case]) -> None:
        import mooncake.store as ms
        rpc, metrics, http = free_port(), free_port(), free_port()
        self.master = procs.start([str(BIN / "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
                                   "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
                                   "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                                   f"--http_metadata_server_port={http}"],
                                  stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "master.log"), "w"))
        wait_port(rpc, self.master, "mooncake_master")
        wait_port(http, self.master, "mooncake metadata server")
        meta, master = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        seg = 1 << 30
        self.holder = procs.start([sys.executable, "-c", HOLDER, f"127.0.0.1:{free_port()}", meta, master, str(seg)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  stderr=open(os.path.join(tmp, "holder.log"), "w"))
        line = self.holder.stdout.readline().split()
        if line[:2] != ["READY", "0"]:
            raise RuntimeError(f"Mooncake segment holder failed to start: {line}")
        self.store = ms.MooncakeDistributedStore()
        rc = self.store.setup(f"127.0.0.1:{free_port()}", meta, 0, 16 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        for case in cases:  # zero-copy put_from / get_into need registered buffers
            for arena in (case.src_arena, case.dst_arena):
                if self.store.register_buffer(arena.ctypes.data, arena.nbytes) != 0:
                    raise RuntimeError("Mooncake register_buffer failed")

    def put(self, case: Case, keys: list[str]) -> None:
        ptrs = [s.ctypes.data for s in case.src]
        if case.batch:
            rcs = self.store.batch_put_from(keys, ptrs, [case.size] * case.n)
        else:
            rcs = [self.store.put_from(k, p, case.size) for k, p in zip(keys, ptrs)]
        assert all(rc == 0 for rc in rcs), rcs[:2]

    def get(self, case: Case, keys: list[str]) -> None:
        ptrs = [d.ctypes.data for d in case.dst]
        if case.batch:
            got = self.store.batch_get_into(keys, ptrs, [case.size] * case.n)
        else:
            got = [self.store.get_into(k, p, case.size) for k, p in zip(keys, ptrs)]
        assert all(g == case.size for g in got), got[:2]

    def clear(self, case: Case, keys: list[str]) -> None:
        for k in keys:
            self.store.remove(k, True)  # force: a get holds a lease on the object for 10 s

    def close(self) -> None:
        self.store.close()
        self.holder.stdin.close()


class Redis:
    name = "redis"

    def __init__(self, procs: Processes, tmp: str) -> None:
        import redis
        port = free_port()
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = procs.start([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--protected-mode", "yes"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(port, self.proc, "redis-server")
        self.r = redis.Redis(host="127.0.0.1", port=port)
        self.r.ping()

    def put(self, case: Case, keys: list[str]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k, s in zip(keys, case.src):
            pipe.set(k, memoryview(s))
        assert all(pipe.execute())

    def get(self, case: Case, keys: list[str]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        for d, v in zip(case.dst, pipe.execute()):
            np.copyto(d, np.frombuffer(v, dtype=np.uint8))

    def clear(self, case: Case, keys: list[str]) -> None:
        self.r.delete(*keys)

    def close(self) -> None:
        self.r.close()


class CopyTo:
    """The physical limit: the same bytes between the same arrays, one process."""

    name = "np.copyto"

    def put(self, case: Case, keys: list[str]) -> None:
        for s, d in zip(case.src, case.dst):
            np.copyto(d, s)

    get = put

    def clear(self, case: Case, keys: list[str]) -> None:
        pass

    def close(self) -> None:
        pass


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


def run(rounds: int) -> dict:
    started = time.perf_counter()
    procs = Processes()
    tmp = tempfile.mkdtemp(prefix="kvstore-bench-dp-")
    cases = [Case(*c) for c in CASES]
    systems: list[Any] = []
    best: dict[tuple[str, str, str], float] = {}
    checks: dict[str, bool] = {}
    try:
        systems = [KVStore(procs, tmp), Mooncake(procs, tmp, cases), Redis(procs, tmp), CopyTo()]
        kv_path = systems[0].path
        te_case = next(c for c in cases if c.label == "16MiB")
        systems[0].open_te(te_case)
        print(f"started kvstore ({kv_path}), Mooncake Store, Redis in {time.perf_counter() - started:.1f} s",
              flush=True)
        for rnd in range(rounds + 1):
            for case in cases:
                for sysm in systems:
                    keys = case.keys(sysm.name, rnd)
                    for op in ("put", "get"):
                        fn: Callable[[Case, list[str]], None] = getattr(sysm, op)
                        t0 = time.perf_counter()
                        fn(case, keys)
                        dt = time.perf_counter() - t0
                        if rnd:
                            k = (sysm.name, case.label, op)
                            best[k] = min(best.get(k, dt), dt)
                    if rnd == 0:
                        checks[f"{sysm.name}/{case.label}"] = case.check()
                    # the checksum's share of a kvstore get, on the same keys; and the 1 MiB and
                    # 16 MiB blocks in one call each (as Redis gets them, pipelined)
                    if sysm.name == "kvstore":
                        if case is te_case:  # the transfer-engine path, on the blocks just put
                            t0 = time.perf_counter()
                            sysm.get_te(case, keys)
                            dt = time.perf_counter() - t0
                            if rnd:
                                k = ("kvstore-te", case.label, "get")
                                best[k] = min(best.get(k, dt), dt)
                            if rnd == 0:
                                checks[f"kvstore-te/{case.label}"] = case.check()
                        if not case.batch:
                            bkeys = [k + "-b" for k in keys]
                            for op in ("put", "get"):
                                t0 = time.perf_counter()
                                getattr(sysm, op)(case, bkeys, batch=True)
                                dt = time.perf_counter() - t0
                                if rnd:
                                    k = ("kvstore-batched", case.label, op)
                                    best[k] = min(best.get(k, dt), dt)
                        plane = sysm.client._local()
                        plane.verify = False
                        t0 = time.perf_counter()
                        sysm.get(case, keys)
                        dt = time.perf_counter() - t0
                        plane.verify = True
                        if rnd:
                            k = ("kvstore-noverify", case.label, "get")
                            best[k] = min(best.get(k, dt), dt)
                    sysm.clear(case, keys)
            print(f"  round {rnd}{' (warm-up)' if rnd == 0 else ''} done ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    finally:
        for sysm in systems:
            try:
                sysm.close()
            except Exception:  # noqa: BLE001 — keep stopping the rest
                pass
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)

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
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
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
        print(f"  te_probe (16 MiB, own node with a staging area, best GB/s): get_into {probe['te_tcp_get_into_best_gbps']:.2f}, raw "
              f"engine read {probe['te_raw_read_best_gbps']:.2f}, gRPC stream {probe['grpc_stream_get_best_gbps']:.2f}")
    bad = [k for k, ok in report["byte_identical"].items() if not ok]
    print(f"\nbyte-identical round trips: {'all' if not bad else 'FAILED for ' + ', '.join(bad)}")
    print(f"wrote {RESULTS.relative_to(ROOT)} in {report['wall_s']:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
