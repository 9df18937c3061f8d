"""The discrete-event cluster simulator: virtual time, the real scheduler, cost-model engines.

Events (a heap of ``(time, seq, kind, …)``; no sleeping): arrival, prefill end, KV ready at
decode, and decode-batch boundaries (a request joins or leaves; see
:mod:`scheduler.sim.instance`). Per arrival the simulator builds the frozen views of
:mod:`scheduler.policy.views` from virtual state — each instance's predicted queue, its own prefix
hit and the pool's hit from the real :class:`~kvstore.index.prefix_index.PrefixIndex`, each
decode instance's running and incoming work — and calls the real policy's ``decide`` (any
policy of :mod:`scheduler.policy.baselines`); it feeds back ``observe_prefill``/``observe_decode``
as the live router does, and re-times a request's incoming decode work when its prefill
starts (it joins at that prefill's predicted end) and ends, as the router does.

Each instance's GPUs are a :class:`engines.cost_model.CostModelEngine` — the real engines'
interface in virtual time. Engines behave as docs/architecture.md §4 says, whatever the policy: at
prefill start an instance finds the longest prefix among its own cache (HBM, then its
local DRAM read over PCIe, with ``local_dram_tokens``), the pool
(disaggregated) and the peer the decision planned to fetch from; its engine loads it — from
the pool no further than the decision's ``max_load_blocks`` when the policy chose to
recompute (:func:`scheduler.policy.views.load_limit`, as the live router tells the live engines) —
and computes the rest; it keeps the prompt's blocks in its HBM cache and (disaggregated)
writes them to the pool's DRAM. The caches are real :class:`kvstore.pool.pool.KVPool` objects
accounting bytes without payloads (:mod:`scheduler.sim.cache`). Colocated, the decision API
is told so (``ClusterView.colocated``): a request decodes on its prefill instance, and
admission judges that one. The KV streams to the decode instance layer by layer during
prefill (ready at ``max(prefill end, start + KV bytes / network)``). Colocated instances
pause their decode batch while they prefill.

With ``chunked_prefill_tokens`` a colocated instance does not pause: each decode step also
computes one chunk of the prefill at the head of its queue (step time = decode step + the
prefill's seconds / its chunks), as Sarathi-style chunked prefill does.

Admission "late", "current" and "predictive" reject late, after its prefill was spent: a request
whose step time at its decode instance would exceed the TBT SLO, or which finds the instance
full (batch, KV) and cannot wait for room without breaking the TBT SLO (one long interval
counts in Mooncake's TBT; :meth:`Simulator._max_wait_s`). Admission "none" queues it at
decode for as long as it takes.
"""
from __future__ import annotations

import dataclasses
import heapq
import math

from engines.cost_model import CostModel, LoadedPrefix, load_model, load_profile
from kvstore.index.prefix_index import PrefixIndex
from scheduler.policy.admission import Rejection
from scheduler.policy.baselines import make_policy
from scheduler.policy.views import (
    NO_HIT,
    POOL,
    ClusterView,
    DecodeView,
    RequestView,
    TierHit,
    load_limit,
)
from scheduler.sim.cache import accounting_pool, hold_chain, touch_chain
from scheduler.sim.config import SimConfig
from scheduler.sim.instance import Instance
from scheduler.sim.metrics import SimResult, summarize
from scheduler.sim.profiling import conductor_config, variance_of
from scheduler.sim.workload import SimRequest
from scheduler.trace import TRACE_BLOCK_TOKENS

ARRIVAL, PREFILL_END, DECODE_READY, BOUNDARY = 0, 1, 2, 3
BLOCK = TRACE_BLOCK_TOKENS


class Simulator:
    """One run: ``cfg`` over ``requests`` (fresh :class:`SimRequest` objects, arrival order).
    ``run()`` returns the requests with their outcomes filled in."""

    def __init__(self, cfg: SimConfig, requests: list[SimRequest]) -> None:
        self.cfg = cfg
        self.requests = requests
        self.cost = cost = CostModel(load_model(cfg.model), load_profile(cfg.profile))
        self.block_bytes = BLOCK * cost.model.kv_bytes_per_token
        self.colocated = cfg.topology == "colocated"
        self.index = PrefixIndex(capacity=1 << 16)
        kv_cap = cost.kv_capacity_tokens()
        var = variance_of(cfg)
        if self.colocated:
            cache_tokens = kv_cap // 2 if cfg.hbm_cache_tokens is None else cfg.hbm_cache_tokens
            self.prefill = [Instance(f"C{i}", cost, prefill=True, decode=True, max_running=cfg.max_running,
                                     block_size=BLOCK, kv_capacity_tokens=max(0, kv_cap - cache_tokens), variance=var)
                            for i in range(cfg.instances)]
            self.decode = self.prefill
        else:
            cache_tokens = kv_cap if cfg.hbm_cache_tokens is None else cfg.hbm_cache_tokens
            n_p = cfg.n_prefill
            self.prefill = [Instance(f"P{i}", cost, prefill=True, decode=False, max_running=cfg.max_running,
                                     block_size=BLOCK, kv_capacity_tokens=0, variance=var) for i in range(n_p)]
            self.decode = [Instance(f"D{i}", cost, prefill=False, decode=True, max_running=cfg.max_running,
                                    block_size=BLOCK, kv_capacity_tokens=kv_cap, variance=var)
                           for i in range(cfg.instances - n_p)]
        self.by_name = {i.name: i for i in self.prefill + self.decode}
        # The caches are real KVPools over accounting tiers (sizes, no payloads).
        dram = None if cfg.local_dram_tokens is None else cfg.local_dram_tokens // BLOCK
        self.hbm = {i.name: accounting_pool(self.index, i.name, [("hbm", cache_tokens // BLOCK), ("dram", dram)],
                                            self.block_bytes, cfg.eviction)
                    for i in self.prefill}
        self.pool = None
        if not self.colocated and cfg.pool_dram_tokens != 0:
            def blocks(tokens: int | None) -> int | None:
                return None if tokens is None else tokens // BLOCK
            self.pool = accounting_pool(self.index, POOL, [("dram", blocks(cfg.pool_dram_tokens)),
                                                           ("ssd", blocks(cfg.pool_ssd_tokens))],
                                        self.block_bytes, cfg.eviction)
        self.policy = make_policy(cfg.policy, self.block_bytes, conductor_config(cfg, cost))
        self.late_reject = cfg.rejects_late
        self.chunk = cfg.chunked_prefill_tokens if self.colocated else None
        self.events: list[tuple] = []
        self.seq = 0
        self.inflight = 0
        self.now = 0.0

    # -- the loop --------------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: object, b: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def summarize(self, reqs: list[SimRequest], wall_s: float, tbt_slo_s: float | None = None) -> SimResult:
        """The finished run's row: its requests (:meth:`run`'s list) folded with this
        cluster's GPUs per instance and its policy's T_prefill error; ``tbt_slo_s``: score
        against another TBT SLO than the run's (the same requests, re-scored)."""
        cfg = self.cfg if tbt_slo_s is None else dataclasses.replace(self.cfg, tbt_slo_s=tbt_slo_s)
        return summarize(cfg, reqs, wall_s, self.cost.profile.gpus, self.policy.prefill_model.log_error)

    def run(self, progress=None) -> list[SimRequest]:
        """Process every event; ``progress(done, total)`` is called every 1,000 arrivals."""
        for req in self.requests:
            self._push(req.arrival_s, ARRIVAL, req)
        events, pop = self.events, heapq.heappop
        arrivals = 0
        while events:
            t, _, kind, a, b = pop(events)
            self.now = t
            if kind == BOUNDARY:
                if b == a.version:
                    a.sched_s = math.inf
                    self._boundary(a, t)
            elif kind == ARRIVAL:
                self._arrive(a, t)
                arrivals += 1
                if progress is not None and arrivals % 1000 == 0:
                    progress(arrivals, len(self.requests))
            elif kind == PREFILL_END:
                self._on_prefill_end(a, b, t)
            else:
                self._decode_ready(a, t)
        return self.requests

    # -- arrival: the real policy decides ----------------------------------------------------
    def _arrive(self, req: SimRequest, now: float) -> None:
        per = self.index.match(req.keys).per_node if req.keys else {}
        prefill = tuple(i.prefill_view(now, TierHit.from_tiers(per[i.name]) if i.name in per else NO_HIT)
                        for i in self.prefill)
        pool_hit = TierHit.from_tiers(per[POOL]) if self.pool is not None and POOL in per else NO_HIT
        decode = tuple(self._decode_view(d, now) for d in self.decode)
        view = RequestView(str(req.rid), req.prompt, req.keys, req.output, BLOCK)
        result = self.policy.decide(view, ClusterView(now, prefill, decode, pool_hit, self.inflight, self.colocated))
        if isinstance(result, Rejection):
            req.status, req.reason = "rejected_early", result.reason
            return
        req.decision = result
        req.max_load_blocks = load_limit(result, pool_hit, BLOCK)
        req.prefill_id = result.prefill_id
        req.decode_id = result.decode_id     # colocated: the prefill instance (ClusterView.colocated)
        p, d = self.by_name[req.prefill_id], self.by_name[req.decode_id]
        req.pred_prefill_s = result.transfer_s + result.prefill_s
        p.queue.append(req)
        p.engine.enqueue(req.prompt)
        p.backlog.add(str(req.rid), req.pred_prefill_s, result.compute_tokens, req.prompt)
        d.incoming[req.rid] = (req.prompt + req.output, result.decode_start_s, result.decode_finish_s)
        d.view_dirty = True
        self.inflight += 1
        if p.prefilling is None:
            if self.colocated and (self.chunk or p.running) and not p.paused:
                self._schedule(p, p.next_boundary(now))   # pauses the batch there, or chunks
            else:
                self._run_next_prefill(p, now)

    def _decode_view(self, inst: Instance, now: float) -> DecodeView:
        return inst.decode_view(now)

    # -- prefill ------------------------------------------------------------------------------
    def _fetch(self, blocks: int, tiers: tuple[str, ...], own: tuple[str, ...]) -> LoadedPrefix:
        """The prefix of ``blocks`` blocks whose first ``len(own)`` the instance holds itself
        (``own``: their tiers, head first; its HBM's are free, its DRAM's are read over PCIe)
        and the rest held in ``tiers`` (one per block) on another node (network, or the
        holder's SSD when slower): seconds to bring them, bytes, and their usual tier."""
        local = next((i for i, t in enumerate(own) if t != "hbm"), len(own))   # the HBM head
        mine = sum(1 for t in own[local:] if t != "hbm")
        own_s = self.cost.transfer_s(self.block_bytes * mine, "pcie") if mine else 0.0
        if not tiers:
            if not mine:
                return LoadedPrefix(blocks, local)
            return LoadedPrefix(blocks, local, own_s, self.block_bytes * mine, "dram")
        ssd = sum(1 for t in tiers if t == "ssd")
        net = self.cost.transfer_s(self.block_bytes * len(tiers), "network")
        seconds = max(net, self.cost.transfer_s(self.block_bytes * ssd, "ssd")) + own_s
        return LoadedPrefix(blocks, local, seconds, self.block_bytes * (len(tiers) + mine),
                            "ssd" if 2 * ssd > len(tiers) else tiers[0] if ssd == 0 else "dram")

    def _run_next_prefill(self, inst: Instance, now: float) -> None:
        """Start the next queued prefill; colocated (not chunked), the batch pauses for it."""
        if inst.is_decode:
            inst.paused = True
        req = self._take_next_prefill(inst, now)
        self._push(now + req.prefill_s, PREFILL_END, inst, req)

    def _take_next_prefill(self, inst: Instance, now: float) -> SimRequest:
        """Pop the next queued request, find its prefix (the engines' rule) and cost it."""
        req = inst.queue.popleft()
        inst.backlog.start(str(req.rid), now)
        self._retime(req, now + req.pred_prefill_s)
        keys = req.keys
        nodes = [inst.name]
        if self.pool is not None:
            nodes.append(POOL)
        assert req.decision is not None   # only admitted requests are prefilled
        fetch = req.decision.fetch
        if fetch is not None and fetch.source != POOL:
            nodes.append(fetch.source)
        per = self.index.match(keys, nodes).per_node if keys else {}
        own = per.get(inst.name, ())
        local = len(own)
        prefix, source = self._fetch(local, (), own), None
        if self.pool is not None:
            pool_tiers = per.get(POOL, ())
            if len(pool_tiers) > local:
                prefix, source = self._fetch(len(pool_tiers), pool_tiers[local:], own), self.pool
        if fetch is not None and fetch.source != POOL:
            peer = per.get(fetch.source, ())[:fetch.first_block + fetch.blocks]
            if len(peer) > prefix.blocks:
                prefix, source = self._fetch(len(peer), peer[local:], own), self.hbm[fetch.source]
        # The cost-model engine loads the prefix (up to the decision's limit) and computes the rest.
        result = inst.engine.prefill(str(req.rid), range(req.prompt), "", req.max_load_blocks,
                                     block_keys=keys, prefix=prefix)
        best = result.loaded_blocks
        req.hit_blocks = min(best, req.usable_blocks)
        req.cached_tokens = result.cached_tokens
        req.prefill_start_s = now
        req.prefill_s = result.prefill_s
        req.compute_s = result.prefill_s - result.load_s
        touch_chain(self.hbm[inst.name], keys[:local])
        if best > local:
            touch_chain(source, keys[:best])
        inst.prefilling = req
        inst.prefill_busy_s += req.prefill_s
        return req

    def _complete_prefill(self, inst: Instance, req: SimRequest, now: float) -> None:
        """The prefill is over: the predictor learns, the caches keep the prompt's blocks,
        the first token is out."""
        inst.prefilling = None
        inst.backlog.remove(str(req.rid))
        inst.engine.prefill_done()
        self.policy.observe_prefill(req.prompt, req.cached_tokens, req.compute_s)
        hold_chain(self.hbm[inst.name], req.keys, self.block_bytes)
        hold_chain(self.pool, req.keys, self.block_bytes)
        req.first_token_s = now

    def _on_prefill_end(self, inst: Instance, req: SimRequest, now: float) -> None:
        self._complete_prefill(inst, req, now)
        self._retime(req, now)
        if self.colocated:
            inst.joiners.append(req)
            if inst.queue:
                self._run_next_prefill(inst, now)
            else:
                inst.paused = False
                self._boundary(inst, now, inst.k)
            return
        xfer = self.cost.transfer_s(self.cost.kv_bytes(req.prompt), "network")
        self._push(max(now, req.prefill_start_s + xfer), DECODE_READY, req)
        if inst.queue:
            self._run_next_prefill(inst, now)

    def _retime(self, req: SimRequest, start_s: float) -> None:
        """Its decode work, still incoming, is re-timed to join from ``start_s`` for the span
        the decision predicted: when its prefill starts (from the predicted end of it) and
        when it ends (from then) — as the live router does (``Router._advance``,
        ``Router.prefill_finished``)."""
        d = self.by_name[req.decode_id]
        work = d.incoming.get(req.rid)
        if work is not None:
            kv, s0, f0 = work
            d.incoming[req.rid] = (kv, start_s, start_s + (f0 - s0))
            d.view_dirty = True

    # -- decode -------------------------------------------------------------------------------
    def _decode_ready(self, req: SimRequest, now: float) -> None:
        inst = self.by_name[req.decode_id]
        req.ready_s = now
        if self.late_reject:
            pending = sum(r.prompt + r.output for r in inst.joiners)
            full = not inst.fits(req, pending)
            slow = inst.running and inst.engine.decode_step_s(
                len(inst.running) + len(inst.joiners) + 1,
                inst.kv_tokens(inst.step_at(now)) + pending + req.prompt) > self.cfg.tbt_slo_s
            if slow or (full and self._max_wait_s(inst, req) <= 0):
                self._reject_late(inst, req, "tbt_slo" if slow else "decode_capacity")
                return
        inst.joiners.append(req)
        if not inst.running:
            self._boundary(inst, now, inst.k)
        else:
            self._schedule(inst, inst.next_boundary(now))

    def _max_wait_s(self, inst: Instance, req: SimRequest) -> float:
        """How long ``req`` may wait at a full decode instance and still meet the TBT SLO:
        the wait is one token interval, and Mooncake's TBT averages the longest
        ``ceil(0.1·(output − 1))`` of them, so the slack of each at the current step time
        adds up."""
        tail = max(1, math.ceil(0.1 * (req.output - 1)))
        step = inst.dt or inst.engine.decode_step_s(1, req.prompt)
        return (self.cfg.tbt_slo_s - step) * tail - step

    def _reject_late(self, inst: Instance, req: SimRequest, reason: str) -> None:
        req.status, req.reason = "rejected_late", reason
        inst.incoming.pop(req.rid, None)
        inst.view_dirty = True
        self.inflight -= 1

    def _schedule(self, inst: Instance, t: float) -> None:
        if t < inst.sched_s - 1e-12:
            inst.version += 1
            inst.sched_s = t
            self._push(t, BOUNDARY, inst, inst.version)

    def _boundary(self, inst: Instance, now: float, step: int | None = None) -> None:
        """Batch changes at a step boundary: finishes, joins, then (colocated) a prefill pause
        or the new step time and the next boundary."""
        s = inst.step_at(now) if step is None else step
        for req in inst.pop_finished(s):
            self._finish(req)
        if self.chunk and inst.prefilling is not None:
            inst.chunks_left -= s - inst.k
            if inst.chunks_left <= 0:
                req = inst.prefilling
                self._complete_prefill(inst, req, now)
                inst.joiners.append(req)
        joiners, inst.joiners = inst.joiners, []
        for req in joiners:
            req.wait_until_s = now + self._max_wait_s(inst, req) if self.late_reject else math.inf
        inst.waiting.extend(joiners)
        if self.late_reject and inst.waiting:
            for req in [r for r in inst.waiting if r.wait_until_s < now]:
                inst.waiting.remove(req)
                self._reject_late(inst, req, "decode_capacity")
        while inst.waiting and (not inst.running or inst.fits(inst.waiting[0])):
            req = inst.waiting.popleft()
            if not inst.join(req, s, now):
                self._finish(req)
        if inst.is_prefill and inst.queue and inst.prefilling is None:
            if not self.chunk:
                inst.k, inst.t = s, now            # pause at this boundary
                inst.version += 1
                inst.sched_s = math.inf
                self._run_next_prefill(inst, now)
                return
            req = self._take_next_prefill(inst, now)
            inst.chunks_left = max(1, math.ceil((req.prompt - req.cached_tokens) / self.chunk))
            inst.chunk_s = req.prefill_s / inst.chunks_left
        extra = inst.chunk_s if self.chunk and inst.prefilling is not None else 0.0
        dt = inst.reanchor(now, s, extra)
        inst.version += 1
        inst.sched_s = math.inf
        if inst.running:
            self.policy.observe_decode(len(inst.running), inst.kv_tokens(s), dt - extra)
        nxt = inst.finish_time(inst.heap[0][0]) if inst.heap else math.inf
        if extra:
            nxt = min(nxt, now + inst.chunks_left * dt)
        if nxt < math.inf:
            self._schedule(inst, nxt)

    def _finish(self, req: SimRequest) -> None:
        req.status = "ok"
        self.inflight -= 1
