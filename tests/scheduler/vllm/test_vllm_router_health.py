"""The vLLM router keeps the base router's books of instances that are down (engine id → why):
the front door's health checks take a vLLM instance that does not answer out of routing, the
report names it and the reason, and it is back once it answers. No vLLM engine here: the
instances are HTTP servers on 127.0.0.1 answering ``/metrics`` as vLLM does, and a port that
nothing listens on until the dead instance comes back there."""
from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web

from engines.vllm.checkpoint import write_checkpoint
from launcher.supervisor import free_port
from scheduler.frontdoor.health import HealthChecker
from scheduler.policy.admission import AdmissionConfig, Rejection
from scheduler.policy.conductor import ConductorConfig
from scheduler.routing.route_plan import RoutePlan
from scheduler.routing.router import DecodeInstance, PrefillInstance
from scheduler.vllm.instances import VLLMClient, VLLMModel
from scheduler.vllm.router import VLLMRouter

METRICS = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.0\n"


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(text=METRICS)


async def _serve(port: int) -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/metrics", _metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _down_and_back(model: VLLMModel) -> None:
    live, dead = free_port(), free_port()
    runners = [await _serve(live)]
    clients = [VLLMClient(f"http://127.0.0.1:{port}", role, model, name) for name, port, role in
               (("vllm-prefill-0", live, "prefill"), ("vllm-prefill-1", dead, "prefill"),
                ("vllm-decode-0", live, "decode"))]
    infos = [await c.info() for c in clients]
    router = VLLMRouter([PrefillInstance(c, i) for c, i in zip(clients[:2], infos[:2])],
                        [DecodeInstance(clients[2], infos[2])], None, model)
    checks = HealthChecker(router, timeout_s=5.0)
    try:
        await checks.check_once()
        report = checks.report()
        assert report.status == "degraded"
        assert [r for r in report.reasons if r.startswith("prefill vllm-prefill-1: ")], report.reasons
        assert router.serving("prefill") == ["vllm-prefill-0"] and "vllm-prefill-1" in router.down
        runners.append(await _serve(dead))                  # the instance answers again
        await checks.check_once()
        assert checks.report().status == "ok" and router.down == {}
        assert router.serving("prefill") == ["vllm-prefill-0", "vllm-prefill-1"]
    finally:
        await router.close()
        for runner in runners:
            await runner.cleanup()


def test_a_vllm_instance_that_does_not_answer_is_reported_down_and_comes_back(tmp_path: Path) -> None:
    model = VLLMModel.from_dir(write_checkpoint(str(tmp_path / "checkpoint")), block_size=16)
    asyncio.run(_down_and_back(model))


async def _colocated_reroute(model: VLLMModel) -> None:
    ports = [free_port(), free_port()]
    runners = [await _serve(port) for port in ports]
    clients = [VLLMClient(f"http://127.0.0.1:{port}", "colocated", model, f"vllm-{i}") for i, port in enumerate(ports)]
    infos = [await c.info() for c in clients]
    router = VLLMRouter([PrefillInstance(c, i) for c, i in zip(clients, infos)],
                        [DecodeInstance(c, i) for c, i in zip(clients, infos)], None, model, "colocated")
    try:
        plan = await router.plan("r1", list(range(100)), "alice", max_tokens=8)
        assert not isinstance(plan, Rejection)
        assert plan.prefill_id == plan.decode_id == "vllm-0"
        router.begin(plan)
        moved = router.reroute(plan, "decode", {"vllm-0"})        # the instance failed, nothing sent
        assert moved is not None and moved.prefill_id == moved.decode_id == "vllm-1"
        assert "r1" not in router.prefill["vllm-0"].backlog and "r1" in router.prefill["vllm-1"].backlog
        assert "r1" not in router.decode["vllm-0"].work and "r1" in router.decode["vllm-1"].work
        assert router.reroute(moved, "decode", {"vllm-0", "vllm-1"}) is None   # nowhere else to go
        router.finished(moved)
        assert not router.prefill["vllm-1"].backlog and not router.decode["vllm-1"].work
    finally:
        await router.close()
        for runner in runners:
            await runner.cleanup()


def test_a_colocated_request_moves_whole_to_another_instance(tmp_path: Path) -> None:
    """Colocated, a request whose instance failed before anything was sent moves with its
    prefill queue entry and its decode work to the other instance (VLLMRouter.reroute)."""
    model = VLLMModel.from_dir(write_checkpoint(str(tmp_path / "checkpoint")), block_size=16)
    asyncio.run(_colocated_reroute(model))


async def _sequences(model: VLLMModel) -> None:
    ports = [free_port(), free_port()]
    runners = [await _serve(port) for port in ports]
    clients = [VLLMClient(f"http://127.0.0.1:{ports[0]}", "prefill", model, "vllm-prefill-0"),
               VLLMClient(f"http://127.0.0.1:{ports[1]}", "decode", model, "vllm-decode-0")]
    infos = [await c.info() for c in clients]
    config = ConductorConfig(admission=AdmissionConfig(max_inflight=8, max_inflight_per_tenant=4))
    router = VLLMRouter([PrefillInstance(clients[0], infos[0])], [DecodeInstance(clients[1], infos[1])], None,
                        model, config=config, decode_max_running=6)
    try:
        plan = await router.plan("a1", list(range(100)), "alice", max_tokens=8, sequences=3)
        assert isinstance(plan, RoutePlan) and plan.sequences == 3
        router.begin(plan)
        assert router.inflight == 3 and router.inflight_by_tenant == {"alice": 3}
        assert router.decode_running() == {"vllm-decode-0": 3}
        assert router.decode["vllm-decode-0"].work["a1"].kv_tokens == 100 + 3 * 8
        more = await router.plan("a2", list(range(100)), "alice", max_tokens=8, sequences=2)
        assert isinstance(more, Rejection) and more.reason == "tenant_max_inflight"   # 3 + 2 > 4
        full = await router.plan("b1", list(range(100)), "bob", max_tokens=8, sequences=4)
        assert isinstance(full, Rejection) and full.reason == "decode_capacity"       # 3 + 4 > 6 slots
        fits = await router.plan("b2", list(range(100)), "bob", max_tokens=8, sequences=3)
        assert isinstance(fits, RoutePlan)
        router.begin(fits)
        assert router.inflight == 6 and router.decode_running() == {"vllm-decode-0": 6}
        router.finished(plan)
        router.finished(fits)
        assert router.inflight == 0 and router.inflight_by_tenant == {}
        assert router.decode_running() == {"vllm-decode-0": 0}
    finally:
        await router.close()
        for runner in runners:
            await runner.cleanup()


def test_a_request_of_n_sequences_is_admitted_and_counted_as_n(tmp_path: Path) -> None:
    """OpenAI's ``n`` over vLLM: a request decoding 3 sequences holds 3 places in flight, 3 of
    its tenant's and 3 decode slots until it finishes (counted once, one tenant's request of
    n=16 ran past a bound of 4)."""
    model = VLLMModel.from_dir(write_checkpoint(str(tmp_path / "checkpoint")), block_size=16)
    asyncio.run(_sequences(model))


def test_a_checkpoint_directory_without_its_weights_is_refused_naming_why(tmp_path: Path) -> None:
    """The connector's keys hash the checkpoint's weights: a front door given the directory
    without them (config and tokenizer only) would key every prompt apart from vLLM's, so
    it refuses to start, saying so."""
    import os

    import pytest

    from engines.checkpoint_identity import WEIGHT_SUFFIXES
    from kvstore.errors import InvalidArgument

    model_dir = write_checkpoint(str(tmp_path / "checkpoint"))
    assert VLLMModel.from_dir(model_dir, block_size=16).paged.revision
    for name in os.listdir(model_dir):
        if name.endswith(WEIGHT_SUFFIXES):
            os.remove(os.path.join(model_dir, name))
    with pytest.raises(InvalidArgument, match=r"holds no weight files .* would match none of theirs"):
        VLLMModel.from_dir(model_dir, block_size=16)
