"""The live router's view of who holds which blocks comes from the store's own index over KV
events (scheduler/routing/cache_index.py), not a guess: a real store node process and real prefill
engines (the tiny model) publish to a real Redis; the router's IndexReplica reads them, gives
per-instance and per-tier hits, and heals a lost event from the engine's Snapshot RPC."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import redis

from engines.server import start_engine
from kvstore.events.channel import DEFAULT_STREAM
from kvstore.events.event import EventKind, KVEvent
from scheduler.policy.views import TierHit
from scheduler.routing.cache_index import split_hits, start_replica
from scheduler.routing.router import RoutePlan, Router

BS = 16
PROMPT = list(range(1, 6 * BS + 4))       # 6 full blocks and a tail


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def wait_until(cond: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture
def stack(redis_url, spawn_store_node):
    """A store node process publishing to Redis, two prefill engines publishing their own
    caches there, one decode engine."""
    _, store = spawn_store_node("store-0", "--redis", redis_url, "--transfer-engine", "off", "--dram", "64MiB",
                                "--ssd", "0")
    servers, addresses = [], {}
    for role, engine_id in (("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0")):
        server, port = start_engine(role, store, block_size=BS, engine_id=engine_id, kv_events=redis_url,
                                    local_cache_blocks=64)
        servers.append(server)
        addresses[engine_id] = f"127.0.0.1:{port}"
    yield store, addresses, redis_url
    for server in servers:
        server.stop(grace=None).wait()


async def _connect(addresses: dict[str, str], store: str | None, url: str) -> Router:
    """The router over the stack's engines, its replica fed by their and the node's KV events."""
    return await Router.connect([addresses["prefill-0"], addresses["prefill-1"]], [addresses["decode-0"]],
                                store, kv_events=url)


async def _prefill_through(router: Router, engine_id: str) -> list[bytes]:
    """Prefill the prompt on ``engine_id``; its block keys."""
    keys = router.prompt_keys(PROMPT, "public")
    await router.prefill[engine_id].client.prefill("r0", PROMPT, "public")
    assert len(keys) == 6
    return keys


def test_hits_per_instance_and_per_tier_come_from_the_kv_events(stack):
    store, addresses, url = stack

    async def main() -> None:
        router = await _connect(addresses, store, url)
        try:
            keys = router.prompt_keys(PROMPT, "public")
            assert router.cluster_view(keys).pool_hit == TierHit()     # nothing cached anywhere yet
            await _prefill_through(router, "prefill-0")
            # The engine's own cache (hbm) and the store node's DRAM, each from its events.
            def both_hit() -> bool:
                view = router.cluster_view(keys)
                return view.prefill[0].hit.blocks == 6 and view.pool_hit.blocks == 6
            assert await asyncio.to_thread(wait_until, both_hit)
            view = router.cluster_view(keys)
            assert [(v.instance_id, v.hit) for v in view.prefill] == [
                ("prefill-0", TierHit(6, (("hbm", 6),))), ("prefill-1", TierHit())]
            assert view.pool_hit == TierHit(6, (("dram", 6),))
            # The decision follows: the instance holding the prompt, no pool lookup RPC.
            plan = await router.plan("r1", PROMPT, "public")
            assert isinstance(plan, RoutePlan) and plan.prefill_id == "prefill-0"
            assert plan.decision.cached_tokens == 6 * BS and plan.decision.fetch is None
            # Another tenant's keys differ: it sees no hit on either holder.
            other = router.cluster_view(router.prompt_keys(PROMPT, "key-0123456789abcdef"))
            assert other.pool_hit == TierHit() and all(v.hit == TierHit() for v in other.prefill)
            stats = router.replica.stats()
            assert stats.events > 0 and stats.gaps == 0
        finally:
            await router.close()
    run(main())


def test_a_lost_event_is_healed_from_the_engines_snapshot(stack):
    store, addresses, url = stack

    async def main() -> None:
        router = await _connect(addresses, store, url)
        try:
            keys = await _prefill_through(router, "prefill-0")
            assert await asyncio.to_thread(wait_until, lambda: router.cluster_view(keys).prefill[0].hit.blocks == 6)
        finally:
            await router.close()
        # Lose one of prefill-0's BlockStored events from the stream: a replica that starts
        # now reads a sequence gap for that node.
        client = redis.Redis.from_url(url)
        stored = [entry_id for entry_id, fields in client.xrange(DEFAULT_STREAM)
                  if (e := KVEvent.from_fields(fields)).node == "prefill-0" and e.kind is EventKind.BLOCK_STORED]
        assert len(stored) == 6
        client.xdel(DEFAULT_STREAM, stored[2])
        client.close()
        replica = start_replica(url, {"prefill-0": addresses["prefill-0"], "prefill-1": addresses["prefill-1"]},
                                None, lambda node: store, None)
        try:
            # the resync heals prefill-0's gap; the store node's events are another publisher's,
            # applied in their own place in the stream (maybe after the gap), so wait for both
            def healed() -> bool:
                return replica.stats().resyncs >= 1 and replica.hits(keys).get("store-0") == 6
            assert await asyncio.to_thread(wait_until, healed)
            own, pool = split_hits(replica.match(keys), ("prefill-0", "prefill-1"))
            assert own == {"prefill-0": TierHit(6, (("hbm", 6),))}      # the lost block is back
            assert pool == TierHit(6, (("dram", 6),))
            assert replica.stats().gaps >= 1
        finally:
            replica.stop()
    run(main())


def test_a_fetched_prefix_stays_on_the_instance_that_fetched_it(stack):
    """Hot-prefix replication: the second instance loads the prefix from the pool and keeps
    it; its own events then show both instances holding it (no guess by the router)."""
    store, addresses, url = stack

    async def main() -> None:
        router = await _connect(addresses, store, url)
        try:
            first = await router.prefill["prefill-0"].client.prefill("a", PROMPT, "public")
            second = await router.prefill["prefill-1"].client.prefill("b", PROMPT, "public")
            assert first.cached_tokens == 0 and second.cached_tokens == 6 * BS
            keys = router.prompt_keys(PROMPT, "public")
            def both_hold() -> bool:     # each engine publishes its own events, in no set order
                hits = router.replica.hits(keys)
                return hits.get("prefill-0") == 6 and hits.get("prefill-1") == 6
            assert await asyncio.to_thread(wait_until, both_hold)
            view = router.cluster_view(keys)
            assert [v.hit for v in view.prefill] == [TierHit(6, (("hbm", 6),))] * 2
        finally:
            await router.close()
    run(main())


def test_a_front_door_without_a_store_plans_no_pool_hit_from_a_store_nodes_events(stack):
    """``kvstore scheduler --no-store`` beside a cluster whose nodes publish KV events: the
    instances' own caches still guide the routing, but a block only a store node holds is no
    hit, since this front door has no pool to load it from."""
    _, addresses, url = stack

    async def main() -> None:
        router = await _connect(addresses, None, url)
        try:
            keys = await _prefill_through(router, "prefill-0")
            # the store node's DRAM holds the prompt too (the engine saved it there); the node's
            # and the engine's events are separate publishers, so wait for both
            def both_seen() -> bool:
                hits = router.replica.hits(keys)
                return hits.get("store-0") == 6 and hits.get("prefill-0") == 6
            assert await asyncio.to_thread(wait_until, both_seen)
            view = router.cluster_view(keys)
            assert [v.hit for v in view.prefill] == [TierHit(6, (("hbm", 6),)), TierHit()]
            assert view.pool_hit == TierHit()
            plan = await router.plan("r1", PROMPT, "public")
            assert isinstance(plan, RoutePlan) and plan.prefill_id == "prefill-0"
            assert plan.decision.cached_tokens == 6 * BS and plan.decision.fetch is None
        finally:
            await router.close()
    run(main())
