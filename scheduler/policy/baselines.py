"""Baseline policies, the prefill schedulers Mooncake compares the Conductor with (FAST'25
§4.1 and Fig. 5; arXiv 2407.00079 §4.1):

* ``random``: a uniformly random prefill instance;
* ``least_loaded`` (the paper's load-balancing scheduler): ``argmin_i T_queue_i``;
* ``local_cache_aware``: ``argmin_i T_queue_i + T_prefill(n, local_prefix_i)`` — the queue
  plus the prefill with the instance's *own* cached prefix (with the read of its blocks in the
  node's own DRAM tier, ``read_s``, as the engine pays it), no transfer from another holder
  considered;
* ``round_robin``: instances in turn (not in the paper; a sanity floor).

``T_queue`` is :mod:`scheduler.policy.backlog`'s and ``T_prefill`` the Conductor's learned
predictor, so a baseline differs from the Conductor only in its choice. Each is a
:class:`scheduler.policy.conductor.Conductor` that overrides only its choices, so every policy shares
the predictions, the fetch accounting and the admission of the Conductor: one code path,
compared fairly. Baselines fetch as the engines do by default — every longer pool hit, never
a peer's cache — rather than by the balancing threshold.

The routers users deploy instead (NVIDIA Dynamo's KV router, llm-d's inference scheduler,
SGLang's ``cache_aware``) are registered beside them from :mod:`scheduler.policy.peer_routers`.

Registry: :data:`POLICIES` maps a name to its class; :func:`make_policy` builds one.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from kvstore.errors import InvalidArgument
from kvstore.index.keys import usable_prefix_tokens
from scheduler.policy.conductor import Conductor, ConductorConfig, DecodeEstimate, PrefillEstimate
from scheduler.policy.peer_routers import PEER_ROUTERS
from scheduler.policy.views import ClusterView, RequestView


class _Baseline(Conductor):
    balanced_fetch = False
    colocated_decode_wait = False   # the paper's baselines: T_queue of the prefill queue alone

    def choose_decode(self, request: RequestView, cluster: ClusterView,
                      estimates: Sequence[DecodeEstimate]) -> DecodeEstimate:
        """Fewest requests running there now (ties: listed order)."""
        now = cluster.now_s
        return min(estimates, key=lambda e: sum(1 for w in e.view.work if w.start_s <= now < w.finish_s))


class RandomPolicy(_Baseline):
    """A uniformly random prefill and decode instance (seeded: ``config.seed``)."""

    name = "random"

    def __init__(self, block_bytes: int, config: ConductorConfig | None = None) -> None:
        super().__init__(block_bytes, config)
        self.rng = random.Random(self.config.seed)

    def choose_prefill(self, request, cluster, estimates: Sequence[PrefillEstimate]) -> PrefillEstimate:
        return estimates[self.rng.randrange(len(estimates))]

    def choose_decode(self, request, cluster, estimates: Sequence[DecodeEstimate]) -> DecodeEstimate:
        return estimates[self.rng.randrange(len(estimates))]


class RoundRobinPolicy(_Baseline):
    """Prefill and decode instances in turn, each in its listed order."""

    name = "round_robin"

    def __init__(self, block_bytes: int, config: ConductorConfig | None = None) -> None:
        super().__init__(block_bytes, config)
        self._next_prefill = self._next_decode = 0

    def choose_prefill(self, request, cluster, estimates: Sequence[PrefillEstimate]) -> PrefillEstimate:
        e = estimates[self._next_prefill % len(estimates)]
        self._next_prefill += 1
        return e

    def choose_decode(self, request, cluster, estimates: Sequence[DecodeEstimate]) -> DecodeEstimate:
        e = estimates[self._next_decode % len(estimates)]
        self._next_decode += 1
        return e


class LeastLoadedPolicy(_Baseline):
    """Load balancing: the prefill instance with the least T_queue (predicted seconds;
    ties: fewer requests, listed order)."""

    name = "least_loaded"

    def choose_prefill(self, request, cluster, estimates: Sequence[PrefillEstimate]) -> PrefillEstimate:
        return min(estimates, key=lambda e: (e.queue_s, e.view.queued))


class LocalCacheAwarePolicy(_Baseline):
    """The prefill instance with the least ``T_queue + T_prefill(n, its local prefix)``
    (Mooncake FAST'25 §4.1), the read of that prefix's blocks in the node's own DRAM tier
    (``read_s``) included; ties: longer local prefix, fewer requests, listed order."""

    name = "local_cache_aware"

    def choose_prefill(self, request, cluster, estimates: Sequence[PrefillEstimate]) -> PrefillEstimate:
        n, bs = request.prompt_tokens, request.block_size
        predict = self.prefill_model.predict
        memo: dict[int, float] = {}

        def cost(e: PrefillEstimate) -> tuple[float, int, int]:
            t = memo.get(e.local_blocks)
            if t is None:
                t = memo[e.local_blocks] = predict(n, usable_prefix_tokens(e.local_blocks, bs, n))
            return e.queue_s + e.read_s + t, -e.local_blocks, e.view.queued
        return min(estimates, key=cost)


_CLASSES: tuple[type[Conductor], ...] = (Conductor, RandomPolicy, RoundRobinPolicy, LeastLoadedPolicy,
                                         LocalCacheAwarePolicy, *PEER_ROUTERS)
POLICIES: dict[str, Callable[..., Conductor]] = {cls.name: cls for cls in _CLASSES}


def make_policy(name: str, block_bytes: int, config: ConductorConfig | None = None) -> Conductor:
    """The policy registered as ``name`` (see :data:`POLICIES`). Raises InvalidArgument
    listing the valid names."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise InvalidArgument(f"unknown scheduling policy {name!r}; valid: {sorted(POLICIES)}") from None
    return cls(block_bytes, config)
