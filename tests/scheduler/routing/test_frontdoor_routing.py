"""Routing through the front door (real engines, store node and HTTP server on 127.0.0.1,
tests/helpers/frontdoor_cluster.py): prefix hits reported per tenant, the tenant taken from the
Authorization header only, admission (429 with Retry-After and the reason), and the scheduling
policy flag. Hot prefixes replicated to the instance that fetched them, as the router's KV-event
replica sees it: tests/scheduler/routing/test_router_events.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from scheduler.config import FrontdoorConfig
from scheduler.policy.admission import AdmissionConfig, Rejection
from scheduler.routing.tenancy import namespace_from_authorization
from tests.helpers.frontdoor_cluster import (  # noqa: F401  (cluster_fixture, door_fixture, url_fixture: fixtures)
    BS,
    Cluster,
    call,
    cluster_fixture,
    complete,
    door_fixture,
    prompt_of,
    url_fixture,
)


def test_second_identical_request_reports_cached_tokens(url):
    body = {"prompt": "the quick brown fox jumps over the lazy dog, twice over", "max_tokens": 3}
    first = complete(url, body)
    second = complete(url, body)
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BS * BS > 0
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_namespace_comes_from_the_authorization_header_only(url):
    prompt = prompt_of(2, 4 * BS)
    a, b = {"Authorization": "Bearer tenant-a-key"}, {"Authorization": "Bearer tenant-b-key"}
    complete(url, {"prompt": prompt, "max_tokens": 2}, a)
    hit = complete(url, {"prompt": prompt, "max_tokens": 2}, a)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    ns_a = namespace_from_authorization(a["Authorization"])
    miss = complete(url, {"prompt": prompt, "max_tokens": 2, "namespace": ns_a, "user": ns_a}, b)
    assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    public = complete(url, {"prompt": prompt, "max_tokens": 2, "namespace": ns_a})
    assert public["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert ns_a.startswith("key-") and len(ns_a) == 20 and namespace_from_authorization(None) == "public"



def test_admission_bound_gives_429_with_retry_after_and_reason(cluster):
    door = cluster.frontdoor(FrontdoorConfig(admission=AdmissionConfig(max_inflight=0)))
    status, headers, data = call(door, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert status == 429 and int(headers["Retry-After"]) >= 1
    err = json.loads(data)["error"]
    assert err["type"] == "rate_limit" and err["code"] == "max_inflight" and err["message"]
    _, _, metrics = call(door, "/metrics")
    assert 'kvstore_scheduler_requests_rejected_total{reason="max_inflight"} 1.0' in metrics.decode()


def test_idle_cluster_admits_a_2k_prompt_and_saturated_queues_get_429(cluster):
    """Admission on TTFT through the front door: nothing measured yet but the engines' profiling
    pass, TTFT SLO 2 s; then the queue is filled with admitted work (the router's own
    bookkeeping) until the SLO cannot be met (the in-flight bound raised past it: a 4000-token
    prefill of the tiny model is predicted at some 40 ms, so 64 of them fit in 2 s)."""
    door = cluster.start(FrontdoorConfig(admission=AdmissionConfig(ttft_slo_s=2.0, max_inflight=5000)))
    router = door.frontdoor.router
    assert router.policy.prefill_model.samples == 0
    status, _, data = call(door.url, "/v1/completions", {"prompt": prompt_of(9, 2048), "max_tokens": 2})
    assert status == 200, data

    async def saturate():
        plans = []
        while len(plans) < 2000:
            plan = await router.plan(f"filler-{len(plans)}", prompt_of(10, 4000), "public", 2)
            if isinstance(plan, Rejection):
                # T_queue counts what is left of the running prefill: queue a few more past
                # the SLO, so that the wall time the next call takes cannot bring it back under
                for i in range(10):
                    router.begin(dataclasses.replace(plans[-1], request_id=f"extra-{i}"))
                    plans.append(dataclasses.replace(plans[-1], request_id=f"extra-{i}"))
                return plans, plan
            router.begin(plan)
            plans.append(plan)
        raise AssertionError("the queue never saturated")

    plans, rejection = cluster.loop.run(saturate())
    assert rejection.reason == "ttft_slo" and router.queue_depths()["prefill-0"] == len(plans) > 0
    status, headers, data = call(door.url, "/v1/completions", {"prompt": prompt_of(11, 600), "max_tokens": 2})
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert json.loads(data)["error"]["code"] == "ttft_slo"

    async def drain():
        for plan in plans:
            router.finished(plan)
    cluster.loop.run(drain())
    assert call(door.url, "/v1/completions", {"prompt": prompt_of(11, 600), "max_tokens": 2})[0] == 200



def routed(url: str) -> dict[str, float]:
    """prefill instance -> admitted requests routed there, from /metrics."""
    out: dict[str, float] = {}
    for line in call(url, "/metrics")[2].decode().splitlines():
        if line.startswith("kvstore_scheduler_requests_routed_total{"):
            labels, value = line.rsplit(" ", 1)
            prefill = labels.split('prefill="', 1)[1].split('"', 1)[0]
            out[prefill] = out.get(prefill, 0.0) + float(value)
    return out


@pytest.fixture(scope="module")
def second_prefill(cluster: Cluster) -> str:
    return cluster.engine("prefill", "prefill-1")


@pytest.mark.parametrize("policy", ["round_robin", "conductor"])
def test_policy_flag_takes_effect_with_two_prefill_engines(cluster, second_prefill, policy):
    door = cluster.start(FrontdoorConfig(policy=policy), prefill=[cluster.prefill, second_prefill])
    assert door.frontdoor.router.policy.name == policy
    prompt = prompt_of(20 + len(policy), 5 * BS + 3)
    answers = [complete(door.url, {"prompt": prompt, "max_tokens": 2}) for _ in range(4)]
    counts = routed(door.url)
    assert sum(counts.values()) == 4
    if policy == "round_robin":
        assert counts == {"prefill-0": 2.0, "prefill-1": 2.0}
    else:   # idle queues: the instance holding the prefix wins every time
        assert sorted(counts.values()) == [4.0]
    assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * BS for a in answers[1:])
    assert len({tuple(a["choices"][0]["token_ids"]) for a in answers}) == 1

