"""The engines' gRPC service (protos/engine.proto) and ``start_engine``, which builds the
model, the engine and its server in one call."""
from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import torch

from engines.decode import DecodeEngine
from engines.metrics import EngineMetrics
from engines.model import DEFAULT_MAX_MODEL_LEN, LoadedModel, ModelConfig, load_model
from engines.prefill import PrefillEngine
from engines.profiling import describe, profile_engine
from engines.sampling import MAX_TOP_LOGPROBS
from engines.types import GREEDY, ROLES, ProfilePoint, SamplingParams, TokenLogprobs
from kvstore.auth import ENGINE_TOKEN_ENV, interceptors_for
from kvstore.block_store import BlockStore
from kvstore.client import StoreClient
from kvstore.errors import Cancelled, InvalidArgument, KVStoreError
from kvstore.events.channel import make_channel
from kvstore.limits import check_keys
from kvstore.metrics_http import MetricsServer
from kvstore.wire.channel import listen, server_options
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class EngineServicer(pb_grpc.EngineServicer):
    """``metrics``: where prefills and decodes are counted and timed (engines/metrics.py)."""

    def __init__(self, engine: PrefillEngine | DecodeEngine, metrics: EngineMetrics | None = None,
                 profile: Sequence[ProfilePoint] = ()) -> None:
        self.engine = engine
        self.metrics = metrics
        self.profile = [pb.ProfilePoint(batch=p.batch, tokens=p.tokens, seconds=p.seconds) for p in profile]

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.EngineInfo:
        lm: LoadedModel = self.engine.lm
        return pb.EngineInfo(engine_id=self.engine.engine_id, role=self.engine.role,
                             model_id=lm.model_id, revision=lm.revision,
                             layout_json=lm.layout.to_json(), block_size=lm.layout.block_size,
                             vocab_size=lm.vocab_size, eos_token_id=lm.eos_token_id,
                             device=str(lm.device), max_model_len=lm.max_model_len, profile=self.profile)

    def Snapshot(self, request: pb.CacheSnapshotRequest, context: grpc.ServicerContext) -> pb.CacheSnapshot:
        """The prefill engine's own cache as of its last KV event (a decode engine has none)."""
        if not isinstance(self.engine, PrefillEngine):
            return pb.CacheSnapshot(node_id=self.engine.engine_id)
        snap = self.engine.local.snapshot()
        return pb.CacheSnapshot(node_id=snap.node, epoch=snap.epoch, seq=snap.seq,
                                keys=[k for k, _, _ in snap.entries], tiers=[t for _, t, _ in snap.entries],
                                sizes=[n for _, _, n in snap.entries])

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> pb.EngineLoad:
        load = self.engine.load()
        return pb.EngineLoad(queued=load.queued, running=load.running, queued_tokens=load.queued_tokens)

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> pb.PrefillResponse:
        if not isinstance(self.engine, PrefillEngine):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.engine.engine_id} is a decode engine")
        try:
            limit = request.max_load_blocks if request.HasField("max_load_blocks") else None
            r = self.engine.prefill(request.request_id, list(request.prompt), request.namespace, limit,
                                    sampling_from_pb(request), top_logprobs_from_pb(request),
                                    recompute=request.recompute, cancelled=lambda: not context.is_active())
        except Cancelled as exc:
            if self.metrics is not None:
                self.metrics.cancelled()
            context.abort(grpc.StatusCode.CANCELLED, str(exc))
        except InvalidArgument as exc:
            self._failed()
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVStoreError as exc:
            self._failed()
            context.abort(grpc.StatusCode.INTERNAL, str(exc))
        if self.metrics is not None:
            self.metrics.observe_prefill(r)
        return pb.PrefillResponse(request_id=r.request_id, first_token=r.first_token,
                                  block_keys=list(r.block_keys), cached_tokens=r.cached_tokens,
                                  computed_tokens=r.computed_tokens, tail_kv=r.tail_kv,
                                  tail_tokens=r.tail_tokens, prefill_s=r.prefill_s,
                                  loaded_blocks=r.loaded_blocks, stored_blocks=r.stored_blocks,
                                  load_s=r.load_s, load_bytes=r.load_bytes, load_tier=r.load_tier,
                                  first_logprobs=logprobs_pb(r.first_logprobs))

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.DecodeToken]:
        if not isinstance(self.engine, DecodeEngine):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.engine.engine_id} is a prefill engine")
        try:
            check_keys(request.block_keys, "block_keys")
            sampling = sampling_from_pb(request)
            top_logprobs = top_logprobs_from_pb(request)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        steps = self.engine.decode(request.request_id, list(request.prompt), request.first_token,
                                   list(request.block_keys), request.tail_kv, request.max_tokens,
                                   list(request.stop_token_ids), lambda: not context.is_active(),
                                   namespace=request.namespace, sampling=sampling, top_logprobs=top_logprobs)
        if self.metrics is not None:
            steps = self.metrics.timed_decode(steps)
        try:
            for step in steps:
                yield pb.DecodeToken(token=step.token, index=step.index, finished=step.finished,
                                     finish_reason=step.finish_reason, logprobs=logprobs_pb(step.logprobs))
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except KVStoreError as exc:
            context.abort(grpc.StatusCode.INTERNAL, str(exc))

    def _failed(self) -> None:
        if self.metrics is not None:
            self.metrics.failed()


_METRICS: dict[int, MetricsServer] = {}   # id(server) -> the engine's metrics port


def metrics_url(server: grpc.Server) -> str | None:
    """``http://host:port/metrics`` of an engine started with a metrics port; None without."""
    metrics = _METRICS.get(id(server))
    return metrics.url if metrics is not None else None


def stop_metrics(server: grpc.Server) -> None:
    """Close the metrics port of an engine :func:`start_engine` started (if any)."""
    metrics = _METRICS.pop(id(server), None)
    if metrics is not None:
        metrics.close()


MAX_TEMPERATURE = 2.0   # OpenAI's range: https://platform.openai.com/docs/api-reference/completions/create


def sampling_from_pb(request: pb.PrefillRequest | pb.DecodeRequest) -> SamplingParams:
    """The request's sampling parameters (greedy when it carries none; a ``top_p`` of 0, the
    unset value, is 1). Raises InvalidArgument for a temperature outside [0, 2] or a top_p
    outside [0, 1] (NaN included)."""
    if not request.HasField("sampling"):
        return GREEDY
    s = request.sampling
    if not 0.0 <= s.temperature <= MAX_TEMPERATURE:
        raise InvalidArgument(f"sampling.temperature must be in [0, {MAX_TEMPERATURE:g}], got {s.temperature!r}")
    if not 0.0 <= s.top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p must be in [0, 1], got {s.top_p!r}")
    return SamplingParams(float(s.temperature), float(s.top_p) or 1.0, int(s.seed))


def top_logprobs_from_pb(request: pb.PrefillRequest | pb.DecodeRequest) -> int | None:
    """How many alternatives' log probabilities a request asks for (None: no logprobs).
    Raises InvalidArgument above MAX_TOP_LOGPROBS."""
    if not request.HasField("top_logprobs"):
        return None
    if request.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
    return int(request.top_logprobs)


def logprobs_pb(lp: TokenLogprobs | None) -> pb.TokenLogprobs | None:
    if lp is None:
        return None
    return pb.TokenLogprobs(logprob=lp.logprob, top_ids=[i for i, _ in lp.top], top_logprobs=[v for _, v in lp.top])


def default_engine_id(role: str, port: int) -> str:
    """``<role>-<host name>-<port>``: the same for an engine restarted on the same host and
    port, so the front door, which knows its engines by the id they gave when it connected,
    and the KV events of its new life (a new epoch) still name it (a random id made a
    restarted engine a stranger: logs and /health named its previous life, and the router
    took its cache's events for the pool's blocks); different for every engine of a host."""
    return f"{role}-{socket.gethostname()}-{port}"


def start_engine(role: str, store_address: str | None, *, model_dir: str | None = None,
                 block_size: int = 16, address: str = "127.0.0.1:0", engine_id: str | None = None,
                 dtype: str = "float32", device: str = "auto", local_cache_blocks: int = 4096,
                 store_token: str | None = None, workers: int = 80,
                 store_redis: str | None = None, auth_token: str | None = None,
                 metrics_port: int | None = None, kv_events: str | None = None,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN, profile: bool = True,
                 profile_lock: str | None = None) -> tuple[grpc.Server, int]:
    """Build the model and a ``role`` engine ("prefill" or "decode") using the store node at
    ``store_address`` — or, with ``store_redis``, every store node registered in that Redis
    (kvstore/cluster) — (neither: no pool), and serve it on ``address``. ``auth_token``:
    every call must carry ``authorization: Bearer <auth_token>`` (kvstore/auth.py), else it
    is refused with UNAUTHENTICATED — the request's namespace is the caller's word, so only
    the front door may hold this token; None serves any caller (and logs a warning).
    ``metrics_port``: also serve Prometheus metrics (engines/metrics.py) on this port of the
    same host, taking ``auth_token`` too (0: a free port, :func:`metrics_url`; None: none).
    ``kv_events``: a Redis URL; a prefill engine publishes its own cache's KV events there
    (the scheduler's index replica reads them; None: it publishes none).
    ``max_model_len``: the longest prompt + generation served (tokens; a checkpoint's
    ``max_position_embeddings`` caps it); a longer request is INVALID_ARGUMENT.
    ``profile``: run the profiling pass (engines/profiling.py) before serving and report it
    in ``Info``, from which the router seeds its predictors (False: none; the router keeps
    its built-in seeds). ``profile_lock``: a file the pass holds an exclusive lock on
    (:func:`engines.profiling.profile_engine`): engines given one profile one at a time.
    ``workers``: the server's threads; a decode stream holds one for as long as it runs, so
    the default serves the front door's ``--decode-max-running`` (64) streams at once with
    16 to spare for other calls (with 16 in all, 16 streams left no thread for the 17th
    request or a health check, and the engine was taken for dead).
    Returns (server, port). Raises ValueError for an unknown role or a ``max_model_len``
    < 1, RuntimeError when the address cannot be bound."""
    if role not in ROLES:
        raise ValueError(f"engine role must be one of {ROLES}, got {role!r}")
    lm = load_model(ModelConfig(model_dir=model_dir, dtype=dtype, device=device, block_size=block_size,
                                max_model_len=max_model_len))
    if lm.device.type == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    store: BlockStore | None = None
    if store_redis:
        from kvstore.cluster.client import ClusterClient
        store = ClusterClient(store_redis, auth_token=store_token)
    elif store_address:
        store = StoreClient(store_address, auth_token=store_token)
    points: tuple[ProfilePoint, ...] = ()
    if profile:
        t0 = time.perf_counter()
        try:
            points = profile_engine(lm, role, profile_lock)
        except Exception as exc:  # noqa: BLE001 - a failed pass must not stop the engine: no seeds
            log.warning("%s engine: profiling pass failed (%s); the router keeps its built-in seeds", role, exc)
        else:
            log.info("%s engine profiled on %s in %.2f s: %s", role, lm.device, time.perf_counter() - t0,
                     describe(points))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=server_options(),
                         interceptors=interceptors_for(auth_token))
    port = listen(server, address, "engine")
    engine_id = engine_id or default_engine_id(role, port)
    engine: PrefillEngine | DecodeEngine = (
        PrefillEngine(lm, store, engine_id, local_cache_blocks,
                      make_channel(kv_events, token=store_token) if kv_events else None) if role == "prefill"
        else DecodeEngine(lm, store, engine_id))
    metrics = EngineMetrics(engine) if metrics_port is not None else None
    pb_grpc.add_EngineServicer_to_server(EngineServicer(engine, metrics, points), server)
    if metrics is not None:
        _METRICS[id(server)] = MetricsServer(metrics.registry, address.rpartition(":")[0] or "127.0.0.1",
                                             metrics_port or 0, auth_token, f"{role} engine {engine_id}")
    server.start()
    log.info("%s engine %s on %s (port %d), model on %s", role, engine_id, address, port, lm.device)
    if not auth_token:
        log.warning("%s engine %s takes calls without a token: any caller that reaches port %d can run "
                    "requests in any tenant's namespace (give --auth-token or %s)", role, engine_id, port,
                    ENGINE_TOKEN_ENV)
    return server, port
