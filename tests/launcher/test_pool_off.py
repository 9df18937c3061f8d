"""Pool off per request (``"prefix_cache": false``), the mechanism behind ``kvstore up
--replay``'s recompute run: real store node, real engines (tiny model), real HTTP front door.
Such a request computes every prompt token, whatever the engine's own cache and the pool hold,
and leaves nothing in either; its tokens are those of the pool-on path."""
from __future__ import annotations

import json

import pytest

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


def ask(url: str, prompt: list[int], prefix_cache: bool | None, stream: bool = False) -> dict:
    body: dict = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if prefix_cache is not None:
        body["prefix_cache"] = prefix_cache
    if not stream:
        return complete(url, body)
    status, _, data = call(url, "/v1/completions", body)
    assert status == 200, data
    events = sse_events(data)
    return {"choices": [{"token_ids": [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]]}],
            "usage": events[-1]["usage"]}


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_pool_off_recomputes_a_prompt_the_caches_hold(url):
    prompt = prompt_of(31, 6 * BS + 3)
    first = ask(url, prompt, None)
    on = ask(url, prompt, True)
    assert cached(on) == 6 * BS     # the whole blocks, from the engine's cache or the pool
    for stream in (False, True):
        off = ask(url, prompt, False, stream)
        assert cached(off) == 0
        assert off["choices"][0]["token_ids"] == on["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_pool_off_leaves_nothing_in_either_cache(url, cluster):
    pool_blocks = sum(s.blocks for s in cluster.pool.stats())
    prompt = prompt_of(32, 5 * BS + 1)
    assert cached(ask(url, prompt, False)) == 0
    assert cached(ask(url, prompt, False, stream=True)) == 0
    assert sum(s.blocks for s in cluster.pool.stats()) == pool_blocks   # nothing published
    # Neither the engine's own cache nor the pool took the prompt: pool on finds nothing yet.
    assert cached(ask(url, prompt, True)) == 0
    assert cached(ask(url, prompt, True)) == 5 * BS


@pytest.mark.parametrize("value", ["no", 0, [], {}])
def test_a_prefix_cache_that_is_not_a_boolean_is_400(url, value):
    status, _, data = call(url, "/v1/completions", {"prompt": [5, 6, 7], "prefix_cache": value})
    assert status == 400 and "prefix_cache" in json.loads(data)["error"]["message"]


def test_pool_off_samples_and_scores_as_pool_on(url):
    """A seeded sampled request with logprobs: pool off draws the same tokens with the same log
    probabilities as pool on (the first token included, which the recompute path chooses)."""
    prompt = prompt_of(33, 4 * BS + 7)
    body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "temperature": 1.0, "seed": 7, "logprobs": 2}
    on = [complete(url, body) for _ in range(2)][-1]   # the second: served from the caches
    off = complete(url, {**body, "prefix_cache": False})
    assert cached(on) == 4 * BS and cached(off) == 0
    assert off["choices"][0]["token_ids"] == on["choices"][0]["token_ids"]
    lp_on, lp_off = on["choices"][0]["logprobs"]["token_logprobs"], off["choices"][0]["logprobs"]["token_logprobs"]
    assert lp_off == pytest.approx(lp_on, abs=1e-4) and len(lp_off) == 5
