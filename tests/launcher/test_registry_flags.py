"""Flags that name a registered policy take their choices from the registry itself: a policy
registered after the parsers were written is accepted by ``kvctl policy``, ``kvstore serve
--policy``, ``kvstore simulate --eviction`` and the scheduler's ``--policy``, and reaches the
code it names; an unregistered name is still refused."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore import kvctl
from kvstore.pool.eviction import POLICIES as EVICTION_POLICIES
from kvstore.pool.eviction import FifoPolicy, register_policy
from launcher.cli import build_parser, main
from scheduler.frontdoor.app import config_from_args
from scheduler.policy.baselines import POLICIES as SCHEDULING_POLICIES
from scheduler.policy.baselines import RoundRobinPolicy

TRACE = str(Path(__file__).resolve().parents[2] / "data" / "traces" / "conversation_trace.jsonl")


@pytest.fixture
def new_eviction_policy() -> Iterator[type]:
    """An eviction policy registered now, under a name no list in the code knows."""
    @register_policy("test-newcomer")
    class Newcomer(FifoPolicy):
        pass
    yield Newcomer
    del EVICTION_POLICIES["test-newcomer"]


@pytest.fixture
def new_scheduling_policy() -> Iterator[type]:
    class Newcomer(RoundRobinPolicy):
        name = "test-newcomer"
    SCHEDULING_POLICIES[Newcomer.name] = Newcomer
    yield Newcomer
    del SCHEDULING_POLICIES[Newcomer.name]


def test_a_new_eviction_policy_is_accepted_by_every_parser(new_eviction_policy, capsys):
    assert kvctl.build_parser().parse_args(["policy", "test-newcomer"]).name == "test-newcomer"
    assert build_parser().parse_args(["serve", "--policy", "test-newcomer"]).policy == "test-newcomer"
    assert build_parser().parse_args(["simulate", "--eviction", "test-newcomer"]).eviction == "test-newcomer"
    with pytest.raises(SystemExit):
        kvctl.build_parser().parse_args(["policy", "test-unregistered"])
    assert "invalid choice" in capsys.readouterr().err


def test_kvctl_switches_a_node_to_a_newly_registered_policy(new_eviction_policy, store_node, capsys):
    pool, address = store_node
    assert kvctl.main(["--store", address, "policy", "test-newcomer", "--tier", "dram"]) == 0
    assert "dram: lru -> test-newcomer" in capsys.readouterr().out
    assert type(pool._place.books[0].policy) is new_eviction_policy


def test_a_new_scheduling_policy_reaches_the_scheduler_config(new_scheduling_policy):
    for argv in (["scheduler", "--prefill", "a:1", "--decode", "b:2"], ["up"]):
        args = build_parser().parse_args([*argv, "--policy", "test-newcomer"])
        assert config_from_args(args).policy == "test-newcomer"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--policy", "test-unregistered"])


def test_simulate_runs_a_newly_registered_scheduling_policy(new_scheduling_policy, capsys):
    assert main(["simulate", "--trace", TRACE, "--requests", "20", "--instances", "2",
                 "--policies", "test-newcomer"]) == 0
    assert "test-newcomer" in capsys.readouterr().out


def test_simulate_runs_a_newly_registered_policy_by_default(new_scheduling_policy, capsys):
    assert "test-newcomer" in build_parser().parse_args(["simulate"]).policies.split(",")
    assert build_parser().parse_args(["simulate"]).policies.endswith("conductor")
