"""The paper's baseline schedulers, by their definitions (Mooncake FAST'25 §4.1):
load balancing = argmin T_queue; local cache-aware = argmin T_queue + T_prefill(n, own
prefix); random. And T_queue itself (scheduler/policy/backlog.py), the one definition the router
and the simulator share: the running prefill's remaining predicted seconds plus the queued
ones' full predicted seconds."""
from __future__ import annotations

import dataclasses

import pytest

from kvstore.index.keys import usable_prefix_tokens
from scheduler.policy.backlog import PrefillBacklog
from scheduler.policy.baselines import make_policy
from scheduler.policy.conductor import ConductorConfig
from scheduler.policy.costing import Bandwidths, PrefillProfile
from scheduler.policy.views import ClusterView, Decision, DecodeView, PrefillView, RequestView, TierHit

BS = 16
BLOCK_BYTES = 8192
# A slow engine (1 ms per token) so that a prefix is worth seconds: easy figures to read.
SLOW = ConductorConfig(prefill=PrefillProfile(fixed_s=0.0, s_per_token=1e-3, s_per_token_context=0.0,
                                              floor_tokens_per_s=1.0, min_prefill_s=0.0))


def decide(policy: str, views: tuple[PrefillView, ...], n_tokens: int = 64 * BS) -> Decision:
    req = RequestView("r", n_tokens, tuple(i.to_bytes(4, "big") for i in range(n_tokens // BS)), 4, BS)
    d = make_policy(policy, BLOCK_BYTES, SLOW).decide(req, ClusterView(0.0, views, (DecodeView("d0"),)))
    assert isinstance(d, Decision), d
    return d


def t_prefill(n: int, blocks: int) -> float:
    return (n - usable_prefix_tokens(blocks, BS, n)) * 1e-3


@pytest.mark.parametrize("holder_queue_s, want", [(0.5, "p0"), (0.9, "p1")])
def test_local_cache_aware_is_argmin_of_queue_plus_prefill_with_its_own_prefix(holder_queue_s, want):
    # 1024 tokens; p0 holds 48 of 64 blocks (saves 0.768 s) behind holder_queue_s of queue,
    # p1 holds nothing behind 0.1 s.
    views = (PrefillView("p0", holder_queue_s, 2, TierHit.uniform(48, "hbm")), PrefillView("p1", 0.1, 1))
    cost = {v.instance_id: v.queue_s + t_prefill(64 * BS, v.hit.blocks) for v in views}
    assert min(cost, key=cost.__getitem__) == want
    assert decide("local_cache_aware", views).prefill_id == want


def test_local_cache_aware_ignores_the_pool_and_peers_as_the_paper_defines_it():
    # p1's queue is shorter, but p0's own prefix is worth more; a pool hit would help anyone.
    views = (PrefillView("p0", 0.3, 1, TierHit.uniform(32, "hbm")), PrefillView("p1", 0.0, 0))
    assert decide("local_cache_aware", views).prefill_id == "p0"


def test_local_cache_aware_counts_the_read_of_its_own_dram_blocks():
    # Both hold the same 48 blocks, p0 in its HBM (free), p1 in its node's DRAM, read back
    # at 48 blocks a second: p1's shorter queue (0.4 s less) does not pay for that 1 s read.
    slow_dram = dataclasses.replace(SLOW, bandwidths=Bandwidths(dram=48 * BLOCK_BYTES))
    views = (PrefillView("p0", 0.5, 1, TierHit.uniform(48, "hbm")),
             PrefillView("p1", 0.1, 1, TierHit.uniform(48, "dram")))
    req = RequestView("r", 64 * BS, tuple(i.to_bytes(4, "big") for i in range(64)), 4, BS)
    policy = make_policy("local_cache_aware", BLOCK_BYTES, slow_dram)
    d = policy.decide(req, ClusterView(0.0, views, (DecodeView("d0"),)))
    assert isinstance(d, Decision) and d.prefill_id == "p0"
    assert decide("local_cache_aware", views).prefill_id == "p1"     # DRAM as fast as the default: p1


def test_load_balancing_is_argmin_queue_whatever_the_cache():
    views = (PrefillView("p0", 0.3, 1, TierHit.uniform(63, "hbm")), PrefillView("p1", 0.29, 5))
    assert decide("least_loaded", views).prefill_id == "p1"
    tie = (PrefillView("p0", 0.3, 4), PrefillView("p1", 0.3, 2))
    assert decide("least_loaded", tie).prefill_id == "p1"     # ties: fewer requests


def test_random_is_seeded_and_covers_every_instance():
    views = tuple(PrefillView(f"p{i}", 0.1 * i, i) for i in range(3))
    req = RequestView("r", 4 * BS, (), 4, BS)

    def picks(seed: int) -> list[str]:
        policy = make_policy("random", BLOCK_BYTES, ConductorConfig(seed=seed))
        return [policy.decide(req, ClusterView(0.0, views, (DecodeView("d0"),))).prefill_id for _ in range(30)]
    assert picks(1) == picks(1)
    assert set(picks(1)) == {"p0", "p1", "p2"}


def test_t_queue_counts_what_is_left_of_the_running_prefill_and_all_of_the_queued():
    b = PrefillBacklog()
    b.add("a", 10.0)
    assert b.advance(100.0) == "a"          # nothing ran: it starts now
    b.add("b", 3.0)
    b.add("c", 2.0)
    assert b.advance(100.0) is None         # one at a time
    assert b.queue_s(100.0) == pytest.approx(15.0)
    assert b.queue_s(109.0) == pytest.approx(1.0 + 5.0)   # 9 s in: 1 s left of "a", not 10
    assert b.queue_s(112.0) == pytest.approx(5.0)         # "a" overran: its remaining is 0, not < 0
    assert b.remove("a") == 10.0
    assert b.advance(112.0) == "b"
    assert b.queue_s(113.0) == pytest.approx(2.0 + 2.0)
    assert b.remove("c") == 2.0 and len(b) == 1 and "b" in b and "c" not in b
    b.remove("b")
    assert b.queue_s(113.0) == 0.0 and len(b) == 0
    assert b.remove("nope") is None

