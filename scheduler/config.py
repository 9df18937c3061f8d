"""Configuration of the front door (the one place the scheduler's settings live; the CLI
builds it from flags)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from scheduler.admission import AdmissionConfig
from scheduler.policy import POLICIES
from scheduler.predictor import PredictorConfig


@dataclass(frozen=True)
class FrontdoorConfig:
    """``model_dir``: checkpoint whose tokenizer to use (None: the byte-level tokenizer of
    the tiny model); ``policy``: routing policy name (see ``scheduler.policy.POLICIES``);
    ``default_max_tokens``: tokens generated when a request names none; ``store_auth_token``:
    bearer token of the store node; ``local_cache_blocks``: capacity of each prefill engine's
    own cache (blocks), mirrored by the router; ``ready_timeout_s``: how long to wait for the
    engines at start (seconds)."""

    model_dir: str | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    policy: str = "least_ttft"
    default_max_tokens: int = 16
    store_auth_token: str | None = None
    local_cache_blocks: int = 4096
    ready_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidArgument(f"unknown routing policy {self.policy!r}; valid: {sorted(POLICIES)}")
        if not (isinstance(self.default_max_tokens, int) and self.default_max_tokens >= 1):
            raise InvalidArgument(f"default_max_tokens must be an integer >= 1, got {self.default_max_tokens!r}")
        if not (isinstance(self.local_cache_blocks, int) and self.local_cache_blocks >= 0):
            raise InvalidArgument(f"local_cache_blocks must be an integer >= 0, got {self.local_cache_blocks!r}")
        if not self.ready_timeout_s > 0:
            raise InvalidArgument(f"ready_timeout_s must be > 0 s, got {self.ready_timeout_s!r}")
