"""Tenant isolation through the real HTTP front door: the
namespace in every block key comes from ``Authorization: Bearer``, so tenant B never hits
tenant A's blocks, whatever B writes in the request body. A real store node (whose index
publishes KV events to a replica), real prefill and decode engines (the tiny model) and a
real aiohttp front door, all on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from engines.server import start_engine
from kvstore.events import IndexReplica, LocalEventChannel, PublishingIndex
from kvstore.pool.pool import KVPool
from kvstore.service import serve_store
from kvstore.tiers import TIERS
from scheduler.frontdoor.app import start_frontdoor
from scheduler.routing.tenancy import namespace_from_authorization, prompt_keys

BS = 16
A = {"Authorization": "Bearer tenant-a-secret"}
B = {"Authorization": "Bearer tenant-b-secret"}


class Stack:
    """A store node (its index publishing to an in-process channel read by a replica), one
    prefill and one decode engine, and a front door in an event loop thread."""

    def __init__(self) -> None:
        self.channel = LocalEventChannel()
        self.index = PublishingIndex("store-0", self.channel)
        self.pool = KVPool([TIERS["dram"](32 << 20)], node_id="store-0", index=self.index)
        self.store_server, port = serve_store(self.pool)
        self.store = f"127.0.0.1:{port}"
        started = [start_engine(role, self.store, block_size=BS, engine_id=f"{role}-0")
                   for role in ("prefill", "decode")]
        self.engines = [server for server, _ in started]
        prefill, decode = (f"127.0.0.1:{engine_port}" for _, engine_port in started)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.door = self._run(start_frontdoor([prefill], [decode], self.store))
        self.replica = IndexReplica(self.channel).start()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    def close(self) -> None:
        self.replica.stop()
        self._run(self.door.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        for server in self.engines:
            server.stop(None).wait()
        self.store_server.stop(None).wait()
        self.index.close()
        self.pool.close()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack()
    yield s
    s.close()


def complete(stack: Stack, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    req = urllib.request.Request(stack.door.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenant_b_never_hits_tenant_a_blocks(stack: Stack) -> None:
    prompt = [(7 * i + 3) % 500 + 3 for i in range(3 * BS + 5)]     # 3 full blocks + a tail
    info = stack.door.frontdoor.router.info
    ns_a, ns_b = namespace_from_authorization(A["Authorization"]), namespace_from_authorization(B["Authorization"])
    keys_a, keys_b = prompt_keys(prompt, info, ns_a), prompt_keys(prompt, info, ns_b)
    assert len(keys_a) == 3 and not set(keys_a) & set(keys_b)

    first = complete(stack, {"prompt": prompt, "max_tokens": 2}, A)
    assert cached(first) == 0
    assert stack.pool.lookup(keys_a)[0] == 3            # A's 3 blocks, one chain, in the pool
    assert stack.replica.wait_for("store-0", stack.index.seq)
    assert stack.replica.hits(keys_a) == {"store-0": 3} and stack.replica.hits(keys_b) == {}

    # B, same tokens: a miss; also with A's namespace (or anything else) in the body. Each
    # variant is a fresh tenant B_i: B's own second request would hit B's own blocks.
    for i, body_extra in enumerate(({}, {"namespace": ns_a}, {"user": ns_a, "tenant": ns_a},
                                    {"extra_body": {"namespace": ns_a}})):
        b_i = {"Authorization": f"{B['Authorization']}-{i}"}
        answer = complete(stack, {"prompt": prompt, "max_tokens": 2, **body_extra}, b_i)
        assert cached(answer) == 0, body_extra
        assert answer["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    # vLLM's namespace field, A's namespace in it: refused, nothing served
    with pytest.raises(urllib.error.HTTPError) as refused:
        complete(stack, {"prompt": prompt, "max_tokens": 2, "cache_salt": ns_a}, {"Authorization": "Bearer b-salt"})
    assert refused.value.code == 400 and json.loads(refused.value.read())["error"]["param"] == "cache_salt"
    # No credentials at all, A's namespace in the body: the public tenant, a miss.
    assert cached(complete(stack, {"prompt": prompt, "max_tokens": 2, "namespace": ns_a}, {})) == 0
    # B's own blocks were stored under B's keys, never A's; B's repeat hits B's own.
    b_0 = {"Authorization": f"{B['Authorization']}-0"}
    keys_b0 = prompt_keys(prompt, info, namespace_from_authorization(b_0["Authorization"]))
    assert stack.pool.lookup(keys_b0)[0] == 3 and stack.pool.lookup(keys_b)[0] == 0
    assert cached(complete(stack, {"prompt": prompt, "max_tokens": 2, "namespace": ns_a}, b_0)) == 3 * BS

    again = complete(stack, {"prompt": prompt, "max_tokens": 2}, A)
    assert cached(again) == 3 * BS                       # A's repeated request hits
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_a_prefix_shared_inside_one_tenant_hits(stack: Stack) -> None:
    """Two prompts of tenant A sharing 2 blocks: the second reuses them; for B, nothing."""
    head = [(11 * i + 5) % 500 + 3 for i in range(2 * BS)]
    complete(stack, {"prompt": head + [9] * (BS + 3), "max_tokens": 1}, A)
    assert cached(complete(stack, {"prompt": head + [10] * (BS + 3), "max_tokens": 1}, A)) == 2 * BS
    assert cached(complete(stack, {"prompt": head + [10] * (BS + 3), "max_tokens": 1}, B)) == 0
