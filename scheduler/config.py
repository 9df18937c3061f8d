"""Configuration of the front door (the one place the scheduler's settings live; the CLI
builds it from flags)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from scheduler.policy.admission import AdmissionConfig
from scheduler.policy.conductor import ConductorConfig
from scheduler.policy.registry import DEFAULT_POLICY, POLICIES

# The front door's connection guard (scheduler/frontdoor/connection_guard.py): its defaults and bounds.
DEFAULT_HEAD_TIMEOUT_S = 15.0
DEFAULT_IDLE_TIMEOUT_S = 75.0       # aiohttp's web.run_app and nginx keep idle connections as long


def check_bounds(max_connections: int | None, idle_timeout_s: float, head_timeout_s: float) -> None:
    """Raise ValueError naming the first bad one: ``max_connections`` an integer >= 1 (or
    None), the two timeouts > 0 seconds."""
    if max_connections is not None and not (isinstance(max_connections, int) and max_connections >= 1):
        raise ValueError(f"max_connections must be an integer >= 1, got {max_connections!r}")
    for name, value in (("idle_timeout_s", idle_timeout_s), ("head_timeout_s", head_timeout_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 s, got {value!r}")


@dataclass(frozen=True)
class FrontdoorConfig:
    """``model_dir``: checkpoint whose tokenizer to use (None: the byte-level tokenizer of
    the tiny model); ``admission``: SLOs and bounds (it replaces ``conductor.admission``);
    ``conductor``: predictor seeds, bandwidths, balancing threshold; ``policy``: scheduling
    policy name (see ``scheduler.policy.registry.POLICIES``); ``default_max_tokens``: tokens generated
    when a request names none; ``store_auth_token``: bearer token of the store node;
    ``engine_auth_token``: the engines' token (only the front door holds it: it sets each
    request's namespace); ``api_keys``: the keys a caller must send (empty: every caller is
    served, scheduler/frontdoor/api_keys.py);
    ``kv_events``: the Redis URL the store nodes and the prefill engines publish their KV
    events to (the router keeps a replica of their indexes, scheduler/routing/cache_index.py; None:
    no instance's own cache is seen, the pool's hits come from its ``Lookup``);
    ``decode_max_running``/``decode_kv_capacity_tokens``: each decode
    instance's batch and KV limits as admission sees them; ``ready_timeout_s``: how long to
    wait for the engines at start (seconds); ``health_interval_s``: how often each engine
    and the store are health-checked (seconds; scheduler/frontdoor/health.py); ``max_model_len``: the
    longest prompt + ``max_tokens`` admitted (tokens; None: the engines' limit, which also
    caps it); ``max_connections``: HTTP connections open at once (None: 1024, fewer under a
    lower open-files limit; scheduler/frontdoor/connection_guard.py); ``head_timeout_s``: how long a new
    connection may take to send its whole request head; ``idle_timeout_s``: how long one
    may stay idle after a response (seconds)."""

    model_dir: str | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    conductor: ConductorConfig = field(default_factory=ConductorConfig)
    policy: str = DEFAULT_POLICY
    default_max_tokens: int = 16
    store_auth_token: str | None = None
    engine_auth_token: str | None = None
    api_keys: frozenset[str] = frozenset()
    kv_events: str | None = None
    decode_max_running: int = 64
    decode_kv_capacity_tokens: int = 1 << 20
    ready_timeout_s: float = 60.0
    health_interval_s: float = 1.0
    max_model_len: int | None = None
    max_connections: int | None = None
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.model_dir is not None:
            from engines.model import check_checkpoint_dir
            try:
                check_checkpoint_dir(self.model_dir)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        if self.max_model_len is not None and not (isinstance(self.max_model_len, int) and self.max_model_len >= 1):
            raise InvalidArgument(f"max_model_len must be an integer >= 1 (tokens), got {self.max_model_len!r}")
        if self.policy not in POLICIES:
            raise InvalidArgument(f"unknown scheduling policy {self.policy!r}; valid: {sorted(POLICIES)}")
        if not (isinstance(self.default_max_tokens, int) and self.default_max_tokens >= 1):
            raise InvalidArgument(f"default_max_tokens must be an integer >= 1, got {self.default_max_tokens!r}")
        for name in ("decode_max_running", "decode_kv_capacity_tokens"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 0):
                raise InvalidArgument(f"{name} must be an integer >= 0, got {v!r}")
        if not self.health_interval_s > 0:
            raise InvalidArgument(f"health_interval_s must be > 0 s, got {self.health_interval_s!r}")
        try:
            check_bounds(self.max_connections, self.idle_timeout_s, self.head_timeout_s)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if not self.ready_timeout_s > 0:
            raise InvalidArgument(f"ready_timeout_s must be > 0 s, got {self.ready_timeout_s!r}")
