"""The metrics ports of a store node and of the engines: real nodes and engines on 127.0.0.1,
real blocks put and read, scraped over HTTP and parsed as Prometheus text; the counters move
with the traffic; a port with a token refuses a scrape without it. The port's own defences
(idle and dripping connections, the metrics token, binding again): test_metrics_port.py."""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
import urllib.error
import urllib.request

import pytest

from kvstore.client import StoreClient
from kvstore.config import StoreConfig
from kvstore.node import StoreNode
from tests.helpers.metrics_helpers import TOKEN, scrape, status_of, value


@pytest.fixture()
def node(tmp_path):
    cfg = StoreConfig(node_id="metrics-node", port=0, metrics_port=0, dram_bytes=16 << 20, ssd_bytes=32 << 20,
                      data_dir=str(tmp_path), auth_token=TOKEN, dram_prefault=False,
                      high_watermark=1.0, low_watermark=1.0)
    served = StoreNode.start(cfg)
    yield served.address, served.metrics_url, served.pool
    served.stop(grace_s=0)


def blocks(n: int, size: int = 64 << 10, seed: int = 0) -> list[tuple[bytes, bytes]]:
    return [(os.urandom(32), bytes([(seed + i) % 251]) * size) for i in range(n)]


def scrape_released(url: str, plane: str, token: str | None = TOKEN) -> dict:
    """A scrape taken once ``plane`` lends no read lease: a reader's RELEASE gets no reply, so
    it reaches the node a moment after the read returned (the node's control thread, not the
    reader, takes the lease back). 5 s at most; the caller asserts what it then shows."""
    deadline = time.monotonic() + 5
    while value(got := scrape(url, token), "kvstore_leases", plane=plane) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_store_metrics_parse_and_move_with_traffic(node):
    address, url, _ = node
    assert url is not None and url.startswith("http://127.0.0.1:")
    before = scrape(url)
    for tier in ("dram", "ssd"):
        assert value(before, "kvstore_tier_capacity_bytes", tier=tier, node="metrics-node") > 0
    assert value(before, "kvstore_tier_used_bytes", tier="dram") == 0
    assert value(before, "kvstore_block_read_hits_total", tier="dram") == 0
    assert value(before, "kvstore_node_info", node="metrics-node") == 1

    # The same-host data plane (the slab mapped here) and the gRPC stream, each with puts,
    # hits and misses.
    local = StoreClient(address, auth_token=TOKEN)
    stream = StoreClient(address, auth_token=TOKEN, data_path="grpc")
    try:
        assert local.data_path_in_use.startswith("same-host")
        mapped, streamed = blocks(6, seed=1), blocks(4, seed=2)
        assert all(r.ok for r in local.put_blocks(mapped, chain=True))
        assert all(r.ok for r in stream.put_blocks(streamed, chain=True))
        assert local.get_blocks([k for k, _ in mapped]) == [v for _, v in mapped]
        assert stream.get_blocks([k for k, _ in streamed]) == [v for _, v in streamed]
        assert stream.get_blocks([os.urandom(32)]) == [None]
        after = scrape_released(url, "local")
    finally:
        local.close()
        stream.close()

    used = value(after, "kvstore_tier_used_bytes", tier="dram")
    assert used >= 10 * (64 << 10)
    assert value(after, "kvstore_tier_blocks", tier="dram") == 10
    assert value(after, "kvstore_block_read_hits_total", tier="dram") == 10
    assert value(after, "kvstore_block_read_misses_total", tier="dram") >= 1
    assert value(after, "kvstore_put_seconds_count", node="metrics-node") >= 1
    assert value(after, "kvstore_get_seconds_count", node="metrics-node") >= 2
    assert value(after, "kvstore_put_seconds_sum") > 0
    for op in ("lease", "reserve", "commit"):
        assert value(after, "kvstore_dataplane_op_seconds_count", plane="local", op=op) >= 1
    assert value(after, "kvstore_leases", plane="local") == 0      # every read released its lease
    assert value(after, "kvstore_reservations", plane="local") >= 0
    # buckets are cumulative and end at +Inf = count
    assert value(after, "kvstore_put_seconds_bucket", le="+Inf") == value(after, "kvstore_put_seconds_count")


def test_store_metrics_count_evictions_and_demotions(node):
    address, url, pool = node
    with StoreClient(address, auth_token=TOKEN, data_path="grpc") as client:
        # 16 MiB of DRAM: 24 blocks of 1 MiB push the oldest down to SSD.
        assert all(r.ok for r in client.put_blocks(blocks(24, size=1 << 20), chain=False))
    after = scrape(url)
    demoted = value(after, "kvstore_block_demotions_total", tier="dram")
    assert demoted >= 8
    assert value(after, "kvstore_block_evictions_total", tier="dram") >= demoted
    assert value(after, "kvstore_tier_blocks", tier="ssd") == demoted
    assert value(after, "kvstore_tier_used_bytes", tier="ssd") == sum(
        s.used_bytes for s in pool.stats() if s.name == "ssd")


def test_store_metrics_port_refuses_a_wrong_or_missing_token(node):
    _, url, _ = node
    assert status_of(url, {}) == 401
    assert status_of(url, {"Authorization": "Bearer wrong"}) == 401
    assert status_of(url, {"Authorization": TOKEN}) == 401            # no scheme
    assert status_of(url, {"Authorization": f"Bearer {TOKEN}"}) == 200
    assert status_of(url.replace("/metrics", "/other"), {"Authorization": f"Bearer {TOKEN}"}) == 404
    try:
        urllib.request.urlopen(url, timeout=10)
    except urllib.error.HTTPError as exc:
        assert exc.headers["WWW-Authenticate"].startswith("Bearer")
        assert "token" in exc.read().decode()


def test_metrics_port_in_use_is_a_clear_error(node, tmp_path):
    _, url, _ = node
    taken = int(url.rsplit(":", 1)[1].split("/")[0])
    cfg = StoreConfig(node_id="second", port=0, metrics_port=taken, dram_bytes=4 << 20, ssd_bytes=0,
                      data_dir=str(tmp_path / "b"), dram_prefault=False)
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{taken} for metrics"):
        StoreNode.start(cfg)
    with pytest.raises(ValueError, match="metrics_port"):
        StoreConfig(metrics_port=70000)


# -- engines ----------------------------------------------------------------------------------
def test_engine_metrics_parse_and_move_with_traffic(node):
    from engines.client import EngineClient
    from engines.server import metrics_url as engine_metrics_url
    from engines.server import start_engine, stop_metrics

    address, _, _ = node
    servers = []
    try:
        urls, engines = {}, {}
        for role in ("prefill", "decode"):
            server, port = start_engine(role, address, block_size=16, engine_id=f"{role}-m", store_token=TOKEN,
                                        auth_token="engine-token", metrics_port=0)
            servers.append(server)
            urls[role], engines[role] = engine_metrics_url(server), f"127.0.0.1:{port}"
        assert status_of(urls["prefill"], {"Authorization": f"Bearer {TOKEN}"}) == 401   # the engine's token
        before = {role: scrape(url, "engine-token") for role, url in urls.items()}
        assert value(before["prefill"], "kvstore_engine_prompt_tokens_total", source="loaded") == 0
        assert value(before["prefill"], "kvstore_engine_requests_waiting", engine="prefill-m") == 0
        assert value(before["decode"], "kvstore_engine_requests_running", engine="decode-m") == 0

        prompt = [(7 * i) % 500 + 3 for i in range(5 * 16 + 3)]

        async def run() -> None:
            pre = EngineClient(engines["prefill"], auth_token="engine-token")
            dec = EngineClient(engines["decode"], auth_token="engine-token")
            try:
                for rid in ("a", "b"):          # the second one reuses the first one's blocks
                    r = await pre.prefill(rid, prompt, "tenant")
                    steps = [s async for s in dec.decode(rid, prompt, "tenant", r, 4, ())]
                    assert len(steps) == 4
                # as the front door reads a decode: it stops at the finished step and closes the
                # stream (a cancel) — a finished decode all the same, not a cancelled one
                gen = dec.decode("c", prompt, "tenant", r, 4, ())
                async with contextlib.aclosing(gen):
                    async for step in gen:
                        if step.finished:
                            break
                await asyncio.sleep(0.5)        # the engine's generator sees the cancel
            finally:
                await pre.close()
                await dec.close()
        asyncio.run(run())

        pre, dec = scrape(urls["prefill"], "engine-token"), scrape(urls["decode"], "engine-token")
        assert value(pre, "kvstore_engine_prefill_seconds_count", engine="prefill-m") == 2
        assert value(pre, "kvstore_engine_prompt_tokens_total", source="loaded") == 5 * 16
        assert value(pre, "kvstore_engine_prompt_tokens_total", source="computed") == 2 * len(prompt) - 5 * 16
        assert value(pre, "kvstore_engine_stored_blocks_total") == 5
        assert value(pre, "kvstore_engine_requests_total", outcome="ok") == 2
        assert value(pre, "kvstore_engine_info", role="prefill") == 1
        assert value(dec, "kvstore_engine_decode_seconds_count", engine="decode-m") == 3
        assert value(dec, "kvstore_engine_time_per_output_token_seconds_count") == 3 * 3
        assert value(dec, "kvstore_engine_requests_total", outcome="ok") == 3
        assert value(dec, "kvstore_engine_requests_total", outcome="cancelled") == 0
        assert value(dec, "kvstore_engine_recomputed_tokens_total") == 0
        # the decode engine's side of the hand-off: the prompt's blocks read from the pool
        assert value(dec, "kvstore_engine_prompt_tokens_total", source="loaded") == 3 * len(prompt)
        assert value(dec, "kvstore_engine_prompt_tokens_total", source="computed") == 0
        assert value(dec, "kvstore_engine_pool_load_seconds_count", tier="unknown") == 3
        assert value(dec, "kvstore_engine_pool_loaded_bytes_total", tier="unknown") > 0
    finally:
        for server in servers:
            stop_metrics(server)
            server.stop(0).wait()


def test_store_metrics_per_namespace(node):
    """Per-tenant series, from the pool's tenant books (kvstore/pool/tenants.py)."""
    pytest.importorskip("kvstore.pool.tenants", reason="this build keeps no per-tenant books (kvstore/pool/tenants.py)")
    address, url, _ = node
    a, b = blocks(3, seed=3), blocks(2, seed=4)
    with StoreClient(address, auth_token=TOKEN, data_path="grpc") as client:
        assert all(r.ok for r in client.put_blocks(a, chain=True, namespace="tenant-a"))
        assert all(r.ok for r in client.put_blocks(b, chain=True, namespace="tenant-b"))
        assert client.get_blocks([k for k, _ in a]) == [v for _, v in a]
    got = scrape(url)
    assert value(got, "kvstore_namespace_bytes", namespace="tenant-a") == 3 * (64 << 10)
    assert value(got, "kvstore_namespace_blocks", namespace="tenant-b") == 2
    assert value(got, "kvstore_namespace_read_hits_total", namespace="tenant-a") == 3
    assert value(got, "kvstore_namespace_read_hits_total", namespace="tenant-b") == 0
    assert value(got, "kvstore_namespace_tier_bytes", namespace="tenant-a", tier="dram") == 3 * (64 << 10)
    assert not [k for k in got if k[0] == "kvstore_namespace_quota_bytes"]       # no tenant has a quota


def test_store_metrics_count_the_transfer_engine_plane(tmp_path, redis_url):
    """A node in a cluster runs the transfer engine: its TCP control channel's leases are
    the ``remote`` plane; a read through it is a timed ``lease``."""
    from kvstore.cluster.client import ClusterClient

    cfg = StoreConfig(node_id="te-node", port=0, metrics_port=0, dram_bytes=8 << 20, ssd_bytes=0,
                      data_dir=str(tmp_path), redis_url=redis_url, dram_prefault=False)
    served = StoreNode.start(cfg)
    pool = served.pool
    try:
        got = scrape(served.metrics_url, None)
        assert value(got, "kvstore_leases", plane="remote") == 0
        assert value(got, "kvstore_reservations", plane="remote") == 0
        data = blocks(2, seed=5)
        assert all(pool.put(k, v).ok for k, v in data)
        with ClusterClient(redis_url, transport="transfer_engine") as cluster:
            cluster.wait_for_nodes(1, timeout_s=10)
            assert cluster.get_blocks([k for k, _ in data]) == [v for _, v in data]
            assert set(cluster.paths.values()) == {"transfer_engine"}, cluster.paths
        got = scrape_released(served.metrics_url, "remote", None)
        assert value(got, "kvstore_dataplane_op_seconds_count", plane="remote", op="lease") >= 1
        assert value(got, "kvstore_leases", plane="remote") == 0      # released after the read
    finally:
        served.stop(grace_s=0)


def test_a_node_reports_its_lookup_hit_ratio_apart_from_its_read_success(node, tmp_path):
    """Ten reuse lookups of one block, four of them of blocks the node holds: a lookup hit
    ratio of 0.4 in Prometheus, ``kvctl tiers`` and ``kvctl namespaces``; a decode
    instance's hand-off lookups and a router's probes change none of it (the hand-off is
    counted apart); the reads (four served, one missed) are their own ratio, 0.8."""
    from tests.helpers.kvctl_helpers import kvctl, kvctl_env
    address, url, pool = node
    held = blocks(4, seed=9)
    keys = [k for k, _ in held]
    with StoreClient(address, auth_token=TOKEN, data_path="grpc") as client:
        assert all(r.ok for r in client.put_blocks(held, chain=True, namespace="tenant-l"))
        found = [client.lookup([k]).blocks for k in keys + [os.urandom(32) for _ in range(6)]]
        assert found == [1] * 4 + [0] * 6
        assert client.lookup(keys, "handoff").blocks == 4 and client.lookup(keys, "probe").blocks == 4
        assert client.get_blocks(keys + [os.urandom(32)]) == [v for _, v in held] + [None]
    with StoreClient(address, auth_token=TOKEN) as same_host:    # the same-host control socket
        assert same_host.data_path_in_use == "same-host/uds" and same_host.lookup(keys, "handoff").blocks == 4
    got = scrape(url)
    assert value(got, "kvstore_lookup_hit_ratio") == 0.4
    assert value(got, "kvstore_read_success_ratio") == 0.8
    assert value(got, "kvstore_block_lookup_hits_total", tier="dram") == 4
    assert value(got, "kvstore_block_lookup_misses_total", tier="dram") == 6
    assert value(got, "kvstore_block_lookup_misses_total", tier="ssd") == 6    # not found anywhere
    assert value(got, "kvstore_block_handoff_lookups_total", tier="dram") == 8
    assert value(got, "kvstore_namespace_lookup_hits_total", namespace="tenant-l") == 4
    assert value(got, "kvstore_namespace_lookup_misses_total", namespace="_unattributed") == 6  # no one's chain
    env = kvctl_env(tmp_path, token=TOKEN)
    rc, doc, _ = kvctl(env, "--store", address, "tiers")
    assert rc == 0 and doc["lookup_hit_ratio"] == 0.4 and doc["read_success_ratio"] == 0.8, doc
    rc, doc, _ = kvctl(env, "--store", address, "namespaces")
    (mine,) = [n for n in doc["nodes"][0]["namespaces"] if n["namespace"] == "tenant-l"]
    assert rc == 0 and mine["lookup_hit_ratio"] == 1.0 and mine["read_success_ratio"] == 1.0, mine
    rc, text, _ = kvctl(env, "--store", address, "tiers", json_out=False)
    assert "lookup hit ratio (reuse: blocks found / blocks looked up): 0.400" in text, text
