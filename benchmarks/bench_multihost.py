"""kvstore across hosts: network namespaces on a private bridge (benchmarks/netns.py), every
service bound to its host's address; writes benchmarks/results/multihost.json. Needs root.

**Reads between two hosts.** Host 1 runs a store node (``kvstore serve``, DRAM only, the
transfer engine over TCP at its defaults: a 64 MiB staging area) and Mooncake Store
(``mooncake_master`` with its HTTP metadata server, and a process holding a 1 GiB global
segment). On host 2, benchmarks/multihost_reader.py puts 1 MiB blocks (32) and 16 MiB blocks
(8) into each and reads them back one block per call: kvstore through its transfer path
(``TransferEngineTransport.get_into``: lease over the node's TCP control channel, engine read
into the registered output arena, xxh3 check, release) and Mooncake Store through its own
client (``get_into``, registered buffers, no segment of the reader's own), interleaved round
by round, best of ``--rounds`` after a warm-up, every round's bytes compared. The same reader
on host 1 reads through kvstore's same-host path (the node's mapped slab) for
``cross_host_vs_same_host_get_16MiB``.

**Faults under load** (benchmarks/multihost.py): Redis alone on host 1, store nodes on hosts
2-4, checked block traffic from the root namespace through ``ClusterClient``, an index replica
of the KV events. Each fault runs on a fresh load: a link cut past the heartbeat TTL and
restored; a host's processes killed (``kill -9``) and the node restarted; Redis's host cut
off and restored; a partition (two node hosts cut off together) that heals. Per fault:
requests completed, wrong bytes (blocks read back with other bytes), acknowledged blocks of
surviving nodes lost, seconds until membership shows the fault and until it shows the heal.

**vLLM with its hits on another host** (benchmarks/multihost_vllm.py): Redis on host 1, a
store node on host 2, vLLM (the ``bench`` checkpoint of bench_vllm.py, kvstore's connector in
cluster mode) on host 3; the same prompts served with every block but the last loaded from host
2's node through the transfer engine, and recomputed by a fresh vLLM without the connector:
``ttft_hit_remote_vs_recompute`` = median TTFT of the hits / median TTFT of the recomputes
(target <= 0.5).

**vLLM servers behind the front door across hosts** (benchmarks/multihost_frontdoor.py): Redis
on host 1, a store node on host 2, vLLM OpenAI servers (connectors in cluster mode, their own
prefix caches off) on hosts 3 and 4, the front door (``--vllm-colocated``, ``--redis``) on
host 5; prompts that share prefixes sent through the front door: per request the instance
that served it and its ``cached_tokens``, the front door's cached tokens by source, the TTFT
of hits and misses (``frontdoor_*``).

Run as root: ``.venv/bin/python benchmarks/bench_multihost.py [--rounds 5]`` (about 2 minutes);
``--only vllm`` (or ``reads``, ``faults``, ``frontdoor``) runs that part alone and merges its figures into the
existing results, the part's own date, commit and machine recorded beside them
(``runs.<part>``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import netns  # noqa: E402
from benchmarks.dataplane_peers import HOLDER  # noqa: E402
from benchmarks.multihost import TTL_S, Cluster, Load  # noqa: E402
from benchmarks.multihost_frontdoor import frontdoor_remote  # noqa: E402
from benchmarks.multihost_vllm import ttft_remote  # noqa: E402
from benchmarks.run_info import run_info, write_results  # noqa: E402
from kvstore.events.channel import make_channel  # noqa: E402
from kvstore.events.replica import IndexReplica, store_snapshot_source  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "multihost.json"
TARGETS = {"cross_host_get_16MiB_vs_mooncake": 1.0, "ttft_hit_remote_vs_recompute": 0.5}   # >= and <=
PARTS = ("reads", "faults", "vllm", "frontdoor")
MC_RPC, MC_HTTP, MC_METRICS, MC_HOLDER = 50100, 50101, 50102, 50103


def _wait_tcp(host: str, port: int, proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> None:
    import socket
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=0.3).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start on {host}:{port}") from None
            time.sleep(0.1)


def reads(rounds: int, tmp: str) -> dict:
    """The two-host read figures (module docstring)."""
    topo = netns.Topology(2).up()
    procs: list[subprocess.Popen] = []
    token = os.urandom(16).hex()
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVSTORE_STORE_TOKEN=token, GLOG_minloglevel="2")
    h1 = topo.address(1)
    log = open(os.path.join(tmp, "reads.log"), "ab")
    try:
        node = topo.popen(1, [sys.executable, "-m", "launcher", "--log-level", "WARNING", "serve", "--node-id", "r1",
                              "--host", h1, "--port", "50051", "--dram", "1GiB", "--ssd", "0",
                              "--transfer-engine", "tcp", "--data-dir", os.path.join(tmp, "r1")],
                          env=env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT)
        procs.append(node)
        master = topo.popen(1, [str(Path(sys.executable).parent / "mooncake_master"), f"--rpc_address={h1}",
                                f"--rpc_port={MC_RPC}", f"--metrics_host={h1}", f"--metrics_port={MC_METRICS}",
                                "--enable_http_metadata_server=true", f"--http_metadata_server_host={h1}",
                                f"--http_metadata_server_port={MC_HTTP}"], stdout=log, stderr=subprocess.STDOUT)
        procs.append(master)
        _wait_tcp(h1, MC_RPC, master, "mooncake_master")
        _wait_tcp(h1, MC_HTTP, master, "Mooncake's metadata server")
        meta, mc = f"http://{h1}:{MC_HTTP}/metadata", f"{h1}:{MC_RPC}"
        holder = topo.popen(1, [sys.executable, "-c", HOLDER, f"{h1}:{MC_HOLDER}", meta, mc, str(1 << 30)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        procs.append(holder)
        assert holder.stdout is not None
        line = holder.stdout.readline().split()
        if line[:2] != ["READY", "0"]:
            raise RuntimeError(f"Mooncake segment holder failed to start: {line}")
        _wait_tcp(h1, 50051, node, "kvstore serve")
        spec = {"node": f"{h1}:50051", "master": mc, "meta": meta, "rounds": rounds}
        out = {}
        for host, mode in ((2, "cross"), (1, "same")):
            got = topo.run(host, [sys.executable, str(ROOT / "benchmarks" / "multihost_reader.py"),
                                  json.dumps({**spec, "mode": mode})], timeout_s=600, env=env)
            lines = [x for x in got.stdout.splitlines() if x.startswith("{")]
            if got.returncode != 0 or not lines:
                raise RuntimeError(f"the {mode} reader failed ({got.returncode}): {got.stderr[-3000:]}")
            out[mode] = json.loads(lines[-1])
        return out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        topo.down()


def _fault(cluster: Cluster, name: str, replica: IndexReplica) -> dict:
    """One fault under a fresh load (module docstring)."""
    registry = cluster.registry()
    everyone = {cluster.node_id(i) for i in cluster.node_hosts}
    assert cluster.converge(registry, everyone, 60) is not None, f"cluster not whole before {name}"
    load = Load(cluster, name).start()
    load.goes_on(10, requests=20)
    gone: set[str] = set()
    t0 = time.monotonic()
    if name == "link_cut":
        cluster.topology.cut(3)
        gone = {"n3"}
    elif name == "host_killed":
        cluster.kill9(4)
        gone = {"n4"}
    elif name == "redis_host_cut":
        cluster.topology.cut(1)
    elif name == "partition":
        cluster.topology.cut(3, 4)
        gone = {"n3", "n4"}
    result: dict = {}
    if gone:
        converged = cluster.converge(registry, everyone - gone, 30)
        result["seconds_to_converge"] = round(converged, 2) if converged is not None else None
        result["requests_during_fault"] = _during(load, 3.0)
    else:   # Redis cut off: membership cannot be read; serving goes on from the last listing
        result["requests_during_fault"] = _during(load, max(3.0, 2 * TTL_S))
    t1 = time.monotonic()
    if name == "host_killed":
        cluster.start_node(4)
    else:
        cluster.topology.heal(*{"link_cut": (3,), "redis_host_cut": (1,), "partition": (3, 4)}[name])
    back = cluster.converge(registry, everyone, 60)
    result["seconds_to_rejoin"] = round(time.monotonic() - t1, 2) if back is not None else None
    result["fault_seconds"] = round(t1 - t0, 2)
    load.goes_on(10, requests=10)
    load.stop()
    survivors = everyone - ({"n4"} if name == "host_killed" else set())
    lost = load.lost(survivors)
    result.update(load.counts())
    result["acknowledged_blocks_lost"] = len(lost)
    result["index_heals_s"] = _index_heals(load, replica, survivors)
    load.close()
    return result


def _during(load: Load, seconds: float) -> int:
    before = load.requests
    time.sleep(seconds)
    return load.requests - before


def _index_heals(load: Load, replica: IndexReplica, survivors: set[str]) -> float | None:
    """Seconds until the router's index replica holds every acknowledged block of a surviving
    node where the nodes say it is (after a Redis outage: by snapshot); None within 30 s."""
    keys = [k for k, node in load.acked.items() if node in survivors][-200:]
    owners = load.client.locate(keys)
    want = {k: o.node_id for k, o in zip(keys, owners) if o is not None}
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:
        if all(replica.hits([k]).get(node) == 1 for k, node in want.items()):
            return round(time.monotonic() - t0, 2)
        time.sleep(0.2)
    return None


def faults(tmp: str) -> dict:
    with Cluster(os.path.join(tmp, "faults"), nodes=3, extra_hosts=0, dram="1GiB") as cluster:
        addresses = {cluster.node_id(i): cluster.address(i) for i in cluster.node_hosts}
        with IndexReplica(make_channel(cluster.redis_url, token=cluster.token),
                          store_snapshot_source(addresses, cluster.token)) as replica:
            out = {}
            for name in ("link_cut", "host_killed", "redis_host_cut", "partition"):
                out[name] = _fault(cluster, name, replica)
                print(f"  {name}: {out[name]}", flush=True)
            return out


def ratio(a: float, b: float) -> float:
    return round(b / a, 3) if a and b else 0.0


def read_figures(rd: dict) -> dict:
    cross, same = rd["cross"]["best_seconds"], rd["same"]["best_seconds"]
    blocks = rd["cross"]["blocks"]
    gbps = {f"{system}/{label}": round(blocks[label] * int(label.split("MiB")[0]) / 1024 / secs, 3)
            for src in (cross, same) for system, by in src.items() for label, secs in by.items()}
    return {
        "cross_host_get_16MiB_vs_mooncake": ratio(cross["kvstore-te"]["16MiB"], cross["mooncake"]["16MiB"]),
        "cross_host_get_1MiB_vs_mooncake": ratio(cross["kvstore-te"]["1MiB"], cross["mooncake"]["1MiB"]),
        "cross_host_vs_same_host_get_16MiB": ratio(cross["kvstore-te"]["16MiB"], same["kvstore-same-host"]["16MiB"]),
        "get_GiB_per_s": gbps,
        "byte_identical": {**rd["cross"]["checks"], **rd["same"]["checks"]},
        "te_reads": rd["cross"]["te_reads"], "te_reads_over_grpc": rd["cross"]["te_grpc_reads"],
    }


def fault_figures(fl: dict) -> dict:
    return {
        "faults": fl,
        "fault_requests_completed": sum(f["requests_completed"] for f in fl.values()),
        "fault_wrong_bytes": sum(f["wrong_bytes_blocks"] for f in fl.values()),
        "fault_acknowledged_blocks_lost": sum(f["acknowledged_blocks_lost"] for f in fl.values()),
        "fault_client_errors": sum(f["client_errors"] for f in fl.values()),
        "fault_seconds_to_converge_max": max((f["seconds_to_converge"] or 0.0) for f in fl.values()
                                             if "seconds_to_converge" in f),
        "heartbeat_ttl_s": TTL_S,
    }


def vllm_figures(vl: dict) -> dict:
    return {"ttft_hit_remote_vs_recompute": vl.pop("ttft_hit_remote_vs_recompute"), "vllm_remote_hits": vl}


def frontdoor_figures(fd: dict) -> dict:
    return {"frontdoor_requests_completed": fd["requests_completed"],
            "frontdoor_cached_tokens_by_source": fd["cached_tokens_by_source"],
            "frontdoor_ttft_hit_vs_miss": fd["ttft_hit_vs_miss"], "frontdoor_vllm_two_hosts": fd}


def merge(old: dict, new: dict, parts: list[str]) -> dict:
    """``--only``: this run's parts replace their figures in the existing results; each part
    keeps the date, commit and machine of the run that measured it (``runs``)."""
    runs = old.get("runs") or dict.fromkeys(PARTS, old.get("run"))
    report = {k: v for k, v in old.items() if k not in ("run", "runs")}
    report.update(new)
    gaps = {k: why for k, why in report.pop("not_measured", {}).items() if report.get(k) is None}
    if gaps:
        report["not_measured"] = gaps
    this = run_info()
    report["runs"] = {**runs, **dict.fromkeys(parts, this)}
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", choices=PARTS, action="append",
                    help="run only this part (repeatable), merged into the existing results")
    args = ap.parse_args()
    why = netns.unavailable()
    if why:
        print(f"bench_multihost: skipped: {why}")
        return 0
    parts = args.only or list(PARTS)
    started = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="kvstore-bench-multihost-")
    new: dict = {}
    if "reads" in parts:
        print("reads between two hosts ...", flush=True)
        rd = reads(args.rounds, tmp)
        print(f"  {json.dumps(rd)} ({time.monotonic() - started:.0f} s)", flush=True)
        new.update(read_figures(rd))
    if "faults" in parts:
        print("faults under load ...", flush=True)
        new.update(fault_figures(faults(tmp)))
    if "vllm" in parts:
        print("vLLM with its hits on another host ...", flush=True)
        new.update(vllm_figures(ttft_remote(os.path.join(tmp, "vllm"))))
    if "frontdoor" in parts:
        print("vLLM servers on two hosts behind the front door ...", flush=True)
        new.update(frontdoor_figures(frontdoor_remote(os.path.join(tmp, "frontdoor"))))
    new["targets"] = TARGETS
    if args.only and RESULTS.exists():
        report = merge(json.loads(RESULTS.read_text()), new, parts)
        report[f"wall_s_{'_'.join(parts)}"] = round(time.monotonic() - started, 1)
    else:
        report = {**new, "wall_s": round(time.monotonic() - started, 1)}
    write_results(RESULTS, report)
    for key in ("cross_host_get_16MiB_vs_mooncake", "cross_host_get_1MiB_vs_mooncake",
                "cross_host_vs_same_host_get_16MiB", "ttft_hit_remote_vs_recompute", "fault_requests_completed",
                "frontdoor_requests_completed", "frontdoor_cached_tokens_by_source", "frontdoor_ttft_hit_vs_miss",
                "fault_wrong_bytes", "fault_acknowledged_blocks_lost", "fault_seconds_to_converge_max"):
        print(f"{key}: {report.get(key)}")
    print(f"wrote {RESULTS.relative_to(ROOT)} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
