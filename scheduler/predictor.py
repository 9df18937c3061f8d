"""TTFT prediction: a per-token prefill time model fitted online from observed prefills.

The thin model of DESIGN.md §7: ``T_prefill(n) = max(min_s, n · s_per_token)`` where ``n``
is the number of prompt tokens to compute (not loaded from a cache) and ``s_per_token`` is an
exponentially weighted moving average of ``prefill_s / computed_tokens`` over finished
prefills, seeded with a default. The full Conductor replaces this with a regression over
``(n, prefix)`` (Mooncake, FAST'25, §5 and Algorithm 1).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import InvalidArgument


@dataclass(frozen=True)
class PredictorConfig:
    """``initial_s_per_token``: seconds per computed token before any observation;
    ``min_s_per_token``: floor of the fitted rate (seconds/token); ``min_prefill_s``: floor of
    one prediction (seconds, covers the fixed cost of a call); ``alpha``: EWMA weight of a new
    observation, in (0, 1]."""

    initial_s_per_token: float = 1e-3
    min_s_per_token: float = 1e-6
    min_prefill_s: float = 1e-3
    alpha: float = 0.2

    def __post_init__(self) -> None:
        if not self.initial_s_per_token > 0:
            raise InvalidArgument(f"initial_s_per_token must be > 0 s/token, got {self.initial_s_per_token}")
        if not self.min_s_per_token > 0:
            raise InvalidArgument(f"min_s_per_token must be > 0 s/token, got {self.min_s_per_token}")
        if self.min_prefill_s < 0:
            raise InvalidArgument(f"min_prefill_s must be >= 0 s, got {self.min_prefill_s}")
        if not 0 < self.alpha <= 1:
            raise InvalidArgument(f"alpha must be in (0, 1], got {self.alpha}")


class PrefillPredictor:
    """Predicts prefill seconds from tokens to compute. Invariant: ``s_per_token`` is never
    below ``config.min_s_per_token``."""

    def __init__(self, config: PredictorConfig | None = None) -> None:
        self.config = config or PredictorConfig()
        self.s_per_token = max(self.config.initial_s_per_token, self.config.min_s_per_token)
        self.observations = 0

    def predict(self, computed_tokens: int) -> float:
        """Seconds to prefill ``computed_tokens`` new tokens (>= ``min_prefill_s``)."""
        return max(self.config.min_prefill_s, max(0, computed_tokens) * self.s_per_token)

    def observe(self, computed_tokens: int, prefill_s: float) -> None:
        """Fold in one finished prefill (engine-side seconds); ignores empty observations."""
        if computed_tokens <= 0 or prefill_s <= 0:
            return
        rate = prefill_s / computed_tokens
        a = self.config.alpha
        self.s_per_token = max(self.config.min_s_per_token, (1 - a) * self.s_per_token + a * rate)
        self.observations += 1
