"""The routers users deploy in front of vLLM instead of the Conductor, as scheduling
policies of the registry (:mod:`scheduler.policy.baselines`), written from each project's source and
documentation (docs/routers.md gives the version, the formula, the defaults and how each input
maps onto ours):

* ``dynamo_kv`` — NVIDIA Dynamo's KV router: per worker ``cost = prefill_load_scale ×
  max(0, active prefill blocks + prompt blocks − overlap credit) + active blocks + prompt
  blocks``, the overlap credit being 1.0 per block the worker holds in device memory, 0.75
  per host-tier block and 0.25 per disk-tier block; the least cost (ties: random), or a
  softmax over the costs with ``router_temperature`` > 0. Decode workers: the least active
  blocks (Dynamo's decode router zeroes the overlap credit and the prefill term).
* ``llmd`` — llm-d's inference scheduler with the precise prefix-cache scorer: ``2 ×
  prefix + 1 × (1 − KV-cache usage) + 1 × queue``, ``prefix`` the longest cached prefix of
  the worker, each block weighted by its tier (GPU 1.0, CPU 0.8), over the request's blocks;
  ``queue`` the waiting queue min-max normalised (1 when all are equal); the highest score
  (ties: random). Decode workers: the same scorers (no prefix is known there).
* ``sglang_cache_aware`` — SGLang's router ``cache_aware``: when the loads (requests in
  flight per worker, as the router counts them) are imbalanced (``max − min > 64`` and
  ``max > 1.5 × min``), the least loaded; else the worker whose approximate radix tree
  (the router's own history of what it sent where, LRU-evicted every 120 s to its size
  bound) matches the longest prefix when that match covers more than 30% of the prompt,
  else the worker whose tree is smallest. Decode workers: the least loaded.

Each overrides only the choices of :class:`scheduler.policy.conductor.Conductor`, so the
predictions in its :class:`~scheduler.policy.views.Decision`, the admission and the engines'
fetch rule (every longer pool hit, never a peer's cache) are those of the paper's baselines.
"""
from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from scheduler.policy.conductor import Conductor, ConductorConfig, DecodeEstimate, PrefillEstimate
from scheduler.policy.tbt import load_at
from scheduler.policy.views import ClusterView, DecodeView, PrefillView, RequestView, TierHit

T = TypeVar("T")


def pick_least(items: Sequence[T], cost: Callable[[T], float], rng: random.Random) -> T:
    """The item of least cost; ties broken uniformly at random (reservoir over the ties)."""
    best, best_cost, ties = items[0], math.inf, 0
    for item in items:
        c = cost(item)
        if c < best_cost:
            best, best_cost, ties = item, c, 1
        elif c == best_cost:
            ties += 1
            if rng.randrange(ties) == 0:
                best = item
    return best


def softmax_pick(items: Sequence[T], costs: Sequence[float], temperature: float, rng: random.Random) -> T:
    """Dynamo's ``router_temperature`` > 0: sample with probability ∝ exp(−(c − min) /
    ((max − min) × temperature)), costs normalised to their range (uniform when all equal)."""
    lo, hi = min(costs), max(costs)
    if hi == lo:
        return items[rng.randrange(len(items))]
    weights = [math.exp(-(c - lo) / ((hi - lo) * temperature)) for c in costs]
    return rng.choices(list(items), weights)[0]


class _PeerRouter(Conductor):
    """A peer's rule over the Conductor's predictions and admission."""

    balanced_fetch = False
    colocated_decode_wait = False   # its own rule weighs (or ignores) decode load

    def __init__(self, block_bytes: int, config: ConductorConfig | None = None) -> None:
        super().__init__(block_bytes, config)
        self.rng = random.Random(self.config.seed)


def _decode_of(cluster: ClusterView, instance_id: str) -> DecodeView | None:
    return next((d for d in cluster.decode if d.instance_id == instance_id), None)


def _booked_tokens(view: DecodeView | None) -> int:
    """KV tokens of every request booked on a decode instance and not finished (prompt and
    output reservation: the view has no prompt-only figure)."""
    return 0 if view is None else sum(w.kv_tokens for w in view.work)


# -- NVIDIA Dynamo ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DynamoSettings:
    """Dynamo's KvRouterConfig defaults (lib/kv-router/src/scheduling/config.rs)."""

    overlap_score_credit: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    shared_cache_multiplier: float = 0.0
    prefill_load_scale: float = 1.0
    router_temperature: float = 0.0


class DynamoKVPolicy(_PeerRouter):
    """NVIDIA Dynamo's KV router (module docstring; docs/routers.md)."""

    name = "dynamo_kv"
    settings = DynamoSettings()

    def overlap_credit(self, hit: TierHit, pool: TierHit) -> float:
        """Blocks of credit: device (``hbm``) blocks × the overlap credit, host (``dram``)
        blocks × 0.75, disk (``ssd``) × 0.25; the pool's blocks beyond them × the shared-cache
        multiplier (0 by default: Dynamo scores no shared tier unless told to)."""
        s = self.settings
        weight = {"hbm": s.overlap_score_credit, "dram": s.host_cache_hit_weight, "ssd": s.disk_cache_hit_weight}
        own = sum(weight.get(tier, 0.0) * n for tier, n in hit.by_tier)
        return own + s.shared_cache_multiplier * max(0, pool.blocks - hit.blocks)

    def prefill_cost(self, request: RequestView, cluster: ClusterView, view: PrefillView) -> float:
        """``prefill_load_scale × max(0, raw prefill blocks − credit) + decode blocks``."""
        bs = request.block_size
        prompt = request.prompt_tokens / bs
        raw = view.prefill_tokens / bs + prompt
        adjusted = max(0.0, raw - self.overlap_credit(view.hit, cluster.pool_hit))
        if cluster.colocated:       # aggregated: every request on the worker, until it finishes
            active = _booked_tokens(_decode_of(cluster, view.instance_id)) / bs
        else:                       # a prefill worker holds its requests until their prefill ends
            active = view.prompt_tokens / bs
        return self.settings.prefill_load_scale * adjusted + active + prompt

    def _pick(self, items: Sequence[T], costs: list[float]) -> T:
        t = self.settings.router_temperature
        if t > 0:
            return softmax_pick(items, costs, t, self.rng)
        return items[pick_least(range(len(items)), costs.__getitem__, self.rng)]

    def choose_prefill(self, request: RequestView, cluster: ClusterView,
                       estimates: Sequence[PrefillEstimate]) -> PrefillEstimate:
        return self._pick(estimates, [self.prefill_cost(request, cluster, e.view) for e in estimates])

    def choose_decode(self, request: RequestView, cluster: ClusterView,
                      estimates: Sequence[DecodeEstimate]) -> DecodeEstimate:
        bs = request.block_size
        return self._pick(estimates, [(_booked_tokens(e.view) + request.prompt_tokens) / bs for e in estimates])


# -- llm-d ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlmdSettings:
    """llm-d's EPP sample config with the precise prefix-cache scorer
    (deploy/config/epp-precise-prefix-cache-config.yaml) and llm-d-kv-cache's tier weights."""

    prefix_weight: float = 2.0
    kv_utilization_weight: float = 1.0
    queue_weight: float = 1.0
    gpu_block_weight: float = 1.0
    cpu_block_weight: float = 0.8


class LlmdPolicy(_PeerRouter):
    """llm-d's inference scheduler (module docstring; docs/routers.md)."""

    name = "llmd"
    settings = LlmdSettings()

    def prefix_score(self, request: RequestView, hit: TierHit) -> float:
        """The instance's cached prefix, each block weighted by its tier (``hbm``: GPU,
        ``dram``: CPU; any other medium 1.0, as llm-d-kv-cache weighs a medium it has no
        weight for), over the request's blocks, clipped to [0, 1]."""
        total = len(request.block_keys)
        if total == 0:
            return 0.0
        weight = {"hbm": self.settings.gpu_block_weight, "dram": self.settings.cpu_block_weight}
        score = sum(weight.get(tier, 1.0) * n for tier, n in hit.by_tier)
        return min(1.0, score / total)

    @staticmethod
    def queue_scores(waiting: Sequence[int]) -> list[float]:
        """(max − waiting) / (max − min); 1.0 for all when they are equal."""
        hi, lo = max(waiting), min(waiting)
        return [1.0 if hi == lo else (hi - w) / (hi - lo) for w in waiting]

    def _pick(self, items: Sequence[T], scores: list[float]) -> T:
        return items[pick_least(range(len(items)), lambda i: -scores[i], self.rng)]

    def prefill_scores(self, request: RequestView, views: Sequence[PrefillView]) -> list[float]:
        s = self.settings
        queue = self.queue_scores([max(0, v.queued - 1) for v in views])   # vLLM's waiting: not the running one
        return [s.prefix_weight * self.prefix_score(request, v.hit) + s.kv_utilization_weight * (1.0 - v.kv_usage)
                + s.queue_weight * q for v, q in zip(views, queue)]

    def choose_prefill(self, request: RequestView, cluster: ClusterView,
                       estimates: Sequence[PrefillEstimate]) -> PrefillEstimate:
        return self._pick(estimates, self.prefill_scores(request, [e.view for e in estimates]))

    def choose_decode(self, request: RequestView, cluster: ClusterView,
                      estimates: Sequence[DecodeEstimate]) -> DecodeEstimate:
        s, now = self.settings, cluster.now_s
        queue = self.queue_scores([sum(1 for w in e.view.work if w.start_s > now) for e in estimates])
        scores = [s.kv_utilization_weight * (1.0 - min(1.0, load_at(e.view, now).kv_tokens
                                                       / max(1, e.view.kv_capacity_tokens)))
                  + s.queue_weight * q for e, q in zip(estimates, queue)]
        return self._pick(estimates, scores)


# -- SGLang -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SGLangSettings:
    """sgl-router's ``cache_aware`` defaults (CLI defaults: cache_threshold 0.3,
    balance_abs_threshold 64, balance_rel_threshold 1.5, eviction_interval 120 s,
    max_tree_size 2**26 characters); ``chars_per_token`` maps its character tree onto blocks."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int = 1 << 26
    chars_per_token: int = 4


class ApproxTree:
    """SGLang's approximate radix tree over block keys: per worker, the blocks of the prompts
    the router sent there, least recently sent first (a prompt's tail before its head, as the
    radix tree evicts leaves first). A block key names its whole prefix, so a worker matches
    the request's leading keys it holds."""

    def __init__(self) -> None:
        self.tenants: dict[str, OrderedDict[bytes, None]] = {}

    def insert(self, keys: Sequence[bytes], tenant: str) -> None:
        blocks = self.tenants.setdefault(tenant, OrderedDict())
        for k in reversed(keys):           # the head ends most recent: evicted last
            blocks[k] = None
            blocks.move_to_end(k)

    def match(self, keys: Sequence[bytes], tenant: str) -> int:
        blocks = self.tenants.get(tenant)
        if not blocks:
            return 0
        n = 0
        for k in keys:
            if k not in blocks:
                break
            n += 1
        return n

    def size(self, tenant: str) -> int:
        return len(self.tenants.get(tenant, ()))

    def evict(self, max_blocks: int) -> None:
        """Each worker's tree down to ``max_blocks``, least recent first."""
        for blocks in self.tenants.values():
            while len(blocks) > max_blocks:
                blocks.popitem(last=False)


class SGLangCacheAwarePolicy(_PeerRouter):
    """SGLang's router, policy ``cache_aware`` (module docstring; docs/routers.md)."""

    name = "sglang_cache_aware"
    settings = SGLangSettings()

    def __init__(self, block_bytes: int, config: ConductorConfig | None = None) -> None:
        super().__init__(block_bytes, config)
        self.tree = ApproxTree()
        self.evicted_at: float | None = None

    def load(self, cluster: ClusterView, view: PrefillView) -> int:
        """Requests the router has in flight on the worker: in prefill there (disaggregated),
        every one not finished (colocated)."""
        if cluster.colocated:
            d = _decode_of(cluster, view.instance_id)
            return view.queued if d is None else max(view.queued, len(d.work))
        return view.queued

    def _maybe_evict(self, now: float, block_size: int) -> None:
        if self.evicted_at is None:
            self.evicted_at = now
        elif now - self.evicted_at >= self.settings.eviction_interval_s:
            s = self.settings
            self.tree.evict(max(1, s.max_tree_size // (s.chars_per_token * block_size)))
            self.evicted_at = now

    def choose_prefill(self, request: RequestView, cluster: ClusterView,
                       estimates: Sequence[PrefillEstimate]) -> PrefillEstimate:
        s = self.settings
        self._maybe_evict(cluster.now_s, request.block_size)
        loads = [self.load(cluster, e.view) for e in estimates]
        hi, lo = max(loads), min(loads)
        if hi - lo > s.balance_abs_threshold and hi > lo * s.balance_rel_threshold:
            chosen = estimates[loads.index(lo)]                      # shortest queue
        else:
            keys = request.block_keys
            matched = [self.tree.match(keys, e.view.instance_id) for e in estimates]
            best = max(matched)
            rate = min(request.prompt_tokens, best * request.block_size) / max(1, request.prompt_tokens)
            if rate > s.cache_threshold:
                chosen = estimates[matched.index(best)]
            else:
                sizes = [self.tree.size(e.view.instance_id) for e in estimates]
                chosen = estimates[sizes.index(min(sizes))]
        self.tree.insert(request.block_keys, chosen.view.instance_id)
        return chosen

    def choose_decode(self, request: RequestView, cluster: ClusterView,
                      estimates: Sequence[DecodeEstimate]) -> DecodeEstimate:
        """The least loaded decode worker (requests in flight there; ties: listed order)."""
        return min(estimates, key=lambda e: len(e.view.work))


PEER_ROUTERS: tuple[type[Conductor], ...] = (DynamoKVPolicy, LlmdPolicy, SGLangCacheAwarePolicy)
