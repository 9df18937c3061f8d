"""The profiling pass of the front door over vLLM: before it serves, every instance that
prefills computes a few prompts of known lengths, and T_prefill's seed is fitted to their
seconds (:func:`scheduler.policy.profiles.fit_prefill`), as the built-in engines' own pass seeds
it (engines/profiling.py). Without it the first predictions come from the built-in seed, fitted
to a tiny CPU model: on the demo's checkpoint it predicted a 1,446-token prefill at 0.05 s that
took 2.5 s, and the first burst of requests was routed as if every instance were idle.

Each instance first computes one short prompt that the fit leaves out (its first request pays
one-off costs: 0.45 s for 128 tokens against 0.13 s after), then :data:`PROFILE_TOKENS`, one
after another; the instances run theirs at once (each has its own cores). The prompts are
random token ids under a ``cache_salt`` of their own, so nothing is reused from the pool or
the instance's prefix cache and no tenant's namespace is touched; their blocks are saved to the
pool like any prefill's (about 1.7k tokens per instance) and, never read again, evicted first.
A pass that fails leaves the seed as it was and says so; it never stops the front door.
"""
from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Sequence
from dataclasses import replace

from kvstore.errors import KVStoreError
from scheduler.policy.conductor import ConductorConfig
from scheduler.policy.profiles import fit_prefill
from scheduler.vllm.instances import VLLMClient

log = logging.getLogger(__name__)

WARMUP_TOKENS = 32
PROFILE_TOKENS = (128, 512, 1024)    # three lengths: T_prefill has three coefficients
PROFILE_TIMEOUT_S = 120.0


def _prompt(rng: random.Random, tokens: int, vocab_size: int) -> list[int]:
    """``tokens`` random ids, clear of the low ids where tokenizers keep their special tokens."""
    low = min(1000, vocab_size // 2)
    return [rng.randrange(low, vocab_size) for _ in range(tokens)]


async def profile_instance(client: VLLMClient, vocab_size: int, lengths: Sequence[int] = PROFILE_TOKENS,
                           seed: int = 0) -> list[tuple[int, float]]:
    """(prompt tokens, seconds) of each of ``lengths`` computed on ``client``'s instance, after
    one warm-up prompt. Raises what :meth:`VLLMClient.prefill` raises."""
    rng = random.Random(seed)
    salt = f"kvstore-profile-{secrets.token_hex(8)}"
    await client.prefill(f"profile-warmup-{salt}", _prompt(rng, WARMUP_TOKENS, vocab_size), salt)
    points = []
    for i, n in enumerate(lengths):
        result = await client.prefill(f"profile-{i}-{salt}", _prompt(rng, n, vocab_size), salt)
        points.append((result.computed_tokens, result.prefill_s))
    return points


async def seeded_from_vllm(config: ConductorConfig, clients: Sequence[VLLMClient], vocab_size: int,
                           timeout_s: float = PROFILE_TIMEOUT_S) -> ConductorConfig:
    """``config`` with its T_prefill seed fitted to a profiling pass of ``clients`` (their
    points pooled: they serve one model), logged; unchanged, and logged so, when the pass fails,
    outruns ``timeout_s`` or gives too little to fit."""
    if not clients:
        return config
    try:
        runs = await asyncio.wait_for(asyncio.gather(*(profile_instance(c, vocab_size, seed=i)
                                                       for i, c in enumerate(clients))), timeout_s)
    except (KVStoreError, TimeoutError, KeyError, IndexError, TypeError, ValueError) as exc:
        log.warning("T_prefill: built-in seed (the profiling pass of the vLLM instances failed: %s)", exc)
        return config
    points = [p for run in runs for p in run]
    fitted = fit_prefill(points, config.prefill)
    if fitted is None:
        log.warning("T_prefill: built-in seed (the profiling pass gave too little to fit: %s)", points)
        return config
    log.info("T_prefill seeded from %d prefills profiled on %d vLLM instances: %.3g s + %.3g s/token + "
             "%.3g s/(token · context token); measured %s", len(points), len(clients), fitted.fixed_s,
             fitted.s_per_token, fitted.s_per_token_context,
             ", ".join(f"{n} tokens {s:.3f} s" for n, s in points))
    return replace(config, prefill=fitted)
