"""The HTTP front door over a real store node, real prefill and decode engines (the tiny
model) and a real aiohttp server on 127.0.0.1 (tests/helpers/frontdoor_cluster.py): validation
(400, context_length_exceeded included), streamed and whole answers, stop strings, chat,
/health and /metrics. Routing and admission: test_frontdoor_routing.py; failures and cancellation:
test_frontdoor_lifecycle.py; the OpenAI surface through the SDK: test_openai_sdk.py."""
from __future__ import annotations

import json
import math
import re
import time

import pytest
import torch

from engines.model import ModelConfig, load_model
from tests.helpers.frontdoor_cluster import (  # noqa: F401  (cluster_fixture, door_fixture, url_fixture: fixtures)
    BS,
    call,
    cluster_fixture,
    complete,
    door_fixture,
    prompt_of,
    sse_events,
    url_fixture,
)


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


def test_prompt_over_the_limit_is_400_context_length_exceeded(url):
    status, _, data = call(url, "/v1/completions", {"prompt": [7] * 4090, "max_tokens": 16})
    err = json.loads(data)["error"]
    assert status == 400 and "4106" in err["message"] and err["code"] == "context_length_exceeded"


def test_a_text_too_long_for_any_tokenization_is_400_before_tokenizing(url):
    """500 kB of text cannot fit 4096 tokens: refused on its length, so it never holds the event
    loop (the health checks and other requests) while a tokenizer runs over it; 30 MB is over
    the body limit (64 bytes a token of context, 1 MiB at least) and refused unparsed."""
    t0 = time.monotonic()
    status, _, data = call(url, "/v1/completions", {"prompt": "a" * 500_000, "max_tokens": 2})
    err = json.loads(data)["error"]
    assert status == 400 and "characters" in err["message"] and err["code"] == "context_length_exceeded"
    status, _, data = call(url, "/v1/completions", {"prompt": "a" * 30_000_000, "max_tokens": 2})
    assert status == 413 and json.loads(data)["error"]["code"] == "request_too_large"
    status, _, _ = call(url, "/v1/completions", {"prompt": [7] * 100_000, "max_tokens": 2})
    assert status == 400
    assert time.monotonic() - t0 < 30


def test_whole_and_streamed_answers_agree_and_match_generate(url):
    prompt = prompt_of(1, 3 * BS + 5)
    whole = complete(url, {"prompt": prompt, "max_tokens": 6, "ignore_eos": True})
    status, headers, data = call(url, "/v1/completions",
                                 {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": True,
                                  "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    *events, last = sse_events(data)
    streamed = [t for e in events for t in e["choices"][0]["token_ids"]]
    choice = whole["choices"][0]
    assert streamed == choice["token_ids"] and len(streamed) == 6
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert events[-1]["choices"][0]["finish_reason"] == choice["finish_reason"] == "length"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6   # include_usage: a last chunk
    assert whole["usage"]["completion_tokens"] == 6 and all("usage" not in e for e in events)
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
        status, _, data = call(url, "/v1/completions", {**body, "stream": True,
                                                        "stream_options": {"include_usage": True}})
        assert status == 200
        *events, last = sse_events(data)
        got = "".join(e["choices"][0]["text"] for e in events)
        ids = [t for e in events for t in e["choices"][0]["token_ids"]]
        finish, used = events[-1]["choices"][0]["finish_reason"], last["usage"]["completion_tokens"]
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
    from scheduler.frontdoor.text_stream import StopText
    s = StopText(["abc", "xy"])
    assert s.push("12a") == "1" and s.push("b") == "2" and s.push("q") == "a" and not s.hit
    assert s.push("zab") == "bqz" and s.push("cdef") == "" and s.hit and s.flush() == ""
    t = StopText(["xy"])
    assert t.push("ax") == "a" and t.flush() == "x"
    assert StopText([]).push("anything") == "anything"



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
    complete(url, {"prompt": "and a second prefill for the predictor's error", "max_tokens": 2})
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
    # ... and /metrics says how far its T_prefill predictions were from the engine's prefills
    sd = re.search(r'^kvstore_scheduler_prefill_prediction_log_error\{stat="sd"\} (\S+)$', text, re.MULTILINE)
    mean = re.search(r'^kvstore_scheduler_prefill_prediction_log_error\{stat="mean"\} (\S+)$', text, re.MULTILINE)
    assert sd and mean and float(sd.group(1)) >= 0 and math.isfinite(float(mean.group(1)))
    assert (float(mean.group(1)), float(sd.group(1))) == pytest.approx(router.policy.prefill_model.log_error)
    # no replica of the store's index here: the pool hit of a prompt of a whole block or more took a Lookup RPC
    lookups = re.search(r'^kvstore_scheduler_pool_lookups_total\{outcome="ok"\} (\S+)$', text, re.MULTILINE)
    assert router.replica is None and lookups and float(lookups.group(1)) == router.pool_lookups["ok"] >= 1



def test_read_json_refuses_what_both_front_doors_cannot_parse():
    """The one body reader of the front door and the vLLM front door (scheduler/vllm/frontdoor.py)."""
    from scheduler.frontdoor.openai_api import APIError, read_json
    assert read_json(b'{"prompt": [1]}') == {"prompt": [1]}
    for raw, needle in ((b"[" * 100_000, "nested too deeply"), (b"{", "not valid JSON"), (b"\xff", "not valid JSON")):
        with pytest.raises(APIError, match=needle) as exc:
            read_json(raw)
        assert exc.value.status == 400


def test_cached_tokens_are_what_the_prefill_did_not_compute_and_make_the_hit_ratio(door, url):
    """``usage.prompt_tokens_details.cached_tokens``, whole and streamed: 0 for a cold prompt,
    every full block the second time (never the last token: 53 tokens, 3 blocks of 16),
    0 for another tenant's first request of it. The front door's books hold what the
    clients were told: cached / prompt tokens, split by source; the hand-off to decode (all
    of each prompt) is counted apart."""
    get = door.frontdoor.metrics.registry.get_sample_value

    def books() -> tuple[float, ...]:
        sources = sum(get("kvstore_scheduler_cached_prompt_tokens_by_source_total", {"source": s}) or 0.0
                      for s in ("instance", "pool_hbm", "pool_dram", "pool_ssd", "unknown"))
        handoff = sum(get("kvstore_scheduler_handoff_tokens_total", {"via": v}) or 0.0 for v in ("pool", "direct"))
        return (get("kvstore_scheduler_prompt_tokens_total"), get("kvstore_scheduler_cached_prompt_tokens_total"),
                sources, handoff)

    prompt = prompt_of(77, 3 * BS + 5)
    body = {"prompt": prompt, "max_tokens": 2}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    before = books()
    told = []
    for key in ("alice-hits", "bob-hits"):
        auth = {"Authorization": f"Bearer {key}"}
        told.append(complete(url, body, auth)["usage"])
        told.append(sse_events(call(url, "/v1/completions", streamed, auth)[2])[-1]["usage"])
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in told] == [0, 3 * BS, 0, 3 * BS]
    prompt_tokens, cached, sources, handoff = (b - a for a, b in zip(before, books()))
    assert prompt_tokens == sum(u["prompt_tokens"] for u in told) == 4 * len(prompt)
    assert cached == sources == sum(u["prompt_tokens_details"]["cached_tokens"] for u in told)
    assert handoff == 4 * len(prompt)
    text = call(url, "/metrics")[2].decode()
    ratio = float(re.search(r"^kvstore_scheduler_prefix_hit_ratio (\S+)$", text, re.MULTILINE).group(1))
    assert ratio == pytest.approx(get("kvstore_scheduler_cached_prompt_tokens_total")
                                  / get("kvstore_scheduler_prompt_tokens_total"))
