"""Supervision in the front door, over real engines, a real store node and a real HTTP
server on 127.0.0.1: health checks take a dead engine out of routing and put it back when it
answers again; /health is 503 with the reason, saying degraded (still serving) or
unavailable; a request whose prefill engine fails moves to another one before anything is sent, one whose decode engine
dies mid-stream resumes on another with the same tokens; with nothing left, a clean 503."""
from __future__ import annotations

import json
import time

import pytest

from engines.client import engine_snapshot
from engines.server import default_engine_id, start_engine
from scheduler.config import FrontdoorConfig
from tests.helpers.frontdoor_cluster import BS, Cluster, call, prompt_of, sse_events

FAST = FrontdoorConfig(health_interval_s=0.2)


@pytest.fixture()
def cluster(tmp_path):
    c = Cluster(str(tmp_path))
    yield c
    c.close()


def health(url: str) -> tuple[int, dict]:
    status, _, data = call(url, "/health")
    return status, json.loads(data)


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_dead_prefill_engine_is_routed_around_and_comes_back(cluster):
    second = cluster.engine("prefill", None)       # no --engine-id: named after its host and port
    port = int(second.rsplit(":", 1)[1])
    name = default_engine_id("prefill", port)
    door = cluster.start(FAST, prefill=[cluster.prefill, second])
    assert name in door.frontdoor.router.prefill
    assert health(door.url)[1]["status"] == "ok"
    cluster.servers.pop().stop(None).wait()                       # it dies
    # Requests keep succeeding: a prefill routed to the dead engine moves to prefill-0.
    for seed in range(6):
        status, _, data = call(door.url, "/v1/completions", {"prompt": prompt_of(40 + seed, 2 * BS + 1),
                                                             "max_tokens": 3})
        assert status == 200, data
    wait_for(lambda: health(door.url)[1]["status"] == "degraded")
    status, body = health(door.url)        # 503 with the reason, though requests are still served
    assert status == 503 and any(name in r for r in body["reasons"])
    assert name in door.frontdoor.router.down
    server, _ = start_engine("prefill", cluster.store, block_size=BS,
                             address=f"127.0.0.1:{port}")             # it comes back on its port, as itself
    cluster.servers.append(server)
    assert engine_snapshot(second).node == name                  # the same id as its first life
    wait_for(lambda: health(door.url)[1]["status"] == "ok", 15)
    assert door.frontdoor.router.down == {}
    status, _, data = call(door.url, "/v1/completions", {"prompt": prompt_of(50, 2 * BS + 1), "max_tokens": 3})
    assert status == 200, data


def test_a_failed_prefill_moves_to_another_instance_before_anything_is_sent(cluster):
    second = cluster.engine("prefill", "prefill-1")
    door = cluster.start(FrontdoorConfig(health_interval_s=60), prefill=[second, cluster.prefill])
    wait_for(lambda: door.frontdoor.health_checks.rounds >= 1)       # the next one in 60 s
    cluster.servers.pop().stop(None).wait()       # dead, and no health check has seen it yet
    router = door.frontdoor.router
    for seed in range(4):
        status, _, data = call(door.url, "/v1/completions", {"prompt": prompt_of(50 + seed, BS + 3),
                                                             "max_tokens": 2, "stream": True})
        assert status == 200 and sse_events(data)[-1]["choices"][0]["finish_reason"] == "length", data
    wait_for(lambda: router.inflight == 0)          # the last handler ends just after its reply
    assert "prefill-1" in router.down
    assert all(not inst.backlog for inst in router.prefill.values())
    _, _, metrics = call(door.url, "/metrics")
    assert 'kvstore_scheduler_requests_moved_total{role="prefill"}' in metrics.decode()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_p": 0.9, "seed": 5}], ids=["greedy", "seeded"])
def test_a_decode_engine_dying_mid_stream_resumes_on_another_with_the_same_tokens(cluster, sampling):
    second = cluster.engine("decode", "decode-1")
    door = cluster.start(FrontdoorConfig(health_interval_s=60))
    reference_door = cluster.start(FrontdoorConfig(health_interval_s=60))
    wait_for(lambda: door.frontdoor.health_checks.rounds >= 1)       # the next one in 60 s
    # Only decode-1 in routing for the request, decode-0 out until the health check (60 s).
    from engines.client import EngineClient
    router = door.frontdoor.router

    async def add_decode() -> None:
        from scheduler.routing.router import DecodeInstance
        client = EngineClient(second)
        router.decode["decode-1"] = DecodeInstance(client, await client.info())

    cluster.loop.run(add_decode())
    router.mark_down("decode-0", "kept out by the test")
    prompt = {"prompt": prompt_of(60, 2 * BS + 5), "max_tokens": 200, "ignore_eos": True, "stream": True,
              **sampling}
    import http.client
    host, port = door.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(prompt), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    lines = [resp.readline() for _ in range(20)]                       # 10 tokens streamed
    router.mark_up("decode-0")
    cluster.servers.pop().stop(None).wait()                            # decode-1 dies mid-stream
    data = b"".join(lines) + resp.read()
    conn.close()
    events = sse_events(data)
    tokens = [t for e in events for t in e["choices"][0].get("token_ids", [])]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and "error" not in events[-1]
    status, _, whole = call(reference_door.url, "/v1/completions", {**prompt, "stream": False})
    assert status == 200 and tokens == json.loads(whole)["choices"][0]["token_ids"]
    assert len(tokens) == 200
    assert "decode-1" in router.down                                   # seen failing by the request
    _, _, metrics = call(door.url, "/metrics")
    assert 'kvstore_scheduler_requests_moved_total{role="decode"} 1.0' in metrics.decode()
    assert "kvstore_scheduler_resumed_streams_total 1.0" in metrics.decode()


def test_nothing_left_to_serve_is_a_clean_503_and_health_says_unavailable(cluster):
    door = cluster.start(FAST)
    cluster.servers.pop().stop(None).wait()                            # the only decode engine
    status, _, data = call(door.url, "/v1/completions", {"prompt": "hello there", "max_tokens": 4})
    body = json.loads(data)
    assert status == 503 and body["error"]["code"] == "engine_unavailable"
    assert "decode" in body["error"]["message"]
    wait_for(lambda: health(door.url)[0] == 503)
    status, body = health(door.url)
    assert body["status"] == "unavailable" and any("decode-0" in r for r in body["reasons"])
    status, headers, data = call(door.url, "/v1/completions", {"prompt": "hello again", "max_tokens": 4})
    assert status == 503 and headers.get("Retry-After") == "1"
    assert "no decode instance is up" in json.loads(data)["error"]["message"]
    # the outage shows in the metrics too (new-user review: 503s were in no series)
    _, _, metrics = call(door.url, "/metrics")
    text = metrics.decode()
    assert 'kvstore_scheduler_up{instance="decode-0",role="decode"} 0.0' in text
    assert 'kvstore_scheduler_up{instance="prefill-0",role="prefill"} 1.0' in text
    assert 'kvstore_scheduler_up{instance="store",role="store"} 1.0' in text
    assert 'kvstore_scheduler_http_responses_total{route="/v1/completions",status="503"} 2.0' in text
    assert 'kvstore_scheduler_http_responses_total{route="/health",status="503"}' in text


def test_a_store_node_that_is_down_is_503_with_the_reason_and_requests_are_still_served(cluster):
    door = cluster.start(FAST)
    assert health(door.url)[0] == 200
    cluster.store_server.stop(None).wait()                              # the pool goes away
    wait_for(lambda: health(door.url)[1]["status"] == "degraded", 15)
    status, body = health(door.url)
    assert status == 503 and any(r.startswith("store:") for r in body["reasons"])
    status, _, data = call(door.url, "/v1/completions", {"prompt": prompt_of(70, 2 * BS + 3), "max_tokens": 3})
    assert status == 200, data                                          # recomputed, not failed
    assert 'kvstore_scheduler_up{instance="store",role="store"} 0.0' in call(door.url, "/metrics")[2].decode()


def test_a_busy_engine_missing_one_check_stays_in_routing_but_one_silent_for_three_is_out(cluster):
    """A long prefill can hold an engine past one check's timeout; only ``misses_to_down``
    checks in a row without an answer take it out. The busy engine here is a real gRPC server
    whose Engine/Load handler does not answer until the test lets it."""
    import threading
    from concurrent import futures

    import grpc

    from engines.client import EngineClient
    from scheduler.routing.router import PrefillInstance
    from tests.helpers.busy_engine import busy_engine_handler
    door = cluster.start(FrontdoorConfig(health_interval_s=60))
    checks = door.frontdoor.health_checks
    wait_for(lambda: checks.rounds >= 1)                               # the next one in 60 s
    router = door.frontdoor.router
    release = threading.Event()
    busy = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    busy.add_generic_rpc_handlers((busy_engine_handler(release),))
    address = f"127.0.0.1:{busy.add_insecure_port('127.0.0.1:0')}"
    busy.start()
    try:
        info = next(iter(router.prefill.values())).info

        async def add_busy() -> None:        # the client's channel belongs to the door's loop
            router.prefill["prefill-busy"] = PrefillInstance(EngineClient(address), info)

        cluster.loop.run(add_busy())
        checks.timeout_s = 0.3
        for round_ in range(1, checks.misses_to_down):
            cluster.loop.run(checks.check_once())
            assert "prefill-busy" not in router.down, f"out after {round_} missed check(s)"
            assert checks.misses["prefill-busy"] == round_
        cluster.loop.run(checks.check_once())
        assert "prefill-busy" in router.down
        assert f"{checks.misses_to_down} checks in a row" in router.down["prefill-busy"]
        assert not any(e in router.down for e in router.prefill if e != "prefill-busy")
        release.set()                                                  # it answers again
        cluster.loop.run(checks.check_once())
        assert "prefill-busy" not in router.down and "prefill-busy" not in checks.misses
    finally:
        release.set()
        cluster.loop.run(router.prefill.pop("prefill-busy").client.close())
        busy.stop(None).wait()


def test_an_engine_failing_one_request_stays_in_routing_and_the_request_moves(cluster):
    """An engine whose handler raises for a request (gRPC UNKNOWN) is there: the request moves
    to another prefill instance, but the engine is not taken out of routing for every tenant
    (only one that is gone, UNAVAILABLE, is)."""
    from concurrent import futures

    import grpc

    from engines.client import EngineClient
    from scheduler.routing.router import PrefillInstance
    from tests.helpers.busy_engine import failing_engine_handler
    door = cluster.start(FrontdoorConfig(health_interval_s=60))
    wait_for(lambda: door.frontdoor.health_checks.rounds >= 1)       # the next one in 60 s
    router = door.frontdoor.router
    failures: list[str] = []
    bad = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    bad.add_generic_rpc_handlers((failing_engine_handler(failures),))
    address = f"127.0.0.1:{bad.add_insecure_port('127.0.0.1:0')}"
    bad.start()
    try:
        info = next(iter(router.prefill.values())).info

        async def add_bad() -> None:
            router.prefill["prefill-bad"] = PrefillInstance(EngineClient(address), info)

        cluster.loop.run(add_bad())
        router.mark_down("prefill-0", "kept out by the test")          # only prefill-bad routable
        status, _, data = call(door.url, "/v1/completions", {"prompt": prompt_of(70, BS + 2), "max_tokens": 2})
        assert status == 503 and "prefill-bad" in json.loads(data)["error"]["message"], data
        assert failures and "prefill-bad" not in router.down        # failed a request, still routable
        router.mark_up("prefill-0")
        for seed in range(4):                     # wherever the policy sends them, all are served
            status, _, data = call(door.url, "/v1/completions", {"prompt": prompt_of(71 + seed, BS + 2),
                                                                 "max_tokens": 2})
            assert status == 200, data
        assert "prefill-bad" not in router.down
    finally:
        cluster.loop.run(router.prefill.pop("prefill-bad").client.close())
        bad.stop(None).wait()
