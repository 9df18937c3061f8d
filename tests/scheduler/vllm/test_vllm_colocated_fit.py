"""Colocated over vLLM, the T_prefill fit learns each prefill's own seconds, not its TTFT: a
request routed behind another on the same instance waits for it first, a wait T_queue
predicts apart (scheduler/vllm/router.py, ``VLLMRouter.first_token``); prefills whose first
tokens come together (vLLM ran them in the same steps) are learnt as one group
(scheduler/vllm/prefill_groups.py). No vLLM engine here:
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


async def _two_behind_one(model: VLLMModel, clock: Clock, gaps: tuple[float, float], measured: bool = True) -> list:
    clients = [VLLMClient(f"http://127.0.0.1:{free_port()}", "colocated", model, "vllm-0")]
    infos = [await c.info() for c in clients]
    router = VLLMRouter([PrefillInstance(c, i) for c, i in zip(clients, infos)],
                        [DecodeInstance(c, i) for c, i in zip(clients, infos)], None, model, "colocated")
    seen: list = []
    router.policy.observe_prefill = lambda *a: seen.append(("alone", *a))  # type: ignore[method-assign]
    router.policy.observe_prefills = lambda prefills, seconds: seen.append((prefills, seconds))  # type: ignore
    try:
        plans = []
        for rid in ("first", "second"):
            plan = await router.plan(rid, list(range(3, 103)), "alice", max_tokens=4)
            assert isinstance(plan, RoutePlan) and not isinstance(plan, Rejection)
            router.begin(plan)
            plans.append(plan)
        clock.now += gaps[0]
        router.first_token(plans[0], measured)         # the first prefill ends; the second starts now
        clock.now += gaps[1]
        router.first_token(plans[1], measured)
        clock.now += 1.0                               # each usage comes at its stream's end
        for plan in plans:
            router.colocated_prefilled(plan, 0)
            router.finished(plan)
        assert not router._began and not router._prefill_s
        assert not router.prefill_groups._of and not router.prefill_groups._open
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
    seen = asyncio.run(_two_behind_one(model, clock, (0.3, 0.2)))
    assert seen == [([(100, 0)], pytest.approx(0.3)),   # routed to an idle instance: from routing to first token
                    ([(100, 0)], pytest.approx(0.2))]   # behind the first: from its end, not the 0.5-s TTFT


def test_prefills_whose_first_tokens_come_together_are_learnt_as_one_group(tmp_path: Path, monkeypatch) -> None:
    """Booked one after another, the second of two prefills vLLM ran in the same step took
    ~0 s (a 964-token prompt "computed in 0.000 s" in a live replay): the fit gets both
    prompts in the 0.3 s they took together."""
    import scheduler.routing.router
    import scheduler.vllm.router
    model = VLLMModel.from_dir(write_checkpoint(str(tmp_path / "checkpoint")), block_size=16)
    clock = Clock()
    for module in (scheduler.routing.router, scheduler.vllm.router):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    seen = asyncio.run(_two_behind_one(model, clock, (0.3, 0.004)))
    assert seen == [([(100, 0), (100, 0)], pytest.approx(0.304))]


async def _decode_room(model: VLLMModel, clock: Clock) -> tuple[int, int]:
    from scheduler.vllm.instances import VLLMLoad
    clients = [VLLMClient(f"http://127.0.0.1:{free_port()}", "colocated", model, "vllm-0")]
    infos = [await c.info() for c in clients]
    router = VLLMRouter([PrefillInstance(c, i) for c, i in zip(clients, infos)],
                        [DecodeInstance(c, i) for c, i in zip(clients, infos)], None, model, "colocated")
    try:
        blocks = 64                                    # 1,024 tokens of paged KV cache
        clients[0].last_load = VLLMLoad(0, 0, 0.0, blocks, clock.now)
        idle = router.cluster_view(()).decode[0].kv_capacity_tokens
        plan = await router.plan("long", list(range(3, 603)), "alice", max_tokens=4)
        assert isinstance(plan, RoutePlan)
        router.begin(plan)                             # in prefill: vLLM holds its KV already
        used = 600 / (blocks * model.block_size)
        clients[0].last_load = VLLMLoad(1, 0, used, blocks, clock.now)
        busy = router.cluster_view(()).decode[0].kv_capacity_tokens
        router.finished(plan)
    finally:
        await router.close()
    return idle, busy


def test_the_kv_of_a_prefill_under_way_is_not_counted_as_foreign_load(tmp_path: Path, monkeypatch) -> None:
    """vLLM's KV usage holds a colocated request's blocks from its first prefill chunk; the
    router counted only requests past prefill as its own, so the rest looked like another
    client's load — and was also booked as this request's decode work: an instance seemed
    full and requests went behind a 7,540-token prefill on the other one instead."""
    import scheduler.routing.router
    import scheduler.vllm.router
    model = VLLMModel.from_dir(write_checkpoint(str(tmp_path / "checkpoint")), block_size=16)
    clock = Clock()
    for module in (scheduler.routing.router, scheduler.vllm.router):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    idle, busy = asyncio.run(_decode_room(model, clock))
    assert idle == 1024 and busy == idle


def test_the_front_door_reads_the_models_attention_ratio_from_its_checkpoint(tmp_path: Path) -> None:
    import json

    from scheduler.policy.costing import attention_ratio
    model = VLLMModel.from_dir(write_checkpoint(str(tmp_path / "checkpoint"), "bench"), block_size=16)
    cfg = json.loads((Path(model.model_dir) / "config.json").read_text())
    assert model.attention_ratio == pytest.approx(attention_ratio(512, 8, 8, 64, 1408))
    assert cfg["hidden_size"] == 512 and cfg["intermediate_size"] == 1408
    cfg.pop("intermediate_size")
    (Path(model.model_dir) / "config.json").write_text(json.dumps(cfg))
    model = VLLMModel.from_dir(model.model_dir, block_size=16)
    assert model.attention_ratio == 0.0            # dimensions it cannot read: no FLOPs shape


def test_a_response_not_streamed_teaches_the_fit_nothing(tmp_path: Path, monkeypatch) -> None:
    """Not streamed, the front door sees the first token only with the whole response: those
    seconds hold the decode too, and are not prefill seconds."""
    import scheduler.routing.router
    import scheduler.vllm.router
    model = VLLMModel.from_dir(write_checkpoint(str(tmp_path / "checkpoint")), block_size=16)
    clock = Clock()
    for module in (scheduler.routing.router, scheduler.vllm.router):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    assert asyncio.run(_two_behind_one(model, clock, (0.3, 0.2), measured=False)) == []
