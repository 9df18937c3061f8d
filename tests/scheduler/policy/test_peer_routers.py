"""The routers users deploy instead of the Conductor (scheduler/policy/peer_routers.py,
docs/routers.md): each one's decision rule on hand-built cluster views — a case where the
cache wins and one where the load wins —, the simulator running each on a short trace window,
and the front door's ``--policy`` accepting each."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from launcher.cli import build_parser
from scheduler.config import FrontdoorConfig
from scheduler.frontdoor.app import config_from_args
from scheduler.policy.backlog import PrefillBacklog
from scheduler.policy.baselines import make_policy
from scheduler.policy.peer_routers import ApproxTree, DynamoKVPolicy, LlmdPolicy, SGLangCacheAwarePolicy, pick_least
from scheduler.policy.views import ClusterView, Decision, DecodeView, DecodeWork, PrefillView, RequestView, TierHit
from scheduler.sim import Simulator
from scheduler.sim.presets import PEER_ROUTER_POLICIES, preset_runs
from scheduler.sim.workload import load_workload, make_requests

BS = 16
KEYS = tuple(bytes([i]) * 8 for i in range(20))            # a 20-block prompt
REQ = RequestView("r", 20 * BS, KEYS, 8, BS)
BLOCK_BYTES = 1 << 16
TRACE = Path(__file__).resolve().parents[3] / "data" / "traces" / "conversation_trace.jsonl"


def _cluster(*prefill: PrefillView, decode: tuple[DecodeView, ...] = (DecodeView("D0"), DecodeView("D1"))):
    return ClusterView(0.0, tuple(prefill), decode)


def _decide(policy, cluster: ClusterView, request: RequestView = REQ) -> Decision:
    d = policy.decide(request, cluster)
    assert isinstance(d, Decision), d
    return d


def test_dynamo_prefers_the_cached_worker_until_its_prefill_backlog_outweighs_the_hit():
    policy = make_policy("dynamo_kv", BLOCK_BYTES)
    cached = PrefillView("P0", hit=TierHit.uniform(16, "hbm"))
    cold = PrefillView("P1")
    assert _decide(policy, _cluster(cached, cold)).prefill_id == "P0"          # the cache wins
    # P0 has 40 blocks of prefill still to compute: 40 + 20 - 16 = 44 (+ its active blocks)
    # against P1's 20 + 0 (+ none): the load wins.
    busy = cached._replace(prefill_tokens=40 * BS, prompt_tokens=40 * BS, queued=2)
    assert _decide(policy, _cluster(busy, cold)).prefill_id == "P1"


def test_dynamo_credits_host_and_disk_tiers_less_than_device_blocks():
    policy = DynamoKVPolicy(BLOCK_BYTES)
    c = _cluster(PrefillView("P0"))
    costs = {tier: policy.prefill_cost(REQ, c, PrefillView("P0", hit=TierHit.uniform(8, tier)))
             for tier in ("hbm", "dram", "ssd")}
    # prompt 20 blocks: device credit 8 → 12 + 20; host 8 × 0.75 = 6 → 14 + 20; disk 2 → 18 + 20
    assert costs == {"hbm": 32.0, "dram": 34.0, "ssd": 38.0}
    host = PrefillView("P0", hit=TierHit.uniform(12, "dram"))     # 9 blocks of credit beat 8 device blocks
    assert _decide(policy, _cluster(PrefillView("P1", hit=TierHit.uniform(8, "hbm")), host)).prefill_id == "P0"


def test_dynamo_decode_goes_to_the_fewest_active_blocks():
    policy = make_policy("dynamo_kv", BLOCK_BYTES)
    full = DecodeView("D0", (DecodeWork(4000, 0.0, 50.0),))
    d = _decide(policy, _cluster(PrefillView("P0"), decode=(full, DecodeView("D1"))))
    assert d.decode_id == "D1"


def test_llmd_weighs_the_prefix_twice_against_queue_and_kv_usage():
    policy = make_policy("llmd", BLOCK_BYTES)
    cached = PrefillView("P0", queued=3, hit=TierHit.uniform(20, "hbm"), kv_usage=0.5)
    idle = PrefillView("P1")
    # P0: 2 × 1.0 + (1 − 0.5) + 0 = 2.5; P1: 0 + 1 + 1 = 2: the cache wins
    assert _decide(policy, _cluster(cached, idle)).prefill_id == "P0"
    # P0 with 6 of 20 blocks: 2 × 0.3 + 0.1 + 0 = 0.7 against 2: the load wins
    partial = cached._replace(hit=TierHit.uniform(6, "hbm"), kv_usage=0.9)
    assert _decide(policy, _cluster(partial, idle)).prefill_id == "P1"


def test_llmd_scores_cpu_blocks_at_eight_tenths_and_queues_min_max():
    policy = LlmdPolicy(BLOCK_BYTES)
    assert policy.prefix_score(REQ, TierHit.uniform(10, "hbm")) == pytest.approx(0.5)
    assert policy.prefix_score(REQ, TierHit(10, (("hbm", 5), ("dram", 5)))) == pytest.approx(0.45)
    assert policy.prefix_score(REQ, TierHit.uniform(10, "ssd")) == pytest.approx(0.5)   # no weight: 1.0
    assert policy.queue_scores([4, 0, 2]) == [0.0, 1.0, 0.5]
    assert policy.queue_scores([3, 3]) == [1.0, 1.0]


def test_sglang_follows_its_own_history_while_balanced_and_the_shortest_queue_when_not():
    policy = make_policy("sglang_cache_aware", BLOCK_BYTES)
    # No history: the smallest tree (all empty: the first listed) gets it and remembers it.
    assert _decide(policy, _cluster(PrefillView("P0"), PrefillView("P1"))).prefill_id == "P0"
    # The same prompt again goes back to P0 though P1 is idle: the tree matches 100% > 30%,
    # whatever the instances' own caches say (P1 claims the hit: the router never asks).
    c = _cluster(PrefillView("P0", queued=5), PrefillView("P1", hit=TierHit.uniform(20, "hbm")))
    assert _decide(policy, c).prefill_id == "P0"
    # Imbalanced (70 − 0 > 64 and 70 > 1.5 × 0): the shortest queue, whatever the cache.
    c = _cluster(PrefillView("P0", queued=70), PrefillView("P1"))
    assert _decide(policy, c).prefill_id == "P1"
    # A prompt matching 5 of 20 blocks (25% <= 30%) goes to the smaller tree: both hold the
    # 20-block prompt now; give P0 ten more blocks, and P1's is the smaller.
    other = RequestView("o", 20 * BS, KEYS[:5] + tuple(b"x" * 8 + bytes([i]) for i in range(15)), 8, BS)
    policy.tree.insert(tuple(b"y" * 8 + bytes([i]) for i in range(10)), "P0")
    assert _decide(policy, _cluster(PrefillView("P0"), PrefillView("P1")), other).prefill_id == "P1"


def test_the_backlog_counts_the_tokens_its_requests_prefill():
    backlog = PrefillBacklog()
    backlog.add("a", 1.0, 100, 300)
    backlog.add("b", 2.0, 50, 50)
    backlog.start("a", 0.0)
    assert backlog.tokens() == (150, 350)
    backlog.remove("a")
    assert backlog.tokens() == (50, 50)
    backlog.add("b", 2.0, 10, 40)         # re-added: counted once
    assert backlog.tokens() == (10, 40)


def test_the_approximate_tree_evicts_tails_before_heads():
    tree = ApproxTree()
    tree.insert(KEYS[:10], "P0")
    tree.evict(4)
    assert tree.size("P0") == 4 and tree.match(KEYS, "P0") == 4 and tree.match(KEYS, "P1") == 0


def test_ties_are_broken_at_random_but_reproducibly():
    picks = {pick_least([0, 1, 2, 3], lambda i: 0.0 if i in (1, 3) else 1.0, random.Random(s)) for s in range(20)}
    assert picks == {1, 3}


def test_colocated_decodes_where_it_prefilled():
    for cls in (DynamoKVPolicy, LlmdPolicy, SGLangCacheAwarePolicy):
        views = (PrefillView("C0", queued=1), PrefillView("C1"))
        c = ClusterView(0.0, views, (DecodeView("C0"), DecodeView("C1")), colocated=True)
        d = _decide(cls(BLOCK_BYTES), c)
        assert d.decode_id == d.prefill_id


@pytest.mark.parametrize("policy", PEER_ROUTER_POLICIES)
def test_the_simulator_runs_each_peer_router_on_a_short_window(policy):
    cfg = next(c for c in preset_runs("fig5") if c.policy == policy)
    trace, keys = load_workload(TRACE, 300)
    sim = Simulator(cfg, make_requests(trace, keys, cfg.speed))
    res = sim.summarize(sim.run(), 0.0)
    assert res.policy == policy and res.requests == 300 and res.ttft_mean_s is not None
    assert res.rejected_early + res.rejected_late == 0 and 0 < res.hit_ratio <= 1


@pytest.mark.parametrize("policy", PEER_ROUTER_POLICIES)
def test_the_front_door_accepts_each_peer_router(policy):
    args = build_parser().parse_args(["scheduler", "--prefill", "a:1", "--decode", "c:3", "--policy", policy])
    assert config_from_args(args).policy == policy
    assert FrontdoorConfig(policy=policy).policy == policy
