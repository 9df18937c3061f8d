"""``kvstore up --engine vllm``: the stack with vLLM instances instead of the built-in engines —
a store node, ``vllm serve`` processes with the kvstore connector and the front door over
them (``kvstore scheduler --vllm-prefill ... --vllm-decode ...``), then a replay or serving
until Ctrl-C. Every process is supervised (:class:`launcher.supervisor.Stack`): one that
crashes is restarted with back-off, a vLLM instance on its own port with its own spec.

Topologies (``--topology``): ``disaggregated`` — ``--prefill-instances`` kv_producer and
``--decode-instances`` kv_consumer instances; ``colocated`` — as many instances in all, each
kv_both (prefills and decodes, prefix reuse through kvstore). Without ``--model`` a tiny
random Llama checkpoint is written under ``--data-dir`` (nothing is downloaded).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from kvstore.auth import ENGINE_TOKEN_ENV, STORE_TOKEN_ENV
from kvstore.errors import Unavailable
from launcher.flags import connection_flags, json_object
from launcher.supervisor import Stack, _serve_until_signal, _wait_grpc, _wait_http, port_taker
from launcher.up import forget_stack, preflight, record_stack, stack_tokens, write_api_keys


def add_vllm_up_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=["builtin", "vllm"], default="builtin",
                   help="builtin: the torch engines of engines/; vllm: vllm serve instances with the kvstore connector")
    p.add_argument("--topology", choices=["disaggregated", "colocated"], default="disaggregated",
                   help="with --engine vllm: prefill and decode instances apart, or each instance doing both")
    p.add_argument("--vllm-kv-cache", default="256MiB", help="with --engine vllm: each instance's own paged KV cache")
    p.add_argument("--vllm-max-model-len", type=int, default=8192, help="with --engine vllm: context length (tokens)")
    p.add_argument("--vllm-prefix-caching", action="store_true",
                   help="with --engine vllm: turn on each instance's own prefix cache (off by default: every hit "
                        "comes from the pool) and its KV events, on a private ipc:// socket, so that the "
                        "router sees what each prefill instance holds")


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


def run_up_vllm(args: argparse.Namespace) -> int:
    from engines.vllm.launch import VLLMServerSpec, ipc_endpoints, start_servers
    from kvstore.config import parse_bytes
    # vLLM's instances run from the repository's root (engines/vllm/launch.py), so a path
    # relative to the caller's directory would name another file there, or be taken for a
    # Hugging Face repo id: every path handed down is made absolute here.
    args.data_dir = os.path.abspath(args.data_dir)
    if args.model and os.path.exists(args.model):
        args.model = os.path.abspath(args.model)
    host = args.host
    http_port = preflight(args)
    if http_port is None:
        return 2
    n_prefill, n_decode = args.prefill_instances, args.decode_instances
    stack = Stack(log_dir=os.path.join(args.data_dir, "logs"))
    model = args.model
    if not model:
        from engines.vllm.checkpoint import write_checkpoint
        model = write_checkpoint(os.path.join(args.data_dir, "tiny-llama"), "tiny",
                                 max_model_len=args.vllm_max_model_len)
    # Nothing it starts serves a caller without a token: the store takes KVSTORE_STORE_TOKEN,
    # the vLLM instances the engines' token as their API key (only the front door sets a
    # request's cache_salt, its tenant), both through the environment.
    stack.env.update(stack_tokens(args.data_dir))
    keys_file = write_api_keys(args)
    take_port = port_taker(host, getattr(args, "service_ports", 0), frozenset({http_port}))
    store_port = take_port()
    store = f"{host}:{store_port}"
    if args.topology == "colocated":
        roles = [("colocated", "kv_both")] * (n_prefill + n_decode)
    else:
        roles = [("prefill", "kv_producer")] * n_prefill + [("decode", "kv_consumer")] * n_decode
    names = [f"vllm-{kind}-{sum(k == kind for k, _ in roles[:i])}" for i, (kind, _) in enumerate(roles)]
    events_dir = os.path.join(args.data_dir, "kv-events")     # the events carry prompt tokens: 0700
    if args.vllm_prefix_caching:
        os.makedirs(events_dir, mode=0o700, exist_ok=True)
        os.chmod(events_dir, 0o700)
    specs = [VLLMServerSpec(model, take_port(), role, store, host=host,
                            kv_cache_bytes=parse_bytes(args.vllm_kv_cache), max_model_len=args.vllm_max_model_len,
                            store_token=stack.env[STORE_TOKEN_ENV], api_key=stack.env[ENGINE_TOKEN_ENV],
                            prefix_caching=args.vllm_prefix_caching,
                            kv_events=ipc_endpoints(events_dir, name) if args.vllm_prefix_caching and
                            kind != "decode" else None)
             for name, (kind, role) in zip(names, roles)]
    servers = []
    up_record: str | None = None
    t0 = time.monotonic()
    try:
        metrics_port = take_port()
        stack.start("store", "serve", "--host", host, "--port", str(store_port), "--dram", args.dram,
                    "--ssd", args.ssd, "--data-dir", os.path.join(args.data_dir, "store"), "--node-id", "store",
                    "--metrics-port", str(metrics_port))
        _wait_grpc(stack, store, 60)
        print(f"store node     {store}  (DRAM {args.dram}, SSD {args.ssd}; metrics "
              f"http://{host}:{metrics_port}/metrics)", flush=True)
        servers = start_servers(specs, stack.log_dir, names, timeout_s=600)
        for name, server in zip(names, servers):
            # supervised as the other children: a crashed instance is restarted on its port
            # (the front door routes around it meanwhile and takes it back once it answers)
            stack.adopt(name, server.proc, respawn=server.restart)
            print(f"vLLM {server.spec.role:<11} {name} {server.url} (pid {server.proc.pid})", flush=True)
        urls = {kind: [s.url for (k, _), s in zip(roles, specs) if k == kind]
                for kind in ("prefill", "decode", "colocated")}
        flags = (["--vllm-colocated", *urls["colocated"]] if args.topology == "colocated"
                 else ["--vllm-prefill", *urls["prefill"], "--vllm-decode", *urls["decode"]])
        events = [",".join(s.kv_events) for s in specs if s.kv_events]
        if events:
            flags += ["--vllm-kv-events", *events]
        stack.start("scheduler", "scheduler", *flags, "--store", store, "--host", host, "--port", str(http_port),
                    "--model", model, "--max-inflight", str(args.max_inflight),
                    *([] if args.max_inflight_per_tenant is None else
                      ["--max-inflight-per-tenant", str(args.max_inflight_per_tenant)]),
                    *connection_flags(args),
                    "--admit-ttft-s", str(args.admit_ttft_s),
                    "--admit-tbt-s", str(args.admit_tbt_s), "--policy", args.policy,
                    "--decode-max-running", str(args.decode_max_running),
                    "--balancing-threshold", str(args.balancing_threshold),
                    *(["--api-keys-file", keys_file] if keys_file else []))
        url = f"http://{host}:{http_port}"
        _wait_http(stack, f"{url}/health", 120)
        print(f"front door     {url}  over vLLM ({args.topology}; GET /metrics, GET /status)", flush=True)
        up_record = record_stack([store], [], url, args.data_dir, None)   # kvctl finds the store node here
        print(f"started in {time.monotonic() - t0:.1f} s; logs in {stack.log_dir}", flush=True)
        if not args.replay:
            print("serving; Ctrl-C stops everything", flush=True)
            _serve_until_signal(stack)
            return 0
        from scheduler.app import replay_and_report
        if args.tokens_per_block % specs[0].block_size:
            print(f"replay: {specs[0].block_size} tokens per trace block (vLLM's block size), not "
                  f"{args.tokens_per_block}", flush=True)
            args.tokens_per_block = specs[0].block_size
        if args.compare:   # the vLLM front door refuses "prefix_cache": false
            print("replay: pool on only (vLLM instances always reuse the pool through the connector)", flush=True)
            args.compare = False
        return replay_and_report(url, args.replay, args)
    except (RuntimeError, Unavailable) as exc:
        print(f"kvstore up: {exc}", file=sys.stderr)
        return 1
    finally:
        forget_stack(up_record)
        stack.stop()
        for server in servers:
            server.stop(grace_s=10)
        print("stopped all services", flush=True)
