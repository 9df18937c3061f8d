"""Settings of one simulation run (a policy on a topology at a replay speed)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

TOPOLOGIES = ("disaggregated", "colocated")
# The simulator's admission modes, in the order the overload preset runs them: what each
# rejects (the one description, also ``kvstore simulate --admission``'s help).
ADMISSIONS = {
    "none": "admit everything, queue at decode for as long as it takes",
    "late": "reject only after prefill, when decode is full or too slow as the request reaches it "
            "(the baseline of Mooncake's Table 3, arXiv 2407.00079 §7.3)",
    "current": "also reject before prefill, on the TTFT SLO and on the decode load now",
    "predictive": "as current, on the decode load predicted for the moment the request reaches decode "
                  "(Mooncake's prediction-based early rejection)",
}


@dataclass(frozen=True)
class SimConfig:
    """``topology``: "disaggregated" (``prefill_instances`` P + the rest D, a shared pool)
    or "colocated" (every instance prefills and decodes, local prefix cache only).
    ``instances``: all instances (each one node of ``profile``). ``prefill_instances``:
    None = half (disaggregated only). ``speed``: replay speed (arrivals divided by it).
    ``ttft_slo_s``/``tbt_slo_s``: SLOs (seconds; TBT as Mooncake defines it).
    ``admission``: a mode of :data:`ADMISSIONS` (each described there; what it implies:
    :attr:`rejects_early`, :attr:`rejects_late`, :attr:`predicts_decode_load`).
    ``pool_dram_tokens``/``pool_ssd_tokens``: pool capacity (tokens; None = unbounded,
    0 = none). ``hbm_cache_tokens``: an instance's prefix cache (None: all the KV room of a
    prefill instance; half of it when colocated, the other half holds the decode batch).
    ``local_dram_tokens``: each prefill instance's own DRAM cache below its HBM cache
    (tokens; None = unbounded, 0 = none, the default): blocks evicted from HBM demote there,
    its engine loads them back over PCIe, and only that instance (and, with ``peer_fetch``,
    the Conductor's fetches) reads it — Mooncake's local cache, about 1 TB of a node's DRAM
    holding ~3M LLaMA3-70B tokens (FAST'25 §4.2, §5.3.1).
    ``max_running``: decode batch limit. ``peer_fetch``: the Conductor may fetch a prefix from
    another prefill instance's cache. ``chunked_prefill_tokens``: colocated only, prefill in
    chunks of this many tokens fused with decode steps (None: a prefill pauses the batch).
    ``eviction``: the caches' eviction strategy (:mod:`kvstore.pool.eviction`). ``seed``: of the
    random policy and of the engines' noise. ``prefill_cv``/``decode_cv``/``straggler_prob``/
    ``straggler_factor``: the engines' variance (:class:`engines.cost_model.Variance`, where
    each is explained). ``oracle``: the Conductor's predictors are the cost model's exact mean
    coefficients, frozen; otherwise (default) they are seeded from a profiling pass and learn
    online (:mod:`scheduler.sim.profiling`)."""

    policy: str = "conductor"
    topology: str = "disaggregated"
    instances: int = 16
    prefill_instances: int | None = None
    profile: str = "8xA800"
    model: str = "llama3-70b"
    speed: float = 1.0
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    admission: str = "none"
    pool_dram_tokens: int | None = None
    pool_ssd_tokens: int | None = 0
    local_dram_tokens: int | None = 0
    hbm_cache_tokens: int | None = None
    max_running: int = 256
    peer_fetch: bool = True
    chunked_prefill_tokens: int | None = None
    eviction: str = "lru"
    seed: int = 0
    prefill_cv: float = 0.1
    decode_cv: float = 0.05
    straggler_prob: float = 0.01
    straggler_factor: float = 3.0
    oracle: bool = False

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise InvalidArgument(f"unknown topology {self.topology!r}; valid: {list(TOPOLOGIES)}")
        if self.admission not in ADMISSIONS:
            raise InvalidArgument(f"unknown admission {self.admission!r}; valid: {list(ADMISSIONS)}")
        if self.instances < (2 if self.topology == "disaggregated" else 1):
            raise InvalidArgument(f"{self.topology} needs more instances, got {self.instances}")
        p = self.prefill_instances
        if p is not None and not 1 <= p < self.instances:
            raise InvalidArgument(f"prefill_instances must be in [1, {self.instances - 1}], got {p}")
        if not (self.speed > 0 and math.isfinite(self.speed)):
            raise InvalidArgument(f"speed must be a finite number > 0, got {self.speed}")
        if not (self.ttft_slo_s > 0 and self.tbt_slo_s > 0):
            raise InvalidArgument("SLOs must be > 0 seconds")
        if self.chunked_prefill_tokens is not None and self.chunked_prefill_tokens < 1:
            raise InvalidArgument(f"chunked_prefill_tokens must be >= 1 or None, got {self.chunked_prefill_tokens}")
        from kvstore.pool.eviction import POLICIES as EVICTIONS
        if self.eviction not in EVICTIONS:
            raise InvalidArgument(f"unknown eviction policy {self.eviction!r}; valid: {sorted(EVICTIONS)}")
        if self.max_running < 1:
            raise InvalidArgument(f"max_running must be >= 1, got {self.max_running}")
        from engines.cost_model import Variance
        Variance(self.prefill_cv, self.decode_cv, self.straggler_prob, self.straggler_factor)  # validates
        for name in ("pool_dram_tokens", "pool_ssd_tokens", "hbm_cache_tokens", "local_dram_tokens"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise InvalidArgument(f"{name} must be >= 0 tokens or None (unbounded), got {v}")

    @property
    def rejects_early(self) -> bool:
        """Admission may turn a request away before its prefill (the scheduler's early rejection)."""
        return self.admission in ("current", "predictive")

    @property
    def rejects_late(self) -> bool:
        """A request whose decode instance is full or too slow as it arrives is rejected after
        its prefill (else it queues there)."""
        return self.admission != "none"

    @property
    def predicts_decode_load(self) -> bool:
        """Early rejection judges the decode load predicted for the request's arrival there."""
        return self.admission == "predictive"

    @property
    def n_prefill(self) -> int:
        if self.topology == "colocated":
            return self.instances
        return self.prefill_instances if self.prefill_instances is not None else self.instances // 2
