"""The live router's T_prefill and TBT predictors start from a profile of its own engines, as
the simulated Conductor's do: each engine times a few prefills or decode steps of the tiny
model at start (engines/profiling.py) and reports them in Info; the router fits them
(scheduler/policy/profiles.py, the simulator's fit) instead of seeding from built-in constants.
Real engines on gRPC, no store (the pass reads and writes no cache)."""
from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import threading

import pytest
import torch

import engines.profiling as profiling
import launcher.up
from engines.client import EngineClient
from engines.kv import build_cache
from engines.model import ModelConfig, load_model, run
from engines.profiling import (
    BUDGET_S,
    MAX_PROFILED_LEN,
    decode_points,
    prefill_lengths,
    profile_decode,
    profile_engine,
    profile_prefill,
)
from engines.server import start_engine
from engines.types import EngineInfo, ProfilePoint
from kvstore.index.keys import KVLayout
from scheduler.policy.conductor import ConductorConfig
from scheduler.policy.costing import PrefillModel, PrefillProfile
from scheduler.policy.profiles import fit_decode, fit_prefill, seeded_from_engines
from scheduler.policy.tbt import DecodeProfile, TBTModel
from scheduler.routing.router import Router

MAX_LEN = 2048


@pytest.fixture(scope="module")
def engines():
    started = {}
    for role, profile in (("prefill", True), ("decode", True), ("prefill", False)):
        name = f"{role}-{'profiled' if profile else 'bare'}"
        server, port = start_engine(role, None, block_size=16, engine_id=name, max_model_len=MAX_LEN,
                                    profile=profile)
        started[name] = (server, f"127.0.0.1:{port}")
    yield {name: address for name, (_, address) in started.items()}
    for server, _ in started.values():
        server.stop(grace=None).wait()


async def _info(address: str):
    client = EngineClient(address)
    try:
        return await client.info()
    finally:
        await client.close()


def test_each_engine_reports_its_profiling_pass_in_info(engines) -> None:
    prefill = asyncio.run(_info(engines["prefill-profiled"]))
    lengths = prefill_lengths(MAX_LEN)
    assert lengths == [8, 32, 128, 512, 1024]
    assert [(p.batch, p.tokens) for p in prefill.profile] == [(1, n) for n in lengths for _ in range(2)]
    assert all(math.isfinite(p.seconds) and 0 < p.seconds < 60 for p in prefill.profile)
    decode = asyncio.run(_info(engines["decode-profiled"]))
    assert [(p.batch, p.tokens) for p in decode.profile] == [(b, b * c) for b, c in decode_points(MAX_LEN)]
    assert all(math.isfinite(p.seconds) and p.seconds > 0 for p in decode.profile)
    assert asyncio.run(_info(engines["prefill-bare"])).profile == ()   # --no-profile


def test_the_router_seeds_its_predictors_from_the_engines_pass(engines) -> None:
    async def go():
        seeded = await Router.connect([engines["prefill-profiled"]], [engines["decode-profiled"]], None)
        built_in = await Router.connect([engines["prefill-profiled"]], [engines["decode-profiled"]], None,
                                        seed_from_engines=False)
        bare = await Router.connect([engines["prefill-bare"]], [engines["decode-profiled"]], None)
        try:
            return seeded.policy.config, built_in.policy.config, bare.policy.config
        finally:
            for r in (seeded, built_in, bare):
                await r.close()

    seeded, built_in, bare = asyncio.run(go())
    prefill = asyncio.run(_info(engines["prefill-profiled"]))
    decode = asyncio.run(_info(engines["decode-profiled"]))
    want_prefill = fit_prefill([(p.tokens, p.seconds) for p in prefill.profile], PrefillProfile())
    want_decode = fit_decode([(p.batch, p.tokens, p.seconds) for p in decode.profile], DecodeProfile())
    assert seeded.prefill == want_prefill and seeded.decode == want_decode
    default = PrefillProfile()
    assert (seeded.prefill.fixed_s, seeded.prefill.s_per_token) != (default.fixed_s, default.s_per_token)
    model = PrefillModel(seeded.prefill)
    assert model.predict(1024) > model.predict(8) > 0                 # grows with the tokens computed
    assert TBTModel(seeded.decode).predict(2, 2048) > 0
    assert built_in.prefill == ConductorConfig().prefill and built_in.decode == ConductorConfig().decode
    assert bare.prefill == ConductorConfig().prefill and bare.decode == want_decode   # no pass: built-in T_prefill


def test_the_fit_recovers_known_costs_and_refuses_too_little() -> None:
    fixed, per_token, per_attn = 2e-3, 5e-6, 1e-9
    points = [(n, fixed + per_token * n + per_attn * n * n / 2) for n in (16, 64, 256, 1024, 2048)]
    fit = fit_prefill(points, PrefillProfile())
    assert fit is not None
    assert fit.fixed_s == pytest.approx(fixed, rel=1e-6) and fit.s_per_token == pytest.approx(per_token, rel=1e-6)
    assert fit.s_per_token_context == pytest.approx(per_attn, rel=1e-6)
    assert fit_prefill(points[:2], PrefillProfile()) is None                       # too few
    assert fit_prefill([(64, 0.01)] * 5, PrefillProfile()) is None                # one length
    assert fit_prefill(points[:2] * 3, PrefillProfile()) is None                  # two: the split is a guess
    assert fit_prefill(points[:3], PrefillProfile()) is not None
    assert fit_prefill([(64, math.nan), (128, -1.0), (0, 1.0)], PrefillProfile()) is None   # nonsense
    steps = [(b, kv, 1e-3 + 4e-4 * b + 2e-8 * kv) for b, kv in ((1, 64), (1, 2048), (2, 128), (2, 2048))]
    dec = fit_decode(steps, DecodeProfile())
    assert dec is not None and dec.s_per_kv_token == pytest.approx(2e-8, rel=1e-6)
    assert dec.step_s + dec.s_per_request == pytest.approx(1.4e-3, rel=1e-6)


def test_nonsense_points_are_left_out_and_never_stop_the_router() -> None:
    """An engine reports its profile over gRPC: a point no model could produce (a prefill of
    1e-200 s would weigh 1/s² = inf; a batch or context past any model's) is left out, and a
    profile of nothing else leaves the built-in seeds instead of raising in Router.connect."""
    good = [(n, 2e-3 + 5e-6 * n + 1e-9 * n * n / 2) for n in (16, 64, 256, 1024, 2048)]
    bad = [(64, 1e-200), (64, math.inf), (64, math.nan), (1 << 30, 0.01), (128, 2e6)]
    assert fit_prefill(good + bad, PrefillProfile()) == fit_prefill(good, PrefillProfile())
    steps = [(b, kv, 1e-3 + 4e-4 * b + 2e-8 * kv) for b, kv in ((1, 64), (1, 2048), (2, 128), (2, 2048))]
    odd = [(1, -5, 1e-3), (1, 1 << 40, 1e-3), (1 << 30, 64, 1e-3), (1, 64, 1e-300)]
    assert fit_decode(steps + odd, DecodeProfile()) == fit_decode(steps, DecodeProfile())

    layout = KVLayout(dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)
    def info(role: str, points) -> EngineInfo:
        return EngineInfo(f"{role}-0", role, "m", "r", layout, 16, 512, 2, "cpu", 4096,
                          tuple(ProfilePoint(b, n, s) for b, n, s in points))
    config = seeded_from_engines(ConductorConfig(), [info("prefill", [(1, n, s) for n, s in bad]),
                                                      info("decode", odd)])
    assert config.prefill == ConductorConfig().prefill and config.decode == ConductorConfig().decode


def test_the_pass_is_bounded_by_a_long_context_and_by_its_budget(caplog) -> None:
    """A checkpoint served at 128k tokens is profiled at the sizes of 8192 (not with 64k-token
    prompts), and no point is started once the budget is spent."""
    assert prefill_lengths(1 << 17) == prefill_lengths(MAX_PROFILED_LEN) == [32, 128, 512, 2048, 4096]
    assert launcher.up.PROFILE_BUDGET_S == BUDGET_S      # kvstore up waits for its engines' passes
    assert max(c for _, c in decode_points(1 << 17)) == MAX_PROFILED_LEN // 2
    lm = load_model(ModelConfig(block_size=16, max_model_len=1 << 17))
    assert lm.max_model_len == 1 << 17
    with caplog.at_level(logging.WARNING, logger="engines.profiling"):
        assert profile_prefill(lm, budget_s=0.0) == () and profile_decode(lm, budget_s=0.0) == ()
    assert "prefills of 32 tokens and longer left out" in caplog.text


def test_run_computes_the_last_positions_logits_as_a_whole_forward_does() -> None:
    lm = load_model(ModelConfig(block_size=16))
    assert lm.keeps_last_logits          # transformers' Llama takes logits_to_keep
    ids = torch.randint(0, lm.vocab_size, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        whole = lm.model(input_ids=torch.tensor([ids]), use_cache=True)
        cache = build_cache([], lm.layout, lm.dtype, lm.device)
        last = run(lm, ids[:200], cache)
        assert last.shape == (lm.vocab_size,) and cache.get_seq_length() == 200
        last = run(lm, ids[200:], cache)                     # over a cached prefix
    assert torch.allclose(last, whole.logits[0, -1], atol=1e-5)
    assert cache.get_seq_length() == 300


def test_engines_given_one_lock_profile_one_at_a_time(tmp_path, monkeypatch, caplog) -> None:
    lm = load_model(ModelConfig(block_size=16, max_model_len=512))
    lock = str(tmp_path / "profile.lock")
    done: list[tuple] = []
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)                     # another engine's pass
        t = threading.Thread(target=lambda: done.append(profile_engine(lm, "prefill", lock)))
        t.start()
        t.join(1.0)
        assert t.is_alive() and not done                     # waits for the lock
        fcntl.flock(held, fcntl.LOCK_UN)
        t.join(60)
    assert len(done) == 1 and len(done[0]) == 2 * len(prefill_lengths(512))
    monkeypatch.setattr(profiling, "LOCK_WAIT_S", 0.3)
    with open(lock, "w") as held, caplog.at_level(logging.WARNING, logger="engines.profiling"):
        fcntl.flock(held, fcntl.LOCK_EX)                     # held for good (a hung engine)
        assert len(profile_engine(lm, "prefill", lock)) == 2 * len(prefill_lengths(512))
    assert "still held after 0 s: profiling without it" in caplog.text
    link = tmp_path / "planted.lock"
    link.symlink_to(tmp_path / "elsewhere")                  # a link planted where the lock goes
    with pytest.raises(OSError):
        profile_engine(lm, "prefill", str(link))
    assert not (tmp_path / "elsewhere").exists()
