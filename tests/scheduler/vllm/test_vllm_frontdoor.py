"""The front door and Conductor over real vLLM servers on the CPU (scheduler/vllm_*.py): one
kv_producer prefill instance, two kv_consumer decode instances and one kv_both colocated
instance, all sharing one store node in this process and started once for the module;
vLLM's own prefix cache is off, so every cached token came from kvstore."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("vllm")

from engines.vllm.launch import VLLMServerSpec, start_servers  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402
from scheduler.config import FrontdoorConfig  # noqa: E402
from scheduler.routing.tenancy import namespace_from_authorization  # noqa: E402
from scheduler.trace import TraceMapping, load_trace  # noqa: E402
from scheduler.vllm.app import start_vllm_frontdoor  # noqa: E402
from scheduler.vllm.instances import VLLMModel, parse_metrics  # noqa: E402
from tests.helpers.vllm_frontdoor import frontdoor, handoff_tokens, stream, vllm_counter  # noqa: E402

pytestmark = pytest.mark.slow
BS = 32
TRACE = str(Path(__file__).resolve().parents[3] / "data" / "traces" / "conversation_trace.jsonl")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from engines.vllm.checkpoint import write_checkpoint
    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-llama"), "tiny", max_model_len=8192)


@pytest.fixture(scope="module")
def store(same_host_store):
    """The module's store node in this process (tests/conftest.py): (pool, address)."""
    return same_host_store


@pytest.fixture(scope="module")
def servers(model_dir, store, tmp_path_factory):
    """name -> VLLMServer: prefill (kv_producer), decode0/decode1 (kv_consumer), colocated (kv_both)."""
    _, address = store
    roles = {"prefill": "kv_producer", "decode0": "kv_consumer", "decode1": "kv_consumer", "colocated": "kv_both"}
    specs = [VLLMServerSpec(model_dir, free_port(), role, address, kv_cache_bytes=64 << 20, max_model_len=8192)
             for role in roles.values()]
    started = start_servers(specs, tmp_path_factory.mktemp("vllm-logs"), list(roles), timeout_s=300)
    yield dict(zip(roles, started))
    for s in started:
        s.stop(grace_s=10)


def trace_prompts(n: int) -> list[tuple[list[int], int]]:
    mapping = TraceMapping(BS, 512)
    return [(list(mapping.prompt(r)), max(1, min(r.output_length, 8))) for r in load_trace(TRACE, n)]


def test_parse_metrics_reads_load_and_cache_size() -> None:
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="512"} 1.0\n# HELP x\n')
    load = parse_metrics(text)
    assert (load.running, load.waiting, load.kv_usage, load.kv_blocks) == (3, 2, 0.25, 512)


def test_twenty_trace_requests_disaggregated_load_every_block_and_match_colocated(model_dir, store, servers) -> None:
    prompts = trace_prompts(20)

    async def run(topology: str, key: str) -> tuple[list[dict], float]:
        async with frontdoor(model_dir, store, servers, "decode0", topology=topology) as door:
            async with aiohttp.ClientSession() as s:
                out = await asyncio.gather(*(stream(s, door.url, {"prompt": p, "max_tokens": m, "temperature": 0,
                                                                  "ignore_eos": True}, key)
                                             for p, m in prompts))
            return out, handoff_tokens(door)

    disagg, handoff = asyncio.run(run("disaggregated", "tenant-pd"))
    colocated, _ = asyncio.run(run("colocated", "tenant-colocated"))
    # every full block but one holding the last token went from prefill to decode through
    # the pool: the hand-off, booked apart from the cached tokens the clients are told
    assert handoff == sum((len(p) - 1) // BS * BS for p, _ in prompts)
    for (prompt, max_tokens), d, c in zip(prompts, disagg, colocated):
        assert d["status"] == 200 and d["error"] is None and len(d["tokens"]) == max_tokens
        assert d["decode"] == "vllm-decode-0"
        assert 0 <= d["cached"] <= (len(prompt) - 1) // BS * BS
        assert d["tokens"] == c["tokens"]                 # greedy: loaded KV == recomputed KV
    pool, _ = store
    pool.check_integrity()


@pytest.mark.parametrize("topology", ["disaggregated", "colocated"])
def test_cached_tokens_are_the_prefills_in_every_topology(model_dir, store, servers, topology) -> None:
    """``usage.prompt_tokens_details.cached_tokens`` is what the request's prefill did not
    compute, whole and streamed, completions and chat: 0 for a cold prompt, every full block
    but the last token's the second time, 0 for another tenant's first request of it —
    disaggregated too, where the decode instance loads every full block whatever the reuse
    (the hand-off, booked apart). The front door's prefix hit ratio is what the clients were
    told: their cached tokens / their prompt tokens."""
    prompt = [11 + (i * 13) % 240 for i in range(3 * BS + 7)]
    chat = {"messages": [{"role": "user", "content": " ".join(f"word{i}" for i in range(60))}], "max_tokens": 2}
    tag = topology[:4]

    async def post(s: aiohttp.ClientSession, url: str, path: str, body: dict, key: str, streamed: bool) -> dict:
        headers = {"Authorization": f"Bearer {key}"}
        if streamed:
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(url + path, json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            if not streamed:
                return (await r.json())["usage"]
            events = [json.loads(line[5:]) for line in (await r.read()).split(b"\n")
                      if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]
            return events[-1]["usage"]

    async def run() -> tuple[list[dict], tuple[float, float, float, float], tuple[float, float]]:
        async with frontdoor(model_dir, store, servers, "decode0", topology=topology) as door:
            get = door.frontdoor.metrics.registry.get_sample_value
            async with aiohttp.ClientSession() as s:
                told = []
                for key, first, again in ((f"hits-{tag}-a", False, True), (f"hits-{tag}-b", True, False)):
                    for streamed in (first, again):
                        told.append(await post(s, door.url, "/v1/completions",
                                               {"prompt": prompt, "max_tokens": 2}, key, streamed))
                for streamed in (False, True):
                    told.append(await post(s, door.url, "/v1/chat/completions", chat, f"hits-{tag}-c", streamed))
                async with s.get(door.url + "/metrics") as r:
                    text = await r.text()
            ratio = float(next(line.split()[1] for line in text.splitlines()
                               if line.startswith("kvstore_scheduler_prefix_hit_ratio ")))
            return told, (get("kvstore_scheduler_prompt_tokens_total"),
                          get("kvstore_scheduler_cached_prompt_tokens_total"), ratio, handoff_tokens(door)), \
                (get("kvstore_scheduler_request_seconds_count", {"outcome": "ok"}),
                 get("kvstore_scheduler_ttft_seconds_count"))

    told, (prompt_tokens, cached, ratio, handoff), (timed, first_tokens) = asyncio.run(run())
    assert (timed, first_tokens) == (6, 3)      # every request timed whole; a streamed one's first token too
    full = [(u["prompt_tokens"] - 1) // BS * BS for u in told]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in told] == [0, full[1], 0, full[3], 0, full[5]]
    assert full[1] == 3 * BS and full[5] > 0
    assert prompt_tokens == sum(u["prompt_tokens"] for u in told)
    assert cached == sum(u["prompt_tokens_details"]["cached_tokens"] for u in told)
    assert ratio == pytest.approx(cached / prompt_tokens)
    assert handoff == (sum(full) if topology == "disaggregated" else 0)


def test_admission_rejects_before_any_prefill_reaches_vllm(model_dir, store, servers) -> None:
    prompt = trace_prompts(1)[0][0]
    done = "vllm:request_success_total"        # requests vLLM finished, per instance

    async def run() -> tuple[dict, dict, float, float]:
        async with frontdoor(model_dir, store, servers, "decode0", max_inflight=1) as door:
            async with aiohttp.ClientSession() as s:
                router = door.frontdoor.router
                (backlog,) = [p.backlog for p in router.prefill.values()]
                served = await asyncio.to_thread(vllm_counter, servers["prefill"], done)
                long = asyncio.ensure_future(stream(s, door.url, {"prompt": prompt, "max_tokens": 400,
                                                                  "ignore_eos": True}))
                while not router.inflight:
                    await asyncio.sleep(0.005)
                # The long request's prefill call has returned (the router's books: its backlog
                # is empty, the request still in flight) and its 400 tokens are decoding, so the
                # front door is full. (Polling vLLM's prompt counter instead raced the request:
                # the counter could move only once it was over, and the second got a 200.)
                while len(backlog) and not long.done():
                    await asyncio.sleep(0.005)
                assert router.inflight == 1 and not long.done()
                rejected = await stream(s, door.url, {"prompt": prompt[:-3] + [7, 8, 9], "max_tokens": 4})
                first = await long
                # Every request vLLM's prefill instance finished is counted: the long one's
                # prefill, and the rejected one's were it sent there.
                after = served
                for _ in range(200):
                    after = await asyncio.to_thread(vllm_counter, servers["prefill"], done)
                    if after > served:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                after = await asyncio.to_thread(vllm_counter, servers["prefill"], done)
                return first, rejected, served, after

    first, rejected, served, after = asyncio.run(run())
    assert first["status"] == 200 and len(first["tokens"]) == 400
    assert rejected["status"] == 429 and rejected["error"]["code"] == "max_inflight"
    assert after == served + 1


def test_a_bad_sampling_value_is_refused_before_any_prompt_token_is_computed(model_dir, store, servers) -> None:
    """vLLM checks repetition_penalty and min_p (the front door passes them through): the
    prefill request carries them, so vLLM's 400 comes before the prefill, not after it."""
    prompt = trace_prompts(1)[0][0][:-2] + [11, 12]

    async def run() -> tuple[list[dict], float, float, float]:
        async with frontdoor(model_dir, store, servers, "decode0") as door:
            async with aiohttp.ClientSession() as s:
                before = await asyncio.to_thread(vllm_counter, servers["prefill"], "vllm:prompt_tokens_total")
                decoded = await asyncio.to_thread(vllm_counter, servers["decode0"], "vllm:prompt_tokens_total")
                out = [await stream(s, door.url, {"prompt": prompt, "max_tokens": 4, **bad})
                       for bad in ({"repetition_penalty": 0}, {"min_p": 2.0}, {"n": 0})]
                after = await asyncio.to_thread(vllm_counter, servers["prefill"], "vllm:prompt_tokens_total")
                assert await asyncio.to_thread(vllm_counter, servers["decode0"], "vllm:prompt_tokens_total") == decoded
                good = await stream(s, door.url, {"prompt": prompt, "max_tokens": 4, "repetition_penalty": 1.1,
                                                  "min_p": 0.05, "temperature": 0.8, "seed": 3, "n": None})
                async with s.get(door.url + "/v1/models") as r:
                    listed = (await r.json())["data"][0]["id"]
                async with s.post(door.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2,
                                                                       "n": None}) as r:
                    whole = (r.status, await r.json())
                return [*out, good], before, after, listed, whole

    (rp, mp, n0, good), before, after, listed, (status, whole) = asyncio.run(run())
    assert n0["status"] == 400 and n0["error"]["param"] == "n", n0
    for r, field in ((rp, "repetition_penalty"), (mp, "min_p")):
        assert r["status"] == 400 and r["error"]["code"] == "invalid_value" and field in r["error"]["message"], r
    assert after == before                           # no prompt token computed for either
    # "n": null is OpenAI's default (vLLM refused it after the prefill); every answer names
    # the model as /v1/models lists it (it carried vLLM's served name, which is refused)
    assert good["status"] == 200 and good["error"] is None and len(good["tokens"]) == 4
    assert good["models"] == {listed} and status == 200 and whole["model"] == listed, (good, whole)


def test_two_tenants_never_share_blocks(model_dir, store, servers) -> None:
    pool, _ = store
    model = VLLMModel.from_dir(model_dir, BS)
    prompt = [5 + (i * 7) % 250 for i in range(4 * BS + 9)]
    ns_a, ns_b = namespace_from_authorization("Bearer alice"), namespace_from_authorization("Bearer bob")

    def held(ns: str) -> int:
        return pool.lookup(model.keys(prompt, ns))[0]

    async def run() -> tuple[dict, dict]:
        async with frontdoor(model_dir, store, servers, "decode0") as door:
            async with aiohttp.ClientSession() as s:
                body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
                a = await stream(s, door.url, body, "alice")
                assert held(ns_a) == 4 and held(ns_b) == 0
                blocks = pool.stats()[0].blocks
                prefilled = vllm_counter(servers["prefill"], "vllm:prompt_tokens_total")
                b = await stream(s, door.url, body, "bob")
                assert pool.stats()[0].blocks == blocks + 4           # bob's prefill stored its own
                assert vllm_counter(servers["prefill"], "vllm:prompt_tokens_total") == prefilled + len(prompt)
                return a, b

    a, b = asyncio.run(run())
    assert a["cached"] == b["cached"] == 0       # each tenant's first: nothing reused (decode's load is a hand-off)
    assert held(ns_a) == held(ns_b) == 4


def test_requests_move_off_dead_instances_before_anything_is_sent_and_restarted_ones_serve_again(
        model_dir, store, servers) -> None:
    """Prefill and decode0 are killed while the router still routes to them (its watcher
    polls once at start, then sleeps): a request routed to both moves to the colocated
    instance (kv_both, a second prefill instance here) for its prefill and to decode1 for its
    decode, whole and streamed; both dead instances are restarted on their ports
    (VLLMServer.restart, as ``kvstore up --engine vllm`` does) and serve again."""
    _, address = store
    prompt = trace_prompts(3)[2][0]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    config = FrontdoorConfig(model_dir=model_dir, ready_timeout_s=60)

    async def post(s: aiohttp.ClientSession, url: str) -> tuple[int, dict, dict]:
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status, dict(r.headers), await r.json()

    def moved(door) -> dict[str, float]:
        get = door.frontdoor.metrics.registry.get_sample_value     # what /metrics serves
        return {role: get("kvstore_scheduler_requests_moved_total", {"role": role}) for role in ("prefill", "decode")}

    async def run() -> tuple:
        door = await start_vllm_frontdoor(model_dir, [servers["prefill"].url, servers["colocated"].url],
                                          [servers["decode0"].url, servers["decode1"].url], address,
                                          config=config, watch_interval_s=3600)
        try:
            router = door.frontdoor.router
            async with aiohttp.ClientSession() as s:
                before = await post(s, door.url)                   # all up: the first listed serve it
                servers["prefill"].kill()
                servers["decode0"].kill()
                whole = await post(s, door.url)
                down_whole, moved_whole = dict(router.down), moved(door)
                router.down.clear()                                # as if not noticed yet, again
                streamed = await stream(s, door.url, body)
                down_streamed, moved_streamed = dict(router.down), moved(door)
                for name in ("prefill", "decode0"):
                    servers[name].restart()
                for name in ("prefill", "decode0"):
                    await asyncio.to_thread(servers[name].wait_ready, 300)
                router.down.clear()                                # the watcher would see them up
                after = await post(s, door.url)
                return before, whole, down_whole, moved_whole, streamed, down_streamed, moved_streamed, after
        finally:
            await door.stop()

    before, whole, down_whole, moved_whole, streamed, down_streamed, moved_streamed, after = asyncio.run(run())
    status, headers, answer = before
    assert status == 200 and (headers["X-Kvstore-Prefill"], headers["X-Kvstore-Decode"]) == (
        "vllm-prefill-0", "vllm-decode-0")
    tokens = answer["choices"][0]["token_ids"]
    assert len(tokens) == 6
    status, headers, answer = whole
    assert status == 200, answer
    assert (headers["X-Kvstore-Prefill"], headers["X-Kvstore-Decode"]) == ("vllm-prefill-1", "vllm-decode-1")
    assert answer["choices"][0]["token_ids"] == tokens                  # greedy: the same tokens
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(prompt) - 1) // BS * BS
    assert set(down_whole) == {"vllm-prefill-0", "vllm-decode-0"}       # each tried once, marked down
    assert moved_whole == {"prefill": 1, "decode": 1}
    assert streamed["status"] == 200 and streamed["error"] is None and streamed["tokens"] == tokens
    assert streamed["decode"] == "vllm-decode-1"
    assert set(down_streamed) == {"vllm-prefill-0", "vllm-decode-0"}
    assert moved_streamed == {"prefill": 2, "decode": 2}
    status, headers, answer = after                                     # the restarted ones serve
    assert status == 200 and (headers["X-Kvstore-Prefill"], headers["X-Kvstore-Decode"]) == (
        "vllm-prefill-0", "vllm-decode-0")
    assert answer["choices"][0]["token_ids"] == tokens


def test_a_killed_decode_instance_s_stream_resumes_on_the_other_and_new_requests_go_there(
        model_dir, store, servers) -> None:
    """Runs last: it kills decode1. Two long requests spread over the two decode instances;
    decode1 is frozen (SIGSTOP) from the client's own stream as soon as its first token
    arrives, and killed a second later (a vLLM counter polled instead counts earlier tests'
    tokens too, and a tiny model may finish the whole request between two polls). Its stream
    goes on from decode0 (scheduler/vllm/resume.py: the prompt's blocks from the pool, the
    tokens sent so far recomputed) and ends whole, with no error event."""
    # A short prompt and ~4,000 tokens to generate: the tiny model decodes fast and this
    # process reads the two streams slower than vLLM writes them (decode1 was seen at up to
    # 1,643 tokens when its 20th reached us); freezing it at the first token bounds how far
    # it gets, and ~4,000 tokens leave it more than twice that room.
    prompt = trace_prompts(2)[1][0][:64]
    max_tokens = 4096 - len(prompt) - 8

    def kill(out: dict) -> None:
        servers["decode1"].kill()
        out["killed_at"] = len(out["tokens"])

    def kill_mid_stream(out: dict) -> None:
        if out["decode"] == "vllm-decode-1" and "frozen" not in out and servers["decode1"].proc.poll() is None:
            os.killpg(servers["decode1"].proc.pid, signal.SIGSTOP)   # its engine core too
            out["frozen"] = len(out["tokens"])
            asyncio.get_running_loop().call_later(1.0, kill, out)

    async def run() -> tuple[list[dict], list[dict], tuple[int, dict], float | None]:
        async with frontdoor(model_dir, store, servers, "decode0", "decode1") as door:
            router = door.frontdoor.router
            async with aiohttp.ClientSession() as s:
                longs = []
                for i in range(2):
                    longs.append(asyncio.ensure_future(stream(s, door.url, {"prompt": prompt[:-1] + [i + 3],
                                                                            "max_tokens": max_tokens,
                                                                            "ignore_eos": True},
                                                              on_tokens=kill_mid_stream)))
                    while router.inflight <= i:
                        await asyncio.sleep(0.01)
                assert all(d.work for d in router.decode.values())     # one on each
                resumed = await asyncio.wait_for(asyncio.gather(*longs), 300)
                assert servers["decode1"].proc.poll() is not None, "decode1 finished before it was killed"
                t0 = time.monotonic()
                after = [await stream(s, door.url, {"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
                             for _ in range(4)]
                assert time.monotonic() - t0 < 60
                async with s.get(door.url + "/health") as r:       # the dead one is named, 503
                    health = (r.status, await r.json())
                count = door.frontdoor.metrics.registry.get_sample_value("kvstore_scheduler_resumed_streams_total")
                return resumed, after, health, count

    longs, after, (status, health), count = asyncio.run(run())
    assert status == 503 and health["status"] == "degraded"
    assert any(r.startswith("decode vllm-decode-1:") for r in health["reasons"]), health
    by_decode = {r["decode"]: r for r in longs}
    assert set(by_decode) == {"vllm-decode-0", "vllm-decode-1"}
    for r in longs:                      # the killed one's stream went on from decode0, whole
        assert r["status"] == 200 and r["error"] is None and len(r["tokens"]) == max_tokens, r["error"]
    assert by_decode["vllm-decode-1"]["killed_at"] < max_tokens and count == 1
    for r in after:
        assert r["status"] == 200 and r["error"] is None and len(r["tokens"]) == 4
        assert r["decode"] == "vllm-decode-0"
