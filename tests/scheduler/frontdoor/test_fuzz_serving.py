"""Fuzz targets of the serving side: the engines' gRPC servicer (engines/server.py) and the
front door's JSON bodies (scheduler/frontdoor/openai_api.py, scheduler/frontdoor/server.py), on a real store
node, real prefill and decode engines (the tiny model) and a real aiohttp server on
127.0.0.1. An engine answers every request OK or with a status it chose (never UNKNOWN,
never a hang); the front door answers every body 200, 400, 404 (a model it does not serve),
413 or 429 in OpenAI's shapes (never a 5xx). Afterwards both still serve a normal completion. Short deterministic runs
here; ``make fuzz`` runs them long."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protos import engine_pb2 as epb
from scheduler.config import FrontdoorConfig
from tests.helpers.frontdoor_cluster import BS, Cluster, call, complete, prompt_of, sse_events
from tests.helpers.fuzzing import Counter, fuzz_settings, run_target
from tests.helpers.grpc_fuzzing import call_fuzzed, call_raw, message, request_class

ENGINE = epb.DESCRIPTOR.services_by_name["Engine"]
VOCAB = 512                       # the tiny model's vocabulary (tests/helpers/frontdoor_cluster.py prompts)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(str(tmp_path_factory.mktemp("fuzz-serving")))
    yield c
    c.close()


def _token_ids(n_max: int) -> st.SearchStrategy[list[int]]:
    valid = st.integers(0, VOCAB - 1)
    return st.one_of(st.lists(valid, max_size=n_max),
                     st.lists(st.one_of(valid, st.integers(0, 2**32 - 1)), max_size=n_max))


def _engine_requests(prompt_of_keys: list[bytes]) -> st.SearchStrategy[tuple[Any, Any]]:
    small = st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1))
    lists = {"prompt": _token_ids(2 * BS + 3), "stop_token_ids": _token_ids(3)}
    overrides = {"max_tokens": small, "max_load_blocks": small, "tail_tokens": small,
                 "first_token": st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 2**32 - 1))}
    by_method = {m.name: message(request_class(m), prompt_of_keys, overrides, ["default", "tenant-a", ""],
                                 lists=lists) for m in ENGINE.methods}
    return st.sampled_from(list(ENGINE.methods)).flatmap(lambda m: st.tuples(st.just(m), by_method[m.name]))


def _engines_still_serve(cluster: Cluster, url: str) -> None:
    prompt = prompt_of(3, 2 * BS + 1)
    got = complete(url, {"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
    assert len(got["choices"][0]["token_ids"]) == 3 and got["choices"][0]["finish_reason"] == "length"
    status, _, body = call(url, "/health")
    assert status == 200, body


@pytest.fixture(scope="module")
def url(cluster: Cluster) -> str:
    return cluster.frontdoor(FrontdoorConfig(default_max_tokens=4))


def test_fuzz_engine_grpc_messages(cluster, url) -> None:
    """Prefill, Decode, Info and Load on both engines (each refuses the other's call)."""
    counter = Counter()
    channels = [grpc.insecure_channel(a) for a in (cluster.prefill, cluster.decode)]
    try:
        @fuzz_settings(150)
        @given(call=_engine_requests([]), which=st.integers(0, 1))
        def target(call, which: int) -> None:
            method, request = call
            counter()
            call_fuzzed(channels[which], ENGINE.full_name, method, request)

        run_target("engine gRPC messages", target, counter)
    finally:
        for ch in channels:
            ch.close()
    _engines_still_serve(cluster, url)


def test_fuzz_engine_grpc_raw_bytes(cluster, url) -> None:
    counter = Counter()
    channels = [grpc.insecure_channel(a) for a in (cluster.prefill, cluster.decode)]
    try:
        @fuzz_settings(150)
        @given(method=st.sampled_from(list(ENGINE.methods)), raw=st.binary(max_size=200), which=st.integers(0, 1))
        def target(method, raw: bytes, which: int) -> None:
            counter()
            call_raw(channels[which], ENGINE.full_name, method, raw)

        run_target("engine gRPC raw bytes", target, counter)
    finally:
        for ch in channels:
            ch.close()
    _engines_still_serve(cluster, url)


# -- the front door's JSON -----------------------------------------------------------------------
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
garbage = st.one_of(json_value, st.sampled_from([None, True, -1, 0, 2.5, "", "x", [], {}, 10**30, float("nan")]))
prompt_value = st.one_of(st.text(max_size=60), _token_ids(40), st.lists(st.text(max_size=5), max_size=3), garbage)
messages_value = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"]),
                                    "content": st.one_of(st.text(max_size=40), garbage)}), max_size=3),
    garbage)
fields = {"model": st.one_of(st.just("kvstore/tiny-llama"), st.just("tiny"), garbage),
          "max_tokens": st.one_of(st.integers(-2, 4), st.integers(), garbage),
          "max_completion_tokens": st.one_of(st.integers(0, 4), garbage),
          "stream": st.one_of(st.booleans(), garbage), "ignore_eos": st.one_of(st.booleans(), garbage),
          "stop": st.one_of(st.text(max_size=6), st.lists(st.text(max_size=6), max_size=6), garbage),
          "n": st.one_of(st.just(1), garbage), "temperature": st.one_of(st.floats(0, 2), garbage),
          "top_p": st.one_of(st.floats(0, 1), garbage), "seed": st.one_of(st.integers(), garbage),
          "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), garbage),
          "logprobs": garbage,
          "extra": garbage}
completion_body = st.fixed_dictionaries({}, optional={"prompt": prompt_value, **fields})
chat_body = st.fixed_dictionaries({}, optional={"messages": messages_value, **fields})


def _raw(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


@st.composite
def request_body(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return path, draw(st.binary(max_size=200))                          # not JSON at all
    if kind == 1:
        raw = _raw(draw(completion_body if path == "/v1/completions" else chat_body))
        cut = draw(st.integers(0, len(raw)))
        return path, raw[:cut] + draw(st.binary(max_size=4))                # JSON cut short
    if kind == 2:
        depth = draw(st.sampled_from([10, 1000, 50_000]))
        return path, b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"  # nested deep
    if kind == 3:
        return path, _raw(draw(json_value))                                 # any JSON value
    if kind == 4:                                                           # well formed, with fuzzed text
        text = draw(st.text(min_size=1, max_size=40))
        body = ({"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]})
        return path, _raw({**body, "max_tokens": draw(st.integers(1, 4)), "stream": draw(st.booleans())})
    return path, _raw(draw(completion_body if path == "/v1/completions" else chat_body))


def _check_answer(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status in (200, 400, 404, 413, 429), f"HTTP {status}: {body[:300]!r}"
    if status != 200:
        err = json.loads(body)["error"]
        assert err["message"] and err["type"], err
        assert status != 404 or err["code"] == "model_not_found", err
        if status == 429:
            assert "Retry-After" in headers
        return
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        events = sse_events(body)
        assert events and "error" not in events[-1], events[-1:]
        if not events[-1]["choices"]:       # stream_options.include_usage: the usage chunk
            assert events[-1]["usage"]["completion_tokens"] >= 1
            events = events[:-1]
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        answer = json.loads(body)
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")


def test_fuzz_frontdoor_json(cluster, url) -> None:
    counter = Counter()
    statuses: dict[int, int] = {}

    @fuzz_settings(250)
    @given(req=request_body())
    def target(req) -> None:
        path, raw = req
        counter()
        status, headers, body = call(url, path, raw=raw)
        statuses[status] = statuses.get(status, 0) + 1
        _check_answer(status, headers, body)

    run_target("front door JSON", target, counter)
    assert statuses.get(400) and statuses.get(200), statuses
    _engines_still_serve(cluster, url)
