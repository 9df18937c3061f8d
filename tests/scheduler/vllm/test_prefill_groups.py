"""Colocated vLLM: prefills whose first tokens come together are one observation of the T_prefill
fit (scheduler/vllm/prefill_groups.py), on the caller's clock."""
from __future__ import annotations

import pytest

from scheduler.vllm.prefill_groups import PrefillGroups


def test_first_tokens_within_the_gap_form_one_group_handed_over_once_every_usage_is_known():
    groups = PrefillGroups(gap_s=0.1)
    assert groups.first_token("i0", "a", 900, 0, start_s=10.0, now_s=11.0) == []
    assert groups.first_token("i0", "b", 300, 0, start_s=11.0, now_s=11.02) == []   # the same vLLM step
    assert groups.first_token("i1", "c", 500, 0, start_s=10.5, now_s=11.03) == []   # another instance
    assert groups.cached("a", 32, now_s=12.0) == []                              # b's usage still to come
    assert groups.cached("b", 0, now_s=12.1) == [([(900, 32), (300, 0)], pytest.approx(1.02))]
    assert groups.cached("c", 64, now_s=12.2) == [([(500, 64)], pytest.approx(0.53))]


def test_a_first_token_after_the_gap_closes_the_group_before_it():
    groups = PrefillGroups(gap_s=0.1)
    groups.first_token("i0", "a", 900, 0, start_s=10.0, now_s=11.0)
    assert groups.cached("a", 0, now_s=11.05) == []      # within the gap: b may still join
    assert groups.first_token("i0", "b", 300, 0, start_s=11.0, now_s=11.5) == [([(900, 0)], pytest.approx(1.0))]
    assert groups.cached("b", 0, now_s=11.7) == [([(300, 0)], pytest.approx(0.5))]


def test_a_member_that_ends_without_its_usage_counts_with_its_planned_cache():
    groups = PrefillGroups(gap_s=0.1)
    groups.first_token("i0", "a", 900, 0, start_s=10.0, now_s=11.0)
    groups.first_token("i0", "b", 300, 64, start_s=11.0, now_s=11.01)
    assert groups.forget("b") == []                       # cancelled after its first token; a's usage to come
    assert groups.cached("a", 0, now_s=12.0) == [([(900, 0), (300, 64)], pytest.approx(1.01))]
    groups.forget("a")
    assert not groups._of and not groups._open


def test_a_group_spans_from_its_earliest_start_but_never_before_the_last_group_ended():
    """A long prompt booked from 10.0 that joins a short one booked from 10.5 took the group from
    10.0; a group after it starts no earlier than it ended, so no second is learnt twice."""
    groups = PrefillGroups(gap_s=0.1)
    groups.first_token("i0", "short", 100, 0, start_s=10.5, now_s=11.0)
    groups.first_token("i0", "long", 2000, 0, start_s=10.0, now_s=11.02)
    groups.cached("short", 0, now_s=12.0)
    assert groups.cached("long", 0, now_s=12.0) == [([(100, 0), (2000, 0)], pytest.approx(1.02))]
    groups.first_token("i0", "next", 500, 0, start_s=10.8, now_s=12.5)     # booked from before 11.02
    assert groups.cached("next", 0, now_s=13.0) == [([(500, 0)], pytest.approx(12.5 - 11.02))]


def test_a_steady_stream_of_first_tokens_still_makes_observations():
    groups = PrefillGroups(gap_s=0.1, max_members=4)
    learnt = []
    for i in range(40):                                   # a first token every 50 ms
        rid = f"r{i}"
        learnt += groups.first_token("i0", rid, 100, 0, start_s=10.0 + 0.05 * i, now_s=10.05 + 0.05 * i)
        learnt += groups.cached(rid, 0, now_s=10.06 + 0.05 * i)
    assert len(learnt) >= 9 and all(len(prefills) == 4 for prefills, _ in learnt)
    assert sum(seconds for _, seconds in learnt) == pytest.approx(0.05 * 4 * len(learnt), rel=0.05)
