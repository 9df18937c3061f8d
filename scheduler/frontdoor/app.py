"""Entry points the CLI calls: start (and stop) the front door, serve it until a signal,
replay a trace against it and print the report."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from engines.tokenizer import load_tokenizer
from kvstore.auth import ENGINE_TOKEN_ENV, STORE_TOKEN_ENV, token_from
from kvstore.errors import KVStoreError
from kvstore.port_hold import held
from scheduler.config import DEFAULT_HEAD_TIMEOUT_S, DEFAULT_IDLE_TIMEOUT_S, FrontdoorConfig
from scheduler.frontdoor.api_keys import load_api_keys, read_keys_file
from scheduler.frontdoor.connection_guard import ConnectionGuard, GuardedTCPSite
from scheduler.frontdoor.http_log import quiet_client_errors
from scheduler.frontdoor.server import Frontdoor
from scheduler.policy.admission import AdmissionConfig
from scheduler.policy.conductor import ConductorConfig
from scheduler.policy.registry import DEFAULT_POLICY
from scheduler.replay.compare import format_comparison
from scheduler.replay.report import format_report
from scheduler.replay.run import run_comparison, run_replay
from scheduler.routing.router import Router

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Frontdoor)   # a front door over the built-in engines or over vLLM


async def serve_app(router: Router[Any], make: Callable[[Any], F], model_dir: str | None, vocab_size: int,
                    host: str, port: int) -> tuple[F, web.AppRunner, int]:
    """What both front doors do once their router is connected: load the tokenizer, build the
    front door (``make(tokenizer)``), serve its aiohttp app on ``host:port`` and start its
    health checks. Returns the front door, its runner and the bound port; closes ``router``
    and re-raises when any of it fails (OSError: the port cannot be bound)."""
    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, model_dir, vocab_size)
        frontdoor = make(tokenizer)
        c = frontdoor.config
        guard = ConnectionGuard(c.max_connections, c.idle_timeout_s, c.head_timeout_s)
        app = frontdoor.app()
        app.middlewares.insert(0, guard.middleware)      # outermost: it sees every request's span
        quiet_client_errors()      # a client's malformed request: one DEBUG line, not a traceback
        # bodies are decoded by the handler that reads them (scheduler/frontdoor/content_encoding.py)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, auto_decompress=False)
        await runner.setup()
        # beside the hold of its supervisor (kvstore up) where it holds the port: kvstore/port_hold.py
        await GuardedTCPSite(runner, host, port, guard, reuse_port=held() or None).start()
        frontdoor.health_checks.start()
    except BaseException:
        await router.close()
        raise
    return frontdoor, runner, runner.addresses[0][1]


@dataclass
class RunningFrontdoor:
    """A started front door: ``runner`` (aiohttp), ``port`` (bound), ``frontdoor`` (its state),
    ``url`` (``http://host:port``)."""

    runner: web.AppRunner
    port: int
    frontdoor: Frontdoor
    url: str

    def __iter__(self) -> Iterator[Any]:
        """Unpacks as ``(runner, port)``."""
        return iter((self.runner, self.port))

    async def stop(self) -> None:
        """Stop serving, then close the engine and store clients."""
        await self.frontdoor.health_checks.stop()
        await self.runner.cleanup()
        self.frontdoor.parse_slots.close()
        await self.frontdoor.router.close()


async def start_frontdoor(prefill_addresses: Sequence[str], decode_addresses: Sequence[str],
                          store_address: str | None, host: str = "127.0.0.1", port: int = 0,
                          config: FrontdoorConfig | None = None,
                          store_redis: str | None = None) -> RunningFrontdoor:
    """Connect to the engines and the store node and serve HTTP on ``host:port`` (port 0 picks
    a free one). Must be awaited inside the event loop that will serve it.

    Args:
        prefill_addresses, decode_addresses: engine gRPC addresses (``host:port``), at least
            one of each.
        store_address: the store node's gRPC address (None: no pool lookups, local hits only).
        store_redis: instead, every store node registered in this Redis (kvstore/cluster).

    Raises:
        Unavailable: an engine did not answer within ``config.ready_timeout_s``.
        InvalidArgument: engine roles, models or layouts disagree; bad config.
        OSError: the port cannot be bound.
    """
    config = config or FrontdoorConfig()
    router = await Router.connect(prefill_addresses, decode_addresses, store_address, policy=config.policy,
                                  config=dataclasses.replace(config.conductor, admission=config.admission),
                                  store_auth_token=config.store_auth_token,
                                  kv_events=config.kv_events,
                                  decode_max_running=config.decode_max_running,
                                  decode_kv_capacity_tokens=config.decode_kv_capacity_tokens,
                                  ready_timeout_s=config.ready_timeout_s, store_redis=store_redis,
                                  engine_auth_token=config.engine_auth_token)
    frontdoor, runner, bound = await serve_app(
        router, lambda tokenizer: Frontdoor(router, tokenizer, config), config.model_dir,
        router.info.vocab_size, host, port)
    log.info("front door on http://%s:%d: %d prefill, %d decode engines (model %s)", host, bound,
             len(router.prefill), len(router.decode), router.info.model_id)
    log_api_keys(config)
    return RunningFrontdoor(runner, bound, frontdoor, f"http://{host}:{bound}")


def log_api_keys(config: FrontdoorConfig) -> None:
    """Say at start whether the front door takes API keys (a warning when it serves anyone)."""
    if config.api_keys:
        log.info("front door requires an API key (%d accepted) on every path but /health", len(config.api_keys))
    else:
        log.warning("front door takes no API keys (--api-key / --api-keys-file): every caller is served, "
                    "in the tenant its own bearer token names ('public' without one)")


# ---- adapters for launcher/cli.py (argparse namespaces in, exit codes out) ----

def config_from_args(args: argparse.Namespace) -> FrontdoorConfig:
    """The front door's config from ``kvstore scheduler`` / ``kvstore up`` flags
    (``--model``, ``--policy``, ``--max-inflight``, ``--max-inflight-per-tenant``, ``--admit-ttft-s``,
    ``--admit-tbt-s``, ``--max-model-len``,
    ``--decode-max-running``, ``--balancing-threshold``, ``--max-connections``,
    ``--idle-timeout-s``, ``--head-timeout-s``, ``--store-token``, ``--engine-token``
    — those two else from KVSTORE_STORE_TOKEN / KVSTORE_ENGINE_TOKEN —, ``--api-key``,
    ``--api-keys-file``, ``--kv-events`` else ``--redis``, ``--ready-timeout-s``); a flag not defined keeps its
    default. Raises ValueError / OSError for an API keys file that cannot be read or holds no
    key."""
    admit_tbt = getattr(args, "admit_tbt_s", None)
    api_keys = load_api_keys(getattr(args, "api_key", None) or (), getattr(args, "api_keys_file", None))
    max_inflight = getattr(args, "max_inflight", 64)
    per_tenant = getattr(args, "max_inflight_per_tenant", None)
    if per_tenant is None:    # several tenants (API keys): none may take more than half the slots
        per_tenant = max(1, max_inflight // 2) if api_keys and max_inflight > 0 else 0
    return FrontdoorConfig(model_dir=getattr(args, "model", None),
                           admission=AdmissionConfig(ttft_slo_s=getattr(args, "admit_ttft_s", 30.0),
                                                     max_inflight=max_inflight,
                                                     tbt_slo_s=admit_tbt if admit_tbt else math.inf,
                                                     max_inflight_per_tenant=per_tenant or None),
                           conductor=ConductorConfig(balancing_threshold=getattr(args, "balancing_threshold", 1.0)),
                           policy=getattr(args, "policy", None) or DEFAULT_POLICY,
                           decode_max_running=getattr(args, "decode_max_running", 64),
                           store_auth_token=token_from(getattr(args, "store_token", None), STORE_TOKEN_ENV),
                           engine_auth_token=token_from(getattr(args, "engine_token", None), ENGINE_TOKEN_ENV),
                           api_keys=api_keys, max_model_len=getattr(args, "max_model_len", None),
                           kv_events=getattr(args, "kv_events", None) or getattr(args, "redis", None),
                           max_connections=getattr(args, "max_connections", None),
                           idle_timeout_s=getattr(args, "idle_timeout_s", None) or DEFAULT_IDLE_TIMEOUT_S,
                           head_timeout_s=getattr(args, "head_timeout_s", None) or DEFAULT_HEAD_TIMEOUT_S,
                           ready_timeout_s=getattr(args, "ready_timeout_s", None) or FrontdoorConfig.ready_timeout_s)


def serve_until_signal(start: Callable[[], Awaitable[Any]], label: str = "") -> int:
    """Start a front door (``start()``: a coroutine returning a running front door with
    ``url`` and ``stop()``) and serve until SIGINT/SIGTERM; a stop that hangs is forced after
    its grace (kvstore/shutdown.py). Returns 0, or 1 when it cannot start."""
    from kvstore.shutdown import Shutdown
    shutdown = Shutdown("front door")

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal(name: str) -> None:
            shutdown.trigger(name)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig.name)
        running = await start()
        print(f"front door serving on {running.url}{label}", flush=True)
        try:
            await stop.wait()
        finally:
            await running.stop()
        return 0

    try:
        code = asyncio.run(main())
    except KVStoreError as exc:
        print(f"kvstore scheduler: {exc}", file=sys.stderr)
        return 1
    shutdown.exit(code)
    return code


def serve_frontdoor_forever(args: argparse.Namespace) -> int:
    """``kvstore scheduler``: serve until SIGINT/SIGTERM. Reads ``args.prefill`` and
    ``args.decode`` (comma-separated host:port), ``args.store``, ``args.host``, ``args.port``
    and the flags of :func:`config_from_args`. Returns 0, or 1 when it cannot start."""
    return serve_until_signal(lambda: start_frontdoor(_split(args.prefill), _split(args.decode), args.store or None,
                                                      args.host, args.port, config_from_args(args),
                                                      store_redis=getattr(args, "redis", None)))


def replay_and_report(url: str, trace_path: str, args: argparse.Namespace) -> int:
    """Replay ``trace_path`` against the front door at ``url`` with the replay flags in ``args``
    (``--requests``, ``--start``, ``--window-s``, ``--contiguous``, ``--speed``,
    ``--tokens-per-block``, ``--max-output-tokens``, ``--ttft-slo-s``, ``--tbt-slo-s``,
    ``--json``; ``--compare``: twice, pool on then off, side by side — scheduler/replay/compare.py;
    ``--plots DIR``: its PNGs), print the report. Returns 0, or 1 when the replay could not
    run or no request completed (in either run)."""
    window_s = None if getattr(args, "contiguous", False) else getattr(args, "window_s", None)
    kw: dict[str, Any] = {"requests": args.requests, "speed": args.speed, "max_output_tokens": args.max_output_tokens,
                          "tokens_per_block": args.tokens_per_block, "ttft_slo_s": args.ttft_slo_s,
                          "tbt_slo_s": args.tbt_slo_s, "json_path": getattr(args, "json", None),
                          "api_key": _replay_key(args), "start": getattr(args, "start", 0), "window_s": window_s}
    try:
        if getattr(args, "compare", False):
            comparison = asyncio.run(run_comparison(url, trace_path, **kw))
            reports = [comparison.pool, comparison.recompute]
            print(format_comparison(comparison), flush=True)
        else:
            report = asyncio.run(run_replay(url, trace_path, **kw))
            reports = [report]
            print(format_report(report), flush=True)
    except KVStoreError as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 1
    if getattr(args, "json", None):
        print(f"report written to {args.json}", flush=True)
    if getattr(args, "compare", False) and getattr(args, "plots", None):
        from scheduler.replay.plots import write_plots
        for path in write_plots(comparison, args.plots):
            print(f"plot written to {path}", flush=True)
    return 0 if all(r.completed or not r.requests_sent for r in reports) else 1


def _replay_key(args: argparse.Namespace) -> str | None:
    """The API key a replay sends: the first ``--api-key``, else the first of ``--api-keys-file``."""
    keys = getattr(args, "api_key", None)
    if keys:
        return keys if isinstance(keys, str) else keys[0]
    path = getattr(args, "api_keys_file", None)
    return read_keys_file(path)[0] if path else None


def replay_command(args: argparse.Namespace) -> int:
    """``kvstore replay --target URL --trace PATH``: see :func:`replay_and_report`."""
    return replay_and_report(args.target, args.trace, args)


def _split(addresses: str | Sequence[str]) -> list[str]:
    if isinstance(addresses, str):
        return [a.strip() for a in addresses.split(",") if a.strip()]
    return list(addresses)
