"""The front door over running vLLM servers, for the tests that share one set of servers per
module (tests/scheduler/vllm/test_vllm_frontdoor.py): a front door as an async context
manager, a streamed completion as the client sees it, and the counters read after it."""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable

import aiohttp

from scheduler.config import FrontdoorConfig
from scheduler.policy.admission import AdmissionConfig
from scheduler.vllm.app import start_vllm_frontdoor


def frontdoor(model_dir, store, servers, *decode: str, topology: str = "disaggregated", **admission):
    """An async context manager: a front door over the named decode servers (or colocated)."""
    _, address = store
    config = FrontdoorConfig(model_dir=model_dir, admission=AdmissionConfig(**admission), ready_timeout_s=60)
    if topology == "colocated":
        return _Running(start_vllm_frontdoor(model_dir, (), (), address, config=config, topology="colocated",
                                             colocated_urls=[servers["colocated"].url]))
    return _Running(start_vllm_frontdoor(model_dir, [servers["prefill"].url], [servers[d].url for d in decode],
                                         address, config=config, watch_interval_s=0.2))


class _Running:
    def __init__(self, starting) -> None:
        self.starting = starting

    async def __aenter__(self):
        self.running = await self.starting
        return self.running

    async def __aexit__(self, *exc) -> None:
        await self.running.stop()


async def stream(session: aiohttp.ClientSession, url: str, body: dict, key: str | None = None,
                 on_tokens: Callable[[dict], None] | None = None) -> dict:
    """POST a streamed completion; returns {status, tokens, cached, error, decode}.
    ``on_tokens(out)`` is called after each event that carried tokens."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out = {"tokens": [], "cached": None, "error": None, "models": set()}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}   # usage: the cached tokens
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        out["status"], out["decode"] = r.status, r.headers.get("X-Kvstore-Decode")
        if r.status != 200:
            out["error"] = (await r.json())["error"]
            return out
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            out["models"].add(event.get("model"))
            before = len(out["tokens"])
            for c in event.get("choices") or ():
                out["tokens"].extend(c.get("token_ids") or ())
            if on_tokens is not None and len(out["tokens"]) > before:
                on_tokens(out)
            if event.get("usage"):
                out["cached"] = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    return out


def vllm_counter(server, name: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def handoff_tokens(door) -> float:
    get = door.frontdoor.metrics.registry.get_sample_value
    return sum(get("kvstore_scheduler_handoff_tokens_total", {"via": v}) or 0.0 for v in ("pool", "direct"))
