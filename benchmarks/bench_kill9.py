"""``kill -9`` of a store node under puts, cycle after cycle, on one data directory.

Each cycle starts ``kvstore serve`` (SSD only, ``--ssd-fsync commit``, so every put the node
acknowledged is a committed SSD block), checks it, runs writers that put blocks (one per
call and batches of 8, 4–128 KiB, bytes derived from the key) for 0.3–1.0 s and kills the
node with SIGKILL while puts are in flight. After each restart:

- wrong bytes: blocks whose bytes differ from what was put (every acknowledged block and
  every block in flight at the kill that the node holds); must be 0;
- lost: acknowledged blocks the node no longer holds; must be 0;
- usage: the node's SSD ``used_bytes`` / ``blocks`` against the sizes and rows in the LMDB
  file, read with py-lmdb while the node was down; must be equal.

Run: ``.venv/bin/python benchmarks/bench_kill9.py [--cycles 20]``; prints the figures and
writes benchmarks/results/kill9.json. tests/kvstore/test_kill9.py runs 3 cycles.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import lmdb
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run_info import write_results  # noqa: E402
from kvstore.client import StoreClient  # noqa: E402
from kvstore.errors import KVStoreError  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "kill9.json"
NODE = "kill9"


def key_of(n: int) -> bytes:
    return hashlib.sha256(b"kill9 block %d" % n).digest()


def block_of(key: bytes) -> bytes:
    size = (4 + key[0] % 125) << 10                          # 4-128 KiB
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, size, dtype=np.uint8).tobytes()


def _start(data_dir: str, log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "--log-level", "WARNING", "serve",
                             "--node-id", NODE, "--port", str(port), "--dram", "0", "--ssd", "2GiB",
                             "--ssd-fsync", "commit", "--transfer-engine", "off", "--data-dir", data_dir],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(ROOT),
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=60)
        except grpc.FutureTimeoutError:
            proc.kill()
            raise RuntimeError(f"store node did not start: {Path(log_path).read_text()[-2000:]}") from None
    return proc, address


def on_disk(data_dir: str) -> tuple[int, int]:
    """(bytes, blocks) the SSD tier's LMDB holds, read from its ``meta`` rows while the node is down."""
    path = os.path.join(data_dir, NODE, "ssd")
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return 0, 0
    env = lmdb.open(path, readonly=True, max_dbs=2, lock=False)
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin(db=meta) as txn:
            sizes = [struct.unpack_from("<Q", raw)[0] for _, raw in txn.cursor()]
    finally:
        env.close()
    return sum(sizes), len(sizes)


def run_cycles(cycles: int, data_dir: str, log_path: str, seed: int = 0,
               put_s: tuple[float, float] = (0.3, 1.0)) -> dict:
    """The figures of ``cycles`` kill -9 cycles (see the module docstring)."""
    rng = random.Random(seed)
    acked: set[int] = set()
    lock = threading.Lock()
    next_n = [0]
    totals = {"cycles": cycles, "wrong_bytes": 0, "lost_acked": 0, "usage_mismatches": 0,
              "acked_blocks": 0, "in_flight_at_kill": 0, "in_flight_stored": 0, "put_errors": 0}
    per_cycle = []
    in_flight: set[int] = set()
    for cycle in range(cycles + 1):
        disk_bytes, disk_blocks = on_disk(data_dir)
        proc, address = _start(data_dir, log_path)
        try:
            with StoreClient(address, timeout_s=30) as client:
                ssd = next(s for s in client.stats()[1] if s.name == "ssd")
                usage_ok = (ssd.used_bytes, ssd.blocks) == (disk_bytes, disk_blocks)
                check = sorted(acked | in_flight)
                wrong = lost = stored_in_flight = 0
                for at in range(0, len(check), 64):
                    ns = check[at:at + 64]
                    for n, got in zip(ns, client.get_blocks([key_of(n) for n in ns])):
                        if got is None:
                            lost += n in acked
                        elif got != block_of(key_of(n)):
                            wrong += 1
                        elif n not in acked:
                            stored_in_flight += 1
                            acked.add(n)        # stored after all: from now on it must stay
                totals["wrong_bytes"] += wrong
                totals["lost_acked"] += lost
                totals["usage_mismatches"] += not usage_ok
                totals["in_flight_stored"] += stored_in_flight
                per_cycle.append({"cycle": cycle, "checked": len(check), "wrong_bytes": wrong, "lost": lost,
                                  "ssd_used_bytes": ssd.used_bytes, "ssd_blocks": ssd.blocks,
                                  "disk_bytes": disk_bytes, "disk_blocks": disk_blocks})
                if cycle == cycles:
                    break
                in_flight = set()
                stop = threading.Event()

                def writer(batch: int, address: str, stop: threading.Event, in_flight: set[int]) -> None:
                    with StoreClient(address, timeout_s=30) as w:
                        while not stop.is_set():
                            with lock:
                                ns = list(range(next_n[0], next_n[0] + batch))
                                next_n[0] += batch
                                in_flight.update(ns)
                            try:
                                results = w.put_blocks([(key_of(n), block_of(key_of(n))) for n in ns])
                            except KVStoreError:
                                return          # the node is gone
                            with lock:
                                for n, r in zip(ns, results):
                                    if r.ok:
                                        acked.add(n)
                                        in_flight.discard(n)
                                    else:
                                        totals["put_errors"] += 1

                threads = [threading.Thread(target=writer, args=(b, address, stop, in_flight), daemon=True)
                           for b in (1, 1, 8)]
                for t in threads:
                    t.start()
                time.sleep(rng.uniform(*put_s))
                proc.kill()                     # SIGKILL with puts in flight
                proc.wait()
                stop.set()
                for t in threads:
                    t.join(timeout=60)
                with lock:
                    totals["in_flight_at_kill"] += len(in_flight)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    totals["acked_blocks"] = len(acked)
    totals["per_cycle"] = per_cycle
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstore-kill9-") as tmp:
        t0 = time.perf_counter()
        out = run_cycles(args.cycles, os.path.join(tmp, "data"), os.path.join(tmp, "node.log"), args.seed)
        out["wall_s"] = round(time.perf_counter() - t0, 1)
    write_results(RESULTS, out)
    for name in ("cycles", "acked_blocks", "wrong_bytes", "lost_acked", "usage_mismatches",
                 "in_flight_at_kill", "in_flight_stored", "put_errors", "wall_s"):
        print(f"{name:22s} {out[name]}")
    ok = out["wrong_bytes"] == 0 and out["lost_acked"] == 0 and out["usage_mismatches"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
