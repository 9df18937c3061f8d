"""A stream whose vLLM instance is killed mid-stream goes on from another instance
(scheduler/vllm/resume.py, docs/resume.md): two colocated kv_both instances on the CPU and a
store node in this process, started once for the module; each test kills the instance
serving its stream (``kill -9``) once a few tokens reached the client, then restarts it.
vLLM's own prefix cache is off, so every cached token came from kvstore."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable

import aiohttp
import pytest

pytest.importorskip("vllm")

from engines.vllm.launch import VLLMServerSpec, start_servers  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402
from scheduler.config import FrontdoorConfig  # noqa: E402
from scheduler.vllm.app import start_vllm_frontdoor  # noqa: E402

pytestmark = pytest.mark.slow
BS = 32
# Room for the kill to land while the instance still generates: under load this process reads
# the stream far slower than a tiny model writes it, and a whole short answer can sit in the
# socket buffers before the client has seen its first tokens.
MAX_TOKENS = 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from engines.vllm.checkpoint import write_checkpoint
    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-llama"), "tiny", max_model_len=2048)


@pytest.fixture(scope="module")
def store(same_host_store):
    return same_host_store


@pytest.fixture(scope="module")
def servers(store, model_dir, tmp_path_factory):
    """name -> VLLMServer: two kv_both instances."""
    _, address = store
    names = ["a", "b"]
    specs = [VLLMServerSpec(model_dir, free_port(), "kv_both", address, kv_cache_bytes=64 << 20, max_model_len=2048)
             for _ in names]
    started = start_servers(specs, tmp_path_factory.mktemp("vllm-logs"), names, timeout_s=300)
    yield dict(zip(names, started))
    for s in started:
        s.stop(grace_s=10)


@pytest.fixture
def both_up(servers):
    """Restarts whichever instance an earlier test killed."""
    for s in servers.values():
        if s.proc.poll() is not None:
            s.restart()
    for s in servers.values():
        s.wait_ready(300)
    return servers


def counters(server, names: tuple[str, ...]) -> dict[str, float]:
    """vLLM's counters ``names`` once two reads 1 s apart agree (it counts a step's tokens
    as it streams them; the last step's may land just after the stream's end, later on a
    busy machine)."""
    def read() -> dict[str, float]:
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
        return {n: sum(float(line.rsplit(" ", 1)[1]) for line in lines
                       if line.startswith(n + "{") or line.startswith(n + " ")) for n in names}
    last = read()
    for _ in range(10):
        time.sleep(1.0)
        now = read()
        if now == last:
            break
        last = now
    return last


async def stream(s: aiohttp.ClientSession, url: str, path: str, body: dict,
                 on_tokens: Callable[[dict], None] | None = None) -> dict:
    """POST a stream with usage; returns {status, decode, events, tokens, text, error, usage}."""
    out: dict = {"events": [], "tokens": [], "text": "", "error": None, "usage": None}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with s.post(url + path, json=body, headers={"Authorization": "Bearer resume"}) as r:
        out["status"], out["decode"] = r.status, r.headers.get("X-Kvstore-Decode")
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            out["events"].append(event)
            if "error" in event:
                out["error"] = event["error"]
                continue
            before = len(out["tokens"])
            for c in event.get("choices") or ():
                out["tokens"].extend(c.get("token_ids") or ())
                out["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
            if event.get("usage"):
                out["usage"] = event["usage"]
            if on_tokens is not None and len(out["tokens"]) > before:
                on_tokens(out)
    return out


def killed_mid_stream(model_dir, store, servers, path: str, body: dict) -> tuple[dict, dict, dict, dict]:
    """An uninterrupted stream of ``body``, then the same stream with the instance serving it
    frozen at its first token and killed half a second later. Returns (reference, resumed, the survivor's counters'
    growth during the resumed stream, the front door's metrics)."""
    _, address = store
    config = FrontdoorConfig(model_dir=model_dir, ready_timeout_s=60)

    async def run() -> tuple[dict, dict, dict, dict]:
        door = await start_vllm_frontdoor(model_dir, (), (), address, config=config, topology="colocated",
                                          colocated_urls=[servers["a"].url, servers["b"].url])
        router = door.frontdoor.router
        by_id = dict(zip(router.prefill, servers.values()))
        try:
            async with aiohttp.ClientSession() as s:
                reference = await stream(s, door.url, path, body)
                names = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
                before = {sid: await asyncio.to_thread(counters, srv, names) for sid, srv in by_id.items()}

                def kill(out: dict) -> None:
                    victim = by_id[out["decode"]]
                    victim.kill()
                    out["killed_at"] = len(out["tokens"])

                def freeze(out: dict) -> None:
                    # the client reads slower than a tiny model writes: SIGSTOP (the engine core
                    # too) bounds how far the instance gets before the kill a moment later
                    victim = by_id[out["decode"]]
                    if "frozen" not in out and victim.proc.poll() is None:
                        os.killpg(victim.proc.pid, signal.SIGSTOP)
                        out["frozen"] = len(out["tokens"])
                        asyncio.get_running_loop().call_later(0.5, kill, out)
                resumed = await stream(s, door.url, path, body, on_tokens=freeze)
                survivor = next(sid for sid in by_id if sid != resumed["decode"])
                after = await asyncio.to_thread(counters, by_id[survivor], names)
                grown = {n: after[n] - before[survivor][n] for n in names}
                get = door.frontdoor.metrics.registry.get_sample_value
                metrics = {"resumed": get("kvstore_scheduler_resumed_streams_total"),
                           "moved": get("kvstore_scheduler_requests_moved_total", {"role": "decode"}),
                           "down": set(router.down), "inflight": router.inflight,
                           "backlog": {e: len(p.backlog) for e, p in router.prefill.items()},
                           "work": {e: len(d.work) for e, d in router.decode.items()}}
                return reference, resumed, grown, metrics
        finally:
            await door.stop()
    return asyncio.run(run())


def killed_mid_generation(model_dir, store, servers, path: str, body: dict) -> tuple[dict, dict, dict, dict]:
    """:func:`killed_mid_stream` until the kill lands while the instance still generates (at
    most three tries): on a loaded machine the whole answer can already sit in the socket
    buffers when the client sees its first token, and such a try, where the stream simply
    ends whole with nothing to resume, says nothing about resuming."""
    for _ in range(3):
        reference, resumed, grown, metrics = killed_mid_stream(model_dir, store, servers, path, body)
        if metrics["resumed"] or resumed["error"] is not None or resumed.get("killed_at") is None:
            break
        for s in servers.values():            # the killed one back, for the next try
            if s.proc.poll() is not None:
                s.restart()
        for s in servers.values():
            s.wait_ready(300)
    return reference, resumed, grown, metrics


def check_resumed(reference: dict, resumed: dict, grown: dict, metrics: dict, prompt_tokens: int) -> None:
    assert resumed.get("killed_at") is not None, "the stream ended before the kill"
    assert metrics["resumed"] == 1, ("no resume: the instance had written the whole answer before it was frozen",
                                     resumed["frozen"], metrics)
    assert reference["error"] is None and resumed["error"] is None, resumed["error"]
    assert len(reference["tokens"]) == MAX_TOKENS
    assert resumed["tokens"] == reference["tokens"]            # greedy: exactly the uninterrupted run
    assert resumed["text"] == reference["text"]
    assert len({e["id"] for e in resumed["events"]}) == 1 and len({e["created"] for e in resumed["events"]}) == 1
    assert resumed["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"] == prompt_tokens
    assert resumed["usage"]["completion_tokens"] == MAX_TOKENS
    assert resumed["usage"]["total_tokens"] == prompt_tokens + MAX_TOKENS
    # the prompt's full blocks came from the pool (saved by the killed instance's prefill)
    assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens // BS * BS
    # the survivor was given the prompt and the tokens generated so far, and generated the rest
    generated_before = grown["vllm:prompt_tokens_total"] - prompt_tokens
    # at least every token the client had seen when the instance froze, and not the whole answer
    assert resumed["frozen"] <= generated_before < MAX_TOKENS
    assert grown["vllm:generation_tokens_total"] == MAX_TOKENS - generated_before
    assert metrics["resumed"] == 1 and metrics["moved"] == 1
    assert metrics["down"] == {resumed["decode"]}
    # the router's books are empty once the stream is over
    assert metrics["inflight"] == 0 and not any(metrics["backlog"].values()) and not any(metrics["work"].values())


def test_a_completion_stream_resumes_on_the_other_instance_with_the_uninterrupted_tokens(
        model_dir, store, both_up) -> None:
    prompt = [5 + (i * 7) % 250 for i in range(3 * BS + 5)]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    reference, resumed, grown, metrics = killed_mid_generation(model_dir, store, both_up, "/v1/completions", body)
    check_resumed(reference, resumed, grown, metrics, len(prompt))
    assert all(e["object"] == "text_completion" for e in resumed["events"])


def test_a_chat_stream_resumes_as_chat_chunks(model_dir, store, both_up) -> None:
    messages = [{"role": "user", "content": "tell me about the key value cache " * 3}]
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    reference, resumed, grown, metrics = killed_mid_generation(model_dir, store, both_up, "/v1/chat/completions", body)
    check_resumed(reference, resumed, grown, metrics, reference["usage"]["prompt_tokens"])
    assert all(e["object"] == "chat.completion.chunk" for e in resumed["events"])
    assert all("text" not in c and "delta" in c for e in resumed["events"] for c in e["choices"])
    assert resumed["events"][0]["choices"][0]["delta"]["role"] == "assistant"
