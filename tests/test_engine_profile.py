"""The live router's T_prefill and TBT predictors start from a profile of its own engines, as
the simulated Conductor's do: each engine times a few prefills or decode steps of the tiny
model at start (engines/profiling.py) and reports them in Info; the router fits them
(scheduler/profiles.py, the simulator's fit) instead of seeding from built-in constants.
Real engines on gRPC, no store (the pass reads and writes no cache)."""
from __future__ import annotations

import asyncio
import math

import pytest

from engines.client import EngineClient
from engines.profiling import decode_points, prefill_lengths
from engines.server import start_engine
from scheduler.conductor import ConductorConfig
from scheduler.costing import PrefillModel, PrefillProfile
from scheduler.profiles import fit_decode, fit_prefill
from scheduler.router import Router
from scheduler.tbt import DecodeProfile, TBTModel

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
    assert fit_prefill([(64, math.nan), (128, -1.0), (0, 1.0)], PrefillProfile()) is None   # nonsense
    steps = [(b, kv, 1e-3 + 4e-4 * b + 2e-8 * kv) for b, kv in ((1, 64), (1, 2048), (2, 128), (2, 2048))]
    dec = fit_decode(steps, DecodeProfile())
    assert dec is not None and dec.s_per_kv_token == pytest.approx(2e-8, rel=1e-6)
    assert dec.step_s + dec.s_per_request == pytest.approx(1.4e-3, rel=1e-6)
