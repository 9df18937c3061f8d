"""The router: builds the decision views (:mod:`scheduler.policy.views`) from live state, asks the
scheduling policy (:mod:`scheduler.policy.conductor`, :mod:`scheduler.policy.baselines`), and keeps the
bookkeeping of work in flight that the next decisions need (docs/architecture.md §5).

For a prompt it computes the block keys (the engines' key spec), looks them up in its
replica of the store's index (:mod:`scheduler.routing.cache_index`: the KV events of the store nodes
and of the prefill engines' own caches) for each prefill instance's local hit and the pool's
hit by tier — without a replica (no ``kv_events``), the store node's ``Lookup`` gives the
pool's hit and no instance has a local one — and hands the policy: per prefill instance the predicted
seconds queued there (T_queue) and its hit; per decode instance the requests it holds and those it will
receive, with predicted join and finish instants; ``now_s`` from ``time.monotonic()``. Finished prefills
feed the T_prefill regression, finished decodes the TBT regression.

The live engines fetch a longer pool hit themselves — no further than the plan's ``max_load_blocks`` when the policy
chose to recompute — and cannot read a peer's cache, so the router runs policies with ``peer_fetch`` off. The prefill
engines report how long their pool reads took and how many bytes they moved; :meth:`Router.prefill_finished` feeds
that to the policy's bandwidth estimate (seeded from the configured defaults until then). Each route and each finished
prefill (predicted and measured seconds) is logged at DEBUG. A prefill instance keeps what it fetched, and its events
tell the replica so (hot prefixes replicate by themselves). KV transfers a request owns in-process
(:mod:`scheduler.routing.request_transfers`) are registered in ``transfers`` and aborted by ``finished``; the engines'
own transfers go through the store service, whose streamed put aborts its reservation when the stream breaks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Generic

from engines.client import EngineClient
from engines.types import EngineInfo, PrefillResult
from kvstore.block_store import BlockStore
from kvstore.client import StoreClient
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.events.replica import IndexReplica
from kvstore.index.keys import block_bytes
from scheduler.policy.admission import AdmissionConfig, Rejection
from scheduler.policy.backlog import PrefillBacklog
from scheduler.policy.conductor import Conductor, ConductorConfig
from scheduler.policy.profiles import seeded_from_engines
from scheduler.policy.registry import DEFAULT_POLICY, make_policy
from scheduler.policy.views import (
    NO_HIT,
    ClusterView,
    DecodeView,
    DecodeWork,
    RequestView,
    TierHit,
    decoding_finish,
    held_work,
    load_limit,
)
from scheduler.routing.cache_index import split_hits, start_replica, store_address_of
from scheduler.routing.engine_link import DTYPE_BYTES, C, check_compatible
from scheduler.routing.request_transfers import TransferTable
from scheduler.routing.route_plan import DecodeInstance, PrefillInstance, RoutePlan
from scheduler.routing.tenancy import prompt_keys

log = logging.getLogger(__name__)

class Router(Generic[C]):
    """Holds the engine clients, the policy and the in-flight state. Used from one event
    loop; ``plan`` is the only coroutine, so a caller that calls ``begin`` right after
    ``plan`` returns sees the state ``plan`` saw (no await in between).

    Invariant: ``inflight`` equals the number of ``begin`` calls minus ``finished`` calls.
    """

    def __init__(self, prefill: Sequence[PrefillInstance[C]], decode: Sequence[DecodeInstance[C]],
                 store: BlockStore | None, policy: str = DEFAULT_POLICY,
                 config: ConductorConfig | None = None, replica: IndexReplica | None = None,
                 decode_max_running: int = 64, decode_kv_capacity_tokens: int = 1 << 20) -> None:
        if not prefill or not decode:
            raise InvalidArgument(f"need at least one prefill and one decode engine, got "
                                  f"{len(prefill)} prefill and {len(decode)} decode")
        check_compatible([p.info for p in prefill] + [d.info for d in decode])
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
        self.replica = replica     # the store's index over KV events (None: pool hits by Lookup)
        self.pool_in_replica = store is not None   # False: no pool hit from the replica (by Lookup, or none)
        self.hits_ignored: frozenset[str] = frozenset()   # replica nodes no hit is taken from (split_hits)
        self.transfers = TransferTable()
        self.decode_max_running, self.decode_kv_capacity_tokens = decode_max_running, decode_kv_capacity_tokens
        self.inflight = 0
        self.inflight_by_tenant: dict[str, int] = {}   # namespace -> its requests in flight
        self.down: dict[str, str] = {}   # engine id -> why it is out of routing (scheduler/frontdoor/health.py)
        self.pool_lookups = {"ok": 0, "failed": 0}   # Lookup RPCs to the store (a replica's hits take none)

    @staticmethod
    async def connect(prefill_addresses: Sequence[str], decode_addresses: Sequence[str],
                      store_address: str | None, *, policy: str = DEFAULT_POLICY,
                      config: ConductorConfig | None = None, store_auth_token: str | None = None,
                      kv_events: str | None = None, decode_max_running: int = 64,
                      decode_kv_capacity_tokens: int = 1 << 20, ready_timeout_s: float = 60.0,
                      store_redis: str | None = None, engine_auth_token: str | None = None,
                      seed_from_engines: bool = True) -> Router[EngineClient]:
        """Connect to the engines (host:port each; ``engine_auth_token``: the engines' token,
        kvstore/auth.py) and the store node (``store_redis``: every
        store node registered in that Redis, kvstore/cluster); waits until every engine
        answers ``Info``. ``kv_events``: the Redis the store nodes and prefill engines publish
        their KV events to — the router then keeps a replica of their indexes
        (:mod:`scheduler.routing.cache_index`). ``seed_from_engines``: the T_prefill and TBT
        predictors start from a fit of the profiling pass the engines ran at start
        (:func:`scheduler.policy.profiles.seeded_from_engines`; False: from ``config``'s seeds).
        Raises Unavailable if one does not within ``ready_timeout_s`` and InvalidArgument if
        roles, models or layouts disagree, or the policy is unknown."""
        opened: list[EngineClient] = []

        async def open_engine(address: str) -> tuple[EngineClient, EngineInfo]:
            opened.append(client := EngineClient(address, auth_token=engine_auth_token))
            try:
                await client.wait_ready(min(2.0, ready_timeout_s))
            except Unavailable:   # not up yet (an engine loads its model for a while): say so, then wait
                log.warning("waiting up to %.0f s for the engine at %s to answer", ready_timeout_s, address)
                await client.wait_ready(ready_timeout_s)
            return client, await client.info()
        try:
            pre = [PrefillInstance(*await open_engine(address)) for address in prefill_addresses]
            dec = [DecodeInstance(*await open_engine(address)) for address in decode_addresses]
            for inst, role in [(p, "prefill") for p in pre] + [(d, "decode") for d in dec]:
                if inst.info.role != role:
                    raise InvalidArgument(f"engine {inst.info.engine_id} at {inst.client.address} is a "
                                          f"{inst.info.role!r} engine, listed as {role!r}")
        except BaseException:
            for client in opened:
                await client.close()
            raise
        store: BlockStore | None = None
        if store_redis:
            from kvstore.cluster.client import ClusterClient
            store = ClusterClient(store_redis, auth_token=store_auth_token, prefault=False)  # lookups only
        elif store_address:
            store = StoreClient(store_address, auth_token=store_auth_token, prefault=False)  # lookups only
        router = None
        try:
            if seed_from_engines:
                config = seeded_from_engines(config or ConductorConfig(),
                                             [p.info for p in pre] + [d.info for d in dec])
            router = Router(pre, dec, store, policy, config, None, decode_max_running, decode_kv_capacity_tokens)
            if kv_events:
                router.replica = start_replica(kv_events, {e: p.client.address for e, p in router.prefill.items()},
                                               engine_auth_token, store_address_of(store, store_address),
                                               store_auth_token)
            return router
        except BaseException:
            if router is not None and router.replica is not None:
                router.replica.stop()
            for client in opened:
                await client.close()
            if store is not None:
                store.close()
            raise

    async def close(self) -> None:
        for client in [*(p.client for p in self.prefill.values()), *(d.client for d in self.decode.values())]:
            await client.close()
        if self.store is not None:
            self.store.close()
        if self.replica is not None:
            self.replica.stop()

    @property
    def admission(self) -> AdmissionConfig:
        return self.policy.config.admission

    # -- deciding ---------------------------------------------------------------------------
    async def plan(self, request_id: str, tokens: Sequence[int], namespace: str,
                   max_tokens: int = 16, reuse: bool = True, sequences: int = 1) -> RoutePlan | Rejection:
        """Choose the instances for a prompt of token ids, or reject it (before any prefill).
        ``reuse`` False (pool off): the policy sees no pool hit and no instance's own hit,
        so it plans and admits a full prefill. ``sequences``: how many it decodes (OpenAI's
        ``n``, each ``max_tokens`` long): each counts in flight, for its tenant and in the
        decode batch. Raises InvalidArgument for bad token ids. A
        store node that cannot be reached counts as a pool miss."""
        keys = tuple(self.prompt_keys(tokens, namespace))
        self.check_serving()
        if not reuse:                      # pool off: planned as a full prefill, whatever is cached
            pool_hit = NO_HIT
            view = self.cluster_view((), NO_HIT)
        elif self.replica is not None and self.pool_in_replica:   # every hit from the replica: no await, no RPC
            view = self.cluster_view(keys)
            pool_hit = view.pool_hit
        else:
            pool_hit = await self._pool_hit(keys)
            self.check_serving()   # the lookup awaited: an instance may have gone down since
            view = self.cluster_view(keys, pool_hit)
        # the tenant's own bound, after the last await: nothing runs between it and begin()
        busy = self.policy.admission.check_tenant(self.inflight_by_tenant.get(namespace, 0), sequences)
        if busy is not None:
            return busy
        request = RequestView(request_id, len(tokens), keys, max_tokens, self.info.block_size, sequences)
        result = self.policy.decide(request, view)
        if isinstance(result, Rejection):     # each decision logged with the views it was judged on
            log.debug("reject %s: %s; %s", request_id, result, view)
            return result
        log.debug("route %s: %s; %s", request_id, result, view)
        return RoutePlan(request_id, namespace, len(tokens), max_tokens, keys, pool_hit, result,
                         load_limit(result, pool_hit, self.info.block_size), reuse, sequences)

    def prompt_keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        """The pool keys of the prompt's full blocks, as the engines key them."""
        return prompt_keys(tokens, self.info, namespace)

    def cluster_view(self, keys: Sequence[bytes], pool_hit: TierHit | None = None,
                     now_s: float | None = None) -> ClusterView:
        """The policy's view of the cluster for a prompt with block ``keys`` (no await): the
        instances' own hits from the replica; the pool's hit ``pool_hit``, or the
        replica's when None and :attr:`pool_in_replica` (else a miss)."""
        own: dict[str, TierHit] = {}
        if self.replica is not None and keys:
            own, replica_pool = split_hits(self.replica.match(keys), self.prefill, self.hits_ignored)
            if pool_hit is None and self.pool_in_replica:   # without a store (--no-store): no pool to load from
                pool_hit = replica_pool
        now = time.monotonic() if now_s is None else now_s
        prefill = tuple(inst.view(engine_id, now, own.get(engine_id, NO_HIT))
                        for engine_id, inst in self.prefill.items() if engine_id not in self.down)
        decode = tuple(DecodeView(engine_id, tuple(held_work(w, now) for w in inst.work.values()),
                                  self.decode_max_running,
                                  self.decode_kv_capacity_tokens)
                       for engine_id, inst in self.decode.items() if engine_id not in self.down)
        return ClusterView(now, prefill, decode, NO_HIT if pool_hit is None else pool_hit, self.inflight)

    async def _pool_hit(self, keys: Sequence[bytes]) -> TierHit:
        if self.store is None or not keys:
            return NO_HIT
        try:
            found = await asyncio.to_thread(self.store.lookup, keys, "probe")   # planning: no reuse yet
        except KVStoreError as exc:
            log.warning("store lookup failed, counting a pool miss: %s", exc)
            found = None
        self.pool_lookups["ok" if found is not None else "failed"] += 1
        return NO_HIT if found is None else TierHit.from_tiers(found.tiers[:found.blocks])

    # -- health -----------------------------------------------------------------------------
    def serving(self, role: str) -> list[str]:
        """Ids of the ``role`` ("prefill"/"decode") instances in routing (not down)."""
        pool = self.prefill if role == "prefill" else self.decode
        return [engine_id for engine_id in pool if engine_id not in self.down]

    def check_serving(self) -> None:
        """Raises Unavailable (with the reasons) when no prefill or no decode instance is up."""
        for role in ("prefill", "decode"):
            if not self.serving(role):
                pool = self.prefill if role == "prefill" else self.decode
                why = "; ".join(f"{e}: {self.down.get(e, '?')}" for e in pool)
                raise Unavailable(f"no {role} instance is up ({why})")

    def mark_down(self, engine_id: str, reason: str) -> None:
        """Take an instance out of routing until a health check finds it up again."""
        if engine_id not in self.down:
            log.warning("engine %s is down, routing around it: %s", engine_id, reason)
        self.down[engine_id] = reason   # a restarted engine's NodeCleared empties its hits

    def mark_up(self, engine_id: str) -> None:
        if self.down.pop(engine_id, None) is not None:
            log.info("engine %s is up again, back in routing", engine_id)

    def reroute(self, plan: RoutePlan, role: str, tried: set[str]) -> RoutePlan | None:
        """``plan`` with its ``role`` instance replaced by the least loaded other one that is
        up and not in ``tried`` (bookkeeping moved with it), or None when there is none."""
        if role == "prefill":
            ids = [e for e in self.serving("prefill") if e not in tried]
            if not ids:
                return None
            now = time.monotonic()
            new_id = min(ids, key=lambda e: self.prefill[e].queue_s(now))
            old_backlog = self.prefill[plan.prefill_id].backlog
            old = old_backlog.remove(plan.request_id)
            self._advance(old_backlog, now)
            new_backlog, d = self.prefill[new_id].backlog, plan.decision
            new_backlog.add(plan.request_id, d.prefill_s if old is None else old, d.compute_tokens, d.prompt_tokens)
            self._advance(new_backlog, now)
            return dataclasses.replace(plan, decision=dataclasses.replace(plan.decision, prefill_id=new_id))
        ids = [e for e in self.serving("decode") if e not in tried]
        if not ids:
            return None
        new_id = min(ids, key=lambda e: self.decode[e].running)
        work = self.decode[plan.decode_id].work.pop(plan.request_id, None)
        if work is not None:
            self.decode[new_id].work[plan.request_id] = work
        return dataclasses.replace(plan, decision=dataclasses.replace(plan.decision, decode_id=new_id))

    # -- bookkeeping ------------------------------------------------------------------------
    def begin(self, plan: RoutePlan) -> None:
        """Count the admitted request as queued on its prefill and incoming on its decode."""
        d = plan.decision
        backlog = self.prefill[d.prefill_id].backlog
        backlog.add(plan.request_id, d.ttft_s - d.queue_s, d.compute_tokens, d.prompt_tokens)
        n = plan.sequences
        self.decode[d.decode_id].work[plan.request_id] = DecodeWork(
            plan.prompt_tokens + n * plan.max_tokens, d.decode_start_s, d.decode_finish_s, n)
        self._advance(backlog, time.monotonic())      # FIFO: it starts now when nothing runs there
        self.inflight += n
        self.inflight_by_tenant[plan.namespace] = self.inflight_by_tenant.get(plan.namespace, 0) + n

    def _advance(self, backlog: PrefillBacklog, now: float) -> None:
        """FIFO: start the oldest request queued on ``backlog`` when nothing runs there
        (:meth:`PrefillBacklog.advance`); its decode work is re-timed to join at the
        predicted end of that prefill, for the span predicted (the simulator does the same
        when its engine starts a prefill; :meth:`prefill_finished` re-times it again from
        the real end)."""
        started = backlog.advance(now)
        end = None if started is None else backlog.predicted_end(started)
        if started is None or end is None:
            return
        for inst in self.decode.values():
            w = inst.work.get(started)
            if w is not None:
                inst.work[started] = w._replace(start_s=end, finish_s=end + (w.finish_s - w.start_s))
                return

    def prefill_finished(self, plan: RoutePlan, result: PrefillResult | None, learn: bool = True) -> None:
        """The prefill is over (``result`` None: it failed or was cancelled). On success the T_prefill fit learns
        from its compute seconds (the engine's less its pool read, which the policy predicts apart as T_transfer and
        the bandwidth estimate learns from; the simulator's fit sees the same, ``SimRequest.compute_s``), the
        replica hears of the blocks from the engine's own events, and the request's decode work is re-timed.
        ``learn`` False: the caller feeds the fit itself (colocated vLLM, :mod:`scheduler.vllm.prefill_groups`)."""
        backlog = self.prefill[plan.prefill_id].backlog
        backlog.remove(plan.request_id)
        self._advance(backlog, time.monotonic())      # the next one queued there starts
        if result is None:
            return
        compute_s = result.prefill_s - min(result.load_s, result.prefill_s)
        log.debug("prefill %s on %s: %d prompt tokens, %d cached, computed in %.3f s (predicted %.3f)", plan.request_id,
                  plan.prefill_id, plan.prompt_tokens, result.cached_tokens, compute_s, plan.decision.prefill_s)
        if learn:
            self.policy.observe_prefill(plan.prompt_tokens, result.cached_tokens, compute_s)
        if result.load_bytes > 0 and result.load_s > 0:
            # A measured read from the pool: the tier's bandwidth estimate (seeded from the defaults) moves to it
            latency = self.policy.config.bandwidths.fetch_latency_s
            seconds = result.load_s - latency if result.load_s > 2 * latency else result.load_s
            self.policy.observe_transfer(result.load_tier or "dram", result.load_bytes, seconds, remote=True)
        work = self.decode[plan.decode_id].work
        if plan.request_id in work:
            now = time.monotonic()
            span = plan.decision.decode_finish_s - plan.decision.decode_start_s
            work[plan.request_id] = work[plan.request_id]._replace(start_s=now, finish_s=now + span)

    def decode_progress(self, plan: RoutePlan, tokens: int, mean_tbt_s: float) -> None:
        """The request has streamed ``tokens`` tokens (every sequence's), ``mean_tbt_s``
        seconds apart on average: its booked decode finish becomes its tokens still to come at
        that pace from now (:func:`scheduler.policy.views.decoding_finish`; the simulator re-times a
        running request the same way), so the decode load predicted for later arrivals
        follows the instance's real pace, not the decision's guess. Each of its ``sequences``
        gets one token a step, so a step of each sequence spans ``sequences`` such gaps."""
        work = self.decode[plan.decode_id].work
        w = work.get(plan.request_id)
        if w is not None:
            now = time.monotonic()
            n = max(1, plan.sequences)   # n tokens a decode step: a sequence's pace is n gaps
            work[plan.request_id] = w._replace(
                start_s=min(w.start_s, now),
                finish_s=decoding_finish(now, plan.max_tokens, tokens // n, mean_tbt_s * n))

    def observe_decode(self, plan: RoutePlan, mean_tbt_s: float) -> None:
        """A decode finished with ``mean_tbt_s`` between the tokens it streamed (every
        sequence's: a step of each of its ``sequences`` spans that many gaps): feed the TBT
        fit a step's seconds with the batch (sequences) and KV it shared the instance with."""
        inst = self.decode[plan.decode_id]
        now = time.monotonic()
        live = [w for w in inst.work.values() if w.start_s <= now]
        self.policy.observe_decode(max(1, sum(w.sequences for w in live)), sum(w.kv_tokens for w in live),
                                   mean_tbt_s * max(1, plan.sequences))

    def finished(self, plan: RoutePlan) -> None:
        """The request is over, whatever the outcome; call exactly once per ``begin``. Aborts
        the request's KV transfers still running (their leases and reservations are freed)."""
        self.transfers.finish(plan.request_id)
        now = time.monotonic()
        for inst in self.prefill.values():   # wherever a reroute moved it
            if inst.backlog.remove(plan.request_id) is not None:
                self._advance(inst.backlog, now)
        for dec in self.decode.values():
            dec.work.pop(plan.request_id, None)
        self.inflight -= plan.sequences
        left = self.inflight_by_tenant.pop(plan.namespace, 0) - plan.sequences
        if left > 0:
            self.inflight_by_tenant[plan.namespace] = left

    def prefill_client(self, plan: RoutePlan) -> C:
        return self.prefill[plan.prefill_id].client

    def decode_client(self, plan: RoutePlan) -> C:
        return self.decode[plan.decode_id].client

    def queue_depths(self) -> dict[str, int]:       # prefill engine id → requests routed there, prefill unfinished
        return {engine_id: len(inst.backlog) for engine_id, inst in self.prefill.items()}

    def decode_running(self) -> dict[str, int]:
        return {engine_id: inst.running for engine_id, inst in self.decode.items()}
