"""Routing policies: which prefill instance serves a request, given each instance's predicted
TTFT. A policy is a strategy object with one method, picked by name from :data:`POLICIES`.

This holds the thin policy (least predicted TTFT). The full Conductor of DESIGN.md §7
(Mooncake, FAST'25, Algorithm 1: transfer-vs-recompute, predicted decode load) and the
baselines (random, round-robin, least-loaded, local cache-aware) plug in here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class PrefillCandidate:
    """One prefill instance's estimate for one request.

    ``local_hit_blocks``: blocks of the prompt in the instance's own cache (scheduler's
    replica); ``hit_blocks``: max(pool hit, local hit); ``cached_tokens``: prompt tokens the
    instance may reuse (never the last one); ``new_tokens``: tokens it must compute;
    ``queue_s``, ``prefill_s``, ``ttft_s``: predicted seconds (ttft = queue + prefill).
    """

    engine_id: str
    local_hit_blocks: int
    hit_blocks: int
    cached_tokens: int
    new_tokens: int
    queue_s: float
    prefill_s: float

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s


class Policy(ABC):
    """Chooses a prefill instance. ``candidates`` is non-empty, in a stable order."""

    name: str = ""

    @abstractmethod
    def choose(self, candidates: Sequence[PrefillCandidate]) -> PrefillCandidate: ...


class LeastTTFTPolicy(Policy):
    """The least predicted TTFT; ties go to the longer local hit, then the first listed."""

    name = "least_ttft"

    def choose(self, candidates: Sequence[PrefillCandidate]) -> PrefillCandidate:
        return min(candidates, key=lambda c: (c.ttft_s, -c.local_hit_blocks))


POLICIES: dict[str, Callable[[], Policy]] = {LeastTTFTPolicy.name: LeastTTFTPolicy}


def make_policy(name: str) -> Policy:
    """The policy registered as ``name``; raises InvalidArgument listing the valid names."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgument(f"unknown routing policy {name!r}; valid: {sorted(POLICIES)}") from None
