"""``kvstore up``: the whole stack on one host, as separate processes — a store node (``--store-nodes
N``: N nodes registered in Redis, ``--redis URL`` or a private ``redis-server``, engines and
scheduler in cluster mode), ``--prefill-instances`` prefill engines, ``--decode-instances`` decode engines and the
scheduler's front door (``--policy``), engines and front door limited to ``--max-model-len``
tokens — then a trace replay through the front door (``--replay``: by default twice, pool
on then pool off, side by side; scheduler/replay/compare.py) or serving until Ctrl-C."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass

from kvstore.auth import ENGINE_TOKEN_ENV, METRICS_TOKEN_ENV, REDIS_URL_ENV, STORE_TOKEN_ENV, new_token, token_from
from kvstore.errors import Unavailable
from kvstore.events.channel import EVENTS_URL_ENV
from launcher.flags import connection_flags
from launcher.stack_record import forget_stack, record_stack
from launcher.supervisor import (
    MAX_RESTARTS,
    Stack,
    _install_stop_handlers,
    _serve_until_signal,
    _Stopped,
    _wait_grpc,
    _wait_http,
    hold_front_door,
    port_taker,
    release_front_door,
)

PROFILE_BUDGET_S = 30.0      # engines/profiling.py BUDGET_S (not imported: it would load torch here)
STACK_MARK = ".kvstore-up"   # in a data directory kvstore up made, so it may wipe it


_HELD: dict[tuple[int, int], int] = {}   # (device, inode) → descriptor: directories this process holds


def _hold(path: str) -> bool:
    """Take an exclusive lock (``flock``) on directory ``path`` for as long as this process
    lives; True when this process holds it already, False when
    another one does (a running ``kvstore up``)."""
    import fcntl
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) in _HELD:
        os.close(fd)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _HELD[(st.st_dev, st.st_ino)] = fd
    return True


def fresh_data_dir(path: str, keep: bool) -> str | None:
    """Prepare ``kvstore up``'s data directory (0700): wiped at start unless ``keep``, but
    only when it is empty or one kvstore up made (it holds :data:`STACK_MARK`), so a wrong
    ``--data-dir`` never deletes someone's files; and never while another ``kvstore up``
    runs on it (each holds a lock on its directory for its lifetime). A directory of another
    user's is refused untouched (root's chmod would leave it theirs). Returns an error
    message, or None."""
    given, path = path, os.path.realpath(path)   # a link to a directory elsewhere means that one
    busy = (f"--data-dir {given} is in use by another kvstore up that is still running (its tokens, "
            f"logs and blocks are there); stop it first, or give another --data-dir")
    try:
        if os.path.isdir(path):
            owner = os.stat(path).st_uid
            if owner != os.geteuid():    # checked before it is changed in any way
                return (f"--data-dir {given} belongs to another user (uid {owner}), who could read "
                        "the stack's tokens, logs and blocks there; give a directory of your own")
            if not _hold(path):
                return busy
            if not keep and os.listdir(path):
                if not os.path.exists(os.path.join(path, STACK_MARK)):
                    return (f"--data-dir {given} is not empty and was not made by kvstore up (no {STACK_MARK} "
                            f"in it); it is wiped at start, so give an empty or new directory, or --keep-data "
                            f"to use it as it is")
                gone = os.stat(path)
                shutil.rmtree(path)   # still locked while it goes; then the lock of the old one
                fd = _HELD.pop((gone.st_dev, gone.st_ino), None)
                if fd is not None:
                    os.close(fd)
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)   # tokens, logs and SSD blocks of every tenant live below it
        if not _hold(path):     # made again since the check: another kvstore up took it meanwhile
            return busy
        open(os.path.join(path, STACK_MARK), "a").close()
    except OSError as exc:
        return (f"--data-dir {given} cannot be used as a directory ({exc.strerror or exc}); "
                "give a directory it can write")
    return None


def preflight(args: argparse.Namespace) -> int | None:
    """What every ``kvstore up`` checks before it starts anything: at least one prefill and
    one decode instance and one store node, a free front-door port (``--port``, 0 for a free
    one), then the data directory (:func:`fresh_data_dir`, only once the rest is sound).
    Returns the front door's port, or None after printing the problem."""
    host = args.host
    if getattr(args, "prefill_instances", 1) < 1 or getattr(args, "decode_instances", 1) < 1:
        problem: str | None = "need at least one prefill and one decode instance"
    elif getattr(args, "store_nodes", 1) < 1:
        problem = "need at least one store node"
    elif (problem := _size_problem(args)) is not None:
        pass
    elif getattr(args, "replay", None) and not os.path.isfile(args.replay):
        problem = f"--replay {args.replay}: no such trace file"
    elif getattr(args, "replay", None) and (problem := _trace_problem(args)) is not None:
        pass
    else:
        try:   # held from here to the end of kvstore up (release_front_door)
            http_port = hold_front_door(host, args.port)
        except RuntimeError:
            problem = (f"port {args.port} on {host} is in use (another front door?); "
                       "pick another with --port, or --port 0 for a free one")
        if not problem and (problem := fresh_data_dir(args.data_dir, args.keep_data)):
            release_front_door(http_port)
    if problem:
        print(f"kvstore up: {problem}", file=sys.stderr)
        return None
    return http_port


def _trace_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--replay``'s trace or ``--start`` in it, or None (read once here:
    the replay reads it again after the services start, which take 10-20 s)."""
    from kvstore.errors import KVStoreError
    from scheduler.trace import load_trace
    try:
        n = len(load_trace(args.replay))
    except (KVStoreError, OSError, ValueError) as exc:
        return f"--replay {args.replay}: {exc}"
    if not 0 <= args.start < n:
        return f"--start {args.start} is outside the trace (requests 0 to {n - 1})"
    return None


def _size_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--dram`` / ``--ssd`` (checked here, before Redis or anything
    else starts, rather than by the store node's own start), or None."""
    from kvstore.config import TierSpec, parse_bytes
    for flag in ("dram", "ssd"):
        text = getattr(args, flag, None)
        if text is None:
            continue
        try:
            n = parse_bytes(text)
        except ValueError as exc:
            return f"--{flag}: {exc}"
        if n or flag == "dram":              # --ssd 0: no SSD tier; any other size is a tier's
            try:
                TierSpec(flag, n)            # the one rule of a tier's capacity
            except ValueError as exc:
                return f"--{flag}: a tier of {n} bytes: {exc}"
    return None


@dataclass
class _Layout:
    """Where each service of ``kvstore up`` listens on ``host``: the front door's
    ``http_port``, the store nodes', the engines' (name, role, port) and every store node's
    and engine's metrics port (the front door has its /metrics)."""

    host: str
    http_port: int
    store_ports: list[int]
    engines: list[tuple[str, str, int]]
    metrics_ports: dict[str, int]
    private_redis: bool = False   # one of its own, on a Unix socket (_redis)

    def store_name(self, i: int) -> str:
        return "store" if len(self.store_ports) == 1 else f"store-{i}"


def _layout(args: argparse.Namespace, http_port: int, stack: Stack) -> _Layout:
    n_prefill, n_decode = getattr(args, "prefill_instances", 1), getattr(args, "decode_instances", 1)
    n_store = getattr(args, "store_nodes", 1)
    stack.hold_port(args.host, http_port)   # every port held by the stack until it stops: kvstore/port_hold.py
    take_port = port_taker(args.host, stack.holds, getattr(args, "service_ports", 0), frozenset({http_port}))
    store_ports = [take_port() for _ in range(n_store)]
    engines = [(f"prefill-{i}", "prefill", take_port()) for i in range(n_prefill)]
    engines += [(f"decode-{i}", "decode", take_port()) for i in range(n_decode)]
    lay = _Layout(args.host, http_port, store_ports, engines, {})
    lay.metrics_ports = {name: take_port() for name in
                         [lay.store_name(i) for i in range(n_store)] + [e[0] for e in engines]}
    if not getattr(args, "redis", None) and (n_store > 1 or shutil.which("redis-server")):
        lay.private_redis = True
    return lay


def run_up(args: argparse.Namespace) -> int:
    http_port = preflight(args)
    if http_port is None:
        return 2
    stack = Stack(log_dir=os.path.join(args.data_dir, "logs"),
                  max_restarts=getattr(args, "max_restarts", MAX_RESTARTS), log_level=getattr(args, "log_level", None))
    t0 = time.monotonic()
    _install_stop_handlers(stack)
    stack.handlers_installed = True
    up_record: str | None = None
    try:
        lay = _layout(args, http_port, stack)
        stack.env.update(stack_tokens(args.data_dir))
        keys_file = write_api_keys(args)
        redis_url, private_redis = _redis(stack, getattr(args, "redis", None), len(lay.store_ports), lay.private_redis)
        # Engines and the scheduler find a cluster's nodes in Redis; a single node by address.
        redis_flags = [] if private_redis or not redis_url else ["--redis", redis_url]
        pool_flags = redis_flags if len(lay.store_ports) > 1 else ["--store", f"{lay.host}:{lay.store_ports[0]}"]
        _start_stores_and_engines(stack, args, lay, redis_flags, pool_flags)
        url = _start_front_door(stack, args, lay, pool_flags, keys_file)
        up_record = record_stack([f"{lay.host}:{p}" for p in lay.store_ports],
                                 [f"{lay.host}:{p}" for _, _, p in lay.engines], url, args.data_dir, redis_url)
        print(f"started in {time.monotonic() - t0:.1f} s; logs in {stack.log_dir}", flush=True)
        if not args.replay:
            print("serving; Ctrl-C stops everything", flush=True)
            _serve_until_signal(stack)
            return 0
        from scheduler.frontdoor.app import replay_and_report
        return replay_and_report(url, args.replay, args)
    except (RuntimeError, Unavailable, OSError, ValueError) as exc:
        print(f"kvstore up: {exc}", file=sys.stderr)
        return 1
    except (_Stopped, KeyboardInterrupt) as exc:
        print(f"kvstore up: {exc or 'SIGINT'}: stopping", flush=True)
        return 0
    finally:
        stack.stopping = True   # a signal from here on kills the children, never unwinds
        forget_stack(up_record)
        stack.stop()
        release_front_door()
        print("stopped all services", flush=True)


def _redis(stack: Stack, redis_url: str | None, n_store: int, private: bool) -> tuple[str | None, bool]:
    """The Redis of the stack and whether it is a private one started here (``private``: the
    layout wants one): a cluster's registry, and the channel of the KV events the scheduler's
    index replica reads (scheduler/routing/cache_index.py). A private one listens on a Unix
    socket in this user's 0700 socket directory (no other user can reach it or take its
    address first) and dies with kvstore up, even by SIGKILL."""
    private_redis = False
    if not redis_url and private:
        from kvstore.cluster.redis_server import redact_url, socket_path, start_private_redis
        os.makedirs(stack.log_dir, exist_ok=True)
        proc, redis_url = start_private_redis(os.path.join(stack.log_dir, "redis.log"), password=new_token(),
                                              unix_socket=socket_path(), die_with_parent=True)
        stack.adopt("redis", proc)
        print(f"redis          {redact_url(redis_url)}  (private: KV events{', membership' if n_store > 1 else ''}; "
              "no persistence)", flush=True)
        if n_store > 1:
            stack.env[REDIS_URL_ENV] = redis_url   # children read it there: no password on a command line
        private_redis = True
    elif not redis_url:
        print("kvstore up: no redis-server installed: the scheduler sees no engine's own cache and "
              "looks pool hits up per request", file=sys.stderr, flush=True)
    if redis_url:
        stack.env[EVENTS_URL_ENV] = redis_url       # KV events: store nodes, engines, scheduler
    return redis_url, private_redis


def _model_flags(args: argparse.Namespace) -> list[str]:
    """The engines' and the front door's ``--model`` and ``--max-model-len``, when given."""
    return ((["--model", args.model] if args.model else [])
            + (["--max-model-len", str(args.max_model_len)] if getattr(args, "max_model_len", None) else []))


def _start_stores_and_engines(stack: Stack, args: argparse.Namespace, lay: _Layout, redis_flags: list[str],
                              pool_flags: list[str]) -> None:
    """Start the store nodes and the engines, and wait until each answers."""
    host, n_store = lay.host, len(lay.store_ports)
    for i, port in enumerate(lay.store_ports):
        name = lay.store_name(i)
        stack.start(name, "serve", "--host", host, "--port", str(port), "--dram", args.dram,
                    "--ssd", args.ssd, "--data-dir", os.path.join(args.data_dir, "store"),
                    "--node-id", name, *redis_flags, "--metrics-port", str(lay.metrics_ports[name]),
                    # every node is on this host: the mapped slab serves them, and the
                    # transfer engine (which listens on every interface) stays off
                    "--transfer-engine", "off")
    # one profiling pass at a time: passes run side by side on a few cores time each other
    profile = (["--profile-lock", os.path.join(args.data_dir, "profile.lock")]
               if getattr(args, "profile", True) else ["--no-profile"])
    for name, role, port in lay.engines:
        stack.start(name, "engine", "--role", role, *pool_flags, "--host", host,
                    "--port", str(port), "--engine-id", name, *_model_flags(args), *profile,
                    "--metrics-port", str(lay.metrics_ports[name]))
    for i, port in enumerate(lay.store_ports):
        _wait_grpc(stack, f"{host}:{port}", 60)
        name = lay.store_name(i)
        print(f"store node     {host}:{port}  (DRAM {args.dram}, SSD {args.ssd} under "
              f"{args.data_dir}/store{'' if n_store == 1 else f', {name}'}; metrics "
              f"http://{host}:{lay.metrics_ports[name]}/metrics)", flush=True)
    # each engine may wait for every other's profiling pass (up to its budget) before its own
    engine_wait_s = 180 + (len(lay.engines) * (PROFILE_BUDGET_S + 10) if getattr(args, "profile", True) else 0)
    for name, role, port in lay.engines:
        _wait_grpc(stack, f"{host}:{port}", engine_wait_s)
        print(f"{role} engine {name} {host}:{port}  (metrics http://{host}:{lay.metrics_ports[name]}/metrics)",
              flush=True)


def _start_front_door(stack: Stack, args: argparse.Namespace, lay: _Layout, pool_flags: list[str],
                      keys_file: str | None) -> str:
    """Start the front door over the engines and wait for its /health; returns its URL."""
    host = lay.host
    prefill = ",".join(f"{host}:{port}" for _, role, port in lay.engines if role == "prefill")
    decode = ",".join(f"{host}:{port}" for _, role, port in lay.engines if role == "decode")
    stack.start("scheduler", "scheduler", "--prefill", prefill,
                "--decode", decode, *pool_flags, "--host", host,
                "--port", str(lay.http_port), "--max-inflight", str(args.max_inflight),
                *([] if args.max_inflight_per_tenant is None else
                  ["--max-inflight-per-tenant", str(args.max_inflight_per_tenant)]),
                *connection_flags(args),
                "--admit-ttft-s", str(args.admit_ttft_s), "--admit-tbt-s", str(args.admit_tbt_s),
                "--policy", args.policy, "--decode-max-running", str(args.decode_max_running),
                "--balancing-threshold", str(args.balancing_threshold), *_model_flags(args),
                *(["--api-keys-file", keys_file] if keys_file else []))
    url = f"http://{host}:{lay.http_port}"
    _wait_http(stack, f"{url}/health", 120)
    stack.check_alive()  # the answer must come from our own front door
    print(f"front door     {url}  (POST /v1/completions and /v1/chat/completions, "
          "GET /health, GET /metrics, GET /status)", flush=True)
    return url


def stack_tokens(data_dir: str) -> dict[str, str]:
    """The store, engine and metrics tokens of the services ``kvstore up`` starts
    (kvstore/auth.py): those in the environment, else fresh ones, so nothing it starts serves
    a caller without one. Written to ``<data_dir>/auth.env`` (mode 0600, shell syntax) for
    kvctl, clients and scrapers."""
    tokens = {env: token_from(None, env) or new_token()
              for env in (STORE_TOKEN_ENV, ENGINE_TOKEN_ENV, METRICS_TOKEN_ENV)}
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, "auth.env")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in tokens.items())
    print(f"auth           store and engine ports take bearer tokens only ({', '.join(tokens)} in {path}; "
          f"every metrics port and /metrics of the stack also takes {METRICS_TOKEN_ENV}, which reads nothing else)",
          flush=True)
    return tokens


def write_api_keys(args: argparse.Namespace) -> str | None:
    """The front door's API keys (``--api-key``, ``--api-keys-file``) in one file (mode 0600,
    under ``--data-dir``) for the scheduler's ``--api-keys-file``, keeping them off its
    command line; None when none were given. Raises OSError / ValueError as
    :func:`scheduler.frontdoor.api_keys.load_api_keys`."""
    from scheduler.frontdoor.api_keys import load_api_keys
    keys = load_api_keys(getattr(args, "api_key", None) or (), getattr(args, "api_keys_file", None))
    if not keys:
        print("api keys       none: the front door serves every caller that reaches it (--api-key KEY, "
              "--api-keys-file FILE: each caller then needs one)", flush=True)
        return None
    path = os.path.join(args.data_dir, "api-keys")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}\n" for k in sorted(keys))
    return path
