"""Entry points for the front door over vLLM instances: start (and stop) it in an event loop,
and ``kvstore scheduler --vllm-prefill URL... --vllm-decode URL...`` (or ``--vllm-colocated``)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from kvstore.errors import InvalidArgument
from scheduler.config import FrontdoorConfig
from scheduler.frontdoor.app import log_api_keys, serve_app
from scheduler.frontdoor.tasks import cancel_and_wait
from scheduler.vllm.frontdoor import VLLMFrontdoor
from scheduler.vllm.instances import VLLMModel
from scheduler.vllm.router import connect_vllm

log = logging.getLogger(__name__)


@dataclass
class RunningVLLMFrontdoor:
    """A started front door over vLLM: ``runner`` (aiohttp), ``port``, ``frontdoor``,
    ``url``, ``watcher`` (the task polling the instances' ``/metrics``)."""

    runner: web.AppRunner
    port: int
    frontdoor: VLLMFrontdoor
    url: str
    watcher: asyncio.Task

    async def stop(self) -> None:
        await self.frontdoor.health_checks.stop()
        await cancel_and_wait(self.watcher)
        await self.runner.cleanup()
        self.frontdoor.parse_slots.close()
        await self.frontdoor.router.close()


async def start_vllm_frontdoor(model_dir: str, prefill_urls: Sequence[str] = (), decode_urls: Sequence[str] = (),
                               store_address: str | None = None, host: str = "127.0.0.1", port: int = 0,
                               config: FrontdoorConfig | None = None, *, topology: str = "disaggregated",
                               colocated_urls: Sequence[str] = (), block_size: int = 32,
                               store_redis: str | None = None, watch_interval_s: float = 0.5,
                               kv_events: Sequence[str] = (), quantization: str | None = None,
                               hf_overrides: dict | None = None) -> RunningVLLMFrontdoor:
    """Connect to running vLLM instances (``http://host:port``) and the store node, serve HTTP
    on ``host:port`` (0: a free port). ``model_dir``: the checkpoint the instances serve (its
    tokenizer, and its config for the keys); ``block_size``: the instances' ``--block-size``;
    ``kv_events``: the prefill instances' KV-event endpoints (:func:`connect_vllm`);
    ``config.kv_events``: the Redis of the store nodes' KV events (``--kv-events``, else
    ``--redis``): the pool's hits then come from the router's replica of their indexes;
    ``quantization``, ``hf_overrides``: the instances' ``--quantization`` and
    ``--hf-overrides``, which their connectors key (the front door's keys must agree).

    Raises:
        Unavailable: an instance did not answer within ``config.ready_timeout_s``.
        InvalidArgument: no checkpoint at ``model_dir``, a bad topology or config.
        OSError: the port cannot be bound.
    """
    if not model_dir:
        raise InvalidArgument("the front door over vLLM needs --model DIR: the checkpoint the instances serve")
    config = config or FrontdoorConfig(model_dir=model_dir)
    model = VLLMModel.from_dir(model_dir, block_size, quantization=quantization, hf_overrides=hf_overrides)
    # vLLM runs prefill chunks in its decode steps; T_prefill beyond the prompts measured follows the model's FLOPs
    conductor = dataclasses.replace(config.conductor, chunked_prefill=True)
    if not conductor.prefill.attention_ratio:
        conductor = dataclasses.replace(conductor, prefill=dataclasses.replace(
            conductor.prefill, attention_ratio=model.attention_ratio))
    router = await connect_vllm(model, prefill_urls, decode_urls, store_address, topology=topology,
                                colocated_urls=colocated_urls, policy=config.policy,
                                config=dataclasses.replace(conductor, admission=config.admission),
                                store_auth_token=config.store_auth_token,
                                decode_max_running=config.decode_max_running,
                                decode_kv_capacity_tokens=config.decode_kv_capacity_tokens,
                                ready_timeout_s=config.ready_timeout_s, store_redis=store_redis,
                                api_key=config.engine_auth_token, kv_events=kv_events,
                                store_events=config.kv_events)
    frontdoor, runner, bound = await serve_app(
        router, lambda tokenizer: VLLMFrontdoor(router, tokenizer, config), model_dir, model.vocab_size, host, port)
    watcher = asyncio.get_running_loop().create_task(router.watch(watch_interval_s))
    log.info("front door on http://%s:%d over vLLM (%s): %d prefill, %d decode instances", host, bound,
             topology, len(router.prefill), len(router.decode))
    log_api_keys(config)
    return RunningVLLMFrontdoor(runner, bound, frontdoor, f"http://{host}:{bound}", watcher)


def serve_vllm_frontdoor_forever(args: argparse.Namespace) -> int:
    """``kvstore scheduler --vllm-prefill ... --vllm-decode ...`` (or ``--vllm-colocated``):
    serve until SIGINT/SIGTERM. Returns 0, or 1 when it cannot start."""
    from scheduler.frontdoor.app import _split, config_from_args, serve_until_signal
    colocated = _split(args.vllm_colocated or "")
    return serve_until_signal(lambda: start_vllm_frontdoor(
        args.model, _split(args.vllm_prefill or ""), _split(args.vllm_decode or ""), args.store or None,
        args.host, args.port, config_from_args(args), topology="colocated" if colocated else "disaggregated",
        colocated_urls=colocated, block_size=args.vllm_block_size, store_redis=getattr(args, "redis", None),
        kv_events=_split(getattr(args, "vllm_kv_events", None) or ""),
        quantization=getattr(args, "vllm_quantization", None), hf_overrides=getattr(args, "vllm_hf_overrides", None)),
        " over vLLM")
