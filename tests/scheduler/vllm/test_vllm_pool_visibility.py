"""The pool seen from outside a vLLM instance, on one real ``vllm serve`` (kv_both, its own
prefix cache off, KV events on a private ipc socket, its connector in cluster mode: the store
node in this process, registered in a private Redis and publishing its KV events there, as
``kvstore serve --redis``): the connector's KV events in the router's index
(engines/vllm/connector_events.py → scheduler/vllm/pool_events.py), the store node's KV events
in the front door's replica through Redis (scheduler/vllm/router.py), and the connector's
figures in vLLM's ``/metrics`` (engines/vllm/connector_metrics.py)."""
from __future__ import annotations

import asyncio
import os
import tempfile
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

from engines.vllm.launch import VLLMServerSpec, ipc_endpoints, start_servers  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402

pytestmark = pytest.mark.slow
BLOCK_BYTES = 2 * 2 * 2 * 32 * 64 * 4     # the tiny checkpoint: 2 layers × K,V × 2 heads × 32 tokens × 64 × fp32


@pytest.fixture(scope="module")
def cluster_node(tmp_path_factory, redis_server):
    """(store node, Redis URL): a store node in this process in cluster mode, a 256 MiB DRAM
    tier, registered in the session's Redis and publishing its KV events there."""
    from kvstore.config import StoreConfig
    from kvstore.node import StoreNode
    cfg = StoreConfig(node_id="pool-n1", port=0, dram_bytes=256 << 20, ssd_bytes=0, high_watermark=1.0,
                      low_watermark=1.0, data_dir=str(tmp_path_factory.mktemp("node")), redis_url=redis_server)
    node = StoreNode.start(cfg)
    try:
        yield node, redis_server
    finally:
        node.stop(grace_s=None)


@pytest.fixture(scope="module")
def served(tmp_path_factory, cluster_node):
    """(server, model, endpoints, pool, model_dir): one vLLM server for the module's tests,
    its connector on :func:`cluster_node`'s cluster."""
    from engines.vllm.checkpoint import write_checkpoint
    from scheduler.vllm.instances import VLLMModel
    node, redis = cluster_node
    tmp = tmp_path_factory.mktemp("visible")
    model_dir = write_checkpoint(str(tmp / "tiny-llama"), "tiny", max_model_len=2048)
    events_dir = tempfile.mkdtemp(prefix="kvev-", dir="/tmp")     # ours alone (0700): events carry tokens
    endpoints = ipc_endpoints(events_dir, "c0")
    spec = VLLMServerSpec(model_dir, free_port(), "kv_both", redis=redis, kv_cache_bytes=32 << 20,
                          max_model_len=2048, kv_events=endpoints)
    (server,) = start_servers([spec], tmp / "logs", ["c0"], timeout_s=400)
    try:
        yield server, VLLMModel.from_dir(model_dir), endpoints, node.pool, model_dir
    finally:
        server.stop(grace_s=10)
        for name in os.listdir(events_dir):
            os.unlink(os.path.join(events_dir, name))
        os.rmdir(events_dir)


def prompt_of(model, seed: int, n: int) -> list[int]:
    return [(i * 37 + seed * 101) % (model.vocab_size - 5) + 5 for i in range(n)]


async def until(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.1)


def test_blocks_the_pool_stores_for_an_instance_are_in_the_routers_index_by_tier_and_a_lost_one_leaves(served):
    """Without a store of its own, the router sees the pool through the connector's events
    alone: after one prompt, its 3 full blocks on the instance's pool node in ``dram`` (the
    pool's hit, by tier, for every instance); once the pool lost the first one, the next
    lookup of the prompt tells the router (the block is then stored again)."""
    from scheduler.vllm.pool_events import pool_node
    from scheduler.vllm.router import connect_vllm
    server, model, endpoints, pool, _ = served
    prompt = prompt_of(model, 1, 100)                 # 3 full blocks of 32 tokens and 4 more

    async def run() -> dict:
        router = await connect_vllm(model, (), (), None, topology="colocated", colocated_urls=[server.url],
                                    kv_events=[",".join(endpoints)])
        try:
            (engine_id,) = router.prefill
            (bridge,) = router.bridges
            keys = router.prompt_keys(prompt, "alice")
            node = pool_node(engine_id)

            def pool_tiers() -> tuple[str, ...]:
                return router.replica.match(keys).per_node.get(node, ())
            out: dict = {"before": router.cluster_view(keys).pool_hit.blocks}
            await router.prefill[engine_id].client.prefill("r1", prompt, "alice")
            out["tiers"] = await until(lambda: pool_tiers() == ("dram",) * 3)
            out["tiers"] = pool_tiers()
            out["view"] = router.cluster_view(keys).pool_hit
            out["own"] = router.cluster_view(keys).prefill[0].hit.blocks
            out["bob"] = router.replica.match(router.prompt_keys(prompt, "bob")).per_node.get(node, ())
            for key in keys[:1]:
                pool.remove(key)                      # the pool evicts the prompt's first block
            result = await router.prefill[engine_id].client.prefill("r2", prompt, "alice")
            out["cached"] = result.cached_tokens
            # the bridge counts a store once the replica applied it: wait for the count too
            await until(lambda: bridge.stats.removed >= 1 and pool_tiers() == ("dram",) * 3
                        and bridge.stats.stored >= 4)
            out["removed"], out["stored"], out["bad"] = bridge.stats.removed, bridge.stats.stored, bridge.stats.bad
            out["again"] = pool_tiers()
            return out
        finally:
            await router.close()

    out = asyncio.run(run())
    assert out["before"] == 0
    assert out["tiers"] == ("dram",) * 3, out
    assert out["view"].blocks == 3 and out["view"].by_tier == (("dram", 3),)
    assert out["own"] == 0                    # the pool's blocks are not the instance's own cache
    assert out["bob"] == ()                   # another tenant's keys
    assert out["cached"] == 0                 # the first block was gone: nothing loaded
    assert out["removed"] == 1 and out["stored"] == 4 and out["bad"] == 0, out
    assert out["again"] == ("dram",) * 3


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(metrics: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= ls)


def test_after_a_pool_hit_vllms_metrics_show_the_connectors_figures_and_the_pool_as_the_source(served):
    server, model, _, pool, _ = served
    from engines.vllm.launch import SERVED_MODEL_NAME
    from scheduler.vllm.instances import VLLMClient
    first = prompt_of(model, 2, 3 * 32 + 4)
    second = first[:96] + prompt_of(model, 3, 9)
    keys = model.keys(first, "carol")

    async def run() -> int:
        client = VLLMClient(server.url, "colocated", model, "c0")
        try:
            await client.prefill("m1", first, "carol")
            await until(lambda: pool.lookup(keys)[0] == 3, 10)   # kv_both saves beside the next steps
            return (await client.prefill("m2", second, "carol")).cached_tokens
        finally:
            await client.close()

    before = scrape(server.url)
    cached = asyncio.run(run())
    assert cached == 96
    name = {"model_name": SERVED_MODEL_NAME}

    def grew(metric: str, by: float, **labels: str) -> bool:
        return value(scrape(server.url), metric, **name, **labels) - value(before, metric, **name, **labels) == by

    deadline = time.monotonic() + 30          # vLLM's API server records the engine's stats as they come
    while not grew("vllm:kvstore_hit_tokens_total", 96, tier="dram") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert grew("vllm:kvstore_hit_tokens_total", 96, tier="dram")
    assert grew("vllm:kvstore_hit_blocks_total", 3, tier="dram")
    assert grew("vllm:kvstore_load_bytes_total", 3 * BLOCK_BYTES)
    assert grew("vllm:kvstore_load_seconds_count", 1)
    assert grew("vllm:prompt_tokens_cached_by_source_total", 96, source="host")   # the pool's DRAM: vLLM's "host"
    assert grew("vllm:external_prefix_cache_hits_total", 96)
    after = scrape(server.url)
    assert value(after, "vllm:kvstore_save_bytes_total", **name) - value(before, "vllm:kvstore_save_bytes_total",
                                                                          **name) >= 3 * BLOCK_BYTES
    assert value(after, "vllm:kvstore_load_errors_total", **name) == value(before, "vllm:kvstore_load_errors_total",
                                                                           **name)


def test_over_a_cluster_the_front_doors_pool_hits_come_from_the_nodes_kv_events_with_no_lookup(served, cluster_node):
    """The front door over vLLM given the cluster's Redis (``--redis``, hence ``--kv-events``)
    keeps a replica of the store node's index from its KV events there: once the instance's
    connector saved a prompt's 3 blocks onto the node, the prompt's plan books them as the
    pool's hit in ``dram`` with no ``Lookup`` from the router; once the node drops the first
    block, its ``BlockRemoved`` makes the prompt a pool miss, though the connector's own view
    of the pool (``<engine id>/pool``, told of a loss only when a request asks again) still
    holds the block. A gap on that node (one the bridges feed, which has no snapshot) drops
    it: a failed resync, no store node asked for it."""
    from kvstore.events.event import EventKind, KVEvent
    from scheduler.config import FrontdoorConfig
    from scheduler.vllm.app import start_vllm_frontdoor
    from scheduler.vllm.pool_events import pool_node
    server, model, endpoints, pool, model_dir = served
    node, redis = cluster_node
    prompt = prompt_of(model, 4, 100)                 # 3 full blocks of 32 tokens and 4 more

    async def run() -> dict:
        door = await start_vllm_frontdoor(model_dir, config=FrontdoorConfig(model_dir=model_dir, kv_events=redis),
                                          topology="colocated", colocated_urls=[server.url], store_redis=redis,
                                          kv_events=[",".join(endpoints)])
        router = door.frontdoor.router
        lookups: list[int] = []
        real_lookup = router.store.lookup

        def counted(keys, *args, **kw):               # each Lookup the router sends, counted on its way out
            lookups.append(len(keys))
            return real_lookup(keys, *args, **kw)
        router.store.lookup = counted
        try:
            (engine_id,) = router.prefill
            keys = router.prompt_keys(prompt, "dora")
            held = node.pool.node_id

            def tiers(n: str) -> tuple[str, ...]:
                return router.replica.match(keys).per_node.get(n, ())
            out: dict = {"before": (await router.plan("q0", prompt, "dora")).pool_hit}
            await router.prefill[engine_id].client.prefill("r1", prompt, "dora")
            out["node"] = await until(lambda: tiers(held) == ("dram",) * 3, 20) and tiers(held)
            # the connector's own view of the pool comes from vLLM's engine process, on its own path
            out["connector_saved"] = await until(lambda: tiers(pool_node(engine_id)) == ("dram",) * 3, 20)
            out["hit"] = (await router.plan("q1", prompt, "dora")).pool_hit
            out["lookups"] = list(lookups)
            pool.remove(keys[0])                      # the node drops the prompt's first block
            out["gone"] = await until(lambda: tiers(held) == (), 20)
            out["miss"] = (await router.plan("q2", prompt, "dora")).pool_hit
            out["connector"] = tiers(pool_node(engine_id))
            # a gap on a node the bridges feed: there is no snapshot of it, so it is dropped (no RPC is tried)
            failed, st = router.replica.stats().resync_failures, router.replica.node_state(pool_node(engine_id))
            router.replica.apply(KVEvent(pool_node(engine_id), st.epoch, st.seq + 2, EventKind.BLOCK_STORED,
                                         keys[0], "dram", 1, time.time()))
            out["gap"] = router.replica.stats().resync_failures - failed, tiers(pool_node(engine_id))
            out["lookups_after"] = list(lookups)
            page = await asyncio.to_thread(scrape, door.url)      # the front door serves in this loop
            out["replica_events"] = value(page, "kvstore_scheduler_kv_index_replica", what="events")
            return out
        finally:
            await door.stop()

    out = asyncio.run(run())
    assert out["before"].blocks == 0
    assert out["node"] == ("dram",) * 3, out
    assert out["hit"].blocks == 3 and out["hit"].by_tier == (("dram", 3),), out
    assert out["lookups"] == [] and out["lookups_after"] == [], out     # no Lookup RPC: the replica answered
    assert out["gone"], out
    assert out["miss"].blocks == 0, out
    assert out["connector_saved"], out
    assert out["connector"] == ("dram",) * 3, out     # kept, but no hit is taken from it
    assert out["gap"] == (1, ()), out
    assert out["replica_events"] >= 3 + 1, out        # the node's stores and removal, in the front door's metrics
