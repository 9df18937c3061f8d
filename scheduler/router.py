"""The router: builds the decision views (:mod:`scheduler.views`) from live state, asks the
scheduling policy (:mod:`scheduler.conductor`, :mod:`scheduler.baselines`), and keeps the
bookkeeping of work in flight that the next decisions need (DESIGN.md §7).

For a prompt it computes the block keys (the engines' key spec), asks the store node for the
pool's prefix hit by tier and its own replica for each prefill instance's local hit, and
hands the policy: per prefill instance the predicted seconds queued there (T_queue) and its
hit; per decode instance the requests it holds and those it will receive, with predicted
join and finish instants; ``now_s`` from ``time.monotonic()``. Finished prefills feed the
T_prefill regression, finished decodes the TBT regression.

The live engines fetch a longer pool hit themselves — no further than the plan's
``max_load_blocks`` when the policy chose to recompute — and cannot read a peer's cache, so
the router runs policies with ``peer_fetch`` off. The prefill engines report how long their
pool reads took and how many bytes they moved; :meth:`Router.prefill_finished` feeds that to
the policy's bandwidth estimate (seeded from the configured defaults until then). A
prefill instance keeps what it fetched, and the replica records the whole prompt on it (hot
prefixes replicate by themselves). KV transfers a request owns in-process
(:mod:`scheduler.transfer`) are registered in ``transfers`` and aborted by ``finished``; the
engines' own transfers go through the store service, whose streamed put aborts its
reservation when the stream breaks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

from engines.client import EngineClient
from engines.kv import block_bytes
from engines.types import EngineInfo, PrefillResult
from kvstore.client import StoreClient
from kvstore.errors import InvalidArgument, KVStoreError
from scheduler.admission import AdmissionConfig, Rejection
from scheduler.cache_replica import LocalCacheReplica
from scheduler.conductor import Conductor, ConductorConfig
from scheduler.keys import prompt_keys
from scheduler.policy import DEFAULT_POLICY, make_policy
from scheduler.transfer import TransferTable
from scheduler.views import (NO_HIT, ClusterView, Decision, DecodeView, DecodeWork, PrefillView, RequestView,
                             TierHit, load_limit)

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


@dataclass
class PrefillInstance:
    """A prefill engine and the predicted seconds of each request routed to it whose prefill
    has not finished (``queue_s`` is their sum: T_queue)."""

    client: EngineClient
    info: EngineInfo
    inflight: dict[str, float] = field(default_factory=dict)

    @property
    def queue_s(self) -> float:
        return sum(self.inflight.values())


@dataclass
class DecodeInstance:
    """A decode engine and the requests routed to it and not yet finished, with their
    predicted join and finish instants."""

    client: EngineClient
    info: EngineInfo
    work: dict[str, DecodeWork] = field(default_factory=dict)

    @property
    def running(self) -> int:
        return len(self.work)


@dataclass(frozen=True)
class RoutePlan:
    """An admitted request: its identity, block keys, the pool's hit, and the policy's
    :class:`Decision` (instances, fetch, predicted TTFT and TBT). ``max_load_blocks``: the
    prefix the prefill engine may load from the pool (:func:`scheduler.views.load_limit`:
    set when the policy chose to recompute what the pool holds; None: any hit)."""

    request_id: str
    namespace: str
    prompt_tokens: int
    max_tokens: int
    keys: tuple[bytes, ...]
    pool_hit: TierHit
    decision: Decision
    max_load_blocks: int | None = None

    @property
    def predicted_ttft_s(self) -> float:
        return self.decision.ttft_s

    @property
    def prefill_id(self) -> str:
        return self.decision.prefill_id

    @property
    def decode_id(self) -> str:
        return self.decision.decode_id


class Router:
    """Holds the engine clients, the policy and the in-flight state. Used from one event
    loop; ``plan`` is the only coroutine, so a caller that calls ``begin`` right after
    ``plan`` returns sees the state ``plan`` saw (no await in between).

    Invariant: ``inflight`` equals the number of ``begin`` calls minus ``finished`` calls.
    """

    def __init__(self, prefill: Sequence[PrefillInstance], decode: Sequence[DecodeInstance],
                 store: StoreClient | None, policy: str = DEFAULT_POLICY,
                 config: ConductorConfig | None = None, local_cache_blocks: int = 4096,
                 decode_max_running: int = 64, decode_kv_capacity_tokens: int = 1 << 20) -> None:
        if not prefill or not decode:
            raise InvalidArgument(f"need at least one prefill and one decode engine, got "
                                  f"{len(prefill)} prefill and {len(decode)} decode")
        _check_compatible([p.info for p in prefill] + [d.info for d in decode])
        self.prefill = {p.info.engine_id: p for p in prefill}
        self.decode = {d.info.engine_id: d for d in decode}
        if len(self.prefill) != len(prefill) or len(self.decode) != len(decode):
            raise InvalidArgument("engine ids must be unique; give each engine its own --engine-id")
        self.info = prefill[0].info
        self.store = store
        layout = self.info.layout
        nbytes = block_bytes(layout, layout.block_size, DTYPE_BYTES.get(layout.dtype, 4))
        config = dataclasses.replace(config or ConductorConfig(), peer_fetch=False)
        self.policy: Conductor = make_policy(policy, nbytes, config)
        self.replica = LocalCacheReplica(local_cache_blocks)
        self.transfers = TransferTable()
        self.decode_max_running = decode_max_running
        self.decode_kv_capacity_tokens = decode_kv_capacity_tokens
        self.inflight = 0

    @classmethod
    async def connect(cls, prefill_addresses: Sequence[str], decode_addresses: Sequence[str],
                      store_address: str | None, *, policy: str = DEFAULT_POLICY,
                      config: ConductorConfig | None = None, store_auth_token: str | None = None,
                      local_cache_blocks: int = 4096, decode_max_running: int = 64,
                      decode_kv_capacity_tokens: int = 1 << 20, ready_timeout_s: float = 60.0,
                      store_redis: str | None = None, engine_auth_token: str | None = None) -> "Router":
        """Connect to the engines (host:port each; ``engine_auth_token``: the engines' token,
        kvstore/auth.py) and the store node (``store_redis``: every
        store node registered in that Redis, kvstore/cluster); waits until every engine
        answers ``Info``. Raises Unavailable if one does not within ``ready_timeout_s`` and
        InvalidArgument if roles, models or layouts disagree, or the policy is unknown."""
        opened: list[EngineClient] = []
        try:
            pre, dec = [], []
            for addresses, kind, out in ((prefill_addresses, PrefillInstance, pre),
                                         (decode_addresses, DecodeInstance, dec)):
                for address in addresses:
                    client = EngineClient(address, auth_token=engine_auth_token)
                    opened.append(client)
                    await client.wait_ready(ready_timeout_s)
                    out.append(kind(client, await client.info()))
            for inst, role in [(p, "prefill") for p in pre] + [(d, "decode") for d in dec]:
                if inst.info.role != role:
                    raise InvalidArgument(f"engine {inst.info.engine_id} at {inst.client.address} is a "
                                          f"{inst.info.role!r} engine, listed as {role!r}")
        except BaseException:
            for client in opened:
                await client.close()
            raise
        store = StoreClient(store_address, auth_token=store_auth_token) if store_address else None
        if store_redis:
            from kvstore.cluster.client import ClusterClient
            store = ClusterClient(store_redis, auth_token=store_auth_token)  # type: ignore[assignment]
        try:
            return cls(pre, dec, store, policy, config, local_cache_blocks, decode_max_running,
                       decode_kv_capacity_tokens)
        except BaseException:
            for client in opened:
                await client.close()
            if store is not None:
                store.close()
            raise

    async def close(self) -> None:
        for inst in [*self.prefill.values(), *self.decode.values()]:
            await inst.client.close()
        if self.store is not None:
            self.store.close()

    @property
    def admission(self) -> AdmissionConfig:
        return self.policy.config.admission

    # -- deciding ---------------------------------------------------------------------------
    async def plan(self, request_id: str, tokens: Sequence[int], namespace: str,
                   max_tokens: int = 16) -> RoutePlan | Rejection:
        """Choose the instances for a prompt of token ids, or reject it (before any prefill).
        Raises InvalidArgument for bad token ids. A store node that cannot be reached counts
        as a pool miss."""
        keys = tuple(self.prompt_keys(tokens, namespace))
        pool_hit = await self._pool_hit(keys)
        request = RequestView(request_id, len(tokens), keys, max_tokens, self.info.block_size)
        result = self.policy.decide(request, self.cluster_view(keys, pool_hit))
        if isinstance(result, Rejection):
            return result
        return RoutePlan(request_id, namespace, len(tokens), max_tokens, keys, pool_hit, result,
                         load_limit(result, pool_hit, self.info.block_size))

    def prompt_keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        """The pool keys of the prompt's full blocks, as the engines key them."""
        return prompt_keys(tokens, self.info, namespace)

    def cluster_view(self, keys: Sequence[bytes], pool_hit: TierHit = NO_HIT,
                     now_s: float | None = None) -> ClusterView:
        """The policy's view of the cluster for a prompt with block ``keys`` (no await)."""
        per_node = self.replica.index.match(keys).per_node if keys else {}
        prefill = tuple(PrefillView(engine_id, inst.queue_s, len(inst.inflight),
                                    TierHit.from_tiers(per_node[engine_id]) if engine_id in per_node else NO_HIT)
                        for engine_id, inst in self.prefill.items())
        decode = tuple(DecodeView(engine_id, tuple(inst.work.values()), self.decode_max_running,
                                  self.decode_kv_capacity_tokens)
                       for engine_id, inst in self.decode.items())
        now = time.monotonic() if now_s is None else now_s
        return ClusterView(now, prefill, decode, pool_hit, self.inflight)

    async def _pool_hit(self, keys: Sequence[bytes]) -> TierHit:
        if self.store is None or not keys:
            return NO_HIT
        try:
            found = await asyncio.to_thread(self.store.lookup, keys)
        except KVStoreError as exc:
            log.warning("store lookup failed, counting a pool miss: %s", exc)
            return NO_HIT
        return TierHit.from_tiers(found.tiers[:found.blocks])

    # -- bookkeeping ------------------------------------------------------------------------
    def begin(self, plan: RoutePlan) -> None:
        """Count the admitted request as queued on its prefill and incoming on its decode."""
        d = plan.decision
        self.prefill[d.prefill_id].inflight[plan.request_id] = d.ttft_s - d.queue_s
        self.decode[d.decode_id].work[plan.request_id] = DecodeWork(
            plan.prompt_tokens + plan.max_tokens, d.decode_start_s, d.decode_finish_s)
        self.inflight += 1

    def prefill_finished(self, plan: RoutePlan, result: PrefillResult | None) -> None:
        """The prefill is over (``result`` None: it failed or was cancelled). On success the
        T_prefill fit learns from it, the replica records the prompt's blocks on the
        instance, and the request's decode work is re-timed from now."""
        self.prefill[plan.prefill_id].inflight.pop(plan.request_id, None)
        if result is None:
            return
        self.policy.observe_prefill(plan.prompt_tokens, result.cached_tokens, result.prefill_s)
        if result.load_bytes > 0 and result.load_s > 0:
            # A measured read from the pool: the tier's bandwidth estimate moves towards it
            # (seeded from the configured defaults until then).
            latency = self.policy.config.bandwidths.fetch_latency_s
            seconds = result.load_s - latency if result.load_s > 2 * latency else result.load_s
            self.policy.observe_transfer(result.load_tier or "dram", result.load_bytes, seconds, remote=True)
        self.replica.add_chain(plan.prefill_id, result.block_keys)
        work = self.decode[plan.decode_id].work
        if plan.request_id in work:
            now = time.monotonic()
            span = plan.decision.decode_finish_s - plan.decision.decode_start_s
            work[plan.request_id] = DecodeWork(work[plan.request_id].kv_tokens, now, now + span)

    def observe_decode(self, plan: RoutePlan, mean_tbt_s: float) -> None:
        """A decode finished with ``mean_tbt_s`` between its tokens: feed the TBT fit with the
        batch and KV it shared the instance with."""
        inst = self.decode[plan.decode_id]
        now = time.monotonic()
        live = [w for w in inst.work.values() if w.start_s <= now]
        self.policy.observe_decode(max(1, len(live)), sum(w.kv_tokens for w in live), mean_tbt_s)

    def finished(self, plan: RoutePlan) -> None:
        """The request is over, whatever the outcome; call exactly once per ``begin``. Aborts
        the request's KV transfers still running (their leases and reservations are freed)."""
        self.transfers.finish(plan.request_id)
        self.prefill[plan.prefill_id].inflight.pop(plan.request_id, None)
        self.decode[plan.decode_id].work.pop(plan.request_id, None)
        self.inflight -= 1

    def prefill_client(self, plan: RoutePlan) -> EngineClient:
        return self.prefill[plan.prefill_id].client

    def decode_client(self, plan: RoutePlan) -> EngineClient:
        return self.decode[plan.decode_id].client

    def queue_depths(self) -> dict[str, int]:
        """Prefill engine id → requests routed to it whose prefill has not finished."""
        return {engine_id: len(inst.inflight) for engine_id, inst in self.prefill.items()}

    def decode_running(self) -> dict[str, int]:
        return {engine_id: inst.running for engine_id, inst in self.decode.items()}


def _check_compatible(infos: Sequence[EngineInfo]) -> None:
    first = infos[0]
    for info in infos[1:]:
        for name in ("model_id", "revision", "layout", "block_size", "vocab_size"):
            if getattr(info, name) != getattr(first, name):
                raise InvalidArgument(f"engines disagree on {name}: {info.engine_id} has "
                                      f"{getattr(info, name)!r}, {first.engine_id} has {getattr(first, name)!r}")
