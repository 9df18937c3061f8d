"""A request's life through the front door when things go wrong (real engines, store node
and HTTP server on 127.0.0.1, tests/helpers/frontdoor_cluster.py): a dead engine is a 503, a client
that disconnects cancels its decode, and 100 requests dropped mid-transfer leave nothing
held (no lease, no reservation, no request in flight)."""
from __future__ import annotations

import http.client
import json
import time

from engines.client import EngineClient
from tests.helpers.frontdoor_cluster import BS, call, cluster_fixture, complete, door_fixture, prompt_of, url_fixture  # noqa: F401  (cluster_fixture, door_fixture, url_fixture: fixtures)


def test_engine_failure_is_503(cluster):
    address = cluster.engine("prefill", "prefill-doomed")
    door = cluster.frontdoor(prefill=address)
    cluster.servers.pop().stop(None).wait()
    status, _, data = call(door, "/v1/completions", {"prompt": "hello there", "max_tokens": 2})
    assert status == 503 and "prefill" in json.loads(data)["error"]["message"]


def test_client_disconnect_cancels_the_decode(cluster, url):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": prompt_of(3, 20), "max_tokens": 3000, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    resp.readline()
    assert resp.readline().startswith(b"data: ")    # decode is streaming
    conn.sock.close()
    conn.close()

    async def decode_running() -> int:
        client = EngineClient(cluster.decode)
        try:
            return (await client.load()).running
        finally:
            await client.close()

    deadline = time.monotonic() + 10
    while cluster.loop.run(decode_running()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.loop.run(decode_running()) == 0
    _, _, metrics = call(url, "/metrics")
    assert 'kvstore_scheduler_requests_finished_total{outcome="cancelled"} 1.0' in metrics.decode()
    assert 'kvstore_scheduler_request_seconds_count{outcome="cancelled"} 1.0' in metrics.decode()
    assert "kvstore_scheduler_inflight_requests 0.0" in metrics.decode()



def test_aborting_requests_mid_transfer_releases_everything(cluster, door, url):
    """Aborts end to end: 100 times, a streamed request is dropped by its client during its
    prefill (blocks loading and publishing) or its decode (blocks loading), and another is
    admitted at once; the other is always served right, and afterwards nothing is held:
    no request in flight, no decode running, no lease and no reservation in the pool, and
    the pool's bytes where they were before (both prompts' blocks were cached already)."""
    host, port = url.removeprefix("http://").split(":")
    dropped, other = prompt_of(40, 3 * BS + 2), prompt_of(41, 2 * BS + 7)
    want = complete(url, {"prompt": other, "max_tokens": 3, "ignore_eos": True})["choices"][0]["token_ids"]
    complete(url, {"prompt": dropped, "max_tokens": 1})      # both prompts' blocks are in the pool now
    router = door.frontdoor.router
    used_before = [s.used_bytes for s in cluster.pool.stats()]
    for cycle in range(100):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": dropped, "max_tokens": 50, "ignore_eos": True, "stream": True}),
            {"Content-Type": "application/json"})
        if cycle % 2:
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
        conn.sock.shutdown(2)
        conn.close()
        got = complete(url, {"prompt": other, "max_tokens": 3, "ignore_eos": True})
        assert got["choices"][0]["token_ids"] == want
    deadline = time.monotonic() + 20
    while router.inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert router.inflight == 0 and not any(router.queue_depths().values())
    assert not any(router.decode_running().values())
    stats = cluster.pool.stats()
    assert all(s.leased_bytes == 0 and s.reserved_bytes == 0 for s in stats)
    assert [s.used_bytes for s in stats] == used_before
    cluster.pool.check_integrity()


def test_clients_that_stop_reading_slow_no_one_else(cluster):
    """20 streaming clients that send a long request and never read — more than 16 spare
    threads, each held by a decode stream — leave the decode
    engine serving everyone else (it has a thread per admitted stream and 16 to spare), and
    once they hang up their decodes are cancelled."""
    import socket

    url = cluster.frontdoor()
    host, port = url.removeprefix("http://").split(":")
    stalled = []
    try:
        for i in range(20):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            body = json.dumps({"prompt": prompt_of(40 + i, 20), "max_tokens": 4000, "ignore_eos": True,
                               "stream": True})
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            stalled.append(s)
        deadline = time.monotonic() + 30
        while "kvstore_scheduler_inflight_requests 20.0" not in call(url, "/metrics")[2].decode():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(2)                                   # all 20 decoding
        t0 = time.monotonic()
        status, _, data = call(url, "/v1/completions", {"prompt": "hello there", "max_tokens": 4})
        assert status == 200, data
        assert time.monotonic() - t0 < 30
    finally:
        for s in stalled:
            s.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = call(url, "/metrics")[2].decode()
        if "kvstore_scheduler_inflight_requests 0.0" in metrics:
            break
        time.sleep(0.2)
    lines = [ln for ln in metrics.splitlines()
             if ln.startswith(("kvstore_scheduler_inflight", "kvstore_scheduler_requests_finished"))]
    assert "kvstore_scheduler_inflight_requests 0.0" in lines, lines
    assert 'kvstore_scheduler_requests_finished_total{outcome="cancelled"} 20.0' in lines, lines


def test_one_tenant_cannot_take_every_slot(cluster):
    """With API keys and a bound per tenant, a tenant holding its bound of requests gets 429
    (``tenant_max_inflight``, Retry-After) for one more, and another tenant is still served."""
    from scheduler.config import FrontdoorConfig
    from scheduler.policy.admission import AdmissionConfig
    url = cluster.frontdoor(FrontdoorConfig(api_keys=frozenset({"sk-a", "sk-b"}),
                                            admission=AdmissionConfig(max_inflight=4, max_inflight_per_tenant=2)))
    host, port = url.removeprefix("http://").split(":")
    held = []
    try:
        for i in range(2):
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("POST", "/v1/completions", json.dumps(
                {"prompt": prompt_of(60 + i, 20), "max_tokens": 3000, "ignore_eos": True, "stream": True}),
                {"Content-Type": "application/json", "Authorization": "Bearer sk-a"})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
            held.append(conn)
        status, headers, data = call(url, "/v1/completions", {"prompt": "one more", "max_tokens": 2},
                                     {"Authorization": "Bearer sk-a"})
        err = json.loads(data)["error"]
        assert status == 429 and err["code"] == "tenant_max_inflight" and headers["Retry-After"] == "1", data
        status, _, data = call(url, "/v1/completions", {"prompt": "another tenant", "max_tokens": 2},
                               {"Authorization": "Bearer sk-b"})
        assert status == 200, data
        metrics = call(url, "/metrics", headers={"Authorization": "Bearer sk-b"})[2].decode()
        assert 'kvstore_scheduler_requests_rejected_total{reason="tenant_max_inflight"} 1.0' in metrics
    finally:
        for conn in held:
            conn.sock.close()
            conn.close()
