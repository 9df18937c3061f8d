"""The router: which prefill and which decode instance serve a request, and the bookkeeping
of work in flight that the TTFT prediction needs (DESIGN.md §7, the thin policy).

For a prompt it computes the block keys (the engines' key spec), asks the store node for the
pool's prefix hit and its own replica for each prefill instance's local hit, predicts
``TTFT(i) = T_queue(i) + T_prefill(new tokens on i)`` and lets the :class:`Policy` choose.
The decode instance is the one with the fewest requests routed to it and not yet finished.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Sequence

from engines.client import EngineClient
from engines.types import EngineInfo, PrefillResult
from kvstore.client import StoreClient
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.index.keys import usable_prefix_tokens
from scheduler.cache_replica import LocalCacheReplica
from scheduler.keys import prompt_keys
from scheduler.policy import Policy, PrefillCandidate, make_policy
from scheduler.predictor import PredictorConfig, PrefillPredictor

log = logging.getLogger(__name__)


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
    """A decode engine and the number of requests routed to it and not yet finished."""

    client: EngineClient
    info: EngineInfo
    running: int = 0


@dataclass(frozen=True)
class RoutePlan:
    """The routing decision for one request. ``keys``: block keys of the prompt's full
    blocks; ``pool_hit_blocks``: the store node's prefix hit; ``prefill``: the chosen
    instance's estimate (its ``ttft_s`` is the predicted TTFT, seconds); ``decode_id``: the
    chosen decode instance."""

    request_id: str
    namespace: str
    prompt_tokens: int
    keys: tuple[bytes, ...]
    pool_hit_blocks: int
    prefill: PrefillCandidate
    decode_id: str

    @property
    def predicted_ttft_s(self) -> float:
        return self.prefill.ttft_s


class Router:
    """Holds the engine clients and the in-flight state. Used from one event loop; ``plan``
    is the only coroutine, so a caller that calls ``begin`` right after ``plan`` returns sees
    the state ``plan`` saw (no await in between).

    Invariant: ``inflight`` equals the number of ``begin`` calls minus finished requests.
    """

    def __init__(self, prefill: Sequence[PrefillInstance], decode: Sequence[DecodeInstance],
                 store: StoreClient | None, policy: Policy | None = None,
                 predictor: PrefillPredictor | None = None, local_cache_blocks: int = 4096) -> None:
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
        self.policy = policy or make_policy("least_ttft")
        self.predictor = predictor or PrefillPredictor()
        self.replica = LocalCacheReplica(local_cache_blocks)
        self.inflight = 0

    @classmethod
    async def connect(cls, prefill_addresses: Sequence[str], decode_addresses: Sequence[str],
                      store_address: str | None, *, policy: str = "least_ttft",
                      predictor: PredictorConfig | None = None, store_auth_token: str | None = None,
                      local_cache_blocks: int = 4096, ready_timeout_s: float = 60.0) -> "Router":
        """Connect to the engines (host:port each) and the store node; waits until every engine
        answers ``Info``. Raises Unavailable if one does not within ``ready_timeout_s`` and
        InvalidArgument if roles, models or layouts disagree."""
        opened: list[EngineClient] = []
        try:
            pre, dec = [], []
            for addresses, kind, out in ((prefill_addresses, PrefillInstance, pre),
                                         (decode_addresses, DecodeInstance, dec)):
                for address in addresses:
                    client = EngineClient(address)
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
        try:
            return cls(pre, dec, store, make_policy(policy), PrefillPredictor(predictor), local_cache_blocks)
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

    async def plan(self, request_id: str, tokens: Sequence[int], namespace: str) -> RoutePlan:
        """Choose the instances for a prompt of token ids. Raises InvalidArgument for bad token
        ids. A store node that cannot be reached counts as a pool miss."""
        keys = prompt_keys(tokens, self.info, namespace)
        pool_hit = await self._pool_hit(keys)
        local = self.replica.hits(keys)
        bs, n = self.info.block_size, len(tokens)
        candidates = []
        for engine_id, inst in self.prefill.items():
            hit = max(pool_hit, local.get(engine_id, 0))
            cached = usable_prefix_tokens(hit, bs, n)
            candidates.append(PrefillCandidate(engine_id, local.get(engine_id, 0), hit, cached, n - cached,
                                               inst.queue_s, self.predictor.predict(n - cached)))
        chosen = self.policy.choose(candidates)
        decode_id = min(self.decode, key=lambda d: self.decode[d].running)
        return RoutePlan(request_id, namespace, n, tuple(keys), pool_hit, chosen, decode_id)

    async def _pool_hit(self, keys: Sequence[bytes]) -> int:
        if self.store is None or not keys:
            return 0
        try:
            return (await asyncio.to_thread(self.store.lookup, keys)).blocks
        except KVStoreError as exc:
            log.warning("store lookup failed, counting a pool miss: %s", exc)
            return 0

    def begin(self, plan: RoutePlan) -> None:
        """Count the admitted request as queued on its prefill and running on its decode."""
        self.prefill[plan.prefill.engine_id].inflight[plan.request_id] = plan.prefill.prefill_s
        self.decode[plan.decode_id].running += 1
        self.inflight += 1

    def prefill_finished(self, plan: RoutePlan, result: PrefillResult | None) -> None:
        """The prefill is over (``result`` None: it failed or was cancelled). On success the
        predictor learns from it and the replica records the prompt's blocks on the instance."""
        self.prefill[plan.prefill.engine_id].inflight.pop(plan.request_id, None)
        if result is not None:
            self.predictor.observe(result.computed_tokens, result.prefill_s)
            self.replica.add_chain(plan.prefill.engine_id, result.block_keys)

    def finished(self, plan: RoutePlan) -> None:
        """The request is over, whatever the outcome; call exactly once per ``begin``."""
        self.prefill[plan.prefill.engine_id].inflight.pop(plan.request_id, None)
        self.decode[plan.decode_id].running -= 1
        self.inflight -= 1

    def prefill_client(self, plan: RoutePlan) -> EngineClient:
        return self.prefill[plan.prefill.engine_id].client

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
