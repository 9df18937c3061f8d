"""The router over vLLM instances: the same :class:`~scheduler.routing.router.Router` (the Conductor or
a baseline, admission, the in-flight books), with the prompt keyed as the kvstore connector
keys it (:class:`~scheduler.vllm.instances.VLLMModel`), instances that fail taken out of the
views until their ``/health`` answers again, and the load vLLM reports in ``/metrics``
folded into the views:

* a prefill instance's T_queue gains, for each request vLLM holds (running or waiting)
  beyond those the router routed there, the mean measured prefill time — load that came
  from elsewhere;
* a decode instance's KV capacity is its paged cache (blocks × block size, from
  ``vllm:cache_config_info``) less what ``vllm:kv_cache_usage_perc`` shows in use beyond the
  router's own requests there.

T_prefill is fitted from the measured seconds of each prefill call and the cached tokens
vLLM reports; TBT from the gaps between the tokens streamed to clients (the front door).

Topologies: ``disaggregated`` (prefill instances are ``kv_producer``, decode instances
``kv_consumer``) and ``colocated`` (every instance ``kv_both`` is both; a request's decode
instance is its prefill instance).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from engines.types import PrefillResult
from kvstore.block_store import BlockStore
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.events.channel import LocalEventChannel
from kvstore.events.replica import IndexReplica
from scheduler.policy.admission import Rejection
from scheduler.policy.conductor import ConductorConfig
from scheduler.policy.registry import DEFAULT_POLICY
from scheduler.policy.views import ClusterView, TierHit
from scheduler.routing.cache_index import start_replica, store_address_of
from scheduler.routing.router import DecodeInstance, PrefillInstance, RoutePlan, Router
from scheduler.vllm.events import VLLMEventBridge, start_bridges, stop_bridges
from scheduler.vllm.instances import VLLMClient, VLLMModel
from scheduler.vllm.pool_events import pool_node
from scheduler.vllm.prefill_groups import PrefillGroups

log = logging.getLogger(__name__)

TOPOLOGIES = ("disaggregated", "colocated")


class VLLMRouter(Router[VLLMClient]):
    """Invariant (beyond Router's): an engine id in ``down`` is in no view the policy sees;
    ``plan`` raises Unavailable when no prefill or no decode instance is up."""

    def __init__(self, prefill: Sequence[PrefillInstance[VLLMClient]], decode: Sequence[DecodeInstance[VLLMClient]],
                 store: BlockStore | None, model: VLLMModel, topology: str = "disaggregated", **kw) -> None:
        if topology not in TOPOLOGIES:
            raise InvalidArgument(f"unknown topology {topology!r}; valid: {list(TOPOLOGIES)}")
        super().__init__(prefill, decode, store, **kw)
        self.model = model
        self.topology = topology
        self.down: dict[str, str] = {}     # instance id -> why it is out of routing
        self.mean_prefill_s = 0.0
        self._began: dict[str, float] = {}          # colocated: request id -> when it was routed
        self._prefill_s: dict[str, float] = {}      # colocated: request id -> its prefill's own seconds
        self.prefill_groups = PrefillGroups()       # colocated: prefills vLLM ran together, for the T_prefill fit
        self.bridges: list[VLLMEventBridge] = []   # vLLM KV events into self.replica (watch_kv_events)

    @property
    def colocated(self) -> bool:
        return self.topology == "colocated"

    def clients(self) -> dict[str, VLLMClient]:
        """Every instance by engine id (a colocated instance once)."""
        out = {i: p.client for i, p in self.prefill.items()}
        out.update({i: d.client for i, d in self.decode.items()})
        return out

    def prompt_keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        return self.model.keys(tokens, namespace)

    # -- deciding ---------------------------------------------------------------------------
    async def plan(self, request_id: str, tokens: Sequence[int], namespace: str,
                   max_tokens: int = 16, reuse: bool = True, sequences: int = 1) -> RoutePlan | Rejection:
        """As :meth:`Router.plan`; raises Unavailable when every prefill or every decode
        instance is down."""
        if all(i in self.down for i in self.prefill) or all(i in self.down for i in self.decode):
            raise Unavailable(f"no vLLM instance is up (down: {sorted(self.down)})")
        plan = await super().plan(request_id, tokens, namespace, max_tokens, reuse, sequences)
        if isinstance(plan, RoutePlan) and self.colocated and plan.decode_id != plan.prefill_id:
            plan = dataclasses.replace(plan, decision=dataclasses.replace(plan.decision, decode_id=plan.prefill_id))
        return plan

    def cluster_view(self, keys: Sequence[bytes], pool_hit: TierHit | None = None,
                     now_s: float | None = None) -> ClusterView:
        view = super().cluster_view(keys, pool_hit, now_s)
        prefill = []
        for v in view.prefill:
            if v.instance_id in self.down:
                continue
            load = self.prefill[v.instance_id].client.last_load
            ours = len(self.prefill[v.instance_id].backlog)
            if self.colocated:
                ours += self.decode[v.instance_id].running
            if load is not None:
                v = v._replace(kv_usage=load.kv_usage)
            if load is not None and load.running + load.waiting > ours:
                v = v._replace(queue_s=v.queue_s + (load.running + load.waiting - ours) * self.mean_prefill_s)
            prefill.append(v)
        decode = []
        for d in view.decode:
            if d.instance_id in self.down:
                continue
            load = self.decode[d.instance_id].client.last_load
            if load is not None and load.kv_blocks:
                capacity = load.kv_blocks * self.model.block_size
                # Colocated, a request routed here holds KV from its first prefill chunk on: every one
                # is ours (counting only those past prefill took the others' KV for foreign load, and
                # booked it twice). Disaggregated, the KV arrives with the hand-off.
                ours = sum(w.kv_tokens for w in d.work if self.colocated or w.start_s <= view.now_s)
                foreign = max(0, int(load.kv_usage * capacity) - ours)
                d = d._replace(kv_capacity_tokens=min(d.kv_capacity_tokens, max(0, capacity - foreign)))
            decode.append(d)
        return dataclasses.replace(view, prefill=tuple(prefill), decode=tuple(decode), colocated=self.colocated)

    # -- bookkeeping ------------------------------------------------------------------------
    def prefill_finished(self, plan: RoutePlan, result: PrefillResult | None, learn: bool = True) -> None:
        super().prefill_finished(plan, result, learn)
        if result is not None:
            a = 0.2
            self.mean_prefill_s = result.prefill_s if not self.mean_prefill_s else \
                (1 - a) * self.mean_prefill_s + a * result.prefill_s

    def begin(self, plan: RoutePlan) -> None:
        super().begin(plan)
        if self.colocated:
            self._began[plan.request_id] = time.monotonic()

    def first_token(self, plan: RoutePlan, measured: bool = True) -> None:
        """Colocated: the instance's prefill is over (its first token arrived). Its own seconds
        are the time since it was routed, or since the prefill ahead of it in the instance's
        books ended when it started later (:meth:`PrefillBacklog.started_s`): what T_prefill
        predicts, without the wait that T_queue predicts apart. ``measured`` False: the call
        comes at the whole response's end (not streamed), whose seconds hold the decode too,
        so nothing is learnt from them."""
        backlog = self.prefill[plan.prefill_id].backlog
        now = time.monotonic()
        began = self._began.pop(plan.request_id, None)
        if began is not None and plan.request_id in backlog and measured:
            started = backlog.started_s(plan.request_id)
            start = max(began, started if started is not None else began)
            self._prefill_s[plan.request_id] = now - start
            self._learn(self.prefill_groups.first_token(plan.prefill_id, plan.request_id, plan.prompt_tokens,
                                                        plan.decision.cached_tokens, start, now))
        backlog.remove(plan.request_id)
        self._advance(backlog, now)

    def colocated_prefilled(self, plan: RoutePlan, cached_tokens: int) -> None:
        """Colocated: feed the T_prefill fit once the request's usage says what was cached, with
        the prefill's own seconds (:meth:`first_token`; nothing when they were not measured). The
        TTFT also holds the wait behind the prefills routed there before it, which T_queue
        counts: fed to the fit, every wait was counted twice and predictions grew with the
        queues (live, 60 requests: TTFT a median 0.21 of the Conductor's prediction)."""
        seconds = self._prefill_s.pop(plan.request_id, None)     # None: not measured, nothing to learn
        self.prefill_finished(plan, None if seconds is None else PrefillResult(
            plan.request_id, 0, plan.keys, cached_tokens, plan.prompt_tokens - cached_tokens, b"", 0, seconds, 0, 0),
                              learn=False)
        self._learn(self.prefill_groups.cached(plan.request_id, cached_tokens, time.monotonic()))

    def _learn(self, groups: list[tuple[list[tuple[int, int]], float]]) -> None:
        """Colocated: the T_prefill fit learns from the prefills vLLM ran together
        (:mod:`scheduler.vllm.prefill_groups`), each group whole."""
        for prefills, seconds in groups:
            log.debug("prefills %s (prompt, cached tokens) computed together in %.3f s", prefills, seconds)
            self.policy.observe_prefills(prefills, seconds)

    def finished(self, plan: RoutePlan) -> None:
        super().finished(plan)
        self._began.pop(plan.request_id, None)
        self._prefill_s.pop(plan.request_id, None)
        self._learn(self.prefill_groups.forget(plan.request_id))

    def reroute(self, plan: RoutePlan, role: str, tried: set[str]) -> RoutePlan | None:
        """As :meth:`Router.reroute`; colocated, the request moves whole (its prefill queue
        entry and its decode work) to the least loaded other instance, whatever ``role``."""
        if not self.colocated:
            return super().reroute(plan, role, tried)
        moved = super().reroute(plan, "prefill", tried)
        if moved is None:
            return None
        new_id = moved.prefill_id
        work = self.decode[plan.decode_id].work.pop(plan.request_id, None)
        if work is not None:
            self.decode[new_id].work[plan.request_id] = work
        if plan.request_id in self._began:     # its prefill there starts now, not when first routed
            self._began[plan.request_id] = time.monotonic()
        return dataclasses.replace(moved, decision=dataclasses.replace(moved.decision, decode_id=new_id))

    def read_store_events(self, redis_url: str, store_address: str | None, store_token: str | None) -> None:
        """Keep a replica of the store nodes' indexes from their KV events in the Redis Stream
        at ``redis_url`` (:func:`scheduler.routing.cache_index.start_replica`, entries sealed
        with ``store_token``), as the built-in engines' router does: the pool's hit by tier
        comes from it, with no ``Lookup`` per request. After a gap a store node is
        resynchronised from its ``Snapshot`` (a registered member's address, else
        ``store_address``); the instances' nodes, which the bridges of :meth:`watch_kv_events`
        number themselves, have no snapshot: a gap there drops the node until its next epoch.
        Raises InvalidArgument once the bridges run (they feed the replica this one replaces)."""
        if self.bridges:
            raise InvalidArgument("read the store nodes' KV events before the instances' (watch_kv_events)")
        stores = store_address_of(self.store, store_address)
        bridged = {n for e in self.clients() for n in (e, pool_node(e))}
        self.replica = start_replica(redis_url, {}, None, lambda node: None if node in bridged else stores(node),
                                     store_token)
        self.pool_in_replica = True

    def watch_kv_events(self, endpoints: dict[str, tuple[str, str | None]]) -> None:
        """Keep the instances' own prefix caches in the replica from their vLLM KV events
        (engine id → (PUB endpoint, replay endpoint or None)), and what their connectors say
        the pool holds (scheduler/vllm/pool_events.py, node ``<engine id>/pool``). The pool's
        hit comes from the store nodes' own events when :meth:`read_store_events` reads them
        (the connectors' nodes are then kept but give no hit: a connector learns of a store's
        eviction only when a request asks again), else from the store's ``Lookup`` when the
        router has a store, else from the connectors' events."""
        if self.replica is None:
            self.replica = IndexReplica(LocalEventChannel())   # fed by the bridges, never polled
            self.pool_in_replica = self.store is None
        else:
            self.hits_ignored = frozenset(pool_node(e) for e in endpoints)
        self.bridges = start_bridges(endpoints, self.model.paged, self.replica)

    async def close(self) -> None:
        stop_bridges(self.bridges)
        await super().close()

    def mark_down(self, engine_id: str, why: str) -> None:
        if engine_id not in self.down:
            log.warning("vLLM instance %s is down, routing around it: %s", engine_id, why)
        self.down[engine_id] = why

    async def watch(self, interval_s: float = 0.5) -> None:
        """Poll every instance's ``/metrics`` (its load) forever: one that fails is down, one
        that answers again is up."""
        while True:
            clients = self.clients()
            results = await asyncio.gather(*(c.load() for c in clients.values()), return_exceptions=True)
            for engine_id, res in zip(clients, results):
                if isinstance(res, BaseException):
                    self.mark_down(engine_id, str(res))
                elif engine_id in self.down:
                    log.info("vLLM instance %s is up again", engine_id)
                    del self.down[engine_id]
            await asyncio.sleep(interval_s)


async def connect_vllm(model: VLLMModel, prefill_urls: Sequence[str], decode_urls: Sequence[str],
                       store_address: str | None, *, topology: str = "disaggregated",
                       colocated_urls: Sequence[str] = (), policy: str = DEFAULT_POLICY,
                       config: ConductorConfig | None = None, store_auth_token: str | None = None,
                       decode_max_running: int = 64, decode_kv_capacity_tokens: int = 1 << 20,
                       ready_timeout_s: float = 60.0, store_redis: str | None = None,
                       api_key: str | None = None, kv_events: Sequence[str] = (),
                       store_events: str | None = None) -> VLLMRouter:
    """A :class:`VLLMRouter` over running vLLM instances (``http://host:port`` each):
    ``prefill_urls`` and ``decode_urls`` (disaggregated) or ``colocated_urls`` (colocated).
    Waits until each answers. ``kv_events``: none, or one per prefill (colocated) instance,
    in their order — its vLLM KV-event endpoint, ``PUB`` or ``PUB,REPLAY``
    (``--kv-events-config``'s ``endpoint`` and ``replay_endpoint``): the router then sees
    each instance's own prefix cache (:mod:`scheduler.vllm.events`) beside the pool's hits;
    without them it sees the pool's only (it never guesses an instance's cache).
    ``store_events``: the Redis the store nodes publish their KV events to (the CLI's
    ``--kv-events``, else ``--redis``): with a store, the pool's hits come from a replica of
    their indexes (:meth:`VLLMRouter.read_store_events`), not from a ``Lookup`` per request.
    ``api_key``: the instances' vLLM API key (the engines' token: only the front door may call them). Raises
    Unavailable (an instance not up in ``ready_timeout_s``) or InvalidArgument."""
    from kvstore.client import StoreClient
    if topology == "colocated":
        if not colocated_urls:
            raise InvalidArgument("the colocated topology needs at least one instance (--vllm-colocated URL)")
        named = [(f"vllm-{i}", u, "colocated") for i, u in enumerate(colocated_urls)]
    else:
        if not prefill_urls or not decode_urls:
            raise InvalidArgument("the disaggregated topology needs --vllm-prefill and --vllm-decode URLs")
        named = [(f"vllm-prefill-{i}", u, "prefill") for i, u in enumerate(prefill_urls)]
        named += [(f"vllm-decode-{i}", u, "decode") for i, u in enumerate(decode_urls)]
    prefill_ids = [engine_id for engine_id, _, role in named if role in ("prefill", "colocated")]
    if kv_events and len(kv_events) != len(prefill_ids):
        raise InvalidArgument(f"give one KV-event endpoint per prefill instance ({len(prefill_ids)}, in their "
                              f"order), got {len(kv_events)}")
    endpoints = {engine_id: _endpoints(spec) for engine_id, spec in zip(prefill_ids, kv_events)}
    clients = [VLLMClient(u, role, model, engine_id, api_key=api_key) for engine_id, u, role in named]
    store: BlockStore | None = None
    router: VLLMRouter | None = None
    try:
        await asyncio.gather(*(c.wait_ready(ready_timeout_s) for c in clients))
        await asyncio.gather(*(c.load() for c in clients))
        infos = [await c.info() for c in clients]
        pre = [PrefillInstance(c, i) for c, i in zip(clients, infos) if c.role in ("prefill", "colocated")]
        dec = [DecodeInstance(c, i) for c, i in zip(clients, infos) if c.role in ("decode", "colocated")]
        if store_redis:
            from kvstore.cluster.client import ClusterClient
            store = ClusterClient(store_redis, auth_token=store_auth_token, prefault=False)  # lookups only
        elif store_address:
            store = StoreClient(store_address, auth_token=store_auth_token, prefault=False)  # lookups only
        router = VLLMRouter(pre, dec, store, model, topology, policy=policy, config=config,
                            decode_max_running=decode_max_running,
                            decode_kv_capacity_tokens=decode_kv_capacity_tokens)
        if store_events and store is not None:
            router.read_store_events(store_events, store_address, store_auth_token)
        if endpoints:
            router.watch_kv_events(endpoints)
        return router
    except BaseException:
        if router is not None:
            await router.close()    # its bridges, replica, store and instance clients
        else:
            if store is not None:
                store.close()
            for c in clients:
                await c.close()
        raise


def _endpoints(spec: str) -> tuple[str, str | None]:
    """``PUB`` or ``PUB,REPLAY`` (ZeroMQ endpoints) → (pub, replay or None)."""
    parts = [p.strip() for p in spec.split(",")]
    if not 1 <= len(parts) <= 2 or not all(p.startswith(("ipc://", "tcp://")) for p in parts):
        raise InvalidArgument(f"a KV-event endpoint is PUB or PUB,REPLAY, each ipc://PATH or tcp://HOST:PORT, "
                              f"got {spec!r}")
    return parts[0], parts[1] if len(parts) == 2 else None
