"""Async gRPC client of an engine (prefill or decode), for the scheduler."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from engines.types import (
    GREEDY,
    DecodeStep,
    EngineInfo,
    EngineLoad,
    PrefillResult,
    ProfilePoint,
    SamplingParams,
    TokenLogprobs,
)
from kvstore.auth import bearer_metadata
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.events.event import NodeSnapshot
from kvstore.index.keys import KVLayout
from kvstore.wire.channel import GRPC_OPTIONS
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc as pb_grpc


class EngineClient:
    """Calls one engine at ``address`` (host:port). Must be created inside a running event
    loop. Raises :class:`Unavailable` when the engine cannot be reached or fails, and
    :class:`InvalidArgument` when it rejects the request. ``auth_token``: the engines' token
    (kvstore/auth.py), sent with every call; an engine that requires another refuses the
    calls (Unavailable, naming UNAUTHENTICATED)."""

    def __init__(self, address: str, timeout_s: float = 600.0, auth_token: str | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._meta = bearer_metadata(auth_token)
        self._channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = pb_grpc.EngineStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        try:
            import asyncio
            async with asyncio.timeout(timeout_s):
                await self._channel.channel_ready()
        except Exception:
            raise Unavailable(f"engine at {self.address} not ready after {timeout_s} s") from None

    async def info(self) -> EngineInfo:
        r = await self._unary(self._stub.Info, pb.InfoRequest())
        return EngineInfo(r.engine_id, r.role, r.model_id, r.revision, KVLayout.from_json(r.layout_json),
                          r.block_size, r.vocab_size, r.eos_token_id, r.device, r.max_model_len,
                          tuple(ProfilePoint(p.batch, p.tokens, p.seconds) for p in r.profile))

    async def load(self) -> EngineLoad:
        r = await self._unary(self._stub.Load, pb.LoadRequest())
        return EngineLoad(r.queued, r.running, r.queued_tokens)

    async def prefill(self, request_id: str, prompt: Sequence[int], namespace: str,
                      max_load_blocks: int | None = None, sampling: SamplingParams = GREEDY,
                      top_logprobs: int | None = None, recompute: bool = False) -> PrefillResult:
        """``max_load_blocks``: the longest prefix (blocks) the engine may load from the pool
        (None: any hit; its own cache is never limited); ``sampling``: how the first token
        is chosen; ``top_logprobs``: set, the result carries the first token's logprobs and
        that many alternatives'. ``recompute``: pool off — the engine computes every token
        and reads or writes no cache (protos/engine.proto)."""
        r = await self._unary(self._stub.Prefill, pb.PrefillRequest(
            request_id=request_id, prompt=list(prompt), namespace=namespace,
            max_load_blocks=max_load_blocks, sampling=_sampling_pb(sampling), top_logprobs=top_logprobs,
            recompute=recompute))
        return PrefillResult(r.request_id, r.first_token, tuple(r.block_keys), r.cached_tokens,
                             r.computed_tokens, r.tail_kv, r.tail_tokens, r.prefill_s,
                             r.loaded_blocks, r.stored_blocks, r.load_s, r.load_bytes, r.load_tier,
                             _logprobs(r, "first_logprobs"))

    async def decode(self, request_id: str, prompt: Sequence[int], namespace: str,
                     prefill: PrefillResult, max_tokens: int,
                     stop_token_ids: Sequence[int] = (),
                     sampling: SamplingParams = GREEDY,
                     top_logprobs: int | None = None) -> AsyncIterator[DecodeStep]:
        """Stream the generated tokens, the prefill's first token included (index 0), chosen
        as ``sampling`` says (the same parameters the prefill was given); with
        ``top_logprobs`` each step after the first carries its logprobs.
        Cancelling the iteration (or the task running it) cancels the call on the engine."""
        call = self._stub.Decode(pb.DecodeRequest(
            request_id=request_id, prompt=list(prompt), namespace=namespace,
            first_token=prefill.first_token, block_keys=list(prefill.block_keys),
            tail_kv=prefill.tail_kv, tail_tokens=prefill.tail_tokens, max_tokens=max_tokens,
            stop_token_ids=list(stop_token_ids), sampling=_sampling_pb(sampling), top_logprobs=top_logprobs),
            timeout=self.timeout_s, metadata=self._meta)
        try:
            async for m in call:
                yield DecodeStep(m.token, m.index, m.finished, m.finish_reason, _logprobs(m, "logprobs"))
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, self.address) from None
        finally:
            call.cancel()

    async def _unary(self, fn: Callable[..., Any], request: Any) -> Any:
        try:
            return await fn(request, timeout=self.timeout_s, metadata=self._meta)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, self.address) from None


def _sampling_pb(s: SamplingParams) -> pb.SamplingParams | None:
    return None if s.greedy else pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=s.seed)


def _logprobs(message: pb.PrefillResponse | pb.DecodeToken, field: str) -> TokenLogprobs | None:
    if not message.HasField(field):
        return None
    lp = getattr(message, field)
    return TokenLogprobs(lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs)))


# Codes of an engine that is there but failed this one request (its handler raised): the
# request may move to another instance, the engine stays in routing for everyone else.
_REQUEST_FAILED = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS,
                   grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE)


def _translate(exc: grpc.aio.AioRpcError, address: str) -> Exception:
    """INVALID_ARGUMENT → InvalidArgument (the client's fault: a 400); a failure of this
    request only (:data:`_REQUEST_FAILED`) → KVStoreError; anything else (not reachable, a
    deadline, refused credentials) → Unavailable: the engine is treated as gone."""
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(exc.details() or "invalid argument")
    if exc.code() in _REQUEST_FAILED:
        return KVStoreError(f"engine at {address} failed the request: {exc.code().name}: {exc.details()}")
    return Unavailable(f"engine at {address}: {exc.code().name}: {exc.details()}")


def engine_snapshot(address: str, auth_token: str | None = None, timeout_s: float = 10.0) -> NodeSnapshot:
    """The prefill engine at ``address``'s own cache as of its last KV event (the engine's
    ``Snapshot`` RPC), synchronously: what :class:`kvstore.events.IndexReplica` calls from
    its thread to resynchronise after a lost event. Raises Unavailable when the engine
    cannot be reached or refuses."""
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        try:
            r = pb_grpc.EngineStub(channel).Snapshot(pb.CacheSnapshotRequest(), timeout=timeout_s,
                                                     metadata=bearer_metadata(auth_token))
        except grpc.RpcError as exc:
            raise Unavailable(f"engine at {address}: snapshot failed: {exc.code().name}: {exc.details()}") from None
    return NodeSnapshot(r.node_id, r.epoch, r.seq, tuple(zip(r.keys, r.tiers, r.sizes)))
