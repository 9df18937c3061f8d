"""The cost model that stands in for GPUs in simulation (docs/architecture.md §4): seconds of prefill,
decode steps and KV transfers on one instance of a hardware profile serving one model.

* Prefill FLOPs (Mooncake, FAST'25, §2.2): ``flops(n) = l·(a·n²·d + b·n·d²)``. With ``p``
  cached prefix tokens only tokens ``p..n`` are computed; they still attend to the prefix, so
  the work is ``flops(n) − flops(p)``. Seconds = FLOPs / (GPUs × peak FLOP/s × MFU).
* Decode step: every step reads the weights and the resident KV once, so
  ``step = overhead + max((W + kv_tokens·kv_bytes) / (GPUs × HBM B/s × MBU),
  2·params·batch / (GPUs × peak × MFU))`` — memory-bound, growing with batch size and context.
* Transfer: bytes over the link's bandwidth (network: the node's RDMA NICs; pcie: one GPU's
  link times the GPUs; nvlink; ssd: the node's SSD reads).
* Variance (:class:`Variance`): the formulas above are a mean. A :class:`CostModelEngine`
  draws, from its own seeded generator, a factor per prefill and per decode segment (the
  steps between two batch changes) and, rarely, a straggler — so that a scheduler predicting
  from observations is wrong as a live one is.

Profiles and models are TOML files under ``configs/`` (see ``configs/README.md``), each
constant with its source.
"""
from __future__ import annotations

import math
import random
import tomllib
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple, TypeVar

from engines.types import EngineLoad, PrefillResult
from kvstore.errors import InvalidArgument
from kvstore.index.keys import usable_prefix_tokens

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
LINKS = ("network", "pcie", "nvlink", "ssd")


@dataclass(frozen=True)
class HardwareProfile:
    """One serving instance (a node of ``gpus`` GPUs under tensor parallelism). Per-GPU
    figures are FLOP/s, bytes and bytes/s; ``network_bw`` is the node's total NIC bandwidth
    (bytes/s); ``ssd_bw`` the node's SSD read bandwidth (bytes/s); ``mfu``/``mbu`` in (0, 1];
    ``step_overhead_s`` seconds per decode step."""

    name: str
    gpus: int
    peak_flops_per_gpu: float
    hbm_bytes_per_gpu: float
    hbm_bw_per_gpu: float
    nvlink_bw: float
    pcie_bw_per_gpu: float
    network_bw: float
    ssd_bw: float = 12e9
    mfu: float = 0.5
    mbu: float = 0.6
    step_overhead_s: float = 0.003
    usable_hbm_fraction: float = 0.9

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and not (isinstance(v, (int, float)) and v > 0 or
                                         f.name == "step_overhead_s" and v == 0):
                raise InvalidArgument(f"hardware profile {self.name!r}: {f.name} must be > 0, got {v!r}")
        for name in ("mfu", "mbu", "usable_hbm_fraction"):
            if getattr(self, name) > 1:
                raise InvalidArgument(f"hardware profile {self.name!r}: {name} must be in (0, 1]")


@dataclass(frozen=True)
class ModelConfig:
    """A model in Mooncake's FLOPs form: ``layers`` (l), ``hidden`` (d), ``attn_coeff`` (a),
    ``linear_coeff`` (b); ``kv_bytes_per_token`` and ``weight_bytes`` in bytes."""

    name: str
    layers: int
    hidden: int
    attn_coeff: float
    linear_coeff: float
    kv_bytes_per_token: int
    params: float
    weight_bytes: float

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "name" and not (isinstance(v, (int, float)) and v > 0):
                raise InvalidArgument(f"model config {self.name!r}: {f.name} must be > 0, got {v!r}")


_Config = TypeVar("_Config", HardwareProfile, ModelConfig)


def _load(kind: str, name_or_path: str | Path, cls: type[_Config]) -> _Config:
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIG_DIR / kind / f"{name_or_path}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONFIG_DIR / kind).glob("*.toml"))
        raise InvalidArgument(f"no {kind} config {str(name_or_path)!r}; known: {known} (or a path to a .toml)")
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise InvalidArgument(f"{path}: unknown keys {unknown}; valid: {sorted(names)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise InvalidArgument(f"{path}: {exc}") from None


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """``configs/hardware/<name>.toml`` (e.g. ``8xA800``) or a TOML path. Raises
    InvalidArgument listing the known profiles."""
    return _load("hardware", name_or_path, HardwareProfile)


def load_model(name_or_path: str | Path) -> ModelConfig:
    """``configs/models/<name>.toml`` (e.g. ``llama3-70b``) or a TOML path."""
    return _load("models", name_or_path, ModelConfig)


class CostModel:
    """Seconds of work on one instance of ``profile`` serving ``model``. Pure functions of
    their arguments; no state."""

    def __init__(self, model: ModelConfig, profile: HardwareProfile) -> None:
        self.model = model
        self.profile = profile
        hw = profile
        self.flops_per_s = hw.gpus * hw.peak_flops_per_gpu * hw.mfu
        self.hbm_bytes_per_s = hw.gpus * hw.hbm_bw_per_gpu * hw.mbu
        self._link_bw = {"network": hw.network_bw, "pcie": hw.pcie_bw_per_gpu * hw.gpus,
                         "nvlink": hw.nvlink_bw, "ssd": hw.ssd_bw}

    def prefill_flops(self, tokens: int, cached: int = 0) -> float:
        """FLOPs to prefill a ``tokens``-token prompt whose first ``cached`` tokens are loaded
        (Mooncake FAST'25 §2.2, differenced): ``l·(a·(n²−p²)·d + b·(n−p)·d²)``."""
        m = self.model
        n, p = float(tokens), float(min(max(cached, 0), tokens))
        return m.layers * (m.attn_coeff * (n * n - p * p) * m.hidden + m.linear_coeff * (n - p) * m.hidden ** 2)

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        """Seconds to prefill (compute only; add :meth:`transfer_s` for loaded blocks)."""
        return self.prefill_flops(tokens, cached) / self.flops_per_s

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.model.kv_bytes_per_token

    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit in the instance's HBM beside the weights."""
        hw = self.profile
        free = hw.gpus * hw.hbm_bytes_per_gpu * hw.usable_hbm_fraction - self.model.weight_bytes
        return max(0, int(free // self.model.kv_bytes_per_token))

    def decode_step_s(self, batch: int, kv_tokens: int) -> float:
        """Seconds of one decode step of ``batch`` requests holding ``kv_tokens`` tokens of KV
        in all (0.0 for an empty batch)."""
        if batch <= 0:
            return 0.0
        m = self.model
        memory = (m.weight_bytes + kv_tokens * m.kv_bytes_per_token) / self.hbm_bytes_per_s
        compute = 2.0 * m.params * batch / self.flops_per_s
        return self.profile.step_overhead_s + max(memory, compute)

    def transfer_s(self, nbytes: float, link: str = "network") -> float:
        """Seconds to move ``nbytes`` over ``link`` (one of :data:`LINKS`)."""
        try:
            return nbytes / self._link_bw[link]
        except KeyError:
            raise InvalidArgument(f"unknown link {link!r}; valid: {list(LINKS)}") from None


@dataclass(frozen=True)
class Variance:
    """How far a real engine's seconds stray from the cost model's mean (all >= 0; zeros:
    none, the deterministic model).

    * ``prefill_cv``: coefficient of variation of one prefill's compute seconds (a lognormal
      factor of mean 1). It stands for what the FLOPs formula leaves out: kernels chosen per
      shape and their tail effects, clock and power throttling, the achieved MFU moving with
      the batch, memory-allocator stalls. Mooncake observes prefill-time prediction errors of
      this order (arXiv 2407.00079 §7.2: predictions are "mostly accurate" but not exact).
    * ``decode_cv``: the same for a decode step's seconds, drawn once per segment (the steps
      between two batch changes share it: the simulator advances a batch analytically, one
      event per change). It stands for HBM-bandwidth contention, KV layout, sampling cost.
    * ``straggler_prob``/``straggler_factor``: a prefill is a straggler with that
      probability and then takes ``straggler_factor`` times as long — a throttled or
      faulty GPU, a preempted host thread, an NCCL or NIC hiccup (the slow tail every
      large cluster reports).
    * ``seed``: of the draws (a prefill's from it and the request's id, a decode segment's
      from the engine's generator, derived from it and the engine's id).
    """

    prefill_cv: float = 0.0
    decode_cv: float = 0.0
    straggler_prob: float = 0.0
    straggler_factor: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefill_cv", "decode_cv"):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.straggler_prob <= 1:
            raise InvalidArgument(f"straggler_prob must be in [0, 1], got {self.straggler_prob!r}")
        if not self.straggler_factor >= 1:
            raise InvalidArgument(f"straggler_factor must be >= 1, got {self.straggler_factor!r}")

    @property
    def none(self) -> bool:
        return self.prefill_cv == 0 and self.decode_cv == 0 and self.straggler_prob == 0


NO_VARIANCE = Variance()


class _Noise:
    """Seeded lognormal factors of mean 1 (``σ = sqrt(ln(1 + cv²))``). A prefill's factor
    (straggler or not) is drawn from the seed and the request's id alone — common random
    numbers: one request gets the same factor whichever engine runs it and whatever ran
    before, so policies compared on one seed see the same noise (drawn per engine in run
    order, only 109 of fig5's first 1,500 requests had had the same factor under two
    policies). A decode segment's factor comes from the engine's own stream."""

    def __init__(self, variance: Variance, name: str) -> None:
        self.v = variance
        self.rng = random.Random((variance.seed << 32) ^ zlib.crc32(name.encode()))
        self._sp = math.sqrt(math.log1p(variance.prefill_cv ** 2))
        self._sd = math.sqrt(math.log1p(variance.decode_cv ** 2))

    def prefill(self, request_id: str) -> float:
        if not (self._sp or self.v.straggler_prob):
            return 1.0
        rng = random.Random(f"{self.v.seed}/prefill/{request_id}")
        f = math.exp(rng.gauss(-self._sp * self._sp / 2, self._sp)) if self._sp else 1.0
        if self.v.straggler_prob and rng.random() < self.v.straggler_prob:
            f *= self.v.straggler_factor
        return f

    def decode(self) -> float:
        return math.exp(self.rng.gauss(-self._sd * self._sd / 2, self._sd)) if self._sd else 1.0


class LoadedPrefix(NamedTuple):
    """The cached prefix a simulated engine finds for a prompt (the simulator owns the
    virtual cluster's caches and finds it): ``blocks`` (head first) of which the first
    ``local_blocks`` are in the engine's own HBM cache; ``load_s`` seconds and
    ``load_bytes`` bytes to fetch the rest (from the pool or a peer), ``tier`` the tier
    they come from (``""``: none)."""

    blocks: int = 0
    local_blocks: int = 0
    load_s: float = 0.0
    load_bytes: int = 0
    tier: str = ""


class CostModelEngine:
    """An engine in virtual time: the real engines' interface (:class:`engines.types.Engine`,
    :class:`engines.types.PrefillBackend`) with seconds from a :class:`CostModel` instead of
    a GPU. ``role``: ``"prefill"``, ``"decode"`` or ``"colocated"`` (both).

    Nothing blocks: :meth:`prefill` returns at once with ``prefill_s`` = the prefix's load
    seconds + the compute seconds of the rest, and the caller (the simulator) advances its
    clock. :meth:`load` reports what the caller told it: :meth:`enqueue` a request,
    :meth:`prefill` starts it (queued → running), :meth:`prefill_done` ends it,
    :meth:`join`/:meth:`leave` a decode batch. Invariant: the counters are >= 0.
    ``variance``: the noise of its seconds (:class:`Variance`; default none).
    """

    def __init__(self, cost: CostModel, engine_id: str, role: str = "prefill", block_size: int = 512,
                 variance: Variance = NO_VARIANCE) -> None:
        if role not in ("prefill", "decode", "colocated"):
            raise InvalidArgument(f"engine role must be one of ['colocated', 'decode', 'prefill'], got {role!r}")
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be > 0 tokens, got {block_size}")
        self.cost = cost
        self.engine_id = engine_id
        self.role = role
        self.block_size = block_size
        self.queued = self.queued_tokens = self.running = 0
        self.noise = _Noise(variance, engine_id)

    def load(self) -> EngineLoad:
        return EngineLoad(self.queued, self.running, self.queued_tokens)

    def enqueue(self, prompt_tokens: int) -> None:
        """A request was routed here; its prefill waits."""
        self.queued += 1
        self.queued_tokens += prompt_tokens

    def prefill(self, request_id: str, prompt: Sequence[int], namespace: str = "",
                max_load_blocks: int | None = None, *, block_keys: Sequence[bytes] = (),
                prefix: LoadedPrefix = LoadedPrefix()) -> PrefillResult:
        """Prefill ``prompt`` (only its length matters: a ``range(n)`` will do) reusing its
        own cached blocks and fetching the rest of ``prefix`` only up to block
        ``max_load_blocks`` (None: all; the real engine's rule), never the last token.
        ``block_keys``: the prompt's full blocks' keys, handed on in the result. The fetch
        seconds and bytes scale with the blocks fetched. Starts a request queued here by
        :meth:`enqueue`, if any."""
        n, bs = len(prompt), self.block_size
        if n <= 0:
            raise InvalidArgument("prompt is empty")
        if self.queued > 0:
            self.queued -= 1
            self.queued_tokens = max(0, self.queued_tokens - n)
        self.running += 1
        local = min(prefix.local_blocks, prefix.blocks, n // bs)
        blocks = min(prefix.blocks, n // bs)
        if max_load_blocks is not None:
            blocks = max(local, min(blocks, max_load_blocks))
        fetchable = prefix.blocks - local
        share = (blocks - local) / fetchable if fetchable > 0 else 0.0
        load_s, load_bytes = prefix.load_s * share, int(prefix.load_bytes * share)
        cached = usable_prefix_tokens(blocks, bs, n)
        compute_s = self.cost.prefill_s(n, cached) * self.noise.prefill(request_id)
        return PrefillResult(request_id, 0, tuple(block_keys), cached, n - cached, b"", n % bs,
                             load_s + compute_s, blocks, n // bs - blocks, load_s, load_bytes,
                             prefix.tier if load_bytes else "")

    def prefill_done(self) -> None:
        """The prefill started last has ended (virtual time)."""
        self.running = max(0, self.running - 1)

    def join(self, requests: int = 1) -> None:
        """Requests joined the decode batch."""
        self.running += requests

    def leave(self, requests: int = 1) -> None:
        """Requests left the decode batch."""
        self.running = max(0, self.running - requests)

    def decode_step_s(self, batch: int, kv_tokens: int) -> float:
        """Mean seconds of one decode step of ``batch`` requests holding ``kv_tokens`` KV
        tokens (:meth:`CostModel.decode_step_s`)."""
        return self.cost.decode_step_s(batch, kv_tokens)

    def sample_decode_step_s(self, batch: int, kv_tokens: int) -> float:
        """Seconds of the decode steps of a new batch segment: the mean with this segment's
        noise (:class:`Variance`)."""
        return self.cost.decode_step_s(batch, kv_tokens) * self.noise.decode()

    def transfer_s(self, nbytes: float, link: str = "network") -> float:
        """Seconds to move ``nbytes`` over ``link`` (:meth:`CostModel.transfer_s`)."""
        return self.cost.transfer_s(nbytes, link)
