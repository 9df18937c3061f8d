"""``kvstore up`` over vLLM (the default engine; ``--engine builtin`` runs the built-in torch
engines, launcher/up.py): a store node, ``vllm serve`` processes with the kvstore connector and
the front door over them, then serving until Ctrl-C or a trace replay. ``--replay`` compares
three set-ups on the same requests (launcher/vllm_setups.py: vLLM alone, kvstore, recompute)
unless ``--no-compare``. Every process is supervised (:class:`launcher.supervisor.Stack`): one
that crashes is restarted with back-off, a vLLM instance on its own port with its own spec.

Topologies (``--topology``): ``colocated`` (the default) — ``--prefill-instances`` +
``--decode-instances`` instances, each kv_both (prefills and decodes, prefix reuse through
kvstore); ``disaggregated`` — that many kv_producer and kv_consumer instances. Colocated is
the default because it serves two CPU cores best: each instance uses its core for whatever
request it holds, where a prefill instance and a decode instance leave one core idle whenever
the load is all prefill or all decode, and every request then pays a save and a load of its
whole prompt's KV for the hand-off. Without ``--model`` the ``bench`` checkpoint is written
(once, :func:`default_checkpoint`; nothing is downloaded).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable

from engines.vllm.launch import BLOCK_SIZE
from kvstore.errors import Unavailable
from launcher.flags import json_object, positive_int, positive_seconds
from launcher.stack_record import forget_stack, record_stack
from launcher.supervisor import _serve_until_signal, release_front_door
from launcher.up import preflight, stack_tokens, write_api_keys


def add_vllm_up_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["vllm", "builtin"], default="vllm",
                   help="vllm: vllm serve instances with the kvstore connector; builtin: the torch engines of "
                        "engines/ (the reference the unit tests use)")
    p.add_argument("--topology", choices=["colocated", "disaggregated"], default="colocated",
                   help="with --engine vllm: each instance prefills and decodes (kv_both; serves 2 cores best), "
                        "or prefill and decode instances apart (kv_producer, kv_consumer)")
    p.add_argument("--vllm-kv-cache", default="320MiB",
                   help="with --engine vllm: each instance's own paged KV cache (the bench checkpoint's KV is "
                        "32 KiB a token: 320 MiB holds 10,240 tokens, a fifth of the demo's working set)")
    p.add_argument("--vllm-max-model-len", type=positive_int, default=8192,
                   help="with --engine vllm: context length (tokens; --max-model-len overrides it)")
    p.add_argument("--vllm-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="with --engine vllm: each kvstore instance's own prefix cache, with its KV events on a "
                        "private ipc:// socket so that the router sees what each instance holds "
                        "(--no-vllm-prefix-caching: every hit comes from the pool)")


def add_vllm_scheduler_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-prefill", nargs="+", metavar="URL", help="vLLM prefill instances (kv_producer), "
                   "http://host:port each; with --vllm-decode instead of --prefill/--decode")
    p.add_argument("--vllm-decode", nargs="+", metavar="URL", help="vLLM decode instances (kv_consumer)")
    p.add_argument("--vllm-colocated", nargs="+", metavar="URL",
                   help="vLLM instances that prefill and decode (kv_both): the colocated topology")
    p.add_argument("--vllm-block-size", type=int, default=32, help="the vLLM instances' --block-size")
    p.add_argument("--vllm-quantization", metavar="METHOD",
                   help="the vLLM instances' --quantization, when they quantize at load (e.g. fp8): their "
                        "connectors key it, and the front door's keys must agree with theirs")
    p.add_argument("--vllm-hf-overrides", type=json_object, metavar="JSON",
                   help="the vLLM instances' --hf-overrides (a JSON object): their connectors key it, and the "
                        "front door's keys must agree with theirs")
    p.add_argument("--vllm-kv-events", nargs="+", metavar="PUB[,REPLAY]",
                   help="the prefill (or colocated) instances' KV-event endpoints, one each in their order: "
                        "vLLM's --kv-events-config endpoint and replay_endpoint (ipc://PATH or tcp://HOST:PORT); "
                        "the router then sees each instance's own prefix cache, not only the pool's hits. The "
                        "events carry prompt tokens and vLLM's sockets take no credentials: use ipc:// in a "
                        "directory only this user can open, not TCP")
    p.add_argument("--ready-timeout-s", type=positive_seconds, default=60.0, metavar="S",
                   help="wait this long for every engine or vLLM instance to answer before giving up (kvstore up "
                        "starts the front door beside its instances and gives it their start-up timeout)")


def _vllm_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the vLLM flags (checked before anything starts), or None."""
    from kvstore.config import parse_bytes
    if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"--model {args.model}: not a checkpoint directory (no config.json there)"
    try:
        if parse_bytes(args.vllm_kv_cache) <= 0:
            return f"--vllm-kv-cache {args.vllm_kv_cache}: must be more than 0 bytes"
    except ValueError as exc:
        return f"--vllm-kv-cache: {exc}"
    return None


def default_checkpoint(max_model_len: int) -> str:
    """The ``bench`` checkpoint (engines/vllm/checkpoint.py: a random-weight Llama of 8 layers,
    hidden 512; nothing downloaded), written once to ``$XDG_CACHE_HOME/kvstore/checkpoints``
    (``~/.cache`` without it) and kept there: large enough that recomputing a prefix costs
    clearly more than loading it on a CPU, small enough to serve a trace on two cores."""
    from engines.vllm.checkpoint import write_checkpoint
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(cache, "kvstore", "checkpoints", "bench-llama")
    return write_checkpoint(path, "bench", max_model_len=max(16384, max_model_len))


def run_up_vllm(args: argparse.Namespace) -> int:
    # vLLM's instances run from the repository's root (engines/vllm/launch.py), so a path
    # relative to the caller's directory would name another file there, or be taken for a
    # Hugging Face repo id: every path handed down is made absolute here.
    args.data_dir = os.path.abspath(args.data_dir)
    if args.model and os.path.exists(args.model):
        args.model = os.path.abspath(args.model)
    problem = _vllm_problem(args)
    if problem:
        print(f"kvstore up: {problem}", file=sys.stderr)
        return 2
    http_port = preflight(args)
    if http_port is None:
        return 2
    try:
        return _run(args, http_port)
    finally:
        release_front_door()   # held since the preflight, across the set-ups


def _run(args: argparse.Namespace, http_port: int) -> int:
    model = args.model or default_checkpoint(args.vllm_max_model_len)
    # Nothing it starts serves a caller without a token: the store takes KVSTORE_STORE_TOKEN,
    # the vLLM instances the engines' token as their API key (only the front door sets a
    # request's cache_salt, its tenant), both through the environment.
    tokens = stack_tokens(args.data_dir)
    keys_file = write_api_keys(args)
    if args.replay and args.tokens_per_block % BLOCK_SIZE:
        print(f"replay: {BLOCK_SIZE} tokens per trace block (vLLM's block size), not "
              f"{args.tokens_per_block}", flush=True)
        args.tokens_per_block = BLOCK_SIZE
    if args.replay and args.compare:
        from launcher.vllm_compare import compare_setups
        return _stopping_on_signal(lambda: compare_setups(args, model, http_port, tokens, keys_file))
    return _stopping_on_signal(lambda: _serve_kvstore(args, model, http_port, tokens, keys_file))


def _stopping_on_signal(run: Callable[[], int]) -> int:
    """``run()``, where SIGTERM, as SIGINT, unwinds once to the ``finally`` that stops every
    service (the vLLM instances run in sessions of their own: nothing else would stop them)
    and a signal during that stop is ignored, so that it runs to its end. Returns ``run()``'s
    code, 130 after a signal."""
    stopping: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        if not stopping:
            stopping.append(signum)
            raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run()
    except KeyboardInterrupt as exc:
        print(f"kvstore up: {exc or 'SIGINT'}: stopped", flush=True)
        return 130
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _key_spec(model: str, dtype: str | None) -> dict:
    """What the instances' keys are made of, for kvctl lookup (they run with neither
    ``--quantization`` nor ``--hf-overrides``): the checkpoint, its tokenizer, the key extras."""
    from scheduler.vllm.instances import VLLMModel
    return {"model": model, "block_size": BLOCK_SIZE, "dtype": dtype,
            "key_spec": VLLMModel.from_dir(model, BLOCK_SIZE, dtype).key_spec()}


def _serve_kvstore(args: argparse.Namespace, model: str, http_port: int, tokens: dict[str, str],
                   keys_file: str | None) -> int:
    """The kvstore set-up alone: serve until Ctrl-C, or replay once (``--no-compare``)."""
    from launcher.vllm_setups import SETUPS, start_setup
    up_record: str | None = None
    running = None
    try:
        running = start_setup(args, SETUPS["kvstore"], model, http_port, tokens, keys_file,
                              os.path.join(args.data_dir, "logs"))
        print(f"front door     {running.url}  over vLLM ({args.topology}; GET /metrics, GET /status)", flush=True)
        up_record = record_stack([running.store or ""], [], running.url, args.data_dir, None,
                                 _key_spec(model, running.servers[0].spec.dtype))
        print(f"started in {running.startup_s:.1f} s; logs in {running.stack.log_dir}", flush=True)
        if not args.replay:
            print("serving; Ctrl-C stops everything", flush=True)
            _serve_until_signal(running.stack)
            return 0
        from scheduler.frontdoor.app import replay_and_report
        return replay_and_report(running.url, args.replay, args)
    except (RuntimeError, Unavailable) as exc:
        print(f"kvstore up: {exc}", file=sys.stderr)
        return 1
    finally:
        forget_stack(up_record)
        if running is not None:
            running.stop()
        print("stopped all services", flush=True)
