"""A prefill engine behind its real gRPC server honours the scheduler's ``max_load_blocks``
(recompute what the Conductor chose not to fetch) and reports how long loading the prefix
from the pool took, how many bytes and from which tier; the router feeds that into the
Conductor's bandwidth estimate. Real store node, real engines (the tiny model), 127.0.0.1."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engines.client import EngineClient
from engines.server import start_engine
from engines.types import PrefillBackend
from kvstore.pool.pool import KVPool
from kvstore.service import serve_store
from kvstore.tiers import TIERS
from scheduler.policy.conductor import ConductorConfig
from scheduler.policy.costing import Bandwidths, PrefillModel
from scheduler.routing.router import Router

BS = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    pool = KVPool([TIERS["dram"](32 << 20)])
    store_server, port = serve_store(pool)
    store = f"127.0.0.1:{port}"
    servers = [start_engine("prefill", store, block_size=BS, engine_id="prefill-0", local_cache_blocks=0),
               start_engine("decode", store, block_size=BS, engine_id="decode-0")]
    yield store, [f"127.0.0.1:{p}" for _, p in servers]
    for server, _ in servers:
        server.stop(None).wait()
    store_server.stop(None).wait()
    pool.close()


def prompt_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def test_engine_honours_max_load_blocks_and_reports_the_load(stack):
    _, (prefill, _) = stack
    prompt = prompt_of(1, 5 * BS + 3)

    async def go():
        client = EngineClient(prefill)
        try:
            cold = await client.prefill("r0", prompt, "t")              # publishes 5 blocks
            results = [await client.prefill(f"r{i}", prompt, "t", limit)
                       for i, limit in ((1, None), (2, 2), (3, 0))]
            return cold, results
        finally:
            await client.close()

    cold, (full, part, none) = asyncio.run(go())
    assert cold.loaded_blocks == 0 and cold.load_bytes == 0 and cold.load_tier == ""
    assert full.loaded_blocks == 5 and full.cached_tokens == 5 * BS
    assert part.loaded_blocks == 2 and part.cached_tokens == 2 * BS and part.computed_tokens == 3 * BS + 3
    assert none.loaded_blocks == 0 and none.cached_tokens == 0 and none.load_bytes == 0
    assert full.load_tier == part.load_tier == "dram"
    assert full.load_s > 0 and part.load_s > 0
    assert full.load_bytes == 5 * (part.load_bytes // 2) and part.load_bytes > 0
    # Exact whatever was loaded: the first token does not depend on the limit.
    assert len({r.first_token for r in (cold, full, part, none)}) == 1


def test_router_passes_the_limit_and_measures_pool_bandwidth(stack):
    store, (prefill, decode) = stack
    prompt = prompt_of(2, 4 * BS + 1)

    async def go():
        # the built-in seeds: the tiny model's profiled prefill of 65 tokens (about 1 ms) is
        # cheaper than the seeded pool read, and a seeded Conductor recomputes it
        router = await Router.connect([prefill], [decode], store, policy="conductor", seed_from_engines=False)
        try:
            client = router.prefill[router.info.engine_id].client
            await client.prefill("seed", prompt, "public")                  # the pool holds it now
            plan = await router.plan("r1", prompt, "public", max_tokens=2)
            router.begin(plan)
            before = router.policy.transfer.remote_s([("dram", 1)])
            result = await router.prefill_client(plan).prefill(plan.request_id, prompt, plan.namespace,
                                                               plan.max_load_blocks)
            router.prefill_finished(plan, result)
            router.finished(plan)
            return plan, result, before, router.policy.transfer.remote_s([("dram", 1)])
        finally:
            await router.close()

    plan, result, before, after = asyncio.run(go())
    assert plan.pool_hit.blocks == 4 and plan.max_load_blocks is None        # the Conductor fetches it
    assert result.loaded_blocks == 4 and result.load_bytes > 0 and result.load_tier == "dram"
    latency = ConductorConfig().bandwidths.fetch_latency_s
    seconds = result.load_s - latency if result.load_s > 2 * latency else result.load_s
    measured = seconds * (result.load_bytes // 4) / result.load_bytes        # per block
    before, after = before - latency, after - latency                        # remote_s adds the latency
    assert min(before, measured) < after < max(before, measured)             # moved towards it


def test_a_recompute_decision_keeps_the_engine_from_fetching(stack):
    """Fetching over a 1 kB/s network never pays: the Conductor plans to recompute, the
    router sends max_load_blocks=0 and the engine loads nothing though the pool holds it."""
    store, (prefill, decode) = stack
    prompt = prompt_of(3, 4 * BS + 1)
    slow = ConductorConfig(bandwidths=Bandwidths(network=1e3, dram=1e3, ssd=1e3))

    async def go():
        router = await Router.connect([prefill], [decode], store, policy="conductor", config=slow)
        try:
            client = router.prefill[router.info.engine_id].client
            await client.prefill("seed", prompt, "public")
            plan = await router.plan("r1", prompt, "public", max_tokens=2)
            result = await client.prefill(plan.request_id, prompt, plan.namespace, plan.max_load_blocks)
            return plan, result
        finally:
            await router.close()

    plan, result = asyncio.run(go())
    assert plan.pool_hit.blocks == 4 and plan.decision.fetch is None and plan.max_load_blocks == 0
    assert result.loaded_blocks == 0 and result.cached_tokens == 0 and result.load_bytes == 0


def test_real_prefill_engine_has_the_backend_interface():
    from engines.model import ModelConfig, load_model
    from engines.prefill import PrefillEngine

    assert isinstance(PrefillEngine(load_model(ModelConfig(block_size=BS)), None), PrefillBackend)


def test_the_prefill_fit_learns_compute_seconds_not_the_pool_read(stack):
    """T_prefill is predicted apart from T_transfer, so the fit learns the engine's seconds
    less its pool read (as the simulator's does); fed the whole, it counted each fetch twice."""
    store, (prefill, decode) = stack
    prompt = prompt_of(4, 6 * BS + 1)

    async def go():   # the built-in seeds, as above (the reference below starts from them too)
        router = await Router.connect([prefill], [decode], store, policy="conductor", seed_from_engines=False)
        try:
            await router.prefill[router.info.engine_id].client.prefill("seed", prompt, "public")
            results = []
            for i in range(2):
                plan = await router.plan(f"r{i}", prompt, "public", max_tokens=2)
                router.begin(plan)
                result = await router.prefill_client(plan).prefill(plan.request_id, prompt, plan.namespace,
                                                                   plan.max_load_blocks)
                router.prefill_finished(plan, result)
                router.finished(plan)
                results.append(result)
            model = router.policy.prefill_model
            return model.log_error, model.predict(len(prompt)), results
        finally:
            await router.close()

    learned, predicted, results = asyncio.run(go())
    # the first fetches its prefix (the seeded bandwidths make that cheaper than recompute); the
    # second may recompute when the first's read was slow (a loaded machine): both still feed the fit
    assert results[0].loaded_blocks == 6 and results[0].load_s > 0
    reference = PrefillModel(ConductorConfig().prefill)        # the same seed, fed compute seconds
    for r in results:
        reference.observe(len(prompt), r.cached_tokens, r.prefill_s - r.load_s)
    whole = PrefillModel(ConductorConfig().prefill)
    for r in results:
        whole.observe(len(prompt), r.cached_tokens, r.prefill_s)
    assert learned == pytest.approx(reference.log_error, rel=1e-9)
    # what it learnt: the reference's prediction, below what the whole seconds teach
    assert predicted == pytest.approx(reference.predict(len(prompt)), rel=1e-9)
    assert predicted < whole.predict(len(prompt))


def test_a_streaming_request_s_decode_work_follows_its_pace(stack):
    """From its second token, a request's booked decode finish is its tokens to come at its
    mean pace so far, from now (``TokenClock`` -> ``Router.decode_progress``): a slower
    decode than predicted moves it later, so later arrivals see the instance as it runs."""
    import time

    from scheduler.frontdoor.metrics import FrontdoorMetrics
    from scheduler.frontdoor.request_parts import TokenClock

    store, (prefill, decode) = stack
    prompt = prompt_of(7, 3 * BS)

    async def go():
        router = await Router.connect([prefill], [decode], store, policy="conductor")
        try:
            plan = await router.plan("paced", prompt, "public", max_tokens=40)
            router.begin(plan)
            booked = router.decode[plan.decode_id].work[plan.request_id]
            clock = TokenClock(FrontdoorMetrics(), router, time.perf_counter(), plan)
            for _ in range(3):
                clock()
                time.sleep(0.05)        # 50 ms a token: far slower than the tiny model's predicted TBT
            clock()
            now = time.monotonic()
            paced = router.decode[plan.decode_id].work[plan.request_id]
            router.finished(plan)
            return booked, paced, now
        finally:
            await router.close()

    booked, paced, now = asyncio.run(go())
    gap = (paced.finish_s - now) / (40 - 4)
    assert 0.04 < gap < 0.2                                   # 36 tokens to come at ~50 ms each
    assert paced.finish_s > booked.finish_s and paced.kv_tokens == booked.kv_tokens


def test_a_request_of_n_sequences_is_paced_per_step_not_per_token(stack):
    """A request of ``n`` sequences streams ``n`` tokens a decode step: ``decode_progress``
    hears every sequence's tokens and their mean gap, a step is ``n`` such gaps, so its
    finish is its steps to come at ``n`` gaps each (it was one gap each: ``n`` times early,
    freeing its batch slots in the load predicted for later arrivals before it ends)."""
    import time

    from scheduler.frontdoor.metrics import FrontdoorMetrics
    from scheduler.frontdoor.request_parts import TokenClock

    store, (prefill, decode) = stack
    prompt = prompt_of(8, 3 * BS)

    async def go():
        router = await Router.connect([prefill], [decode], store, policy="conductor")
        try:
            plan = await router.plan("paced-n", prompt, "public", max_tokens=40, sequences=2)
            router.begin(plan)
            clock = TokenClock(FrontdoorMetrics(), router, time.perf_counter(), plan)
            for _ in range(4):      # two steps of two sequences, 25 ms apart a token: 50 ms a step
                clock()
                time.sleep(0.025)
            clock()
            now = time.monotonic()
            paced = router.decode[plan.decode_id].work[plan.request_id]
            seen = []                                        # what the TBT fit is fed at its end
            observe = router.policy.observe_decode
            router.policy.observe_decode = lambda *a: (seen.append(a), observe(*a))
            clock.done()
            router.finished(plan)
            return paced, now, seen
        finally:
            await router.close()

    paced, now, seen = asyncio.run(go())
    step = (paced.finish_s - now) / (40 - 5 // 2)          # 38 steps to come for each sequence
    assert 0.04 < step < 0.2, step                          # ~50 ms a step, not ~25 ms
    (batch, _, tbt), = seen
    assert batch == 2 and 0.04 < tbt < 0.2, seen            # a step of two sequences, not a token gap
