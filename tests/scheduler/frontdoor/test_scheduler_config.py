"""The scheduler's flags (``kvstore scheduler`` and ``kvstore up``) become its config."""
from __future__ import annotations

import math

import pytest

from kvstore.errors import InvalidArgument
from launcher.cli import build_parser
from scheduler.config import FrontdoorConfig
from scheduler.frontdoor.app import config_from_args


def test_scheduler_flags_reach_the_config():
    args = build_parser().parse_args(["scheduler", "--prefill", "a:1,b:2", "--decode", "c:3",
                                      "--policy", "round_robin", "--admit-ttft-s", "2", "--admit-tbt-s", "0.5",
                                      "--max-inflight", "9", "--decode-max-running", "8",
                                      "--balancing-threshold", "2.5", "--ready-timeout-s", "600"])
    cfg = config_from_args(args)
    assert cfg.policy == "round_robin" and cfg.decode_max_running == 8 and cfg.ready_timeout_s == 600
    assert config_from_args(build_parser().parse_args(["scheduler"])).ready_timeout_s == 60
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--ready-timeout-s", "0"])
    assert (cfg.admission.ttft_slo_s, cfg.admission.tbt_slo_s, cfg.admission.max_inflight) == (2.0, 0.5, 9)
    assert cfg.conductor.balancing_threshold == 2.5


def test_defaults_and_up_flags():
    args = build_parser().parse_args(["up", "--prefill-instances", "2", "--decode-instances", "3"])
    cfg = config_from_args(args)
    assert (args.prefill_instances, args.decode_instances) == (2, 3)
    assert cfg.policy == "conductor" and cfg.admission.tbt_slo_s == math.inf
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--policy", "fastest"])
    with pytest.raises(InvalidArgument, match="valid"):
        FrontdoorConfig(policy="fastest")


def test_the_bound_per_tenant_defaults_to_half_the_slots_only_with_api_keys():
    parse = build_parser().parse_args
    base = ["scheduler", "--prefill", "a:1", "--decode", "c:3", "--max-inflight", "10"]
    assert config_from_args(parse(base)).admission.max_inflight_per_tenant is None          # one tenant
    assert config_from_args(parse([*base, "--api-key", "sk-a"])).admission.max_inflight_per_tenant == 5
    assert config_from_args(parse([*base, "--api-key", "sk-a", "--max-inflight-per-tenant", "0"])
                            ).admission.max_inflight_per_tenant is None                      # 0: none
    assert config_from_args(parse([*base, "--max-inflight-per-tenant", "3"])).admission.max_inflight_per_tenant == 3
    with pytest.raises(SystemExit):
        parse([*base, "--max-inflight-per-tenant", "-1"])
