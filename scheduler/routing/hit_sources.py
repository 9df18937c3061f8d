"""Where a request's cached prompt tokens came from, and what its prefill handed to decode:
the figures the front door's books keep apart (docs/metrics.md).

``cached_tokens`` (the figure a client gets in ``usage.prompt_tokens_details``) are the prompt
tokens the request's prefill did not compute because they were already cached: the prefill
instance's own cache (``instance``: vLLM's prefix cache, a built-in engine's local block
cache) or the pool (``pool_hbm``, ``pool_dram``, ``pool_ssd``, by the tier that served
them). The engines report the total, not its split: :func:`hit_sources` attributes it from
the router's plan, whose view of the chosen instance's own hit comes from the instances' KV
events (none without them) and whose pool hit by tier comes from the store's index — the
instance's own blocks first (it reuses those before it asks the pool), then the pool's
blocks past them tier by tier; what neither covered (blocks stored between the plan and
the prefill) goes to the tier the engine said it read (``load_tier``), else to
``unknown``.

The hand-off is not a hit: in the disaggregated topology the decode instance takes the
prompt's KV from the prefill instance instead of computing it — through the pool (``pool``:
vLLM's ``kv_consumer`` loads every full block the prefill saved, which its own ``usage``
reports as ``cached_tokens``; a built-in decode engine reads the prefill's blocks from the
pool) or with the prefill's answer (``direct``: a built-in prefill's tail KV). It is counted
apart (:func:`handoff_of`), whatever the reuse.
"""
from __future__ import annotations

from engines.types import PrefillResult
from scheduler.policy.views import POOL
from scheduler.routing.route_plan import RoutePlan

SOURCES = ("instance", "pool_hbm", "pool_dram", "pool_ssd", "unknown")


def planned_local_blocks(plan: RoutePlan, block_size: int) -> int:
    """Blocks of the prompt the plan counted on from the prefill instance's own cache: where
    a pool fetch starts, or (no fetch) the whole planned reuse."""
    d = plan.decision
    if d.fetch is not None and d.fetch.source == POOL:
        return d.fetch.first_block
    if d.fetch is not None:        # a peer's blocks (not in the live router): none of its own
        return 0
    return -(-d.cached_tokens // block_size)


def hit_sources(cached_tokens: int, plan: RoutePlan, block_size: int, load_tier: str = "") -> dict[str, int]:
    """``cached_tokens`` split by source (keys of :data:`SOURCES`, tokens > 0 only; the
    values sum to ``cached_tokens``), attributed as the module says."""
    out: dict[str, int] = {}
    left = max(0, cached_tokens)
    if not left:
        return out
    local = min(left, planned_local_blocks(plan, block_size) * block_size)
    if local:
        out["instance"] = local
        left -= local
    start = -(-local // block_size)
    for tier, blocks in plan.pool_hit.between(start, plan.pool_hit.blocks):
        if left <= 0:
            break
        take = min(left, blocks * block_size)
        name = f"pool_{tier}" if f"pool_{tier}" in SOURCES else "unknown"
        out[name] = out.get(name, 0) + take
        left -= take
    if left > 0:
        name = f"pool_{load_tier}" if f"pool_{load_tier}" in SOURCES else "unknown"
        out[name] = out.get(name, 0) + left
    return out


def handoff_of(result: PrefillResult, prompt_tokens: int) -> tuple[int, int]:
    """A built-in prefill's hand-off to decode, in prompt tokens: (through the pool, with the
    answer). The decode engine reads the full blocks before the tail from the pool and takes
    the tail's KV (``tail_kv``) from the result; it computes none of the prompt."""
    direct = min(prompt_tokens, max(0, result.tail_tokens))
    return prompt_tokens - direct, direct
