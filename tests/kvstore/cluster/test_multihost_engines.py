"""Engines and the front door across hosts (network namespaces, benchmarks/netns.py): Redis on
host 1, a store node on host 2, the built-in prefill engine on host 3, the decode engine on
host 4, the front door on host 5, each bound to its host's address, all in cluster mode. A
request's prompt blocks, saved by the prefill engine onto host 2's node, are loaded by the
decode engine on host 4 through the transfer engine; the front door's index replica learns
the blocks of host 2's node and of host 3's engine through the KV events in Redis, and the
repeat of a prompt is served from them. vLLM inside a host is measured in
benchmarks/bench_multihost.py (``ttft_hit_remote_vs_recompute``), not here: it would double
this test's time. Skipped only where network namespaces cannot be made (not root)."""
from __future__ import annotations

import time

import pytest

from benchmarks import netns
from benchmarks.multihost import METRICS_PORT, Cluster
from benchmarks.multihost_engines import ENGINE_PORT, FRONT_DOOR_PORT, Stack, complete, metrics

WHY_NOT = netns.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=f"multi-host harness: {WHY_NOT}")]
STORE, PREFILL, DECODE, DOOR = 2, 3, 4, 5
BLOCK = 16     # the built-in engines' block size


def _replica(url: str, what: str) -> float:
    return metrics(f"{url}/metrics").get(f'kvstore_scheduler_kv_index_replica{{what="{what}"}}', -1.0)


@pytest.mark.timeout(180)
def test_engines_on_other_hosts_load_the_nodes_blocks_and_the_front_door_sees_them(tmp_path):
    with Cluster(str(tmp_path), nodes=1, extra_hosts=3, dram="64MiB") as cluster, Stack(cluster) as stack:
        topo = cluster.topology
        stack.start_engine("prefill-0", "prefill", PREFILL)
        stack.start_engine("decode-0", "decode", DECODE)
        stack.wait_engine("prefill-0", PREFILL)
        stack.wait_engine("decode-0", DECODE)
        url = stack.start_front_door(DOOR, [PREFILL], [DECODE])
        node_metrics = f"http://{topo.address(STORE)}:{METRICS_PORT}/metrics"
        leases = 'kvstore_dataplane_op_seconds_count{node="n2",op="lease",plane="remote"}'
        before = metrics(node_metrics, cluster.token)
        prompt = list(range(1, 4 * BLOCK + 6))          # 4 full blocks and a tail
        first = complete(url, prompt)
        assert first["usage"]["completion_tokens"] == 2
        deadline = time.monotonic() + 30                  # n2's and the prefill engine's events
        while _replica(url, "events") < 2 + 2 * 4 and time.monotonic() < deadline:
            time.sleep(0.2)      # NodeCleared and 4 BlockStored of each: n2 (host 2), prefill-0 (host 3)
        assert _replica(url, "events") >= 2 + 2 * 4, stack.log_tail("frontdoor")
        second = complete(url, prompt)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK, second["usage"]
        after = metrics(node_metrics, cluster.token)
        # the decode engine (host 4) read the prompt's blocks off host 2's node through the
        # transfer engine: remote leases, no gRPC Get
        assert after.get(leases, 0) > before.get(leases, 0), {k: v for k, v in after.items() if "lease" in k}
        grpc_gets = [k for k in after if k.startswith("kvstore_get_seconds_count")]
        assert all(after[k] == before.get(k, 0) for k in grpc_gets), grpc_gets
        for host, port in ((PREFILL, ENGINE_PORT), (DECODE, ENGINE_PORT), (DOOR, FRONT_DOOR_PORT)):
            mine = {f"{topo.address(host)}:{port}", f"[::ffff:{topo.address(host)}]:{port}"}   # gRPC: v4-mapped
            listening = cluster.listeners(host)
            wildcard = [a for a in listening if a.startswith(("*:", "0.0.0.0:", "[::]:"))]
            assert len(mine & set(listening)) == 1 and len(listening) == 1 + len(wildcard), listening
            # only the transfer engine listens on every interface (no bind setting), where it reads
            assert len(wildcard) == (2 if host == DECODE else 0), (host, listening)
        door = metrics(f"{url}/metrics")
        by_source = "kvstore_scheduler_cached_prompt_tokens_by_source_total"
        cached = {k.removeprefix(by_source): v for k, v in door.items() if k.startswith(by_source)}
        # the route plan counted the prefill engine's own blocks, known from host 3's KV events
        assert cached == {'{source="instance"}': 4 * BLOCK}, cached
