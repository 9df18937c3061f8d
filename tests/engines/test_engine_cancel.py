"""A prefill whose caller hung up while it waited for the model is dropped, not computed:
a client that sends prefills and cancels them cannot fill the engine's queue (and its gRPC
threads) with work for nobody. Real engine (the tiny model) behind its real gRPC server on
127.0.0.1; the test holds the model's lock to keep the prefills waiting."""
from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
import torch

from engines.metrics import EngineMetrics
from engines.model import ModelConfig, load_model
from engines.prefill import PrefillEngine
from engines.server import EngineServicer
from engines.types import EngineLoad
from kvstore.errors import Cancelled
from kvstore.wire.channel import listen, server_options
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc as pb_grpc

BS = 16


@pytest.fixture(scope="module")
def served():
    engine = PrefillEngine(load_model(ModelConfig(block_size=BS)), None, "prefill-cancel", local_cache_blocks=64)
    metrics = EngineMetrics(engine)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=server_options())
    port = listen(server, "127.0.0.1:0", "engine")
    pb_grpc.add_EngineServicer_to_server(EngineServicer(engine, metrics), server)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield engine, metrics, pb_grpc.EngineStub(channel)
    channel.close()
    server.stop(None).wait()


def prompt_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def counted(metrics: EngineMetrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value("kvstore_engine_requests_total",
                                              {"engine": "prefill-cancel", "outcome": outcome})
    assert value is not None
    return value


def computed_tokens(metrics: EngineMetrics) -> float:
    value = metrics.registry.get_sample_value("kvstore_engine_prompt_tokens_total",
                                              {"engine": "prefill-cancel", "source": "computed"})
    return value or 0.0


def wait_for(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_prefills_cancelled_while_queued_are_dropped_not_computed(served):
    engine, metrics, stub = served
    cancelled_before, computed_before = counted(metrics, "cancelled"), computed_tokens(metrics)
    engine._lock.acquire()          # the model is busy: every prefill below waits for it
    try:
        calls = [stub.Prefill.future(pb.PrefillRequest(request_id=f"gone-{i}", prompt=prompt_of(i, 3 * BS),
                                                       namespace="t")) for i in range(6)]
        wait_for(lambda: engine.load().queued == 6, "6 queued prefills")
        for call in calls:
            call.cancel()
        # Dropped while the model is still busy: the queue drains without computing anything.
        wait_for(lambda: engine.load().queued == 0, "the cancelled prefills to leave the queue")
        wait_for(lambda: counted(metrics, "cancelled") == cancelled_before + 6, "6 cancelled requests counted")
        assert engine.load().queued_tokens == 0 and engine.load().running == 0
    finally:
        engine._lock.release()
    assert computed_tokens(metrics) == computed_before
    assert all(call.cancelled() for call in calls)
    # The engine serves the next caller as before.
    r = stub.Prefill(pb.PrefillRequest(request_id="live", prompt=prompt_of(99, 2 * BS + 1), namespace="t"),
                     timeout=60)
    assert r.computed_tokens == 2 * BS + 1
    assert computed_tokens(metrics) == computed_before + 2 * BS + 1


def test_a_caller_gone_before_the_model_frees_is_never_computed(served):
    engine, _, _ = served
    held = len(engine.local.snapshot().entries)
    gone = [False]
    engine._lock.acquire()
    try:
        with futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(engine.prefill, "gone", prompt_of(7, BS), "t", cancelled=lambda: gone[0])
            wait_for(lambda: engine.load().queued == 1, "the prefill to queue")
            gone[0] = True
            with pytest.raises(Cancelled, match="the caller left"):
                waiting.result(timeout=10)
    finally:
        engine._lock.release()
    assert engine.load() == EngineLoad(0, 0, 0)
    assert len(engine.local.snapshot().entries) == held       # no block of it was computed or cached


def test_a_caller_gone_as_the_model_frees_leaves_it_free_and_a_failing_check_too(served):
    engine, _, _ = served
    with pytest.raises(Cancelled, match="before it began"):    # the model is free: checked once, gone
        engine.prefill("gone-at-once", prompt_of(8, BS), "t", cancelled=lambda: True)

    def broken() -> bool:
        raise RuntimeError("the check itself failed")
    with pytest.raises(RuntimeError, match="the check itself failed"):
        engine.prefill("broken-check", prompt_of(9, BS), "t", cancelled=broken)
    assert engine._lock.acquire(timeout=1), "the model's lock was left held"
    engine._lock.release()
    assert engine.load() == EngineLoad(0, 0, 0)
