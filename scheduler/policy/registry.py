"""Scheduling policies by name — the registry the front door's ``--policy`` flag and the
simulator pick from ("scheduling policy", never plain "policy": the store's eviction
policies are :mod:`kvstore.pool.eviction`). The policies live in :mod:`scheduler.policy.conductor` (the
Conductor, Mooncake's Algorithm 1) and :mod:`scheduler.policy.baselines` (random, round-robin,
least-loaded, local cache-aware) and :mod:`scheduler.policy.peer_routers` (NVIDIA Dynamo's KV router,
llm-d's inference scheduler, SGLang's ``cache_aware``: docs/routers.md); every one has the decision API of
:class:`SchedulingPolicy` (:class:`scheduler.policy.conductor.Conductor`).
"""
from __future__ import annotations

from scheduler.policy.baselines import POLICIES, make_policy
from scheduler.policy.conductor import Conductor as SchedulingPolicy

DEFAULT_POLICY = "conductor"

__all__ = ["POLICIES", "DEFAULT_POLICY", "SchedulingPolicy", "make_policy"]
