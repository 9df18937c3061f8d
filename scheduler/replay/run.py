"""Trace replay: send a trace's requests to a front door at their (scaled) arrival times and
measure, client-side, what each one saw; fold it into a :class:`Report`.

Each request is ``POST {target}/v1/completions`` with the mapped prompt as token ids,
``stream: true``, ``ignore_eos: true``, ``temperature: 0`` (greedy, so that set-ups can be
checked token for token) and ``max_tokens = max(1, min(output_length, max_output_tokens))``
(and ``"prefix_cache": false`` when the pool is off), sent at ``timestamp / speed`` after
the start whether or not earlier requests have finished (open loop). TTFT is send → first
token event; TBT the gaps between later token events. A request whose prompt +
``max_tokens`` exceed the front door's ``max_model_len`` is not sent: it is reported as
skipped (``context_length_exceeded``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from kvstore.errors import InvalidArgument, Unavailable
from scheduler.replay.compare import Comparison
from scheduler.replay.report import Report, RequestOutcome, summarize
from scheduler.trace import TraceMapping, TraceRequest, best_possible_hit_blocks, load_trace, select_window

log = logging.getLogger(__name__)
T = TypeVar("T")

# Sent once in each mode before a comparison, not counted: hash ids far from the trace's, so
# its tokens share no block with a trace request.
WARM_UP = TraceRequest(0, 4 * 512, 2, tuple(range(1 << 40, (1 << 40) + 4)))
DEFAULT_TTFT_SLO_S = 5.0
DEFAULT_TBT_SLO_S = 0.5


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
               tokens_per_block: int, trace_blocks: int) -> RequestOutcome:
    prompt_tokens = len(body["prompt"])
    base: dict[str, Any] = {"prompt_tokens": prompt_tokens, "trace_blocks": trace_blocks}
    t0 = time.perf_counter()
    times: list[float] = []
    token_ids: list[int] = []
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
                    token_ids.extend(event["choices"][0]["token_ids"])
                if event.get("usage"):
                    cached = int(event["usage"]["prompt_tokens_details"]["cached_tokens"])
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return RequestOutcome("failed", type(exc).__name__, **base)
    if not times:
        return RequestOutcome("failed", "no_tokens", **base)
    gaps = tuple(b - a for a, b in zip(times, times[1:]))
    return RequestOutcome("ok", "", times[0] - t0, gaps, prompt_tokens, cached, len(times),
                          cached // tokens_per_block, trace_blocks, tuple(token_ids))


async def replay(target_url: str, requests: Sequence[TraceRequest], speed: float = 1.0,
                 max_output_tokens: int = 32, mapping: TraceMapping | None = None, *,
                 ttft_slo_s: float = DEFAULT_TTFT_SLO_S, tbt_slo_s: float = DEFAULT_TBT_SLO_S,
                 api_key: str | None = None, timeout_s: float = 600.0,
                 progress_every_s: float = 5.0, prefix_cache: bool = True,
                 max_model_len: int | None = None) -> Report:
    """Replay ``requests`` against the front door at ``target_url`` (``http://host:port``).

    Args:
        speed: time compression (> 0): 10 sends the trace ten times faster.
        max_output_tokens: cap on tokens generated per request (>= 1).
        mapping: trace block → token ids (default: ``TraceMapping()``).
        ttft_slo_s, tbt_slo_s: the SLOs goodput is counted against (seconds).
        api_key: sent as ``Authorization: Bearer``; None replays in the public namespace.
        timeout_s: per-request limit (seconds); a request over it counts as failed.
        progress_every_s: how often to log progress (seconds).
        prefix_cache: False sends every request with ``"prefix_cache": false`` (pool off:
            every prompt token recomputed, scheduler/frontdoor/openai_api.py).
        max_model_len: the front door's limit (tokens, prompt + max_tokens); a request
            over it is skipped, not sent (None: every request is sent).

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
    bodies: list[dict[str, Any]] = [
        {"prompt": mapping.prompt(r), "max_tokens": max(1, min(r.output_length, max_output_tokens)),
         "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0,
         **({} if prefix_cache else {"prefix_cache": False})}
        for r in requests]
    fits = [max_model_len is None or len(b["prompt"]) + b["max_tokens"] <= max_model_len for b in bodies]
    sent = [r for r, ok in zip(requests, fits) if ok]
    if len(sent) < len(requests):
        log.warning("replay: %d of %d requests are longer than the model's limit of %s tokens: skipped",
                    len(requests) - len(sent), len(requests), max_model_len)
    t0_ms = min((r.timestamp_ms for r in requests), default=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.perf_counter()

        done: list[RequestOutcome] = []

        async def at(req: TraceRequest, body: dict[str, Any], fits: bool) -> RequestOutcome:
            if not fits:
                return RequestOutcome("skipped", "context_length_exceeded", prompt_tokens=len(body["prompt"]),
                                      trace_blocks=len(req.hash_ids))
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
                         len(done), len(sent), ok, sum(o.status == "rejected" for o in done),
                         time.perf_counter() - start)

        reporter = asyncio.create_task(progress())
        try:
            outcomes = await asyncio.gather(*(at(r, b, f) for r, b, f in zip(requests, bodies, fits)))
        finally:
            reporter.cancel()
        wall = time.perf_counter() - start
    settings = {"target": target_url, "speed": speed, "max_output_tokens": max_output_tokens,
                "tokens_per_block": mapping.tokens_per_block, "vocab_size": mapping.vocab_size,
                "seed": mapping.seed, "prefix_cache": prefix_cache, "max_model_len": max_model_len}
    best = best_possible_hit_blocks(sent, mapping)   # what was sent: a skipped prompt caches nothing
    return summarize(outcomes, sum(best), wall, ttft_slo_s, tbt_slo_s, settings, best)


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
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        raise Unavailable(f"front door at {target_url} unreachable: {exc}") from None


async def check_api_key(target_url: str, api_key: str | None, timeout_s: float = 10.0) -> None:
    """Raises Unavailable when the front door answers ``GET /v1/models`` with 401: every
    request of a replay would fail so (it ran to its end, reporting each as failed)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(target_url.rstrip("/") + "/v1/models", headers=headers) as resp:
                status = resp.status
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise Unavailable(f"front door at {target_url} unreachable: {exc}") from None
    if status == 401:
        raise Unavailable(f"front door at {target_url} refuses {'this' if api_key else 'a caller without an'} "
                          "API key (401): give one it serves with --api-key")


async def _prepare(target_url: str, trace_path: str | Path, requests: int | None, start: int,
                   window_s: float | None, tokens_per_block: int | None, seed: int | None,
                   api_key: str | None) -> tuple[TraceMapping, list[TraceRequest], int | None, dict[str, Any]]:
    """The mapping (vocabulary and by default ``tokens_per_block`` = the engines' block size,
    from ``/health``), the requests to replay (:func:`scheduler.trace.select_window`), the
    front door's ``max_model_len`` and the settings that say what was replayed. Raises
    Unavailable when the front door refuses ``api_key``."""
    info = await server_info(target_url)
    await check_api_key(target_url, api_key)
    tpb = tokens_per_block or int(info.get("block_size") or 16)
    block = int(info.get("block_size") or tpb)
    if tpb % block:
        log.warning("tokens_per_block %d is not a multiple of the engines' block size %d: trace "
                    "blocks and cache blocks will not align", tpb, block)
    kw = {} if seed is None else {"seed": seed}
    mapping = TraceMapping(tpb, int(info.get("vocab_size") or 512), **kw)
    whole = load_trace(trace_path, None if window_s is not None or requests is None else start + requests)
    trace = select_window(whole, start, requests or len(whole), window_s)
    limit = info.get("max_model_len")
    unique = len({h for r in trace for h in r.hash_ids})
    settings = {"trace": str(trace_path), "requests": len(trace), "start": start, "window_s": window_s,
                "selection": "contiguous" if window_s is None else "conversations with the most turns in the window",
                "distinct_trace_blocks": unique, "working_set_tokens": unique * mapping.tokens_per_block}
    return mapping, trace, int(limit) if limit else None, settings


def _write_json(json_path: str | Path | None, data: dict[str, Any]) -> None:
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")


async def run_replay(target_url: str, trace_path: str | Path, *, requests: int | None = None,
                     speed: float = 1.0, max_output_tokens: int = 32, tokens_per_block: int | None = None,
                     ttft_slo_s: float = DEFAULT_TTFT_SLO_S, tbt_slo_s: float = DEFAULT_TBT_SLO_S,
                     api_key: str | None = None, seed: int | None = None,
                     json_path: str | Path | None = None, start: int = 0, window_s: float | None = None,
                     prefix_cache: bool = True) -> Report:
    """Replay ``requests`` requests (all when None) of the trace at ``trace_path`` from request
    ``start`` on — consecutive ones, or with ``window_s`` the conversations with the most
    turns within ``window_s`` trace seconds (:func:`scheduler.trace.select_window`) —
    against the front door at ``target_url``; the vocabulary, the model's limit and (by
    default) ``tokens_per_block`` = the engines' block size come from its ``/health``.
    ``prefix_cache`` False: pool off. Writes the report as JSON to ``json_path`` when given.
    Raises Unavailable when the front door does not answer or refuses ``api_key``,
    InvalidArgument for a malformed trace or bad settings."""
    mapping, trace, limit, settings = await _prepare(target_url, trace_path, requests, start, window_s,
                                                     tokens_per_block, seed, api_key)
    report = await replay(target_url, trace, speed, max_output_tokens, mapping, ttft_slo_s=ttft_slo_s,
                          tbt_slo_s=tbt_slo_s, api_key=api_key, prefix_cache=prefix_cache, max_model_len=limit)
    report = dataclasses.replace(report, settings={**report.settings, **settings})
    _write_json(json_path, report.to_dict())
    return report


async def run_setup_replay(target_url: str, trace_path: str | Path,
                           snapshot: Callable[[], Awaitable[T]], *, requests: int | None = None,
                           speed: float = 1.0, max_output_tokens: int = 32, tokens_per_block: int | None = None,
                           ttft_slo_s: float = DEFAULT_TTFT_SLO_S, tbt_slo_s: float = DEFAULT_TBT_SLO_S,
                           api_key: str | None = None, seed: int | None = None, start: int = 0,
                           window_s: float | None = None) -> tuple[Report, T, T]:
    """One set-up's replay (launcher/vllm_setups.py): as :func:`run_replay` after one
    :data:`WARM_UP` request, not counted, with ``snapshot()`` taken just before and just after
    the replay (the instances' counters). Returns (report, before, after); raises as
    :func:`run_replay`."""
    mapping, trace, limit, settings = await _prepare(target_url, trace_path, requests, start, window_s,
                                                     tokens_per_block, seed, api_key)
    await replay(target_url, [WARM_UP], 1.0, 2, mapping, api_key=api_key, max_model_len=limit)
    before = await snapshot()
    report = await replay(target_url, trace, speed, max_output_tokens, mapping, ttft_slo_s=ttft_slo_s,
                          tbt_slo_s=tbt_slo_s, api_key=api_key, max_model_len=limit)
    after = await snapshot()
    return dataclasses.replace(report, settings={**report.settings, **settings}), before, after


async def run_comparison(target_url: str, trace_path: str | Path, *, requests: int | None = None,
                         speed: float = 1.0, max_output_tokens: int = 32, tokens_per_block: int | None = None,
                         ttft_slo_s: float = DEFAULT_TTFT_SLO_S, tbt_slo_s: float = DEFAULT_TBT_SLO_S,
                         api_key: str | None = None, seed: int | None = None,
                         json_path: str | Path | None = None, start: int = 0,
                         window_s: float | None = None) -> Comparison:
    """The same requests as :func:`run_replay` replayed twice on the same front door and
    engines: pool on, then pool off (every request sent with ``"prefix_cache": false``, so
    every prompt token is recomputed and no cache is read or written). One :data:`WARM_UP`
    request in each mode goes first, not counted (the first calls on fresh engines and
    connections are slow); then the pool-on run, on whatever the stack holds (cold, under
    ``kvstore up``), then the pool-off run. Writes :meth:`Comparison.to_dict` as JSON to ``json_path`` when
    given. Raises Unavailable when the front door does not answer, InvalidArgument for a
    malformed trace or bad settings, or when the front door served cached tokens to a
    request sent with the pool off (it does not honour ``prefix_cache``)."""
    mapping, trace, limit, settings = await _prepare(target_url, trace_path, requests, start, window_s,
                                                     tokens_per_block, seed, api_key)
    for prefix_cache in (True, False):
        await replay(target_url, [WARM_UP], 1.0, 2, mapping, api_key=api_key, prefix_cache=prefix_cache,
                     max_model_len=limit)
    runs = []
    for prefix_cache in (True, False):
        log.info("replay: %d requests with the pool %s", len(trace), "on" if prefix_cache else "off (recompute)")
        report = await replay(target_url, trace, speed, max_output_tokens, mapping, ttft_slo_s=ttft_slo_s,
                              tbt_slo_s=tbt_slo_s, api_key=api_key, prefix_cache=prefix_cache,
                              max_model_len=limit)
        runs.append(dataclasses.replace(report, settings={**report.settings, **settings}))
    pool, recompute = runs
    if recompute.cached_tokens:
        raise InvalidArgument(f"the front door at {target_url} served {recompute.cached_tokens} cached prompt "
                              "tokens to requests sent with \"prefix_cache\": false: it does not honour the "
                              "flag, so pool on and off cannot be compared")
    comparison = Comparison(pool, recompute, {k: v for k, v in pool.settings.items() if k != "prefix_cache"})
    _write_json(json_path, comparison.to_dict())
    return comparison
