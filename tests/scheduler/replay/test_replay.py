"""Trace mapping (deterministic across processes, prompt lengths as specified), the best
possible hit ratio of the vendored trace, and a small replay against a live front door."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.replay.report import format_report
from scheduler.replay.run import replay, run_replay
from scheduler.trace import TraceMapping, TraceRequest, best_possible_hit_blocks, best_possible_hit_ratio, load_trace
from tests.helpers.frontdoor_cluster import cluster_fixture, door_fixture, url_fixture  # noqa: F401  (fixtures: a live front door)

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"


def test_mapping_is_the_same_in_another_process():
    reqs = load_trace(TRACE, 5)
    here = [TraceMapping(32, 512).prompt(r) for r in reqs]
    code = ("import json; from scheduler.trace import TraceMapping, load_trace; "
            f"print(json.dumps([TraceMapping(32, 512).prompt(r) for r in load_trace({str(TRACE)!r}, 5)]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True, timeout=60)
    assert json.loads(out.stdout) == here


@pytest.mark.parametrize("tpb", [16, 32])
def test_prompt_lengths_and_shared_blocks(tpb):
    m = TraceMapping(tpb, 512)
    cases = [  # (input_length, hash ids) -> expected prompt length
        (6758, 14, round(6758 * tpb / 512)),     # inside the clamp
        (1, 3, 2 * tpb + 1),                     # clamped up: every hash id keeps a token
        (10_000, 2, 2 * tpb),                    # clamped down: no more than the blocks hold
        (1024, 2, 2 * tpb),                      # exact blocks
    ]
    for input_length, n, want in cases:
        req = TraceRequest(0, input_length, 1, tuple(range(n)))
        assert m.prompt_length(req) == want
        prompt = m.prompt(req)
        assert len(prompt) == want and all(3 <= t < 512 for t in prompt)
    a, b = TraceRequest(0, 3 * 512, 1, (7, 8, 9)), TraceRequest(0, 3 * 512, 1, (7, 8, 10))
    pa, pb = m.prompt(a), m.prompt(b)
    assert pa[:2 * tpb] == pb[:2 * tpb] and pa[2 * tpb:] != pb[2 * tpb:]
    assert TraceMapping(tpb, 512, seed=1).prompt(a) != pa


def test_best_possible_hits_by_hand():
    reqs = [TraceRequest(0, 1500, 1, (1, 2, 3)), TraceRequest(0, 1500, 1, (1, 2, 4)),
            TraceRequest(0, 2000, 1, (1, 2, 3, 5)), TraceRequest(0, 1536, 1, (1, 2, 3)),
            TraceRequest(0, 1000, 1, (6, 2))]
    assert best_possible_hit_blocks(reqs) == [0, 2, 3, 3, 0]
    # Capped: never the last prompt token; the 1536-token prompt (48 tokens at 16 per block)
    # may reuse 47 tokens, so 2 whole blocks.
    assert best_possible_hit_blocks(reqs, TraceMapping(16, 512)) == [0, 2, 3, 2, 0]


def test_best_possible_hit_ratio_of_the_whole_trace():
    reqs = load_trace(TRACE)
    assert len(reqs) == 12031
    assert best_possible_hit_ratio(reqs) == pytest.approx(0.366, abs=5e-4)
    assert best_possible_hit_ratio(reqs, TraceMapping(16, 512)) <= best_possible_hit_ratio(reqs)


def test_small_replay_against_a_live_front_door(url, tmp_path):  # noqa: F811
    reqs = load_trace(TRACE, 8)
    report = asyncio.run(replay(url, reqs, speed=1000.0, max_output_tokens=4, mapping=TraceMapping(16, 512)))
    assert (report.requests_sent, report.completed, report.rejected, report.failed) == (8, 8, 0, 0)
    assert 0 < report.hit_ratio <= report.best_possible_hit_ratio
    assert report.cached_tokens > 0 and report.completion_tokens == sum(min(r.output_length, 4) for r in reqs)
    assert report.ttft_p50_s is not None and report.ttft_p99_s >= report.ttft_p50_s > 0
    assert report.tbt_p50_s is not None and report.goodput_rps >= 0 and report.wall_s > 0
    json.dumps(report.to_dict())
    assert "goodput" in format_report(report)
    # The CLI's path: settings from /health, JSON written.
    out = tmp_path / "report.json"
    again = asyncio.run(run_replay(url, TRACE, requests=4, speed=1000.0, max_output_tokens=2, json_path=out))
    assert again.completed == 4 and json.loads(out.read_text())["requests_sent"] == 4


def test_a_replay_refused_its_api_key_stops_before_sending(cluster):  # noqa: F811
    """Against a front door with API keys, a replay without one (or with a wrong one) ran
    the whole trace, every request a 401; it now stops at once and says so."""
    from kvstore.errors import Unavailable
    from scheduler.config import FrontdoorConfig
    keyed = cluster.frontdoor(FrontdoorConfig(api_keys=frozenset({"sk-replay"})))
    for key in (None, "sk-wrong"):
        with pytest.raises(Unavailable, match=r"API key \(401\): give one it serves with --api-key"):
            asyncio.run(run_replay(keyed, TRACE, requests=2, speed=1000.0, max_output_tokens=2, api_key=key))
    report = asyncio.run(run_replay(keyed, TRACE, requests=2, speed=1000.0, max_output_tokens=2, api_key="sk-replay"))
    assert report.completed == 2


def test_a_report_with_a_rejection_says_which_requests_its_token_rows_count():
    """One rejected request: 'cached / prompt tokens' counted its prompt and 'prefill tokens
    computed' did not, so the rows did not add up and nothing said why."""
    from scheduler.replay.report import RequestOutcome, summarize
    ok = RequestOutcome("ok", ttft_s=0.1, prompt_tokens=100, cached_tokens=60, trace_blocks=2, cached_blocks=1)
    rejected = RequestOutcome("rejected", "max_inflight", prompt_tokens=50, trace_blocks=1)
    text = format_report(summarize([ok, rejected], 0, 1.0, 2.0, 0.2))
    assert "60 / 150" in text and "token rows: prompt tokens of every request sent" in text, text
    assert "token rows" not in format_report(summarize([ok], 0, 1.0, 2.0, 0.2))
