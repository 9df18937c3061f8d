"""Colocated vLLM: prefills whose first tokens come together are one observation of the T_prefill
fit (scheduler/vllm/prefill_groups.py), on the caller's clock."""
from __future__ import annotations

import pytest

from scheduler.vllm.prefill_groups import PrefillGroups


def test_first_tokens_within_the_gap_form_one_group_handed_over_once_every_usage_is_known():
    groups = PrefillGroups(gap_s=0.1)
    assert groups.first_token("i0", "a", 900, start_s=10.0, now_s=11.0) == []
    assert groups.first_token("i0", "b", 300, start_s=11.0, now_s=11.02) == []   # the same vLLM step
    assert groups.first_token("i1", "c", 500, start_s=10.5, now_s=11.03) == []   # another instance
    assert groups.cached("a", 32, now_s=12.0) == []                              # b's usage still to come
    assert groups.cached("b", 0, now_s=12.1) == [([(900, 32), (300, 0)], pytest.approx(1.02))]
    assert groups.cached("c", 64, now_s=12.2) == [([(500, 64)], pytest.approx(0.53))]


def test_a_first_token_after_the_gap_closes_the_group_before_it():
    groups = PrefillGroups(gap_s=0.1)
    groups.first_token("i0", "a", 900, start_s=10.0, now_s=11.0)
    assert groups.cached("a", 0, now_s=11.05) == []      # within the gap: b may still join
    assert groups.first_token("i0", "b", 300, start_s=11.0, now_s=11.5) == [([(900, 0)], pytest.approx(1.0))]
    assert groups.cached("b", 0, now_s=11.7) == [([(300, 0)], pytest.approx(0.5))]


def test_a_member_that_ends_without_its_usage_voids_its_group():
    groups = PrefillGroups(gap_s=0.1)
    groups.first_token("i0", "a", 900, start_s=10.0, now_s=11.0)
    groups.first_token("i0", "b", 300, start_s=11.0, now_s=11.01)
    groups.forget("b")                                    # failed after its first token
    assert groups.cached("a", 0, now_s=12.0) == []
    groups.forget("a")
    assert not groups._of and not groups._open
    groups.first_token("i0", "c", 100, start_s=20.0, now_s=20.2)     # the instance starts afresh
    assert groups.cached("c", 0, now_s=21.0) == [([(100, 0)], pytest.approx(0.2))]
