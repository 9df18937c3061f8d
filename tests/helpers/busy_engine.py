"""A real gRPC Engine/Load handler that answers only once released: an engine too busy to
answer health checks, and one whose handler fails every prefill (tests/scheduler/frontdoor/test_frontdoor_health.py)."""
from __future__ import annotations

import threading

import grpc

from protos import engine_pb2 as pb


def busy_engine_handler(release: threading.Event) -> grpc.GenericRpcHandler:
    """``kvstore.engine.v1.Engine/Load`` that waits for ``release`` (at most 30 s) and then
    answers an idle load; every other method is UNIMPLEMENTED."""
    def load(request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.EngineLoad:
        release.wait(30)
        return pb.EngineLoad(queued=0, running=0, queued_tokens=0)

    return grpc.method_handlers_generic_handler("kvstore.engine.v1.Engine", {
        "Load": grpc.unary_unary_rpc_method_handler(
            load, request_deserializer=pb.LoadRequest.FromString,
            response_serializer=pb.EngineLoad.SerializeToString)})


def failing_engine_handler(failures: list[str]) -> grpc.GenericRpcHandler:
    """``kvstore.engine.v1.Engine/Prefill`` whose handler raises (gRPC UNKNOWN, as an engine's
    bug would), recording each request id in ``failures``; ``Load`` answers idle."""
    def prefill(request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        failures.append(request.request_id)
        raise RuntimeError("the engine failed this request")

    def load(request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.EngineLoad:
        return pb.EngineLoad(queued=0, running=0, queued_tokens=0)

    return grpc.method_handlers_generic_handler("kvstore.engine.v1.Engine", {
        "Prefill": grpc.unary_unary_rpc_method_handler(
            prefill, request_deserializer=pb.PrefillRequest.FromString,
            response_serializer=pb.PrefillResponse.SerializeToString),
        "Load": grpc.unary_unary_rpc_method_handler(
            load, request_deserializer=pb.LoadRequest.FromString,
            response_serializer=pb.EngineLoad.SerializeToString)})
