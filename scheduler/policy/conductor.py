"""The Conductor: KV-centric scheduling with prediction-based early rejection (docs/architecture.md §5;
Mooncake, FAST'25, §4 Algorithm 1; arXiv 2407.00079 §7).

Decision API (pure and synchronous — the live router and the simulator both call it)::

    policy = make_policy("conductor", block_bytes=..., config=ConductorConfig(...))
    result = policy.decide(RequestView(...), ClusterView(now_s=..., prefill=..., decode=...,
                                                         pool_hit=..., inflight=...))
    # result: Decision (admitted; see scheduler.policy.views) or Rejection (reason, retry_after_s)
    policy.observe_prefill(prompt_tokens, cached_tokens, seconds)   # feed the T_prefill fit
    policy.observe_decode(batch, kv_tokens, tbt_s)                  # feed the TBT fit
    policy.observe_transfer(tier, nbytes, seconds, remote=True)     # measured bandwidth

For one request (Algorithm 1):

1. per prefill instance ``i`` with local hit ``L_i`` blocks, and the best other holders (the
   pool, and — with ``peer_fetch`` — the prefill instance holding the longest prefix), an
   option "fetch blocks ``[L_i, H)`` from a holder of ``H > L_i``" is taken only when the
   compute it saves is at least ``balancing_threshold`` × its transfer time;
2. ``TTFT_i = T_queue_i + T_local_read_i + T_transfer_i + T_prefill(n, cached_i)`` with the
   best option; the instance with the least TTFT wins (ties: longer cached prefix, fewer
   queued, listed order). Colocated (every instance prefills and decodes on the same
   compute), ``T_queue_i`` also counts the instance's decode load, as NVIDIA Dynamo's KV
   router counts an aggregated worker's active decode blocks beside its prefill load
   (docs/routers.md): the seconds until the decode batch it runs now drains
   (:meth:`Conductor.decode_waits`) — the engine steps that batch with every prefill it
   runs, so the two share the instance's time;
3. per decode instance, the load when the request gets there (``now + TTFT``): requests that
   will have joined minus those that will have finished, and (predictive) at its peak while
   the request would decode: those admitted that join later reserve their room
   (:func:`scheduler.policy.tbt.load_at`); the least predicted TBT among those with room wins
   (colocated: the chosen prefill instance itself); its predicted stay there (what reserves
   its room for later requests) is its steps × the TBT at the load it joins;
4. :class:`scheduler.policy.admission.Admission` rejects on TTFT SLO (on an idle instance too when
   the optimistic TTFT, :meth:`scheduler.policy.costing.PrefillModel.optimistic`, misses it),
   decode capacity or TBT SLO
   before any prefill is spent.

The baselines (:mod:`scheduler.policy.baselines`) subclass :class:`Conductor` and override only the
choices (``choose_prefill``, ``choose_decode``) and the fetch rule, so every policy shares
the predictions and admission — one code path.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstore.errors import InvalidArgument
from kvstore.index.keys import usable_prefix_tokens
from scheduler.policy.admission import Admission, AdmissionConfig, Rejection
from scheduler.policy.costing import Bandwidths, PrefillModel, PrefillProfile, TransferModel
from scheduler.policy.tbt import DecodeLoad, DecodeProfile, TBTModel, load_at
from scheduler.policy.views import POOL, ClusterView, Decision, DecodeView, FetchPlan, PrefillView, RequestView, TierHit


@dataclass(frozen=True)
class ConductorConfig:
    """``admission``: SLOs and bounds; ``balancing_threshold``: fetch a better prefix only when
    the prefill seconds it saves are >= this × its transfer seconds (>= 0; Algorithm 1's
    kvcache_balancing_threshold); ``peer_fetch``: may fetch from another prefill instance's
    cache (False: from the pool only, as the live engines do); ``prefill``, ``decode``,
    ``bandwidths``: the predictors' seeds and the tier bandwidths; ``seed``: of the random
    baseline. ``chunked_prefill``: the engines run prefill chunks in the same steps as their
    decode batch (vLLM's scheduler): colocated, a prefill does not wait for the batch to drain,
    so T_queue adds no decode wait (:meth:`Conductor.decode_waits`) — the decodes' share of
    each step is in the prefill seconds the fit measures."""

    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    balancing_threshold: float = 1.0
    peer_fetch: bool = True
    prefill: PrefillProfile = field(default_factory=PrefillProfile)
    decode: DecodeProfile = field(default_factory=DecodeProfile)
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    seed: int = 0
    chunked_prefill: bool = False

    def __post_init__(self) -> None:
        if not self.balancing_threshold >= 0:
            raise InvalidArgument(f"balancing_threshold must be >= 0, got {self.balancing_threshold!r}")


class PrefillEstimate(NamedTuple):
    """One prefill instance's predicted TTFT for one request (seconds; ``ttft_s`` =
    ``queue_s + read_s + transfer_s + prefill_s``). ``local_blocks``: its own hit;
    ``cached_tokens``: reused tokens with ``fetch`` applied."""

    view: PrefillView
    local_blocks: int
    cached_tokens: int
    fetch: FetchPlan | None
    queue_s: float
    read_s: float
    transfer_s: float
    prefill_s: float
    ttft_s: float


class DecodeEstimate(NamedTuple):
    """One decode instance at the moment the request would reach it: ``load`` (without the
    request; predictive: the peak while it decodes), ``tbt_s`` (with it, at that load: what
    the TBT SLO is judged by), ``fits`` (batch and KV within the limits); ``decode_s``: its
    predicted seconds of decode there (steps × the TBT at the load it joins)."""

    view: DecodeView
    load: DecodeLoad
    tbt_s: float
    fits: bool
    decode_s: float


class Conductor:
    """Algorithm 1 (see the module docstring). Holds the online predictors; otherwise a
    function of its arguments. ``block_bytes``: bytes of one KV block (for transfer times)."""

    name = "conductor"
    balanced_fetch = True   # False: fetch every longer pool hit, never a peer (the engines' rule)
    colocated_decode_wait = True   # False: T_queue of the prefill queue alone, colocated too (the baselines)

    def __init__(self, block_bytes: int, config: ConductorConfig | None = None) -> None:
        self.config = config or ConductorConfig()
        self.admission = Admission(self.config.admission)
        self.prefill_model = PrefillModel(self.config.prefill)
        self.tbt_model = TBTModel(self.config.decode)
        self.transfer = TransferModel(block_bytes, self.config.bandwidths)

    # -- learning ---------------------------------------------------------------------------
    def observe_prefill(self, prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A prefill finished: ``seconds`` on the engine for ``prompt_tokens`` of which
        ``cached_tokens`` were loaded."""
        self.prefill_model.observe(prompt_tokens, cached_tokens, seconds)

    def observe_prefills(self, prefills: Sequence[tuple[int, int]], seconds: float) -> None:
        """Prefills (prompt tokens, cached tokens) an engine ran together, in ``seconds`` in all
        (:meth:`PrefillModel.observe_group`)."""
        self.prefill_model.observe_group(prefills, seconds)

    def observe_decode(self, batch: int, kv_tokens: int, tbt_s: float) -> None:
        """A decode measurement: mean ``tbt_s`` at ``batch`` requests and ``kv_tokens``."""
        self.tbt_model.observe(batch, kv_tokens, tbt_s)

    def observe_transfer(self, tier: str, nbytes: int, seconds: float, remote: bool = True) -> None:
        """A measured read of ``nbytes`` from ``tier`` (another holder's when ``remote``)."""
        self.transfer.observe(tier, nbytes, seconds, remote)

    # -- the decision -----------------------------------------------------------------------
    def decide(self, request: RequestView, cluster: ClusterView) -> Decision | Rejection:
        """Place ``request`` or reject it (reasons: :data:`scheduler.policy.admission.REASONS`)."""
        if not cluster.prefill or not cluster.decode:
            raise InvalidArgument("a cluster view needs at least one prefill and one decode instance")
        rejection = self.admission.check_inflight(cluster.inflight, request.sequences)
        if rejection is not None:
            return rejection
        p = self.choose_prefill(request, cluster, self.prefill_estimates(request, cluster))
        k = self.config.admission.unattainable_k
        best = self.prefill_model.optimistic(p.prefill_s, k) if p.queue_s <= 0 and math.isfinite(k) else None
        rejection = self.admission.check(p.ttft_s, p.queue_s, cluster.inflight,
                                         None if best is None else p.read_s + p.transfer_s + best)
        if rejection is not None:
            return rejection
        arrive = cluster.now_s + p.ttft_s
        views = cluster.decode
        if cluster.colocated:   # it decodes where it prefills: only that instance is judged
            views = tuple(v for v in cluster.decode if v.instance_id == p.view.instance_id)
            if not views:
                raise InvalidArgument(f"colocated cluster view: no decode view for {p.view.instance_id!r}")
        d = self.choose_decode(request, cluster, self.decode_estimates(request, cluster, arrive, views))
        rejection = self.admission.check_decode(
            d.load.running, d.load.kv_tokens, d.load.ending, d.view.max_running,
            d.view.kv_capacity_tokens, request.kv_tokens, d.tbt_s, arrive, p.ttft_s, request.sequences)
        if rejection is not None:
            return rejection
        return Decision(self.name, request.request_id, p.view.instance_id, d.view.instance_id,
                        p.cached_tokens, p.fetch, p.queue_s, p.read_s + p.transfer_s, p.prefill_s,
                        p.ttft_s, d.tbt_s, arrive, arrive + d.decode_s,
                        d.load.running + request.sequences, request.prompt_tokens)

    # -- choices (the baselines override these) ---------------------------------------------
    def choose_prefill(self, request: RequestView, cluster: ClusterView,
                       estimates: Sequence[PrefillEstimate]) -> PrefillEstimate:
        """The least predicted TTFT; ties: more cached tokens, fewer queued, listed order."""
        return min(estimates, key=_ttft_key)

    def choose_decode(self, request: RequestView, cluster: ClusterView,
                      estimates: Sequence[DecodeEstimate]) -> DecodeEstimate:
        """The least predicted TBT among instances with room (all, when none has room)."""
        fitting = [e for e in estimates if e.fits] or list(estimates)
        return min(fitting, key=lambda e: (e.tbt_s, e.load.running))

    # -- estimates --------------------------------------------------------------------------
    def prefill_estimates(self, request: RequestView, cluster: ClusterView) -> list[PrefillEstimate]:
        """Per prefill instance, in the listed order, the best option (module docstring).
        Options depend only on (local hit, best peer), so they are computed once per distinct
        pair: instances without a hit share one."""
        n, bs = request.prompt_tokens, request.block_size
        useful = max(0, -(-(n - 1) // bs))          # blocks that can hold reusable tokens
        peers = _top_two(cluster.prefill) if self.config.peer_fetch and self.balanced_fetch else ()
        memo: dict[tuple[int, str | None], tuple] = {}
        local_s = self.transfer.local_s
        waits = self.decode_waits(cluster) if cluster.colocated and self.colocated_decode_wait and \
            not self.config.chunked_prefill and self.predictors_measured else {}
        out = []
        for view in cluster.prefill:
            hit = view.hit
            local = hit.blocks if hit.blocks <= useful else useful
            peer = None
            if peers:
                peer = peers[0] if peers[0].instance_id != view.instance_id else (
                    peers[1] if len(peers) > 1 else None)
            key = (local, peer.instance_id if peer is not None else None)
            best = memo.get(key)
            if best is None:
                best = memo[key] = self._best_option(n, bs, useful, local, cluster.pool_hit, peer)
            _, fetch, t, pre, c = best
            read = 0.0 if local == 0 else local_s(hit.by_tier if hit.blocks <= useful else hit.between(0, local))
            queue = view.queue_s + waits.get(view.instance_id, 0.0)
            out.append(PrefillEstimate(view, local, c, fetch, queue, read, t, pre, queue + read + t + pre))
        return out

    @property
    def predictors_measured(self) -> bool:
        """The T_prefill and TBT fits are in use (or frozen: the simulator's oracle). Until
        then the decode wait (seconds of the TBT seed) is not weighed against prefill seconds
        of the T_prefill seed: live over vLLM on a CPU the seeds predicted prefills ~20× too
        fast and 16-token decodes at up to ~15 s, and the first requests all went to the
        instance decoding nothing."""
        p, d = self.prefill_model, self.tbt_model
        return (not p.learn or p.fit.fitted) and (not d.profile.learn or d.fit.fitted)

    @staticmethod
    def decode_waits(cluster: ClusterView) -> dict[str, float]:
        """Per decode view, the predicted seconds until the requests decoding there now (joined
        by ``now_s``) have all finished: the longest remaining decode of its batch (the batch
        steps together; each request's ``finish_s`` is predicted at the batch's pace, and the
        live router re-times it from the tokens streamed). Colocated, it is added to that
        instance's T_queue: Dynamo's aggregated-worker cost counts the same load as blocks
        (``active blocks``, docs/routers.md); here it is seconds, the currency of TTFT. It
        is an upper bound when the engine folds the decode steps into the prefill's
        (chunked prefill) and a lower one when a prefill pauses the batch (the simulator's
        colocated engines)."""
        now = cluster.now_s
        return {d.instance_id: max((w.finish_s - now for w in d.work if w.start_s <= now < w.finish_s), default=0.0)
                for d in cluster.decode}

    def _best_option(self, n: int, bs: int, useful: int, local: int, pool: TierHit,
                     peer: PrefillView | None) -> tuple[float, FetchPlan | None, float, float, int]:
        """(cost, fetch, transfer_s, prefill_s, cached_tokens) of the best way to get a prompt
        with ``local`` blocks cached: as is, or fetching from the pool or ``peer``."""
        predict = self.prefill_model.predict
        cached = usable_prefix_tokens(local, bs, n)
        base = predict(n, cached)
        best: tuple[float, FetchPlan | None, float, float, int] = (base, None, 0.0, base, cached)
        sources: list[tuple[str, TierHit]] = [(POOL, pool)] if pool.blocks > local else []
        if peer is not None and peer.hit.blocks > local:
            sources.append((peer.instance_id, peer.hit))
        for source, hit in sources:
            upto = min(hit.blocks, useful)
            if upto <= local:
                continue
            t = self.transfer.remote_s(hit.between(local, upto))
            c = usable_prefix_tokens(upto, bs, n)
            pre = predict(n, c)
            if not self.balanced_fetch:      # the engines' rule: every longer pool hit
                if source == POOL:
                    best = (t + pre, FetchPlan(source, local, upto - local, t), t, pre, c)
                continue
            if base - pre >= self.config.balancing_threshold * t and t + pre < best[0]:
                best = (t + pre, FetchPlan(source, local, upto - local, t), t, pre, c)
        return best

    def decode_estimates(self, request: RequestView, cluster: ClusterView, arrive_s: float,
                         views: Sequence[DecodeView] | None = None) -> list[DecodeEstimate]:
        """Per decode instance of ``views`` (default: all of ``cluster.decode``), in the
        listed order, the load at ``arrive_s`` and the predicted TBT with this request.
        Predictive admission takes the peak load while the request would decode there
        (requests admitted that join after ``arrive_s`` reserve their room); judging the
        current load, the load now. The peak judges room and the TBT SLO (the worst the
        request meets); its predicted decode seconds (``decode_s``, hence the finish instant
        that reserves its room for later requests) take the TBT at the load it joins — the
        peak's TBT overstated every stay, by ~4% on the overload preset, so that later
        requests were refused for room that would be free."""
        predictive = self.config.admission.predicted_decode_load
        at = arrive_s if predictive else cluster.now_s
        kv = request.kv_tokens
        n = request.sequences
        steps = max(1, request.max_tokens - 1)
        predict = self.tbt_model.predict
        out = []
        for view in cluster.decode if views is None else views:
            load = load_at(view, at)
            joined_tbt = predict(load.running + n, load.kv_tokens + kv)
            if predictive and view.work:
                load = load_at(view, at, at + steps * joined_tbt)
            tbt = self.tbt_model.predict(load.running + n, load.kv_tokens + kv)
            fits = load.running + n <= view.max_running and load.kv_tokens + kv <= view.kv_capacity_tokens
            out.append(DecodeEstimate(view, load, tbt, fits, max(0, request.max_tokens - 1) * joined_tbt))
        return out


def _ttft_key(e: PrefillEstimate) -> tuple[float, int, int]:
    return e.ttft_s, -e.cached_tokens, e.view.queued


def _top_two(views: Sequence[PrefillView]) -> tuple[PrefillView, ...]:
    """The two instances with the longest hits (longest first), ignoring empty hits."""
    first = second = None
    for v in views:
        if v.hit.blocks <= 0:
            continue
        if first is None or v.hit.blocks > first.hit.blocks:
            first, second = v, first
        elif second is None or v.hit.blocks > second.hit.blocks:
            second = v
    return tuple(v for v in (first, second) if v is not None)

