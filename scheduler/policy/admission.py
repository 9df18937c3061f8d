"""Admission control: reject a request before any prefill is spent on it when it cannot meet
its SLOs or the front door is full (docs/architecture.md §5; Mooncake, FAST'25, §6 and
arXiv 2407.00079 §7, early rejection). Pure and synchronous: the policies of
:mod:`scheduler.policy.conductor` call it; the HTTP edge turns a :class:`Rejection` into 429 with
``Retry-After``.

Rules, in order:

* ``max_inflight``: requests admitted and not finished reach the bound (a request decoding
  ``n`` sequences counts ``n``, here, per tenant and in the decode batch);
* ``ttft_slo``: the predicted TTFT exceeds the TTFT SLO *and* either the chosen prefill
  instance has work queued, or even the optimistic TTFT — the predictor's, less
  ``unattainable_k`` downside deviations of its measured error
  (:meth:`scheduler.policy.costing.PrefillModel.optimistic`) — exceeds it: the request cannot meet
  its SLO on any instance, so its prefill would be spent for nothing (Mooncake rejects on
  the predicted TTFT, arXiv 2407.00079 §7). An idle instance whose predictor has not
  measured enough, or whose optimistic TTFT is within the SLO, never rejects — it is the
  best the cluster can do;
* ``decode_capacity``: the decode instance will be full (batch or KV tokens) when the
  request reaches it — the load *predicted* for that instant, not the load now;
* ``tbt_slo``: the predicted TBT there exceeds the TBT SLO, unless the request would decode
  alone (again: nothing better exists).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

REASON_MAX_INFLIGHT = "max_inflight"
REASON_TTFT_SLO = "ttft_slo"
REASON_TBT_SLO = "tbt_slo"
REASON_DECODE_CAPACITY = "decode_capacity"
REASON_TENANT_INFLIGHT = "tenant_max_inflight"
REASONS = (REASON_MAX_INFLIGHT, REASON_TTFT_SLO, REASON_TBT_SLO, REASON_DECODE_CAPACITY, REASON_TENANT_INFLIGHT)


@dataclass(frozen=True)
class AdmissionConfig:
    """``ttft_slo_s``: the TTFT SLO (seconds, > 0); ``tbt_slo_s``: the TBT SLO (seconds, > 0;
    ``math.inf``: none). ``max_inflight``: sequences admitted and not finished (>= 0; 0
    rejects everything). ``min_retry_after_s``: the least ``Retry-After`` sent (whole
    seconds, >= 1). ``early_rejection``: reject on the SLOs and decode capacity at all
    (False: only ``max_inflight``). ``predicted_decode_load``: judge decode by the load
    predicted for the moment the request reaches it (True) or by the load now (False,
    the reject-on-current-load baseline). ``unattainable_k``: on an idle instance, reject
    when the prediction less this many downside deviations of its measured error still
    exceeds the TTFT SLO (>= 0; ``math.inf``: never — an idle instance admits anything).
    ``max_inflight_per_tenant``: requests of one tenant admitted and not finished (>= 1;
    None: no bound per tenant), so that one tenant cannot take every slot of
    ``max_inflight``."""

    ttft_slo_s: float = 30.0
    max_inflight: int = 64
    min_retry_after_s: int = 1
    tbt_slo_s: float = math.inf
    early_rejection: bool = True
    predicted_decode_load: bool = True
    unattainable_k: float = 2.0
    max_inflight_per_tenant: int | None = None

    def __post_init__(self) -> None:
        n = self.max_inflight_per_tenant
        if n is not None and not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise InvalidArgument(f"max_inflight_per_tenant must be an integer >= 1 or None, got {n!r}")
        for name in ("ttft_slo_s", "tbt_slo_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise InvalidArgument(f"{name} must be a number of seconds > 0, got {v!r}")
        if not (isinstance(self.max_inflight, int) and self.max_inflight >= 0):
            raise InvalidArgument(f"max_inflight must be an integer >= 0, got {self.max_inflight!r}")
        if not self.unattainable_k >= 0:
            raise InvalidArgument(f"unattainable_k must be >= 0 (inf: never), got {self.unattainable_k!r}")
        if not (isinstance(self.min_retry_after_s, int) and self.min_retry_after_s >= 1):
            raise InvalidArgument(f"min_retry_after_s must be an integer >= 1, got {self.min_retry_after_s!r}")


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request was turned away. ``reason`` is one of :data:`REASONS`;
    ``retry_after_s`` is whole seconds for the ``Retry-After`` header; ``ttft_s`` and
    ``tbt_s`` the predictions that were judged (0 where not reached)."""

    reason: str
    message: str
    retry_after_s: int
    ttft_s: float = 0.0
    tbt_s: float = 0.0


class Admission:
    """Decides admit or reject from predictions; holds no state of its own."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()

    def _retry(self, wait_s: float) -> int:
        return max(self.config.min_retry_after_s, math.ceil(max(0.0, wait_s)))

    def check_inflight(self, inflight: int, sequences: int = 1) -> Rejection | None:
        """A rejection when ``inflight`` (sequences admitted and not finished) plus this
        request's ``sequences`` (OpenAI's ``n``) exceed ``max_inflight``; else None."""
        cfg = self.config
        if inflight + sequences > cfg.max_inflight:
            return Rejection(REASON_MAX_INFLIGHT,
                             f"too many requests in flight ({inflight}{_and_these(sequences)}, limit "
                             f"{cfg.max_inflight}); retry later", cfg.min_retry_after_s)
        return None

    def check_tenant(self, inflight: int, sequences: int = 1) -> Rejection | None:
        """A rejection when the request's tenant already has ``inflight`` sequences in
        flight and this request's ``sequences`` would take it past its bound
        (``max_inflight_per_tenant``); else None."""
        cap = self.config.max_inflight_per_tenant
        if cap is not None and inflight + sequences > cap:
            return Rejection(REASON_TENANT_INFLIGHT,
                             f"too many requests of this tenant in flight ({inflight}{_and_these(sequences)}, "
                             f"limit {cap} per tenant); retry later", self.config.min_retry_after_s)
        return None

    def check(self, predicted_ttft_s: float, queue_s: float, inflight: int,
              optimistic_ttft_s: float | None = None) -> Rejection | None:
        """None to admit, else the bound that is exceeded (``max_inflight``, ``ttft_slo``).

        Args:
            predicted_ttft_s: predicted TTFT of this request on its chosen instance (seconds).
            queue_s: the predicted queueing part of it (seconds); 0 means the instance is idle.
            inflight: requests already admitted and not finished.
            optimistic_ttft_s: a TTFT the request will rarely beat there (seconds, with
                ``unattainable_k`` deviations; None: the predictor is not trusted yet).
        """
        rejection = self.check_inflight(inflight)
        if rejection is not None or not self.config.early_rejection:
            return rejection
        slo = self.config.ttft_slo_s
        if predicted_ttft_s > slo and queue_s <= 0 and optimistic_ttft_s is not None and optimistic_ttft_s > slo:
            return Rejection(REASON_TTFT_SLO,
                             f"predicted time to first token {predicted_ttft_s:.3f} s (at best "
                             f"{optimistic_ttft_s:.3f} s) exceeds the TTFT SLO of {slo:g} s on an idle "
                             f"instance; the request cannot meet it", max(self.config.min_retry_after_s, 60),
                             predicted_ttft_s)
        if predicted_ttft_s > slo and queue_s > 0:
            # Once the queue ahead has drained by the excess, the request would fit.
            return Rejection(REASON_TTFT_SLO,
                             f"predicted time to first token {predicted_ttft_s:.3f} s exceeds the "
                             f"TTFT SLO of {slo:g} s; retry later",
                             self._retry(min(queue_s, predicted_ttft_s - slo)), predicted_ttft_s)
        return None

    def check_decode(self, running: int, kv_tokens: int, ending: tuple[tuple[float, int, int], ...],
                     max_running: int, kv_capacity_tokens: int, request_kv_tokens: int,
                     tbt_s: float, arrive_s: float, ttft_s: float = 0.0, sequences: int = 1) -> Rejection | None:
        """None to admit onto a decode instance, else ``decode_capacity`` or ``tbt_slo``.

        Args:
            running, kv_tokens: sequences and KV tokens predicted there at ``arrive_s``,
                this request excluded; ``ending``: their requests' ``(finish instant,
                kv_tokens, sequences)``, in any order (see :func:`scheduler.policy.tbt.load_at`).
            max_running, kv_capacity_tokens: the instance's limits (sequences, tokens).
            request_kv_tokens: this request's KV (prompt + tokens to generate, every sequence's).
            tbt_s: predicted TBT there with this request in the batch (seconds).
            arrive_s: when the request reaches decode (the caller's clock).
            sequences: the batch slots this request takes (OpenAI's ``n``).
        """
        cfg = self.config
        if not cfg.early_rejection:
            return None
        over_batch = running + sequences - max_running
        over_kv = kv_tokens + request_kv_tokens - kv_capacity_tokens
        if over_batch > 0 or over_kv > 0:
            wait = math.inf
            freed_n = freed_kv = 0
            for finish_s, kv, n in sorted(ending):
                freed_n += n
                freed_kv += kv
                if freed_n >= over_batch and freed_kv >= over_kv:
                    wait = finish_s - arrive_s
                    break
            if request_kv_tokens > kv_capacity_tokens or sequences > max_running:
                wait = math.inf
            retry = self._retry(wait) if math.isfinite(wait) else max(cfg.min_retry_after_s, 60)
            return Rejection(REASON_DECODE_CAPACITY,
                             f"decode will be full when this request reaches it ({running} sequences, "
                             f"{kv_tokens} KV tokens predicted; limits {max_running} and "
                             f"{kv_capacity_tokens}); retry later", retry, ttft_s, tbt_s)
        if tbt_s > cfg.tbt_slo_s and running > 0:
            wait = min(ending)[0] - arrive_s if ending else 0.0
            return Rejection(REASON_TBT_SLO,
                             f"predicted time between tokens {tbt_s:.4f} s exceeds the TBT SLO of "
                             f"{cfg.tbt_slo_s:g} s; retry later", self._retry(wait), ttft_s, tbt_s)
        return None


def _and_these(sequences: int) -> str:
    return "" if sequences == 1 else f", and this request's {sequences} sequences"
