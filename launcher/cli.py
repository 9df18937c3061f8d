"""kvstore: run a store node, an engine, the scheduler, or the whole stack on one host.

    kvstore serve      a store node (DRAM + SSD tiers) with its gRPC API
    kvstore engine     a prefill or decode engine (gRPC) around a torch model
    kvstore scheduler  the HTTP front door (OpenAI-compatible) and router
    kvstore up         all of the above on one host; with --replay, replay a trace and report
    kvstore replay     replay a trace against a running front door and report
    kvstore simulate   replay a trace on a simulated cluster (cost-model engines, real scheduler)
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from engines.types import ROLES
from kvstore import __version__
from kvstore.config import StoreConfig, positive_int
from kvstore.errors import KVStoreError
from kvstore.shutdown import Shutdown
from launcher.flags import (
    add_api_key_flags,
    add_replay_flags,
    add_scheduler_flags,
    add_serve_flags,
    addresses,
    env_events,
    env_redis,
    http_url,
    port_number,
    tier_size_flags,
)
from launcher.up_vllm import add_vllm_scheduler_flags, add_vllm_up_flags

log = logging.getLogger("kvstore")
# kvstore up's engines and front door: room for the demo's longest prompt (15162 tokens at 64
# tokens per trace block) and its output
UP_MAX_MODEL_LEN = 16384
# The vendored trace, found from the checkout whatever the working directory.
DEFAULT_TRACE = str(Path(__file__).resolve().parent.parent / "data" / "traces" / "conversation_trace.jsonl")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None or the help text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action) or ""


def _formatter(prog: str) -> argparse.HelpFormatter:
    return _Formatter(prog, max_help_position=36)




def _wait_for_signal(name: str) -> Shutdown:
    """Until SIGTERM/SIGINT; the stop that follows is bounded (kvstore/shutdown.py): the
    caller stops, then ends with the returned Shutdown's ``exit``."""
    shutdown = Shutdown(name).install()
    shutdown.wait()
    return shutdown


def cmd_serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from kvstore.auth import STORE_TOKEN_ENV, token_from
    from kvstore.node import StoreNode
    sizes = {f"{k}_bytes": getattr(args, f"{k}_bytes") for k in tier_size_flags()}
    cfg = StoreConfig.load(args.config, node_id=args.node_id, host=args.host, port=args.port,
                           data_dir=args.data_dir, tiers=args.tier, **sizes,
                           ssd_fsync=args.ssd_fsync, auth_token=args.auth_token,
                           redis_url=args.redis or env_events(),
                           hbm_device=args.hbm_device, eviction_policy=args.policy,
                           high_watermark=args.high_watermark, low_watermark=args.low_watermark,
                           lease_ttl_s=args.lease_ttl, reservation_timeout_s=args.reservation_timeout,
                           heartbeat_s=args.heartbeat, node_ttl_s=args.node_ttl,
                           transfer_engine=args.transfer_engine, te_metadata=args.te_metadata,
                           te_staging_bytes=args.te_staging,
                           advertise_host=args.advertise_host, dataplane_socket=args.dataplane_socket,
                           control_port=args.control_port, dataplane_poll_us=args.dataplane_poll_us,
                           dram_prefault=args.dram_prefault, ssd_on_error=args.ssd_on_error,
                           metrics_port=args.metrics_port)
    if not cfg.auth_token and token_from(None, STORE_TOKEN_ENV):   # flag, then file, then environment
        cfg = replace(cfg, auth_token=token_from(None, STORE_TOKEN_ENV))
    node = StoreNode.start(cfg)
    pool, port = node.pool, node.port
    from kvstore.shutdown import leave_nothing  # a forced exit unlinks these
    from kvstore.tiers.dram import DramTier
    leave_nothing(cfg.dataplane_socket_path(),
                  *(f"/dev/shm/{t.shm_name}" for t in pool.tiers if isinstance(t, DramTier)))
    tiers = ", ".join(f"{s.name} {s.capacity_bytes / 2**20:.0f} MiB ({s.used_bytes / 2**20:.1f} used)"
                      for s in pool.stats())
    print(f"store node {cfg.node_id} serving on {cfg.host}:{port}: {tiers}", flush=True)
    if node.metrics_url:
        print(f"store node {cfg.node_id} metrics on {node.metrics_url}", flush=True)
    shutdown = _wait_for_signal(f"store node {cfg.node_id}")
    node.stop()
    if "kvstore.transfer.engine" in sys.modules:   # unregister from the metadata service
        sys.modules["kvstore.transfer.engine"].shutdown_engines()
    shutdown.exit(0)
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from engines.server import start_engine
    from kvstore.auth import ENGINE_TOKEN_ENV, STORE_TOKEN_ENV, token_from
    server, port = start_engine(args.role, args.store, model_dir=args.model, block_size=args.block_size,
                                address=f"{args.host}:{args.port}", engine_id=args.engine_id,
                                dtype=args.dtype, device=args.device,
                                local_cache_blocks=args.local_cache_blocks,
                                store_token=token_from(args.store_token, STORE_TOKEN_ENV),
                                store_redis=args.redis, kv_events=args.kv_events or args.redis,
                                auth_token=token_from(args.auth_token, ENGINE_TOKEN_ENV),
                                metrics_port=args.metrics_port, max_model_len=args.max_model_len,
                                profile=args.profile, profile_lock=args.profile_lock)
    print(f"{args.role} engine serving on {args.host}:{port}", flush=True)
    from engines.server import metrics_url
    if metrics_url(server):
        print(f"{args.role} engine metrics on {metrics_url(server)}", flush=True)
    shutdown = _wait_for_signal(f"{args.role} engine")
    server.stop(grace=2).wait()
    shutdown.exit(0)
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    if args.store is None:      # --no-store: no pool at all, neither one node nor a cluster's Redis
        if args.redis and args.redis != env_redis():
            print("kvstore scheduler: --no-store and --redis contradict each other (no pool, or the cluster's "
                  "pool): give one", file=sys.stderr)
            return 2
        args.redis = None
    from launcher.supervisor import port_is_free
    if args.port and not port_is_free(args.host, args.port):   # before waiting for its engines
        print(f"kvstore scheduler: port {args.port} on {args.host} is in use; pick another with --port",
              file=sys.stderr)
        return 2
    if args.vllm_prefill or args.vllm_decode or args.vllm_colocated:
        from scheduler.vllm.app import serve_vllm_frontdoor_forever
        return serve_vllm_frontdoor_forever(args)
    if not args.prefill or not args.decode:
        print("kvstore scheduler: give --prefill and --decode (engines), or --vllm-prefill and "
              "--vllm-decode (or --vllm-colocated) URLs", file=sys.stderr)
        return 2
    from scheduler.frontdoor.app import serve_frontdoor_forever
    return serve_frontdoor_forever(args)


def cmd_up(args: argparse.Namespace) -> int:
    vllm = up_defaults(args)
    if vllm:
        from launcher.up_vllm import run_up_vllm
        return run_up_vllm(args)
    from launcher.up import run_up
    return run_up(args)


def up_defaults(args: argparse.Namespace) -> bool:
    """Fill in ``kvstore up``'s defaults that depend on the engine; returns whether it is vLLM."""
    vllm = args.engine == "vllm"
    if args.dram is None:
        args.dram = "2GiB" if vllm else "256MiB"
    if args.tokens_per_block is None:
        args.tokens_per_block = 32 if vllm else 64
    if args.speed is None:    # over vLLM: the window's load is about what two CPU cores serve
        args.speed = 2.0 if vllm else 4.0
    if args.max_model_len is None:
        args.max_model_len = args.vllm_max_model_len if vllm else UP_MAX_MODEL_LEN
    elif vllm:                # one limit: the instances' context length is the front door's
        args.vllm_max_model_len = args.max_model_len
    return vllm


def cmd_replay(args: argparse.Namespace) -> int:
    from scheduler.frontdoor.app import replay_command
    return replay_command(args)


def cmd_simulate(args: argparse.Namespace) -> int:
    from scheduler.sim.command import simulate_command
    return simulate_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description=(__doc__ or "").replace("``", "`"),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="what the services log to stderr (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_serve(sub)
    _add_engine(sub)
    _add_scheduler(sub)
    _add_up(sub)
    _add_replay(sub)
    _add_simulate(sub)
    return parser


def _add_serve(sub: Any) -> None:
    """``kvstore serve``: run a store node."""
    p = sub.add_parser("serve", help="run a store node",
                       description="Run a store node: a DRAM tier (shared-memory slab) over an SSD "
                                   "tier (LMDB), behind the gRPC API of protos/kvstore.proto.")
    add_serve_flags(p)
    p.set_defaults(func=cmd_serve)


def _add_engine(sub: Any) -> None:
    """``kvstore engine``: run a prefill or decode engine."""
    p = sub.add_parser("engine", help="run a prefill or decode engine", formatter_class=_formatter,
                       description="Run a prefill or decode engine around a transformers causal LM "
                                   "(the tiny seeded Llama unless --model is given).")
    p.add_argument("--role", choices=ROLES, required=True,
                   help="prefill computes prompts and publishes blocks; decode loads them and generates")
    p.add_argument("--store", type=addresses, default="127.0.0.1:50051", help="store node address host:port")
    p.add_argument("--store-token", help="bearer token for the store node (default: KVSTORE_STORE_TOKEN)")
    p.add_argument("--auth-token", help="require this bearer token from callers (the front door's "
                   "--engine-token; default: KVSTORE_ENGINE_TOKEN; none: any caller may run requests "
                   "in any namespace, and the engine warns)")
    p.add_argument("--redis", metavar="URL", default=env_redis(), help="use every store node registered "
                   "in this Redis (cluster mode) instead of --store (default: KVSTORE_REDIS_URL)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port_number, default=0, help="gRPC port (0 picks a free one)")
    p.add_argument("--engine-id", help="engine id: how the front door, metrics and KV events name it "
                   "(default <role>-<host name>-<port>, the same across restarts)")
    p.add_argument("--model", metavar="DIR", help="local Hugging Face checkpoint (default: tiny seeded Llama)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                   help="model and KV dtype (part of every block key)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:1, ...")
    p.add_argument("--local-cache-blocks", type=int, default=4096, help="blocks in the engine's own prefix cache")
    p.add_argument("--metrics-port", type=port_number, metavar="PORT",
                   help="serve Prometheus metrics on GET /metrics at this port of --host (0 picks a free one); "
                        "it takes the engine's --auth-token when one is set (default: no metrics port)")
    p.add_argument("--kv-events", metavar="URL", default=env_events(),
                   help="publish the own cache's KV events to this Redis, where the scheduler reads them "
                        "(default: KVSTORE_EVENTS_URL, else --redis; with neither: publish nothing)")
    p.add_argument("--max-model-len", type=positive_int, default=4096,
                   help="longest prompt + generation served, tokens (a checkpoint's max_position_embeddings "
                        "caps it); a longer request is refused (INVALID_ARGUMENT)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="before serving, time a few prefills (a prefill engine) or decode steps (a decode "
                        "engine) of random tokens, sized by --max-model-len, and report them in Info: the "
                        "front door seeds its T_prefill and TBT predictors from them (0.1 s on the tiny CPU "
                        "model; --no-profile: the front door keeps its built-in seeds)")
    p.add_argument("--profile-lock", metavar="FILE",
                   help="run the profiling pass holding an exclusive lock on FILE (created if missing): "
                        "engines of one host given the same FILE profile one at a time instead of slowing "
                        "one another's timings (kvstore up gives its engines one)")
    p.set_defaults(func=cmd_engine)


def _add_scheduler(sub: Any) -> None:
    """``kvstore scheduler``: run the HTTP front door."""
    p = sub.add_parser("scheduler", help="run the HTTP front door", formatter_class=_formatter,
                       description="Run the scheduler's HTTP front door (OpenAI-compatible "
                                   "/v1/completions and /v1/chat/completions, /v1/models, /health, "
                                   "/metrics, /status) over running engines.")
    p.add_argument("--prefill", type=addresses, help="prefill engine addresses host:port, comma-separated")
    p.add_argument("--decode", type=addresses, help="decode engine addresses host:port, comma-separated")
    p.add_argument("--store", type=addresses, default="127.0.0.1:50051", help="store node address host:port")
    p.add_argument("--no-store", dest="store", action="store_const", const=None,
                   help="no pool: vLLM instances served without the kvstore connector (plain vLLM behind the "
                        "front door's routing and admission); KVSTORE_REDIS_URL is then ignored, --redis refused")
    p.add_argument("--redis", metavar="URL", default=env_redis(), help="look up blocks across every store "
                   "node registered in this Redis (cluster mode) instead of --store (default: KVSTORE_REDIS_URL)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port (0 picks a free one)")
    p.add_argument("--store-token", help="bearer token for the store node (if it requires one; "
                   "default: KVSTORE_STORE_TOKEN)")
    p.add_argument("--engine-token", help="bearer token for the engines (their --auth-token; default: "
                   "KVSTORE_ENGINE_TOKEN)")
    p.add_argument("--kv-events", metavar="URL", default=env_events(),
                   help="keep a replica of the store's and the prefill engines' indexes from the KV events "
                        "in this Redis, over vLLM too (default: KVSTORE_EVENTS_URL, else --redis; with neither: "
                        "pool hits by lookup, no built-in engine's own cache seen)")
    add_api_key_flags(p)
    p.add_argument("--model", metavar="DIR", help="checkpoint whose tokenizer to use (default: byte-level)")
    p.add_argument("--max-model-len", type=positive_int, metavar="TOKENS",
                   help="refuse (400 context_length_exceeded) a request whose prompt + max_tokens exceed this "
                        "(default: the engines' limit, which also caps it)")
    add_scheduler_flags(p)
    add_vllm_scheduler_flags(p)
    p.set_defaults(func=cmd_scheduler)


def _add_up(sub: Any) -> None:
    """``kvstore up``: run the whole stack on this host."""
    p = sub.add_parser("up", help="run the whole stack on this host", formatter_class=_formatter,
                       description="Start a store node, vLLM instances with the kvstore connector (or, with "
                                   "--engine builtin, the built-in prefill and decode engines) and the front door "
                                   "on this host. With --replay over vLLM, replay a trace on three set-ups one "
                                   "after another (vLLM alone with its own prefix caching, kvstore, recompute) and "
                                   "print them side by side; without --replay, serve until Ctrl-C.")
    p.add_argument("--replay", metavar="TRACE",
                   help="Mooncake-format trace to replay, e.g. data/traces/conversation_trace.jsonl")
    add_replay_flags(p, setups=True)
    add_scheduler_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address every service listens on")
    p.add_argument("--port", type=port_number, default=8000, help="front door port (0 picks a free one)")
    p.add_argument("--service-ports", type=port_number, default=0, metavar="FIRST",
                   help="the ports of the store nodes, engines (or vLLM instances) and their metrics, in that "
                        "order from FIRST up, each of which must be free, so a Prometheus config or a firewall "
                        "can name them (0, the default: free ones, new at each start); the banner prints each")
    p.add_argument("--model", metavar="DIR", help="local Hugging Face checkpoint (default: a random-weight "
                   "Llama written to ~/.cache/kvstore/checkpoints: 'bench', 8 layers of hidden 512, over vLLM; "
                   "'tiny' on the built-in engines)")
    p.add_argument("--max-model-len", type=positive_int, default=None, metavar="TOKENS",
                   help="the engines' (or vLLM instances') and the front door's limit on prompt + generation "
                        f"(tokens); a longer request gets a 400 and a replay skips it (default: {UP_MAX_MODEL_LEN} "
                        "on the built-in engines; over vLLM --vllm-max-model-len's, which this overrides)")
    p.add_argument("--dram", default=None, help="store node DRAM tier capacity (default: 2GiB over vLLM, "
                   "which holds the demo's working set; 256MiB on the built-in engines)")
    p.add_argument("--ssd", default="1GiB", help="store node SSD tier capacity")
    p.add_argument("--data-dir", default="var/up",
                   help="the stack's directory: store data, logs, tokens (auth.env), API keys; wiped at start "
                        "unless --keep-data (a directory kvstore up did not make must be empty)")
    p.add_argument("--keep-data", action="store_true", help="do not wipe --data-dir at start")
    p.add_argument("--prefill-instances", type=int, default=1,
                   help="prefill engines to start (over vLLM's default colocated topology: this many plus "
                        "--decode-instances vLLM instances, each prefilling and decoding)")
    p.add_argument("--decode-instances", type=int, default=1, help="decode engines to start (see above)")
    p.add_argument("--store-nodes", type=int, default=1,
                   help="store nodes to start; > 1 forms a cluster registered in Redis")
    p.add_argument("--redis", metavar="URL", help="Redis for membership and KV events (default with "
                   "--store-nodes > 1: a private redis-server, stopped at the end)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of a crashed engine, store node or front door within 5 minutes "
                        "(back-off 0.5 s doubling to 8 s) before the stack stops")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="each engine times a few prefills or decode steps at start, one engine at a time, and "
                        "the front door seeds its T_prefill and TBT predictors from them (kvstore engine "
                        "--profile; --no-profile: built-in seeds); built-in engines only: vLLM instances "
                        "are never profiled")
    add_api_key_flags(p)
    add_vllm_up_flags(p)
    p.set_defaults(func=cmd_up, tokens_per_block=None, speed=None)


def _add_replay(sub: Any) -> None:
    """``kvstore replay``: replay a trace against a running front door."""
    p = sub.add_parser("replay", help="replay a trace against a running front door", formatter_class=_formatter,
                       description="Send a Mooncake-format trace's requests to a running front door "
                                   "at their timestamps / speed and report TTFT, TBT, hit ratio, goodput.")
    p.add_argument("--target", required=True, type=http_url, help="front door URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("OPENAI_API_KEY") or None,
                   help="send 'Authorization: Bearer KEY' (a front door with API keys; default: $OPENAI_API_KEY, "
                        "as the openai SDK reads it — a key given by flag shows in ps to other local users)")
    add_replay_flags(p)
    p.set_defaults(func=cmd_replay)


def _add_simulate(sub: Any) -> None:
    """``kvstore simulate``: replay a trace on a simulated cluster."""
    p = sub.add_parser("simulate", help="replay a trace on a simulated cluster", formatter_class=_formatter,
                       description="Replay a Mooncake-format trace in virtual time on a simulated cluster: "
                                   "cost-model engines (configs/), the real scheduler policies, prefix index "
                                   "and cache accounting. Prints one table of every policy x topology x "
                                   "admission; optional JSON and PNG plots.")
    from scheduler.sim.command import add_simulate_flags
    add_simulate_flags(p, DEFAULT_TRACE)
    p.set_defaults(func=cmd_simulate)


def raise_fd_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (its children inherit
    it): each connection takes a descriptor, and 1,024 are soon taken by many callers."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            logging.getLogger(__name__).info("open-files limit stays %d (%s)", soft, exc)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    raise_fd_limit()
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError, KVStoreError) as exc:
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
