"""Colocated over vLLM, the T_prefill fit learns each prefill's own seconds, not its TTFT: a
request routed behind another on the same instance waits for it first, a wait T_queue
predicts apart (scheduler/vllm/router.py, ``VLLMRouter.first_token``). No vLLM engine here:
the router's books alone, over instances nothing listens on (no call reaches them), on a clock
the test moves (the routers' ``time.monotonic``), so that a loaded machine cannot stretch the
gaps it sets."""
from __future__ import annotations

import asyncio
import types
from pathlib import Path

import pytest

from engines.vllm.checkpoint import write_checkpoint
from launcher.supervisor import free_port
from scheduler.policy.admission import Rejection
from scheduler.routing.route_plan import RoutePlan
from scheduler.routing.router import DecodeInstance, PrefillInstance
from scheduler.vllm.instances import VLLMClient, VLLMModel
from scheduler.vllm.router import VLLMRouter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


async def _two_behind_one(model: VLLMModel, clock: Clock) -> list[tuple[int, int, float]]:
    clients = [VLLMClient(f"http://127.0.0.1:{free_port()}", "colocated", model, "vllm-0")]
    infos = [await c.info() for c in clients]
    router = VLLMRouter([PrefillInstance(c, i) for c, i in zip(clients, infos)],
                        [DecodeInstance(c, i) for c, i in zip(clients, infos)], None, model, "colocated")
    seen: list[tuple[int, int, float]] = []
    router.policy.observe_prefill = lambda n, cached, seconds: seen.append((n, cached, seconds))  # type: ignore[method-assign]
    try:
        plans = []
        for rid in ("first", "second"):
            plan = await router.plan(rid, list(range(3, 103)), "alice", max_tokens=4)
            assert isinstance(plan, RoutePlan) and not isinstance(plan, Rejection)
            router.begin(plan)
            plans.append(plan)
        t0 = clock.now
        clock.now += 0.3
        router.first_token(plans[0])                   # the first prefill ends; the second starts now
        clock.now += 0.2
        router.first_token(plans[1])
        ttft = clock.now - t0
        for plan in plans:
            router.colocated_prefilled(plan, 0, ttft)
            router.finished(plan)
        assert not router._began and not router._prefill_s
    finally:
        await router.close()
    return seen


def test_a_colocated_prefill_feeds_its_own_seconds_not_its_wait(tmp_path: Path, monkeypatch) -> None:
    import scheduler.routing.router
    import scheduler.vllm.router
    model = VLLMModel.from_dir(write_checkpoint(str(tmp_path / "checkpoint")), block_size=16)
    clock = Clock()
    for module in (scheduler.routing.router, scheduler.vllm.router):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    (n1, c1, s1), (n2, c2, s2) = asyncio.run(_two_behind_one(model, clock))
    assert (n1, c1, n2, c2) == (100, 0, 100, 0)
    assert s1 == pytest.approx(0.3)     # routed to an idle instance: from routing to first token
    assert s2 == pytest.approx(0.2)     # behind the first: from its end, not the 0.5-s TTFT
