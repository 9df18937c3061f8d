"""Probe of the across-host path: a block read from a store node *process* by this process's
Mooncake Transfer Engine over tcp loopback (``TransferEngineTransport``: a lease over the
node's control channel, the engine's read from the node's registered staging area, 64 MiB
by default, or with ``--te-staging 0`` its whole slab, xxh3 check, release), against the
gRPC stream of the same block from the same node, measured in the same run.

``get_into`` reads into a buffer registered with the engine (as Mooncake Store's
``get_into`` does), verifying the checksum wave by wave while later pieces still move;
``get_blocks`` returns ``bytes``. Also the raw engine read of the same block (no lease
round trip, checksum or copy out), the ceiling of the path on this machine.
``benchmarks/bench_dataplane.py`` adds :func:`measure`'s figures under its ``te_probe`` key
(its own ``te_tcp_get_16MiB_vs_mooncake`` is timed there, interleaved with Mooncake Store's
``get_into``). Run alone: ``.venv/bin/python benchmarks/te_probe.py [--size 16MiB]
[--rounds 7]``; prints GB/s and writes benchmarks/results/te_probe.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run_info import write_results  # noqa: E402
from kvstore.client import StoreClient  # noqa: E402
from kvstore.config import parse_bytes  # noqa: E402
from kvstore.transfer import GrpcStreamTransport, TransferEngineTransport  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "te_probe.json"


@contextmanager
def store_node_process(dram_bytes: int, transfer_engine: str = "tcp", te_staging: str = "64MiB") -> Iterator[str]:
    """A store node process on 127.0.0.1 (DRAM only; ``te_staging``: its ``--te-staging``,
    "0" registers the whole slab); yields its gRPC address."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "--log-level", "WARNING", "serve",
                                 "--node-id", "te-probe", "--port", str(port), "--dram", str(dram_bytes),
                                 "--ssd", "0", "--data-dir", tmp, "--transfer-engine", transfer_engine,
                                 "--te-staging", te_staging],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        address = f"127.0.0.1:{port}"
        try:
            StoreClient(address).wait_ready(60)
            yield address
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _rounds_gbps(read: Callable[[], object], size: int, rounds: int) -> list[float]:
    read()  # warm-up: handshake, buffer registration, page faults
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        read()
        out.append(size / (time.perf_counter() - t0) / 1e9)
    return out


def measure(size_bytes: int = 16 << 20, rounds: int = 7, te_staging: str = "64MiB") -> dict[str, float]:
    """GB/s over ``rounds`` gets of one ``size_bytes`` block from the same node process:
    the transfer engine into a registered buffer (``get_into``, as Mooncake Store's
    ``get_into`` is measured), the transfer engine to ``bytes`` (``get_blocks``), the gRPC
    stream, and the raw engine read; best and median of the rounds. ``te_staging``: the
    node's staging area (the default, as deployed) or "0" (its whole slab registered)."""
    with store_node_process(max(64 << 20, 3 * size_bytes), te_staging=te_staging) as address:
        key, data = b"te-probe".ljust(16, b"\0"), os.urandom(size_bytes)
        with StoreClient(address) as client:
            assert client.put(key, data).ok
        te = TransferEngineTransport(address)
        grpc_t = GrpcStreamTransport(address)
        try:
            dst = np.zeros(size_bytes, dtype=np.uint8)
            te.register(dst)
            assert te.get_into([key], [dst]) == [size_bytes] and dst.tobytes() == data, \
                "transfer engine read returned other bytes"
            assert te.get_blocks([key]) == [data], "transfer engine read returned other bytes"
            into_r = _rounds_gbps(lambda: te.get_into([key], [dst]), size_bytes, rounds)
            te_r = _rounds_gbps(lambda: te.get_blocks([key]), size_bytes, rounds)
            assert te.grpc_reads == 0, "transfer engine reads fell back to gRPC"
            grpc_r = _rounds_gbps(lambda: grpc_t.get_blocks([key]), size_bytes, rounds)
            raw_r = _rounds_gbps(_raw_engine_read(te, key, size_bytes), size_bytes, rounds)
        finally:
            te.close()
            grpc_t.close()
    med = statistics.median
    return {"size_bytes": size_bytes, "rounds": rounds, "te_staging": te_staging,
            "te_tcp_get_into_best_gbps": max(into_r), "te_tcp_get_into_median_gbps": med(into_r),
            "te_tcp_get_bytes_best_gbps": max(te_r), "te_tcp_get_bytes_median_gbps": med(te_r),
            "grpc_stream_get_best_gbps": max(grpc_r), "grpc_stream_get_median_gbps": med(grpc_r),
            "te_raw_read_best_gbps": max(raw_r), "te_raw_read_median_gbps": med(raw_r),
            "te_vs_grpc_stream": max(into_r) / max(grpc_r), "te_get_into_vs_raw_read": max(into_r) / max(raw_r)}


def _raw_engine_read(te: TransferEngineTransport, key: bytes, size: int) -> Callable[[], object]:
    """The engine's read of the block alone, as the get path moves it (pieces of
    ``PIECE_BYTES`` started at once, each polled), with one lease held throughout and no
    checksum or copy out: the ceiling of the get path on this machine (from a staging node,
    of the one staged copy its lease made)."""
    from kvstore.transfer.engine import DONE
    from kvstore.transfer.te_transport import PIECE_BYTES
    from protos import kvstore_pb2 as kv_pb
    if te.staged:
        block = te.control.lease([key], 600).blocks[0]  # type: ignore[union-attr]
    else:
        block = te._kv.LeaseBlocks(kv_pb.LeaseBlocksRequest(keys=[key], ttl_s=600)).blocks[0]
    _, base = te._buffer(size)
    offs = range(0, size, PIECE_BYTES)
    local = [base + o for o in offs]
    remote = [te.slab_address + block.offset + o for o in offs]
    lengths = [min(PIECE_BYTES, size - o) for o in offs]

    def read() -> None:
        ids = [te.engine.read_piece(te.endpoint, a, b, n) for a, b, n in zip(local, remote, lengths)]
        deadline = time.monotonic() + 60
        assert all([te.engine.wait_piece(i, deadline) == DONE for i in ids]), "raw engine read failed"
    return read


def compare(size_bytes: int, rounds: int, staging: str, runs: int) -> int:
    """What staging costs: ``runs`` alternating measurements of a staging node and a node
    with its whole slab registered; prints and writes the best of each and their ratios."""
    keys = ("te_tcp_get_into_best_gbps", "te_tcp_get_bytes_best_gbps", "te_raw_read_best_gbps")
    best: dict[str, dict[str, float]] = {staging: {}, "0": {}}
    for _ in range(runs):
        for mode in (staging, "0"):
            r = measure(size_bytes, rounds, mode)
            for k in keys:
                best[mode][k] = max(best[mode].get(k, 0.0), r[k])
    out = {"size_bytes": size_bytes, "rounds": rounds, "runs": runs, "staged": best[staging],
           "whole_slab": best["0"],
           **{f"{k}_staged_vs_whole_slab": best[staging][k] / best["0"][k] for k in keys}}
    for k in keys:
        print(f"{k:28s} staged {best[staging][k]:.2f}  whole slab {best['0'][k]:.2f}  "
              f"ratio {out[f'{k}_staged_vs_whole_slab']:.2f}")
    path = RESULTS.with_name("te_staging.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_results(path, out)
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="16MiB")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--te-staging", default="64MiB", help="the node's --te-staging; 0: its whole slab")
    p.add_argument("--compare", type=int, default=0, metavar="N",
                   help="instead: N alternating runs, staging (--te-staging) and whole slab (0), best of each")
    args = p.parse_args()
    if args.compare:
        return compare(parse_bytes(args.size), args.rounds, args.te_staging, args.compare)
    r = measure(parse_bytes(args.size), args.rounds, args.te_staging)
    print(f"transfer engine tcp get {args.size} (staging {args.te_staging}; best / median of {args.rounds}):\n"
          f"  get_into a registered buffer {r['te_tcp_get_into_best_gbps']:.2f} / "
          f"{r['te_tcp_get_into_median_gbps']:.2f} GB/s\n"
          f"  get_blocks (to bytes)        {r['te_tcp_get_bytes_best_gbps']:.2f} / "
          f"{r['te_tcp_get_bytes_median_gbps']:.2f} GB/s\n"
          f"  raw engine read              {r['te_raw_read_best_gbps']:.2f} / {r['te_raw_read_median_gbps']:.2f} GB/s\n"
          f"  gRPC stream                  {r['grpc_stream_get_best_gbps']:.2f} / "
          f"{r['grpc_stream_get_median_gbps']:.2f} GB/s ({r['te_vs_grpc_stream']:.2f}x slower than get_into)")
    write_results(RESULTS, r)
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
