"""Trace replay: send a trace's requests to a front door at their (scaled) arrival times and
measure, client-side, what each one saw; fold it into a :class:`Report`.

Each request is ``POST {target}/v1/completions`` with the mapped prompt as token ids,
``stream: true``, ``ignore_eos: true`` and ``max_tokens = max(1, min(output_length,
max_output_tokens))``, sent at ``timestamp / speed`` after the start whether or not earlier
requests have finished (open loop). TTFT is send → first token event; TBT the gaps between
later token events.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from kvstore.errors import InvalidArgument, Unavailable
from scheduler.report import Report, RequestOutcome, summarize
from scheduler.trace import TraceMapping, TraceRequest, best_possible_hit_blocks, load_trace

log = logging.getLogger(__name__)

DEFAULT_TTFT_SLO_S = 5.0
DEFAULT_TBT_SLO_S = 0.5


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
               tokens_per_block: int, trace_blocks: int) -> RequestOutcome:
    prompt_tokens = len(body["prompt"])
    base = {"prompt_tokens": prompt_tokens, "trace_blocks": trace_blocks}
    t0 = time.perf_counter()
    times: list[float] = []
    cached = 0
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                try:
                    code = str((await resp.json(content_type=None))["error"]["code"])
                except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                    code = ""
                status = "rejected" if resp.status == 429 else "failed"
                return RequestOutcome(status, code or f"http_{resp.status}", **base)
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return RequestOutcome("failed", str(event["error"].get("code") or "stream_error"), **base)
                if event["choices"] and event["choices"][0].get("token_ids"):
                    times.extend([time.perf_counter()] * len(event["choices"][0]["token_ids"]))
                if event.get("usage"):
                    cached = int(event["usage"]["prompt_tokens_details"]["cached_tokens"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return RequestOutcome("failed", type(exc).__name__, **base)
    if not times:
        return RequestOutcome("failed", "no_tokens", **base)
    gaps = tuple(b - a for a, b in zip(times, times[1:]))
    return RequestOutcome("ok", "", times[0] - t0, gaps, prompt_tokens, cached, len(times),
                          cached // tokens_per_block, trace_blocks)


async def replay(target_url: str, requests: Sequence[TraceRequest], speed: float = 1.0,
                 max_output_tokens: int = 32, mapping: TraceMapping | None = None, *,
                 ttft_slo_s: float = DEFAULT_TTFT_SLO_S, tbt_slo_s: float = DEFAULT_TBT_SLO_S,
                 api_key: str | None = None, timeout_s: float = 600.0,
                 progress_every_s: float = 5.0) -> Report:
    """Replay ``requests`` against the front door at ``target_url`` (``http://host:port``).

    Args:
        speed: time compression (> 0): 10 sends the trace ten times faster.
        max_output_tokens: cap on tokens generated per request (>= 1).
        mapping: trace block → token ids (default: ``TraceMapping()``).
        ttft_slo_s, tbt_slo_s: the SLOs goodput is counted against (seconds).
        api_key: sent as ``Authorization: Bearer``; None replays in the public namespace.
        timeout_s: per-request limit (seconds); a request over it counts as failed.
        progress_every_s: how often to log progress (seconds).

    Raises:
        InvalidArgument: bad speed, cap or SLO.
    """
    if not speed > 0:
        raise InvalidArgument(f"speed must be > 0, got {speed}")
    if max_output_tokens < 1:
        raise InvalidArgument(f"max_output_tokens must be >= 1, got {max_output_tokens}")
    if not (ttft_slo_s > 0 and tbt_slo_s > 0):
        raise InvalidArgument(f"SLOs must be > 0 s, got ttft {ttft_slo_s}, tbt {tbt_slo_s}")
    mapping = mapping or TraceMapping()
    url = target_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bodies = [{"prompt": mapping.prompt(r), "max_tokens": max(1, min(r.output_length, max_output_tokens)),
               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
              for r in requests]
    t0_ms = min((r.timestamp_ms for r in requests), default=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.perf_counter()

        done: list[RequestOutcome] = []

        async def at(req: TraceRequest, body: dict[str, Any]) -> RequestOutcome:
            delay = start + (req.timestamp_ms - t0_ms) / 1000.0 / speed - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = await _one(session, url, body, headers, mapping.tokens_per_block, len(req.hash_ids))
            done.append(outcome)
            return outcome

        async def progress() -> None:
            while True:
                await asyncio.sleep(progress_every_s)
                ok = sum(o.status == "ok" for o in done)
                log.info("replay: %d of %d answered (%d completed, %d rejected) after %.0f s",
                         len(done), len(bodies), ok, sum(o.status == "rejected" for o in done),
                         time.perf_counter() - start)

        reporter = asyncio.create_task(progress())
        try:
            outcomes = await asyncio.gather(*(at(r, b) for r, b in zip(requests, bodies)))
        finally:
            reporter.cancel()
        wall = time.perf_counter() - start
    settings = {"target": target_url, "speed": speed, "max_output_tokens": max_output_tokens,
                "tokens_per_block": mapping.tokens_per_block, "vocab_size": mapping.vocab_size,
                "seed": mapping.seed}
    return summarize(outcomes, sum(best_possible_hit_blocks(requests, mapping)), wall,
                     ttft_slo_s, tbt_slo_s, settings)


async def server_info(target_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The front door's ``/health`` answer (model, block_size, vocab_size, max_model_len).
    Raises Unavailable unless it answers 200, or 503 ``degraded`` (a part is down but
    requests are served: the reasons are logged)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(target_url.rstrip("/") + "/health") as resp:
                info = await resp.json(content_type=None) if resp.status in (200, 503) else {}
                if resp.status == 503 and info.get("status") == "degraded":
                    log.warning("front door at %s is degraded: %s", target_url, "; ".join(info.get("reasons", ())))
                elif resp.status != 200:
                    raise Unavailable(f"front door at {target_url}: /health answered {resp.status} "
                                      f"{'; '.join(info.get('reasons', ()))}".rstrip())
                return dict(info)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise Unavailable(f"front door at {target_url} unreachable: {exc}") from None


async def run_replay(target_url: str, trace_path: str | Path, *, requests: int | None = None,
                     speed: float = 1.0, max_output_tokens: int = 32, tokens_per_block: int | None = None,
                     ttft_slo_s: float = DEFAULT_TTFT_SLO_S, tbt_slo_s: float = DEFAULT_TBT_SLO_S,
                     api_key: str | None = None, seed: int | None = None,
                     json_path: str | Path | None = None) -> Report:
    """Replay the first ``requests`` (all when None) of the trace at ``trace_path`` against the
    front door at ``target_url``; the vocabulary and (by default) ``tokens_per_block`` = the
    engines' block size come from its ``/health``. Writes the report as JSON to ``json_path``
    when given. Raises Unavailable when the front door does not answer, InvalidArgument for a
    malformed trace or bad settings."""
    info = await server_info(target_url)
    tpb = tokens_per_block or int(info.get("block_size") or 16)
    block = int(info.get("block_size") or tpb)
    if tpb % block:
        log.warning("tokens_per_block %d is not a multiple of the engines' block size %d: trace "
                    "blocks and cache blocks will not align", tpb, block)
    kw = {} if seed is None else {"seed": seed}
    mapping = TraceMapping(tpb, int(info.get("vocab_size") or 512), **kw)
    trace = load_trace(trace_path, requests)
    report = await replay(target_url, trace, speed, max_output_tokens, mapping,
                          ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, api_key=api_key)
    report = dataclasses.replace(report, settings={**report.settings, "trace": str(trace_path),
                                                   "requests": len(trace)})
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return report
