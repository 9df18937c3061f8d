"""TBT prediction and the predicted decode load (docs/architecture.md §5; Mooncake, FAST'25,
§6 and arXiv 2407.00079 §7, prediction-based early rejection).

A decode step serves the whole batch and re-reads every resident KV token (it is
memory-bandwidth-bound), so the time between tokens is::

    TBT(batch, kv_tokens) = k0 + k1·batch + k2·kv_tokens        (k0, k1, k2 >= 0)

fitted online (:class:`scheduler.policy.fit.OnlineFit`) from observed (batch, resident KV tokens,
seconds between tokens), seeded from a :class:`DecodeProfile`.

The load a request meets is not the load now but the load when it *reaches* decode, at the
end of its prefill: requests that join before then (they finish prefill) are counted,
requests that leave before then (they finish decoding) are not — :func:`load_at`; requests
admitted there that join later, while it still decodes, are too (their room is reserved).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvstore.errors import InvalidArgument
from scheduler.policy.fit import OnlineFit
from scheduler.policy.views import DecodeView


@dataclass(frozen=True)
class DecodeProfile:
    """Seed of the TBT model: ``step_s`` (per step), ``s_per_request`` (per request in the
    batch), ``s_per_kv_token`` (per resident KV token); >= 0. ``min_samples`` and
    ``decay`` as :class:`scheduler.policy.costing.PrefillProfile`. Defaults fit the tiny CPU model
    loosely. ``learn``: False freezes the seed (the simulator's oracle runs)."""

    step_s: float = 4e-3
    s_per_request: float = 5e-4
    s_per_kv_token: float = 1e-7
    min_samples: int = 8
    decay: float = 0.995
    learn: bool = True

    def __post_init__(self) -> None:
        for name in ("step_s", "s_per_request", "s_per_kv_token"):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(f"{name} must be >= 0 s, got {getattr(self, name)!r}")
        if self.min_samples < 1 or not 0 < self.decay <= 1:
            raise InvalidArgument(f"need min_samples >= 1 and decay in (0, 1], got "
                                  f"{self.min_samples!r} and {self.decay!r}")


class TBTModel:
    """Predicts seconds between tokens from batch size and resident KV tokens."""

    def __init__(self, profile: DecodeProfile | None = None) -> None:
        self.profile = p = profile or DecodeProfile()
        self.fit = OnlineFit((p.step_s, p.s_per_request, p.s_per_kv_token), p.min_samples, p.decay)

    def predict(self, batch: int, kv_tokens: int) -> float:
        k0, k1, k2 = self.fit.coefficients
        return k0 + k1 * max(1, batch) + k2 * max(0, kv_tokens)

    def observe(self, batch: int, kv_tokens: int, tbt_s: float) -> None:
        """Fold in one measurement: mean seconds between tokens while ``batch`` requests with
        ``kv_tokens`` resident tokens were decoding."""
        if self.profile.learn and batch >= 1 and kv_tokens >= 0 and tbt_s > 0:
            self.fit.observe((1.0, float(batch), float(kv_tokens)), tbt_s)

    @property
    def samples(self) -> int:
        return self.fit.samples


class DecodeLoad(NamedTuple):
    """Sequences and KV tokens on one decode instance at one instant, and ``ending``: the
    ``(predicted finish instant, kv_tokens, sequences)`` of each of those requests, in no
    order."""

    running: int
    kv_tokens: int
    ending: tuple[tuple[float, int, int], ...]


def load_at(view: DecodeView, t: float, until: float | None = None) -> DecodeLoad:
    """The load of ``view`` at instant ``t``: every :class:`DecodeWork` with
    ``start_s <= t < finish_s`` (joined and not yet finished).

    With ``until`` (> ``t``: when a request arriving at ``t`` would leave), the peak load
    over ``[t, until)`` instead: work admitted there that joins after ``t`` but before
    ``until`` shares the batch with that request, so its room is reserved (requests and
    KV tokens peak separately; ``ending`` lists every request in the window)."""
    if until is None or until <= t:
        ending = tuple((w.finish_s, w.kv_tokens, w.sequences) for w in view.work if w.start_s <= t < w.finish_s)
        return DecodeLoad(sum(e[2] for e in ending), sum(e[1] for e in ending), ending)
    running = kv = 0
    events: list[tuple[float, int, int]] = []
    window = []
    for w in view.work:
        if w.finish_s <= t or w.start_s >= until:
            continue
        n = w.sequences
        window.append((w.finish_s, w.kv_tokens, n))
        if w.start_s <= t:
            running += n
            kv += w.kv_tokens
        else:
            events.append((w.start_s, n, w.kv_tokens))
        if w.finish_s < until:
            events.append((w.finish_s, -n, -w.kv_tokens))
    peak_n, peak_kv = running, kv
    for _, dn, dkv in sorted(events):      # at one instant, leaving (-1) before joining
        running += dn
        kv += dkv
        if running > peak_n:
            peak_n = running
        if kv > peak_kv:
            peak_kv = kv
    return DecodeLoad(peak_n, peak_kv, tuple(window))
