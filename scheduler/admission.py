"""Admission control: reject a request before any prefill is spent on it when it cannot meet
its TTFT SLO or the front door is full (DESIGN.md §7 step 4; Mooncake, FAST'25, §6 early
rejection). The HTTP edge turns a :class:`Rejection` into 429 with ``Retry-After``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

REASON_MAX_INFLIGHT = "max_inflight"
REASON_TTFT_SLO = "ttft_slo"
REASONS = (REASON_MAX_INFLIGHT, REASON_TTFT_SLO)


@dataclass(frozen=True)
class AdmissionConfig:
    """``ttft_slo_s``: the TTFT SLO (seconds, > 0); a request whose predicted TTFT exceeds it
    is rejected. ``max_inflight``: requests admitted and not finished (>= 0; 0 rejects
    everything). ``min_retry_after_s``: the least ``Retry-After`` sent (whole seconds, >= 1).
    """

    ttft_slo_s: float = 30.0
    max_inflight: int = 64
    min_retry_after_s: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.ttft_slo_s, (int, float)) and self.ttft_slo_s > 0):
            raise InvalidArgument(f"ttft_slo_s must be a number of seconds > 0, got {self.ttft_slo_s!r}")
        if not (isinstance(self.max_inflight, int) and self.max_inflight >= 0):
            raise InvalidArgument(f"max_inflight must be an integer >= 0, got {self.max_inflight!r}")
        if not (isinstance(self.min_retry_after_s, int) and self.min_retry_after_s >= 1):
            raise InvalidArgument(f"min_retry_after_s must be an integer >= 1, got {self.min_retry_after_s!r}")


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request was turned away. ``reason`` is one of :data:`REASONS`;
    ``retry_after_s`` is whole seconds for the ``Retry-After`` header."""

    reason: str
    message: str
    retry_after_s: int


class Admission:
    """Decides admit or reject from the router's state; holds no state of its own."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()

    def check(self, predicted_ttft_s: float, queue_s: float, inflight: int) -> Rejection | None:
        """None to admit, else the bound that is exceeded.

        Args:
            predicted_ttft_s: predicted TTFT of this request on its chosen instance (seconds).
            queue_s: the predicted queueing part of it (seconds), for ``Retry-After``.
            inflight: requests already admitted and not finished.
        """
        cfg = self.config
        if inflight >= cfg.max_inflight:
            return Rejection(REASON_MAX_INFLIGHT,
                             f"too many requests in flight ({inflight}, limit {cfg.max_inflight}); retry later",
                             cfg.min_retry_after_s)
        if predicted_ttft_s > cfg.ttft_slo_s:
            # Once the queue ahead has drained by the excess, the request would fit.
            wait = min(queue_s, predicted_ttft_s - cfg.ttft_slo_s) if queue_s > 0 else 0.0
            return Rejection(REASON_TTFT_SLO,
                             f"predicted time to first token {predicted_ttft_s:.3f} s exceeds the "
                             f"TTFT SLO of {cfg.ttft_slo_s:g} s; retry later",
                             max(cfg.min_retry_after_s, math.ceil(wait)))
        return None
