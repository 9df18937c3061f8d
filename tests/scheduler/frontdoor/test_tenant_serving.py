"""Per-tenant accounting and quotas on served traffic, end to end: two tenants (API
keys) send prompts through the real HTTP front door to real prefill and decode engines of the
tiny model, over a real store node process (``kvstore serve``, the engines on its same-host
data path); ``kvctl namespaces --json`` shows each tenant's blocks, bytes and hits, and a quota
set with ``kvctl quota set`` on one tenant is enforced on its served traffic: its own blocks
are evicted, the other tenant's are untouched and its requests keep hitting the pool. The
engines keep no local cache here, so every hit is a read of the pool, and the front door's
policy is ``least_loaded``, which fetches every pool hit (the Conductor may rather recompute a
short prefix of the tiny model than fetch it, which would make a hit a matter of timing)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines.server import start_engine
from kvstore.client import StoreClient
from scheduler.config import FrontdoorConfig
from scheduler.frontdoor.app import start_frontdoor
from scheduler.routing.tenancy import namespace_from_authorization, prompt_keys
from tests.helpers.frontdoor_cluster import BS, LoopThread, complete, prompt_of
from tests.helpers.kvctl_helpers import TOKEN, kvctl, kvctl_env

A = {"Authorization": "Bearer serving-tenant-a"}
B = {"Authorization": "Bearer serving-tenant-b"}
NS_A, NS_B = (namespace_from_authorization(h["Authorization"]) for h in (A, B))
PROMPT_BLOCKS = 3


class Served:
    """A store node process, one prefill and one decode engine (no local cache) and a front
    door, on 127.0.0.1."""

    def __init__(self, spawn: Any, tmp: Path) -> None:
        _, self.store = spawn("tenant-node", "--dram", "16MiB", "--ssd", "0", "--auth-token", TOKEN,
                              "--transfer-engine", "off")
        self.servers = []
        addresses = []
        for role in ("prefill", "decode"):
            server, port = start_engine(role, self.store, block_size=BS, engine_id=f"{role}-t", store_token=TOKEN,
                                        local_cache_blocks=0)
            self.servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        self.loop = LoopThread()
        self.door = self.loop.run(start_frontdoor([addresses[0]], [addresses[1]], self.store,
                                                  config=FrontdoorConfig(store_auth_token=TOKEN,
                                                                         policy="least_loaded")), timeout=120)
        self.env = kvctl_env(tmp)
        self.client = StoreClient(self.store, auth_token=TOKEN, data_path="grpc")

    def ask(self, prompt: list[int], headers: dict[str, str]) -> int:
        """Serve one prompt for a tenant; the prompt tokens it found cached."""
        answer = complete(self.door.url, {"prompt": prompt, "max_tokens": 2}, headers)
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    def namespaces(self) -> dict[str, dict[str, Any]]:
        rc, doc, err = kvctl(self.env, "--store", self.store, "namespaces")
        assert rc == 0, err
        return {n["namespace"]: n for n in doc["nodes"][0]["namespaces"]}

    def held(self, keys: list[bytes]) -> int:
        return self.client.lookup(keys).blocks

    def close(self) -> None:
        self.client.close()
        self.loop.run(self.door.stop())
        self.loop.close()
        for server in self.servers:
            server.stop(None).wait()


@pytest.fixture
def served(spawn_store_node: Any, tmp_path: Path) -> Iterator[Served]:
    s = Served(spawn_store_node, tmp_path)
    yield s
    s.close()


def test_served_traffic_is_accounted_per_tenant_and_a_quota_holds_one_tenant_only(served: Served) -> None:
    info = served.door.frontdoor.router.info
    n = PROMPT_BLOCKS * BS + 5
    pa, pb = prompt_of(101, n), prompt_of(202, n)
    keys_a, keys_b = prompt_keys(pa, info, NS_A), prompt_keys(pb, info, NS_B)
    assert served.ask(pa, A) == 0 and served.ask(pb, B) == 0
    assert served.ask(pa, A) == PROMPT_BLOCKS * BS and served.ask(pb, B) == PROMPT_BLOCKS * BS

    by = served.namespaces()
    a, b = by[NS_A], by[NS_B]
    assert (a["blocks"], b["blocks"]) == (PROMPT_BLOCKS, PROMPT_BLOCKS), by
    block_bytes = a["bytes"] // PROMPT_BLOCKS
    assert block_bytes > 0 and a["bytes"] == b["bytes"] == PROMPT_BLOCKS * block_bytes
    assert a["hits"] >= PROMPT_BLOCKS and b["hits"] >= PROMPT_BLOCKS   # the repeats read the pool
    assert "" not in by, "served blocks were put (or looked up) without their tenant"
    # the prefill engine's reuse lookups name the tenant: each cold prompt missed its blocks,
    # each repeat found them
    assert (a["lookup_hits"], a["lookup_misses"]) == (b["lookup_hits"], b["lookup_misses"]) == (
        PROMPT_BLOCKS, PROMPT_BLOCKS), by

    quota = PROMPT_BLOCKS * block_bytes
    rc, _, err = kvctl(served.env, "--store", served.store, "quota", "set", "--namespace", NS_A,
                       "--bytes", str(quota))
    assert rc == 0, err
    more = [prompt_of(300 + i, n) for i in range(3)]
    for p in more:                       # A keeps going: 9 more blocks under a quota of 3
        assert served.ask(p, A) == 0
        assert served.namespaces()[NS_A]["bytes"] <= quota
    by = served.namespaces()
    a, b = by[NS_A], by[NS_B]
    assert a["quota_bytes"] == quota and a["bytes"] <= quota and a["evictions"] >= 3 * PROMPT_BLOCKS
    assert served.held(prompt_keys(more[-1], info, NS_A)) == PROMPT_BLOCKS   # the newest stay
    assert served.held(keys_a) == 0                                          # the oldest went
    assert (b["blocks"], b["bytes"], b["evictions"]) == (PROMPT_BLOCKS, quota, 0)
    assert served.held(keys_b) == PROMPT_BLOCKS
    hits_b = b["hits"]
    assert served.ask(pb, B) == PROMPT_BLOCKS * BS                           # B keeps hitting the pool
    assert served.namespaces()[NS_B]["hits"] > hits_b
