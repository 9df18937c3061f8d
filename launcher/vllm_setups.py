"""The set-ups ``kvstore up`` runs over vLLM, and the comparison of them that ``kvstore up
--replay`` (``make demo``) prints: the same trace requests, through the same front door, on the
same number of vLLM instances with the same KV-cache memory each, one set-up after another:

* ``vllm`` — **vLLM alone**: each instance's own automatic prefix caching on, no kvstore,
  requests spread by the least-loaded policy (what a user has without kvstore);
* ``kvstore`` — the pool under every instance (the kvstore connector), the Conductor (or
  ``--policy``) routing, the instances' own prefix caches on too, their KV events feeding the
  router;
* ``recompute`` — no prefix reuse at all (no connector, no prefix cache, least-loaded): the
  floor.

Only the pool and the routing differ. The baselines run colocated (an instance without a
connector cannot hand a prefill over); kvstore runs in ``--topology`` (colocated by default,
see ``launcher/up_vllm.py``).
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Any

from kvstore.auth import ENGINE_TOKEN_ENV, METRICS_TOKEN_ENV, STORE_TOKEN_ENV
from launcher.supervisor import Stack, _wait_grpc, _wait_http, port_taker


@dataclass(frozen=True)
class Setup:
    """``connector``: the kvstore pool under every instance; ``prefix_caching``: each
    instance's own prefix cache (and, with the pool, its KV events to the router);
    ``policy``: the front door's scheduling policy (None: ``--policy``)."""

    name: str
    label: str
    connector: bool
    prefix_caching: bool
    policy: str | None
    what: str


SETUPS: dict[str, Setup] = {s.name: s for s in (
    Setup("vllm", "vLLM alone", False, True, "least_loaded",
          "each instance's own prefix cache, no kvstore, least-loaded routing"),
    Setup("kvstore", "kvstore", True, True, None,
          "the pool under every instance, the Conductor, the instances' own prefix caches and their KV events"),
    Setup("recompute", "recompute", False, False, "least_loaded", "no prefix reuse at all, least-loaded routing"),
)}
COMPARED = ("vllm", "kvstore", "recompute")     # the order they run in
START_TIMEOUT_S = 600   # for a set-up's vLLM instances to answer


@dataclass
class RunningSetup:
    """A started set-up: its supervised services (``stack``), vLLM servers, front door URL,
    store node (None without the pool) and the KV memory it holds, by kind (bytes)."""

    setup: Setup
    stack: Stack
    servers: list = field(default_factory=list)
    url: str = ""
    store: str | None = None
    memory: dict[str, int] = field(default_factory=dict)
    startup_s: float = 0.0

    def stop(self) -> None:
        self.stack.stopping = True
        self.stack.stop()
        for server in self.servers:
            server.stop(grace_s=10)


def _roles(args: argparse.Namespace, setup: Setup) -> list[tuple[str, str]]:
    """(kind, vLLM kv_role) per instance: disaggregated only with the pool and ``--topology
    disaggregated``; colocated otherwise, as many instances in all."""
    n = args.prefill_instances + args.decode_instances
    if setup.connector and args.topology == "disaggregated":
        return [("prefill", "kv_producer")] * args.prefill_instances + \
               [("decode", "kv_consumer")] * args.decode_instances
    return [("colocated", "kv_both")] * n


def cpu_sets(instances: int, cores: list[int] | None = None) -> list[tuple[int, ...]]:
    """Disjoint cores for each of ``instances`` vLLM instances on this host's allowed
    ``cores`` (vLLM's CPU guidance: one set of cores per instance, so that two instances'
    OpenMP threads never spin on the same core); no pinning (empty sets) when there are
    fewer cores than instances."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    per = len(cores) // instances if instances else 0
    if per < 1:
        return [()] * instances
    return [tuple(cores[i * per:(i + 1) * per]) for i in range(instances)]


def _specs(args: argparse.Namespace, setup: Setup, model: str, store: str, tokens: dict[str, str],
           take_port) -> tuple[list[str], list[tuple[str, str]], list]:
    from engines.vllm.launch import VLLMServerSpec, ipc_endpoints
    from kvstore.config import parse_bytes
    roles = _roles(args, setup)
    names = [f"vllm-{kind}-{sum(k == kind for k, _ in roles[:i])}" for i, (kind, _) in enumerate(roles)]
    events = setup.connector and setup.prefix_caching      # KV events feed the Conductor's index
    events_dir = os.path.join(args.data_dir, "kv-events")  # the events carry prompt tokens: 0700
    if events:
        os.makedirs(events_dir, mode=0o700, exist_ok=True)
        os.chmod(events_dir, 0o700)
    specs = [VLLMServerSpec(model, take_port(), role, store, host=args.host,
                            kv_cache_bytes=parse_bytes(args.vllm_kv_cache), max_model_len=args.vllm_max_model_len,
                            store_token=tokens[STORE_TOKEN_ENV], api_key=tokens[ENGINE_TOKEN_ENV],
                            metrics_token=tokens[METRICS_TOKEN_ENV],
                            prefix_caching=setup.prefix_caching, connector=setup.connector, cpus=cpus,
                            port_held=True,
                            kv_events=ipc_endpoints(events_dir, name) if events and kind != "decode" else None)
             for name, (kind, role), cpus in zip(names, roles, cpu_sets(len(roles)))]
    return names, roles, specs


def _scheduler_flags(args: argparse.Namespace, setup: Setup, roles, specs, store: str | None,
                     http_port: int, model: str, keys_file: str | None) -> list[str]:
    from launcher.flags import connection_flags
    urls = {kind: [s.url for (k, _), s in zip(roles, specs) if k == kind]
            for kind in ("prefill", "decode", "colocated")}
    flags = (["--vllm-colocated", *urls["colocated"]] if urls["colocated"]
             else ["--vllm-prefill", *urls["prefill"], "--vllm-decode", *urls["decode"]])
    events = [",".join(s.kv_events) for s in specs if s.kv_events]
    if events:
        flags += ["--vllm-kv-events", *events]
    flags += ["--store", store] if store else ["--no-store"]
    return [*flags, "--host", args.host, "--port", str(http_port), "--model", model,
            "--max-inflight", str(args.max_inflight),
            *([] if args.max_inflight_per_tenant is None else
              ["--max-inflight-per-tenant", str(args.max_inflight_per_tenant)]),
            *connection_flags(args), "--admit-ttft-s", str(args.admit_ttft_s),
            "--admit-tbt-s", str(args.admit_tbt_s), "--policy", setup.policy or args.policy,
            "--decode-max-running", str(args.decode_max_running),
            "--balancing-threshold", str(args.balancing_threshold),
            *(["--api-keys-file", keys_file] if keys_file else [])]


def start_setup(args: argparse.Namespace, setup: Setup, model: str, http_port: int, tokens: dict[str, str],
                keys_file: str | None, log_dir: str) -> RunningSetup:
    """Start ``setup``'s services (its store node when it has the pool, its vLLM instances,
    the front door on ``http_port``), printing each as it answers. Raises RuntimeError /
    Unavailable when one does not start; whatever did start is stopped first."""
    from engines.vllm.launch import launch_servers, wait_servers
    from kvstore.config import parse_bytes
    t0 = time.monotonic()
    running = RunningSetup(setup, Stack(log_dir=log_dir, log_level=getattr(args, "log_level", None)))
    running.stack.env.update(tokens)
    try:
        # every port held until the set-up stops (kvstore/port_hold.py)
        running.stack.hold_port(args.host, http_port)
        take_port = port_taker(args.host, running.stack.holds, getattr(args, "service_ports", 0),
                               frozenset({http_port}))
        if setup.connector:
            store_port, metrics_port = take_port(), take_port()
            running.store = f"{args.host}:{store_port}"
            running.stack.start("store", "serve", "--host", args.host, "--port", str(store_port), "--dram",
                                args.dram, "--ssd", args.ssd, "--data-dir", os.path.join(args.data_dir, "store"),
                                "--node-id", "store", "--metrics-port", str(metrics_port))
            _wait_grpc(running.stack, running.store, 60)
            print(f"store node     {running.store}  (DRAM {args.dram}, SSD {args.ssd}; metrics "
                  f"http://{args.host}:{metrics_port}/metrics)", flush=True)
            running.memory.update(pool_dram=parse_bytes(args.dram), pool_ssd=parse_bytes(args.ssd))
        names, roles, specs = _specs(args, setup, model, running.store or "", tokens, take_port)
        running.servers = launch_servers(specs, log_dir, names)
        running.memory["instances_kv"] = sum(s.kv_cache_bytes for s in specs)
        for name, server in zip(names, running.servers):
            # supervised as the other children: a crashed instance is restarted on its port
            # (the front door routes around it meanwhile and takes it back once it answers)
            running.stack.adopt(name, server.proc, respawn=server.restart)
        # The front door starts beside the instances (its tokenizer's imports take seconds) and
        # waits for them longer than this does; any child that exits meanwhile ends the start.
        running.stack.start("scheduler", "scheduler", *_scheduler_flags(args, setup, roles, specs, running.store,
                                                                        http_port, model, keys_file),
                            "--ready-timeout-s", str(START_TIMEOUT_S + 60))
        wait_servers(running.servers, timeout_s=START_TIMEOUT_S, check=running.stack.check_alive)
        for name, server in zip(names, running.servers):
            cores = ",".join(map(str, server.spec.cpus)) or "any"
            print(f"vLLM {server.spec.role:<11} {name} {server.url} (pid {server.proc.pid}; cores {cores}; prefix "
                  f"cache {'on' if setup.prefix_caching else 'off'}, kvstore connector "
                  f"{'on' if setup.connector else 'off'})", flush=True)
        running.url = f"http://{args.host}:{http_port}"
        _wait_http(running.stack, f"{running.url}/health", 120)
        running.startup_s = time.monotonic() - t0
        return running
    except BaseException:
        running.stop()
        raise


async def instance_metrics(running: RunningSetup) -> list[str]:
    """Every vLLM instance's ``/metrics`` text (they take the engines' token)."""
    import aiohttp
    headers = {"Authorization": f"Bearer {running.stack.env[ENGINE_TOKEN_ENV]}"}
    out: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for server in running.servers:
            async with session.get(server.url + "/metrics", headers=headers) as resp:
                out.append(await resp.text())
    return out


def replay_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The replay flags (``--requests``, ``--speed``, ...) as :func:`scheduler.replay.run.run_replay`'s keywords."""
    from scheduler.frontdoor.app import _replay_key
    window_s = None if getattr(args, "contiguous", False) else getattr(args, "window_s", None)
    return {"requests": args.requests, "speed": args.speed, "max_output_tokens": args.max_output_tokens,
            "tokens_per_block": args.tokens_per_block, "ttft_slo_s": args.ttft_slo_s,
            "tbt_slo_s": args.tbt_slo_s, "api_key": _replay_key(args), "start": getattr(args, "start", 0),
            "window_s": window_s}
