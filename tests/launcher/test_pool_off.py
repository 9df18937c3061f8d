"""Pool off per request (``"prefix_cache": false``), the mechanism behind ``kvstore up
--replay``'s recompute run: real store node, real engines (tiny model), real HTTP front door.
Such a request computes every prompt token, whatever the engine's own cache and the pool hold,
and leaves nothing in either; its tokens are those of the pool-on path. And the pool off for a
whole front door: ``kvstore scheduler --no-store``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

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

ROOT = Path(__file__).resolve().parents[2]


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



def test_no_store_keeps_the_front_door_off_a_cluster_that_the_environment_names(tmp_path):
    """``kvstore scheduler --no-store`` with ``KVSTORE_REDIS_URL`` set (as it is on a cluster's
    hosts): no pool at all, so the front door neither reads that Redis nor reports a store."""
    from engines.server import start_engine
    from launcher.supervisor import free_port

    servers, addresses = [], {}
    for role in ("prefill", "decode"):
        server, port = start_engine(role, None, block_size=BS, engine_id=f"{role}-0")
        servers.append(server)
        addresses[role] = f"127.0.0.1:{port}"
    url, log_path = f"http://127.0.0.1:{(port := free_port())}", tmp_path / "scheduler.log"
    env = {**os.environ, "KVSTORE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}   # nothing listens there
    env.pop("KVSTORE_EVENTS_URL", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "scheduler", "--prefill", addresses["prefill"],
                                 "--decode", addresses["decode"], "--no-store", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                call(url, "/health")
                break
            except OSError:      # not listening yet
                time.sleep(0.3)
        time.sleep(2.5)          # two health rounds more: a store the front door had would be checked by now
        status, _, data = call(url, "/health")
        assert (status, json.loads(data)["status"]) == (200, "ok"), (data, log_path.read_text())
        answer = complete(url, {"prompt": prompt_of(34, 2 * BS), "max_tokens": 2, "ignore_eos": True})
        assert answer["usage"]["completion_tokens"] == 2
        assert "redis" not in log_path.read_text().lower()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        for server in servers:
            server.stop(grace=1)
