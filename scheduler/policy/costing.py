"""Costs the Conductor weighs (docs/architecture.md §5; Mooncake, FAST'25, §5 and Algorithm 1):
T_prefill(n, prefix) — a regression fitted online from observed prefills, seeded from a
profile — and T_transfer of a prefix hit, per tier, from bandwidths.

T_prefill. Computing the last ``c = n − p`` tokens of an ``n``-token prompt whose first ``p``
are cached costs a fixed part, a part linear in ``c`` (the MLPs and projections) and the
attention part, linear in ``c`` times the context those tokens see, ``Σ_{i=p}^{n-1} i ≈
c·(n+p)/2`` (Mooncake's ``flops(n) = l·(a·n²·d + b·n·d²)`` restricted to the computed part)::

    T_prefill(n, p) = k0 + k1·c + k2·c·(n+p)/2      (k0, k1, k2 >= 0)

fitted by :class:`scheduler.policy.fit.OnlineFit`, each observation weighted by ``1 / predicted²``
(before it is folded in; the profile's own, unscaled, while the fit is not in use yet), so
that the fit minimises *relative* error. The engines' noise
is multiplicative (a prefill's seconds vary by a share of themselves), and unweighted least
squares in seconds lets the few long prefills set the coefficients: on the simulator's
fig5 preset (seed 0) it left prefills predicted under 0.5 s over-predicted by a median
6–10% with a log-error spread of 0.28–0.29; weighted, the median is within 1% and the
spread 0.14–0.17 at every size, what the cost model's exact coefficients give (the
engines' own noise). Its error is measured too: each observation's
relative residual against the prediction made before it, ``r = seconds / predicted − 1``;
an EWMA of ``min(0, r)²`` (how much faster than predicted prefills ran) gives the downside
deviation ``σ↓ = sqrt(2·E[min(0, r)²])`` (a symmetric error's σ), kept per octave of the
predicted seconds (``floor(log2 predicted)``: the fit's relative error differs with the
size of the prefill — short ones carry the fixed costs the fit smooths over), so that
:meth:`PrefillModel.optimistic` — ``predicted · max(0, 1 − k·σ↓)`` — is a prediction the
engine rarely beats (a residual above the prediction, a straggler's, does not widen it by
itself). Until ``min_samples`` prefills were observed
the profile's coefficients are used; a profile never implies a speed below
``floor_tokens_per_s`` (so that a cluster that has measured nothing yet does not reject for
a guess). The fit needs several prefills for its three coefficients, but a profile made for
another model or machine is wrong mostly in scale, which one prefill shows: the built-in seed,
fitted to the tiny CPU model, predicted the vLLM demo checkpoint's first prefills about 50
times too fast (0.05 s for 1,446 tokens that took 2.5 s), so every booked prefill looked
finished a moment after it was routed, and the first burst of requests went where the
instances looked idle. So while the fit is not in use, each prediction is the profile's times
the geometric mean of ``seconds / the profile's prediction`` over the prefills observed so far
(1 before the first; each ratio bounded to [1/1000, 1000]; not with ``learn=False``): the floor
speed above bounds the profile, not what was measured; σ↓ measures the fit alone. A slow
first prefill (an engine's first request pays one-off costs) makes the next predictions
pessimistic until the fit is in use, and the TTFT SLO may then reject a request early.
Nor is the fit trusted beyond the prompts it has measured: a prompt that computes
more tokens, or sees more context, than any observed one is predicted at most at the seconds
per computed token the fit gives the longest prefill observed, or at the floor speed where
that is slower. Fitted on short prompts only, the attention coefficient ``k2`` is noise
(their ``c·(n+p)/2`` is tiny), and squared up to a long prompt it predicted one 4,000-token
prefill on the tiny CPU model at 1,766 s (0.5 s measured) after 30 prompts of 1–20 tokens,
and the router answered 429 with a Retry-After of half an hour. The floor alone erred the
other way on vLLM: 3.8 s predicted for a 7,540-token prompt that took 24 s, after prompts of
up to 2,000 tokens measured at 0.7k tokens/s. Per computed token a longer prompt costs at
least what a shorter one did (attention grows with the context), so the bound is still low,
but it is measured, not guessed. Where the model's FLOPs are known
(``PrefillProfile.attention_ratio``), a prompt beyond the ones measured is instead the fit's
prediction for the longest one scaled by the FLOPs (:meth:`PrefillModel._anchored`): the
7,540-token prompt above comes out at ~19 s after prompts of up to 2,000 tokens. Prefills an
engine ran together are one observation at the sum of their features
(:meth:`PrefillModel.observe_group`).

T_transfer. A block in tier ``t`` read on the same host costs ``block_bytes / bw(t)``; read
from another host (a peer instance, or a store node reached over the network) it costs
``block_bytes / min(bw(t), network)``; each fetch adds a fixed latency. A block in the
reading instance's own ``hbm`` costs nothing. Bandwidth defaults are each tier kind's figure
in kvstore/tiers/registry.py and 0.5 GB/s between hosts, after the figures measured in
docs/benchmarks.md, "Figures for orientation" (shared memory ~6 GB/s, gRPC ~0.5 GB/s);
:meth:`TransferModel.observe` folds in transfers measured at run time.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.tiers import registry
from scheduler.policy.fit import OnlineFit

HBM = "hbm"
SEED_LOG_BOUND = math.log(1e3)   # one prefill scales the profile by at most 1000x either way


@dataclass(frozen=True)
class PrefillProfile:
    """Seed of T_prefill: ``fixed_s`` (per call), ``s_per_token`` (per computed token),
    ``s_per_token_context`` (per computed token per context token, the attention part); all
    >= 0. ``min_samples``: observations before the fit replaces the seed; ``decay``:
    forgetting factor per observation, in (0, 1]; ``floor_tokens_per_s``: the seed's
    prediction never implies fewer computed tokens per second than this (> 0);
    ``min_prefill_s``: the least any prediction returns (>= 0); ``learn``: False freezes
    the seed (no online fit — the simulator's oracle runs; the error is still measured).
    ``residual_alpha``: EWMA weight of each residual in the measured error, in (0, 1].
    ``outlier_k``: an observation above ``predicted · (1 + outlier_k · max(σ↓, 0.05))`` is a
    straggler, folded into the fit at that cap (> 0; ``math.inf``: never).
    ``attention_ratio``: ``s_per_token_context / s_per_token`` as the model's FLOPs have it
    (:func:`attention_ratio`; 0: the model is not known), the shape a prediction beyond the
    prompts measured follows. The defaults fit the tiny CPU model of ``engines/model.py`` loosely."""

    fixed_s: float = 5e-3
    s_per_token: float = 3e-5
    s_per_token_context: float = 1e-9
    min_samples: int = 8
    decay: float = 0.995
    floor_tokens_per_s: float = 2000.0
    min_prefill_s: float = 1e-4
    learn: bool = True
    residual_alpha: float = 0.05
    outlier_k: float = 3.0
    attention_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not self.attention_ratio >= 0:
            raise InvalidArgument(f"attention_ratio must be >= 0, got {self.attention_ratio!r}")
        for name in ("fixed_s", "s_per_token", "s_per_token_context", "min_prefill_s"):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(f"{name} must be >= 0 s, got {getattr(self, name)!r}")
        if not self.floor_tokens_per_s > 0:
            raise InvalidArgument(f"floor_tokens_per_s must be > 0, got {self.floor_tokens_per_s!r}")
        if self.min_samples < 1 or not 0 < self.decay <= 1:
            raise InvalidArgument(f"need min_samples >= 1 and decay in (0, 1], got "
                                  f"{self.min_samples!r} and {self.decay!r}")
        if not self.outlier_k > 0:
            raise InvalidArgument(f"outlier_k must be > 0 (inf: never), got {self.outlier_k!r}")
        if not 0 < self.residual_alpha <= 1:
            raise InvalidArgument(f"residual_alpha must be in (0, 1], got {self.residual_alpha!r}")


class PrefillModel:
    """Predicts prefill seconds for (prompt tokens, cached tokens); learns from observed
    prefills. Invariant: predictions are >= ``profile.min_prefill_s`` and grow with the
    tokens computed."""

    def __init__(self, profile: PrefillProfile | None = None) -> None:
        self.profile = p = profile or PrefillProfile()
        self.learn = p.learn
        self.fit = OnlineFit((p.fixed_s, p.s_per_token, p.s_per_token_context), p.min_samples, p.decay)
        self._fast_sq: dict[int, list[float]] = {}   # octave → [EWMA of min(0, r)², residuals]
        self.residuals = 0       # residuals measured
        self.outliers = 0        # observations above the outlier cap (stragglers), folded in capped
        self._log_err = [0.0, 0.0]   # Σ ln(seconds / predicted), Σ of its square, over residuals
        self._edge = (0.0, 0.0)      # (computed tokens, attention feature) of the longest prefill observed
        self._max_attn = 0.0         # the largest attention feature observed
        self._seed_log = [0.0, 0]    # Σ ln(seconds / the profile's prediction), count: while not fitted
        self._scale = 1.0            # the profile's scale: exp(mean of _seed_log) while not fitted, else 1

    @staticmethod
    def features(prompt_tokens: int, cached_tokens: int) -> tuple[float, float, float]:
        """The regressors of T_prefill (the module docstring's formula, its one place):
        ``(1, c, c·(n+p)/2)`` with ``c = n − p`` computed tokens."""
        c = max(0, prompt_tokens - cached_tokens)
        return 1.0, float(c), c * (prompt_tokens + cached_tokens) / 2.0

    def predict(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill an ``prompt_tokens``-token prompt of which ``cached_tokens`` are
        loaded, not computed; beyond the prompts observed (or before the fit is in use), at
        most what ``floor_tokens_per_s`` implies, times (before the fit is in use) the scale
        the prefills observed so far gave the profile."""
        return max(self.profile.min_prefill_s, self._bounded(prompt_tokens, cached_tokens) * self._scale)

    def _bounded(self, prompt_tokens: int, cached_tokens: int) -> float:
        """The fit's (or the profile's) seconds, bounded beyond the prompts observed; unscaled,
        unclamped."""
        one, c, attn = self.features(prompt_tokens, cached_tokens)
        k0, k1, k2 = self.fit.coefficients
        s = k0 * one + k1 * c + k2 * attn
        if not self.fit.fitted or c > self._edge[0] or attn > self._max_attn:   # a guess: bounded
            anchored = self._anchored(c, attn)
            s = anchored if anchored is not None else min(s, self.profile.fixed_s + c * self._edge_s_per_token())
        return s

    def _edge_rate(self, rho: float) -> float | None:
        """The fit's seconds for the longest prefill observed, less its fixed part, per
        FLOPs-weighted token there: ``(k1·c + k2·attn) / (c + ρ·attn)`` (ρ = 0: per computed
        token). None while the fit is not in use or nothing was observed."""
        c, attn = self._edge
        if not self.fit.fitted or c <= 0:
            return None
        _, k1, k2 = self.fit.coefficients
        return (k1 * c + k2 * attn) / (c + rho * attn)

    def _anchored(self, c: float, attn: float) -> float | None:
        """Beyond the prompts measured, with the model's FLOPs known (``attention_ratio`` ρ > 0):
        the fit at the longest prefill observed, scaled by the FLOPs, ``k0 + r·(c + ρ·attn)``
        with ``r`` such that the longest one is predicted as the fit predicts it. None while the
        fit is not in use, nothing was observed, or ρ is 0."""
        rho = self.profile.attention_ratio
        r = self._edge_rate(rho) if rho > 0 else None
        return None if r is None else self.fit.coefficients[0] + r * (c + rho * attn)

    def _edge_s_per_token(self) -> float:
        """Seconds per computed token beyond the prompts measured: the fit's for the longest
        prefill observed, or the floor speed's when that is faster or the fit is not in use."""
        return max(1.0 / self.profile.floor_tokens_per_s, self._edge_rate(0.0) or 0.0)

    def observe(self, prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        """Fold in one finished prefill (engine-side seconds): :meth:`observe_group` of one."""
        self.observe_group(((prompt_tokens, cached_tokens),), seconds)

    def observe_group(self, prefills: Sequence[tuple[int, int]], seconds: float) -> None:
        """Fold in prefills (prompt tokens, cached tokens) an engine ran together — batched into
        the same steps, their first tokens in the same step — in ``seconds`` in all. T_prefill
        is linear in its features, so the group's seconds are a point of the fit at the sum of
        its prefills' features, predicted at the sum of their predictions. Ignores nonsense (a
        prefill that computes nothing, seconds not a finite number > 0, or so far from the
        prediction that their ratio is not a finite number > 0). Its residual against the
        current prediction updates the measured error; a frozen model (``learn=False``: the
        simulator's ``--oracle``) keeps its coefficients."""
        if not prefills or any(n <= 0 or p < 0 or p >= n for n, p in prefills):
            return
        if not (math.isfinite(seconds) and seconds > 0):
            return
        bounded = [self._bounded(n, p) for n, p in prefills]    # each prefill's, unscaled
        profile_s = sum(bounded)
        predicted = max(sum(max(self.profile.min_prefill_s, b * self._scale) for b in bounded), 1e-9)
        ratio = seconds / predicted
        if not (math.isfinite(ratio) and ratio > 0):
            return
        r = ratio - 1.0
        a = self.profile.residual_alpha
        if self.fit.fitted or not self.learn:   # σ↓ is the fit's error, not the scaled profile's
            octave = self._fast_sq.setdefault(_octave(predicted), [0.0, 0])
            octave[1] += 1
            octave[0] = (1 - a) * octave[0] + a * min(0.0, r) ** 2 if octave[1] > 1 else min(0.0, r) ** 2
        self.residuals += 1
        log_err = math.log(ratio)
        self._log_err[0] += log_err
        self._log_err[1] += log_err * log_err
        if self.fit.fitted:
            cap = self.outlier_cap(predicted)
            if seconds > cap:
                self.outliers += 1
                seconds = cap
        if self.learn and not self.fit.fitted and profile_s > 0:
            self._seed_log[0] += min(SEED_LOG_BOUND, max(-SEED_LOG_BOUND, math.log(seconds / profile_s)))
            self._seed_log[1] += 1
        if self.learn:
            rows = [self.features(n, p) for n, p in prefills]
            for _, c, attn in rows:
                self._max_attn = max(self._max_attn, attn)
                if c >= self._edge[0]:
                    self._edge = (c, attn)
            # relative error: by the prediction once fitted; before, by the profile's own (a scale
            # that changes with each prefill would weigh the first one unlike the next ones)
            base = predicted if self.fit.fitted else max(profile_s, self.profile.min_prefill_s)
            weight = 1.0 / base ** 2 if base < 1e150 else 0.0     # no overflow
            self.fit.observe(tuple(sum(column) for column in zip(*rows)), seconds, weight)
        total, n = self._seed_log     # the profile's scale, kept for predict (module docstring)
        self._scale = math.exp(total / n) if n and self.learn and not self.fit.fitted else 1.0   # in [1e-3, 1e3]

    @property
    def log_error(self) -> tuple[float, float] | None:
        """How far observed prefills were from the prediction made before each: mean and
        standard deviation of ``ln(seconds / predicted)`` over every observation (0 and 0
        for a perfect predictor on a noiseless engine; a positive mean: prefills ran slower
        than predicted). None before two observations."""
        n = self.residuals
        if n < 2:
            return None
        mean = self._log_err[0] / n
        return mean, math.sqrt(max(0.0, self._log_err[1] / n - mean * mean))

    def outlier_cap(self, predicted_s: float) -> float:
        """Seconds above which a prefill predicted at ``predicted_s`` counts as an outlier
        (a straggler): ``predicted · (1 + outlier_k · max(σ↓, 0.05))``; infinity before σ↓
        is measured there."""
        sigma = self.fast_sigma(predicted_s) if predicted_s > 0 else None
        if sigma is None:
            return math.inf
        return predicted_s * (1.0 + self.profile.outlier_k * max(sigma, 0.05))

    def fast_sigma(self, predicted_s: float) -> float | None:
        """The measured downside deviation σ↓ (relative, >= 0; module docstring) of
        predictions in the octave of ``predicted_s`` (seconds, > 0); None before
        ``min_samples`` residuals there."""
        octave = self._fast_sq.get(_octave(predicted_s))
        if octave is None or octave[1] < self.profile.min_samples:
            return None
        return math.sqrt(2.0 * octave[0])

    def optimistic(self, predicted_s: float, k: float) -> float | None:
        """A prefill predicted at ``predicted_s`` seconds will rarely take less than this:
        ``predicted_s · max(0, 1 − k·σ↓)`` (seconds). None until the predictor is trusted
        there: fewer than ``min_samples`` residuals in that octave, or (learning) the fit
        not in use."""
        sigma = self.fast_sigma(predicted_s) if predicted_s > 0 else None
        if sigma is None or self.learn and not self.fit.fitted:
            return None
        return predicted_s * max(0.0, 1.0 - k * sigma)

    @property
    def samples(self) -> int:
        return self.fit.samples


def attention_ratio(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> float:
    """``s_per_token_context / s_per_token`` of a decoder layer by its multiply-adds (Mooncake,
    FAST'25 §5: ``flops(n) = l·(a·n²·d + b·n·d²)``): per computed token, the projections
    ``2·d·H·hd + 2·d·KV·hd`` (query and output; key and value) and a gated MLP ``3·d·ffn``; per
    computed token and context token, ``2·H·hd`` (scores and the weighted sum). The bench
    checkpoint (hidden 512, 8 heads of 64, MLP 1,408): 3.2e-4."""
    if min(hidden, heads, kv_heads, head_dim, intermediate) <= 0:
        raise InvalidArgument("attention_ratio: every dimension must be > 0")
    per_token = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
    return 2 * heads * head_dim / per_token


def _octave(seconds: float) -> int:
    return math.floor(math.log2(max(seconds, 1e-9)))


@dataclass(frozen=True)
class Bandwidths:
    """Read bandwidths (bytes/s) per tier on the same host, the network's between hosts,
    and a fixed latency per fetch (seconds). Defaults: each tier kind's
    ``bandwidth_bytes_per_s`` in kvstore/tiers/registry.py; a registered tier without a
    field here reads at its registry figure."""

    hbm: float = registry.HBM.bandwidth_bytes_per_s
    dram: float = registry.DRAM.bandwidth_bytes_per_s
    ssd: float = registry.SSD.bandwidth_bytes_per_s
    network: float = 0.5e9
    fetch_latency_s: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("hbm", "dram", "ssd", "network"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"bandwidth {name} must be > 0 bytes/s, got {getattr(self, name)!r}")
        if self.fetch_latency_s < 0:
            raise InvalidArgument(f"fetch_latency_s must be >= 0, got {self.fetch_latency_s!r}")

    def tier(self, name: str) -> float:
        """Bytes/s of a read from tier ``name``. Raises InvalidArgument for a tier that is
        not registered (kvstore/tiers/registry.py), rather than pricing it as another."""
        kind = registry.kind(name)
        return float(getattr(self, kind.name, kind.bandwidth_bytes_per_s))


class TransferModel:
    """Seconds to read prefix blocks by tier (see the module docstring). ``block_bytes``:
    bytes of one block (> 0)."""

    def __init__(self, block_bytes: int, bandwidths: Bandwidths | None = None) -> None:
        if block_bytes <= 0:
            raise InvalidArgument(f"block_bytes must be > 0, got {block_bytes}")
        self.block_bytes = block_bytes
        self.bw = bandwidths or Bandwidths()
        b = self.bw
        self._local = {t: block_bytes / b.tier(t) for t in registry.names()}
        self._remote = {t: block_bytes / min(b.tier(t), b.network) for t in registry.names()}

    def observe(self, tier: str, nbytes: int, seconds: float, remote: bool = True,
                alpha: float = 0.2) -> None:
        """Fold in a measured read of ``nbytes`` from ``tier`` (``remote``: from another
        holder) that took ``seconds`` (latency excluded): the per-block time of that tier
        and route moves towards the measurement (EWMA weight ``alpha``)."""
        if nbytes <= 0 or seconds <= 0 or tier == HBM and not remote:
            return
        table = self._remote if remote else self._local
        per_block = seconds * self.block_bytes / nbytes
        table[tier] = (1 - alpha) * _per_block(table, tier) + alpha * per_block

    def local_s(self, segments: Iterable[tuple[str, int]]) -> float:
        """Reading the instance's own non-``hbm`` blocks (own ``hbm`` is free); no latency."""
        local = self._local
        return sum(n * _per_block(local, t) for t, n in segments if t != HBM)

    def remote_s(self, segments: Iterable[tuple[str, int]]) -> float:
        """Fetching blocks from another holder (a peer instance or the pool), latency included."""
        remote = self._remote
        s = sum(n * _per_block(remote, t) for t, n in segments)
        return s + self.bw.fetch_latency_s if s > 0 else 0.0


def _per_block(table: dict[str, float], tier: str) -> float:
    """Seconds per block of ``tier`` in ``table``. Raises InvalidArgument for an unknown tier."""
    try:
        return table[tier]
    except KeyError:
        raise InvalidArgument(f"unknown tier {tier!r}; tiers: {registry.names()}") from None
