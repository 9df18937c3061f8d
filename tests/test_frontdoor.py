"""The HTTP front door over a real store node, real prefill and decode engines (the tiny
model) and a real aiohttp server on 127.0.0.1: validation, streamed and whole answers,
prefix hits per tenant, admission (429), limits (413), engine failure (503), cancellation,
/health and /metrics."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Coroutine, Iterator

import pytest
import torch

from engines.client import EngineClient
from engines.model import ModelConfig, load_model
from engines.server import start_engine
from kvstore.pool import KVPool
from kvstore.service import serve_store
from kvstore.tiers import TIERS
from scheduler.admission import AdmissionConfig, Rejection
from scheduler.app import RunningFrontdoor, start_frontdoor
from scheduler.config import FrontdoorConfig
from scheduler.keys import namespace_from_authorization, prompt_keys

BS = 16


class LoopThread:
    """An event loop in a daemon thread: the front door lives there, tests call it over HTTP."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Cluster:
    """A store node, one prefill and one decode engine, and a front door on each config asked
    for (:meth:`frontdoor`), all on 127.0.0.1."""

    def __init__(self, tmp: str) -> None:
        self.pool = KVPool([TIERS["dram"](32 << 20), TIERS["ssd"](64 << 20, path=f"{tmp}/ssd")])
        self.store_server, port = serve_store(self.pool)
        self.store = f"127.0.0.1:{port}"
        self.servers = []
        self.prefill = self.engine("prefill", "prefill-0")
        self.decode = self.engine("decode", "decode-0")
        self.loop = LoopThread()
        self.doors: list[RunningFrontdoor] = []

    def engine(self, role: str, engine_id: str) -> str:
        server, port = start_engine(role, self.store, block_size=BS, engine_id=engine_id)
        self.servers.append(server)
        return f"127.0.0.1:{port}"

    def frontdoor(self, config: FrontdoorConfig | None = None, prefill: str | list[str] | None = None) -> str:
        return self.start(config, prefill).url

    def start(self, config: FrontdoorConfig | None = None,
              prefill: str | list[str] | None = None) -> RunningFrontdoor:
        addresses = [prefill] if isinstance(prefill, str) else (prefill or [self.prefill])
        door = self.loop.run(start_frontdoor(addresses, [self.decode], self.store, config=config))
        self.doors.append(door)
        return door

    def close(self) -> None:
        for door in self.doors:
            self.loop.run(door.stop())
        self.loop.close()
        for server in self.servers:
            server.stop(None).wait()
        self.store_server.stop(None).wait()
        self.pool.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(str(tmp_path_factory.mktemp("frontdoor")))
    yield c
    c.close()


@pytest.fixture(scope="module")
def door(cluster: Cluster) -> RunningFrontdoor:
    return cluster.start()


@pytest.fixture(scope="module")
def url(door: RunningFrontdoor) -> str:
    return door.url


def call(url: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """POST (GET when no body) and return (status, headers, body bytes), errors included."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def complete(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    status, _, data = call(url, "/v1/completions", body, headers)
    assert status == 200, data
    return json.loads(data)


def sse_events(data: bytes) -> list[Any]:
    lines = [ln[len(b"data: "):] for ln in data.split(b"\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def prompt_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


@pytest.mark.parametrize("raw,body,needle", [
    (b"{not json", None, "JSON"),
    (None, [1, 2, 3], "object"),
    (None, {"max_tokens": 4}, "prompt"),
    (None, {"prompt": ""}, "empty"),
    (None, {"prompt": []}, "empty"),
    (None, {"prompt": 42}, "prompt"),
    (None, {"prompt": [5, "x"]}, "integer"),
    (None, {"prompt": [5, True]}, "integer"),
    (None, {"prompt": [5, 512]}, "512"),
    (None, {"prompt": [-1, 5]}, "-1"),
    (None, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (None, {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    (None, {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    (None, {"prompt": "hi", "stream": "yes"}, "stream"),
    (b'{"prompt": "\\ud800", "max_tokens": 2}', None, "Unicode"),   # a lone surrogate
    (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),     # was a 500 (RecursionError)
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested too deeply"),
    (None, {"prompt": "hi", "stop": 5}, "stop"),
    (None, {"prompt": "hi", "stop": ["a", 5]}, "stop"),
    (None, {"prompt": "hi", "stop": [""]}, "stop"),
    (None, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    (None, {"prompt": "hi", "stop": "x" * 257}, "256"),
    (None, {"prompt": "hi", "stop": [1]}, "holding a int"),
    (b'{"prompt": "hi", "temperature": NaN}', None, "temperature"),
    (None, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (None, {"prompt": "hi", "temperature": 3}, "temperature"),
    (None, {"prompt": "hi", "top_p": -0.5}, "top_p"),
])
def test_malformed_request_is_400_with_a_message(url, raw, body, needle):
    status, _, data = call(url, "/v1/completions", body, raw=raw)
    assert status == 400
    err = json.loads(data)["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_chat_with_bad_messages_is_400(url):
    status, _, data = call(url, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert status == 400 and "role" in json.loads(data)["error"]["message"]


def test_prompt_over_the_limit_is_413(url):
    status, _, data = call(url, "/v1/completions", {"prompt": [7] * 4090, "max_tokens": 16})
    assert status == 413 and "4106" in json.loads(data)["error"]["message"]


def test_a_text_too_long_for_any_tokenization_is_413_before_tokenizing(url):
    """30 MB of text cannot fit 4096 tokens: refused on its length, so it never holds the event
    loop (the health checks and other requests) while a tokenizer runs over it."""
    t0 = time.monotonic()
    status, _, data = call(url, "/v1/completions", {"prompt": "a" * 30_000_000, "max_tokens": 2})
    assert status == 413 and "characters" in json.loads(data)["error"]["message"]
    status, _, _ = call(url, "/v1/completions", {"prompt": [7] * 100_000, "max_tokens": 2})
    assert status == 413
    assert time.monotonic() - t0 < 30


def test_whole_and_streamed_answers_agree_and_match_generate(url):
    prompt = prompt_of(1, 3 * BS + 5)
    whole = complete(url, {"prompt": prompt, "max_tokens": 6, "ignore_eos": True})
    status, headers, data = call(url, "/v1/completions",
                                 {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(data)
    streamed = [t for e in events for t in e["choices"][0]["token_ids"]]
    choice = whole["choices"][0]
    assert streamed == choice["token_ids"] and len(streamed) == 6
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert events[-1]["choices"][0]["finish_reason"] == choice["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 6
    assert all("usage" not in e for e in events[:-1])
    assert whole["object"] == "text_completion" and whole["usage"]["prompt_tokens"] == len(prompt)
    # Token-identical to one uninterrupted greedy generate of the same model.
    lm = load_model(ModelConfig(block_size=BS))
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    assert choice["token_ids"] == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_generation_and_is_cut(url, stream):
    """OpenAI's ``stop``: generation ends when the text contains a stop string; the text
    ends right before it, finish_reason is "stop" and fewer tokens were generated."""
    prompt = prompt_of(7, 2 * BS + 3)
    free = complete(url, {"prompt": prompt, "max_tokens": 24, "ignore_eos": True})["choices"][0]
    text = free["text"]
    assert len(text) >= 8, text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters in the middle
    cut = text[:text.index(stop)]
    body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "stop": [stop, "\u2603never"]}
    if stream:
        status, _, data = call(url, "/v1/completions", {**body, "stream": True})
        assert status == 200
        events = sse_events(data)
        got = "".join(e["choices"][0]["text"] for e in events)
        ids = [t for e in events for t in e["choices"][0]["token_ids"]]
        finish, used = events[-1]["choices"][0]["finish_reason"], events[-1]["usage"]["completion_tokens"]
    else:
        choice = complete(url, body)
        got, ids, finish = choice["choices"][0]["text"], choice["choices"][0]["token_ids"], \
            choice["choices"][0]["finish_reason"]
        used = choice["usage"]["completion_tokens"]
    assert got == cut and finish == "stop"
    assert ids == free["token_ids"][:len(ids)] and len(ids) == used < 24
    # a stop string that never appears changes nothing
    same = complete(url, {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "stop": "\u2603never"})
    assert same["choices"][0]["text"] == text and same["choices"][0]["finish_reason"] == "length"


def test_stop_text_holds_back_what_may_begin_a_stop_string():
    from scheduler.openai_api import StopText
    s = StopText(["abc", "xy"])
    assert s.push("12a") == "1" and s.push("b") == "2" and s.push("q") == "a" and not s.hit
    assert s.push("zab") == "bqz" and s.push("cdef") == "" and s.hit and s.flush() == ""
    t = StopText(["xy"])
    assert t.push("ax") == "a" and t.flush() == "x"
    assert StopText([]).push("anything") == "anything"


def test_second_identical_request_reports_cached_tokens(url):
    body = {"prompt": "the quick brown fox jumps over the lazy dog, twice over", "max_tokens": 3}
    first = complete(url, body)
    second = complete(url, body)
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BS * BS > 0
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_namespace_comes_from_the_authorization_header_only(url):
    prompt = prompt_of(2, 4 * BS)
    a, b = {"Authorization": "Bearer tenant-a-key"}, {"Authorization": "Bearer tenant-b-key"}
    complete(url, {"prompt": prompt, "max_tokens": 2}, a)
    hit = complete(url, {"prompt": prompt, "max_tokens": 2}, a)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    ns_a = namespace_from_authorization(a["Authorization"])
    miss = complete(url, {"prompt": prompt, "max_tokens": 2, "namespace": ns_a, "user": ns_a}, b)
    assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    public = complete(url, {"prompt": prompt, "max_tokens": 2, "namespace": ns_a})
    assert public["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert ns_a.startswith("key-") and len(ns_a) == 20 and namespace_from_authorization(None) == "public"


def test_admission_bound_gives_429_with_retry_after_and_reason(cluster):
    door = cluster.frontdoor(FrontdoorConfig(admission=AdmissionConfig(max_inflight=0)))
    status, headers, data = call(door, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert status == 429 and int(headers["Retry-After"]) >= 1
    err = json.loads(data)["error"]
    assert err["type"] == "rate_limit" and err["code"] == "max_inflight" and err["message"]
    _, _, metrics = call(door, "/metrics")
    assert 'kvstore_scheduler_requests_rejected_total{reason="max_inflight"} 1.0' in metrics.decode()


def test_idle_cluster_admits_a_2k_prompt_and_saturated_queues_get_429(cluster):
    """Case 2 through the front door: nothing measured yet, TTFT SLO 2 s; then the queue is
    filled with admitted work (the router's own bookkeeping) until the SLO cannot be met."""
    door = cluster.start(FrontdoorConfig(admission=AdmissionConfig(ttft_slo_s=2.0)))
    router = door.frontdoor.router
    assert router.policy.prefill_model.samples == 0
    status, _, data = call(door.url, "/v1/completions", {"prompt": prompt_of(9, 2048), "max_tokens": 2})
    assert status == 200, data

    async def saturate():
        plans = []
        while len(plans) < 500:
            plan = await router.plan(f"filler-{len(plans)}", prompt_of(10, 4000), "public", 2)
            if isinstance(plan, Rejection):
                return plans, plan
            router.begin(plan)
            plans.append(plan)
        raise AssertionError("the queue never saturated")

    plans, rejection = cluster.loop.run(saturate())
    assert rejection.reason == "ttft_slo" and router.queue_depths()["prefill-0"] == len(plans) > 0
    status, headers, data = call(door.url, "/v1/completions", {"prompt": prompt_of(11, 600), "max_tokens": 2})
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert json.loads(data)["error"]["code"] == "ttft_slo"

    async def drain():
        for plan in plans:
            router.finished(plan)
    cluster.loop.run(drain())
    assert call(door.url, "/v1/completions", {"prompt": prompt_of(11, 600), "max_tokens": 2})[0] == 200


def routed(url: str) -> dict[str, float]:
    """prefill instance -> admitted requests routed there, from /metrics."""
    out: dict[str, float] = {}
    for line in call(url, "/metrics")[2].decode().splitlines():
        if line.startswith("kvstore_scheduler_requests_routed_total{"):
            labels, value = line.rsplit(" ", 1)
            prefill = labels.split('prefill="', 1)[1].split('"', 1)[0]
            out[prefill] = out.get(prefill, 0.0) + float(value)
    return out


@pytest.fixture(scope="module")
def second_prefill(cluster: Cluster) -> str:
    return cluster.engine("prefill", "prefill-1")


@pytest.mark.parametrize("policy", ["round_robin", "conductor"])
def test_policy_flag_takes_effect_with_two_prefill_engines(cluster, second_prefill, policy):
    door = cluster.start(FrontdoorConfig(policy=policy), prefill=[cluster.prefill, second_prefill])
    assert door.frontdoor.router.policy.name == policy
    prompt = prompt_of(20 + len(policy), 5 * BS + 3)
    answers = [complete(door.url, {"prompt": prompt, "max_tokens": 2}) for _ in range(4)]
    counts = routed(door.url)
    assert sum(counts.values()) == 4
    if policy == "round_robin":
        assert counts == {"prefill-0": 2.0, "prefill-1": 2.0}
    else:   # idle queues: the instance holding the prefix wins every time
        assert sorted(counts.values()) == [4.0]
    assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BS for a in answers[1:])
    assert len({tuple(a["choices"][0]["token_ids"]) for a in answers}) == 1


def test_a_fetched_prefix_stays_on_the_instance_that_fetched_it(cluster, second_prefill):
    """Hot-prefix replication: round-robin sends the second request to the other instance,
    which loads the prefix from the pool and keeps it; the router's replica then shows both
    instances holding it, and the conductor may use either."""
    door = cluster.start(FrontdoorConfig(policy="round_robin"), prefill=[cluster.prefill, second_prefill])
    prompt = prompt_of(77, 6 * BS + 1)
    first = complete(door.url, {"prompt": prompt, "max_tokens": 2})
    second = complete(door.url, {"prompt": prompt, "max_tokens": 2})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BS
    router = door.frontdoor.router
    keys = prompt_keys(prompt, router.info, "public")
    assert router.replica.hits(keys) == {"prefill-0": 6, "prefill-1": 6}
    view = router.cluster_view(keys)
    assert [p.hit.blocks for p in view.prefill] == [6, 6] and view.prefill[1].hit.by_tier == (("hbm", 6),)


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
    assert "kvstore_scheduler_inflight_requests 0.0" in metrics.decode()


def test_chat_completion(url):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}
    whole = json.loads(call(url, "/v1/chat/completions", body)[2])
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"
    events = sse_events(call(url, "/v1/chat/completions", {**body, "stream": True})[2])
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]


def test_health_and_metrics(door, url):
    status, _, data = call(url, "/health")
    health = json.loads(data)
    assert status == 200 and health["status"] == "ok" and health["prefill"] == 1 and health["decode"] == 1
    assert health["policy"] == "conductor"
    complete(url, {"prompt": "metrics please", "max_tokens": 2})
    status, headers, data = call(url, "/metrics")
    text = data.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for series in ("kvstore_scheduler_ttft_seconds_count", "kvstore_scheduler_tbt_seconds_bucket",
                   "kvstore_scheduler_requests_admitted_total", "kvstore_scheduler_prompt_tokens_total",
                   "kvstore_scheduler_cached_prompt_tokens_total",
                   'kvstore_scheduler_prefill_queue_depth{instance="prefill-0"}',
                   "kvstore_scheduler_ttft_prediction_error_seconds_count", "kvstore_scheduler_prefix_hit_ratio",
                   'kvstore_scheduler_requests_routed_total{decode="decode-0",policy="conductor",prefill="prefill-0"}'):
        assert series in text, series
    router = door.frontdoor.router   # the router's fits learn from what it served
    assert router.policy.prefill_model.samples > 0 and router.policy.tbt_model.samples > 0


def test_aborting_requests_mid_transfer_releases_everything(cluster, door, url):
    """Case 3 end to end: 100 times, a streamed request is dropped by its client during its
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
    assert router.inflight == 0 and not any(router.queue_depths().values()) and not any(router.decode_running().values())
    stats = cluster.pool.stats()
    assert all(s.leased_bytes == 0 and s.reserved_bytes == 0 for s in stats)
    assert [s.used_bytes for s in stats] == used_before
    cluster.pool.check_integrity()


def test_read_json_refuses_what_both_front_doors_cannot_parse():
    """The one body reader of the front door and the vLLM front door (scheduler/vllm_frontdoor.py)."""
    from scheduler.openai_api import APIError, read_json
    assert read_json(b'{"prompt": [1]}') == {"prompt": [1]}
    for raw, needle in ((b"[" * 100_000, "nested too deeply"), (b"{", "not valid JSON"), (b"\xff", "not valid JSON")):
        with pytest.raises(APIError, match=needle) as exc:
            read_json(raw)
        assert exc.value.status == 400
