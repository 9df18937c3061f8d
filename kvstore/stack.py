"""``kvstore up``: the whole stack on one host, as separate processes — a store node
(``--store-nodes N``: N nodes registered in Redis — ``--redis URL``, else a private
``redis-server`` — with engines and scheduler in cluster mode),
``--prefill-instances`` prefill engines, ``--decode-instances`` decode engines and the
scheduler's front door (``--policy``) — then a trace replay through
the front door (``--replay``) or serving until Ctrl-C."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from kvstore.auth import ENGINE_TOKEN_ENV, STORE_TOKEN_ENV, new_token, token_from
from kvstore.errors import Unavailable


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP listener could bind ``host:port`` now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    """Child processes of one ``kvstore up``; stopped in reverse start order."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    log_dir: str = "var/up/logs"
    env: dict[str, str] = field(default_factory=dict)   # added to each child's environment (tokens)

    def start(self, name: str, *argv: str) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        log = open(os.path.join(self.log_dir, f"{name}.log"), "wb")
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", *argv], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **self.env})
        self.procs.append((name, proc))

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = self.log_tail(name)
                raise RuntimeError(f"{name} exited with code {proc.returncode}; its log ends:\n{tail}")

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_grpc(stack: Stack, address: str, timeout_s: float) -> None:
    import grpc
    deadline = time.monotonic() + timeout_s
    channel = grpc.insecure_channel(address)
    try:
        while True:
            stack.check_alive()
            try:
                grpc.channel_ready_future(channel).result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() > deadline:
                    raise Unavailable(f"{address} not ready after {timeout_s} s") from None
    finally:
        channel.close()


def _wait_http(stack: Stack, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stack.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise Unavailable(f"{url} not ready after {timeout_s} s")
        time.sleep(0.2)


def run_up(args: argparse.Namespace) -> int:
    host = args.host
    if not args.keep_data:
        shutil.rmtree(args.data_dir, ignore_errors=True)
    stack = Stack(log_dir=os.path.join(args.data_dir, "logs"))
    n_prefill, n_decode = getattr(args, "prefill_instances", 1), getattr(args, "decode_instances", 1)
    if n_prefill < 1 or n_decode < 1:
        print("kvstore up: need at least one prefill and one decode instance", file=sys.stderr)
        return 2
    n_store = getattr(args, "store_nodes", 1)
    if n_store < 1:
        print("kvstore up: need at least one store node", file=sys.stderr)
        return 2
    redis_url = getattr(args, "redis", None)
    store_ports = [free_port(host) for _ in range(n_store)]
    store_port = store_ports[0]
    engines = [(f"prefill-{i}", "prefill", free_port(host)) for i in range(n_prefill)]
    engines += [(f"decode-{i}", "decode", free_port(host)) for i in range(n_decode)]
    http_port = args.port or free_port(host)
    if not port_is_free(host, http_port):
        print(f"kvstore up: port {http_port} on {host} is in use (another front door?); "
              "pick another with --port, or --port 0 for a free one", file=sys.stderr)
        return 2
    store = f"{host}:{store_port}"
    model = ["--model", args.model] if args.model else []
    t0 = time.monotonic()
    try:
        stack.env.update(stack_tokens(args.data_dir))
        keys_file = write_api_keys(args)
        if n_store > 1 and not redis_url:   # a cluster needs a registry: a private Redis
            from kvstore.cluster.redis_server import start_private_redis
            os.makedirs(stack.log_dir, exist_ok=True)
            proc, redis_url = start_private_redis(os.path.join(stack.log_dir, "redis.log"))
            stack.procs.append(("redis", proc))
            print(f"redis          {redis_url}  (private, no persistence)", flush=True)
        # Engines and the scheduler find a cluster's nodes in Redis; a single node by address.
        pool_flags = ["--redis", redis_url] if n_store > 1 else ["--store", store]
        for i, port in enumerate(store_ports):
            name = "store" if n_store == 1 else f"store-{i}"
            stack.start(name, "serve", "--host", host, "--port", str(port), "--dram", args.dram,
                        "--ssd", args.ssd, "--data-dir", os.path.join(args.data_dir, "store"),
                        "--node-id", name, *(["--redis", redis_url] if redis_url else []))
        for name, role, port in engines:
            stack.start(name, "engine", "--role", role, *pool_flags, "--host", host,
                        "--port", str(port), "--engine-id", name, *model)
        for i, port in enumerate(store_ports):
            _wait_grpc(stack, f"{host}:{port}", 60)
            print(f"store node     {host}:{port}  (DRAM {args.dram}, SSD {args.ssd} under "
                  f"{args.data_dir}/store{'' if n_store == 1 else f', store-{i}'})", flush=True)
        for name, role, port in engines:
            _wait_grpc(stack, f"{host}:{port}", 180)
            print(f"{role} engine {name} {host}:{port}", flush=True)
        prefill = ",".join(f"{host}:{port}" for _, role, port in engines if role == "prefill")
        decode = ",".join(f"{host}:{port}" for _, role, port in engines if role == "decode")
        stack.start("scheduler", "scheduler", "--prefill", prefill,
                    "--decode", decode, *pool_flags, "--host", host,
                    "--port", str(http_port), "--max-inflight", str(args.max_inflight),
                    "--admit-ttft-s", str(args.admit_ttft_s), "--admit-tbt-s", str(args.admit_tbt_s),
                    "--policy", args.policy, "--decode-max-running", str(args.decode_max_running),
                    "--balancing-threshold", str(args.balancing_threshold), *model,
                    *(["--api-keys-file", keys_file] if keys_file else []))
        url = f"http://{host}:{http_port}"
        _wait_http(stack, f"{url}/health", 120)
        stack.check_alive()  # the answer must come from our own front door
        print(f"front door     {url}  (POST /v1/completions, GET /health, GET /metrics)", flush=True)
        print(f"started in {time.monotonic() - t0:.1f} s; logs in {stack.log_dir}", flush=True)
        if not args.replay:
            print("serving; Ctrl-C stops everything", flush=True)
            _serve_until_signal(stack)
            return 0
        from scheduler.app import replay_and_report
        return replay_and_report(url, args.replay, args)
    except (RuntimeError, Unavailable, OSError, ValueError) as exc:
        print(f"kvstore up: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        print("stopped all services", flush=True)


def stack_tokens(data_dir: str) -> dict[str, str]:
    """The store and engine tokens of the services ``kvstore up`` starts (kvstore/auth.py):
    those in the environment, else fresh ones, so nothing it starts serves a caller without
    one. Written to ``<data_dir>/auth.env`` (mode 0600, shell syntax) for kvctl and clients."""
    tokens = {env: token_from(None, env) or new_token() for env in (STORE_TOKEN_ENV, ENGINE_TOKEN_ENV)}
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, "auth.env")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in tokens.items())
    print(f"auth           store and engine ports take bearer tokens only ({', '.join(tokens)} in {path})",
          flush=True)
    return tokens


def write_api_keys(args: argparse.Namespace) -> str | None:
    """The front door's API keys (``--api-key``, ``--api-keys-file``) in one file (mode 0600,
    under ``--data-dir``) for the scheduler's ``--api-keys-file``, keeping them off its
    command line; None when none were given. Raises OSError / ValueError as
    :func:`scheduler.api_keys.load_api_keys`."""
    from scheduler.api_keys import load_api_keys
    keys = load_api_keys(getattr(args, "api_key", None) or (), getattr(args, "api_keys_file", None))
    if not keys:
        return None
    path = os.path.join(args.data_dir, "api-keys")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}\n" for k in sorted(keys))
    return path


def _serve_until_signal(stack: Stack) -> None:
    stopped = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.append(True))
    while not stopped:
        stack.check_alive()
        time.sleep(0.5)
