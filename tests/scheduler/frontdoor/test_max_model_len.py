"""``--max-model-len``: engines and a front door limited to a few blocks (real store node,
real engines running the tiny model, real HTTP server on 127.0.0.1). A request at the limit
is served; one token over is refused clearly (the front door's 400
``context_length_exceeded``, the engine's INVALID_ARGUMENT); a front door's own limit below
the engines' wins; a replay skips what does not fit and reports it, never a crash."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from engines.client import EngineClient
from engines.server import start_engine
from kvstore.errors import InvalidArgument
from scheduler.config import FrontdoorConfig
from scheduler.replay.run import run_replay
from tests.helpers.frontdoor_cluster import BS, Cluster, call, complete, prompt_of

LIMIT = 4 * BS   # tokens, prompt + generation


class LimitedCluster(Cluster):
    """The front door tests' cluster with engines started with ``max_model_len=LIMIT``."""

    def engine(self, role: str, engine_id: str) -> str:
        server, port = start_engine(role, self.store, block_size=BS, engine_id=engine_id, max_model_len=LIMIT)
        self.servers.append(server)
        return f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> Iterator[LimitedCluster]:
    c = LimitedCluster(str(tmp_path_factory.mktemp("limited")))
    yield c
    c.close()


@pytest.fixture(scope="module")
def url(limited: LimitedCluster) -> str:
    return limited.frontdoor()


def test_health_and_models_state_the_limit(url):
    status, _, data = call(url, "/health")
    assert status == 200 and json.loads(data)["max_model_len"] == LIMIT
    status, _, data = call(url, "/v1/models")
    assert json.loads(data)["data"][0]["max_model_len"] == LIMIT


def test_a_request_at_the_limit_is_served(url):
    body = complete(url, {"prompt": prompt_of(11, LIMIT - 4), "max_tokens": 4, "ignore_eos": True})
    assert len(body["choices"][0]["token_ids"]) == 4 and body["usage"]["prompt_tokens"] == LIMIT - 4


@pytest.mark.parametrize("prompt_tokens,max_tokens", [(LIMIT - 3, 4), (LIMIT + 1, 1)])
def test_one_token_over_the_limit_is_a_clear_400(url, prompt_tokens, max_tokens):
    status, _, data = call(url, "/v1/completions", {"prompt": prompt_of(12, prompt_tokens), "max_tokens": max_tokens})
    err = json.loads(data)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded"
    assert str(LIMIT) in err["message"] and str(prompt_tokens) in err["message"]


def test_a_chat_over_the_limit_is_a_clear_400(url):
    status, _, data = call(url, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "x" * (2 * LIMIT)}], "max_tokens": 2})
    assert status == 400 and json.loads(data)["error"]["code"] == "context_length_exceeded"


def test_the_engine_itself_refuses_a_prompt_over_its_limit(limited):
    async def go() -> None:
        client = EngineClient(limited.prefill)
        try:
            with pytest.raises(InvalidArgument, match=f"limit of {LIMIT} tokens"):
                await client.prefill("over", prompt_of(13, LIMIT + 1), "public")
            result = await client.prefill("at", prompt_of(13, LIMIT), "public")
            assert result.computed_tokens + result.cached_tokens == LIMIT
        finally:
            await client.close()
    asyncio.run(go())


def test_a_front_door_limit_below_the_engines_wins(limited):
    door = limited.frontdoor(FrontdoorConfig(max_model_len=2 * BS))
    _, _, data = call(door, "/health")
    assert json.loads(data)["max_model_len"] == 2 * BS
    complete(door, {"prompt": prompt_of(14, 2 * BS - 2), "max_tokens": 2})
    status, _, data = call(door, "/v1/completions", {"prompt": prompt_of(14, 2 * BS - 1), "max_tokens": 2})
    assert status == 400 and json.loads(data)["error"]["code"] == "context_length_exceeded"


def test_a_front_door_limit_above_the_engines_is_capped_at_theirs(limited):
    door = limited.frontdoor(FrontdoorConfig(max_model_len=10 * LIMIT))
    _, _, data = call(door, "/health")
    assert json.loads(data)["max_model_len"] == LIMIT


def test_a_replay_skips_and_reports_requests_over_the_limit(url, tmp_path):
    # 16 tokens per trace block: 2 blocks + 2 output fit the 64-token limit, 4 blocks + 2 do not.
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 2, "hash_ids": [1, 2]},
            {"timestamp": 1, "input_length": 2048, "output_length": 2, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 2, "input_length": 1536, "output_length": 2, "hash_ids": [1, 2, 5]}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "report.json"
    report = asyncio.run(run_replay(url, trace, speed=100.0, max_output_tokens=2, tokens_per_block=BS,
                                    json_path=out))
    assert (report.skipped, report.skipped_by_reason) == (1, {"context_length_exceeded": 1})
    assert (report.requests_sent, report.completed, report.failed) == (2, 2, 0)
    saved = json.loads(out.read_text())
    assert saved["skipped"] == 1 and saved["settings"]["max_model_len"] == LIMIT
    # The best possible counts only what was sent: the third request (48 tokens) reuses the
    # first's 2 blocks ((48 - 1) // 16 = 2 may be reused), of 2 + 3 trace blocks sent.
    assert report.best_possible_hit_ratio == pytest.approx(2 / 5)
