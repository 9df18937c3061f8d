"""``kvstore up``: the whole stack on one host, as separate processes — a store node
(``--store-nodes N``: N nodes registered in Redis — ``--redis URL``, else a private
``redis-server`` — with engines and scheduler in cluster mode),
``--prefill-instances`` prefill engines, ``--decode-instances`` decode engines and the
scheduler's front door (``--policy``) — then a trace replay through
the front door (``--replay``) or serving until Ctrl-C."""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from kvstore.auth import ENGINE_TOKEN_ENV, REDIS_URL_ENV, STORE_TOKEN_ENV, new_token, token_from
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


MAX_RESTARTS = 5          # per child within RESTART_WINDOW_S; one more crash stops the stack
RESTART_WINDOW_S = 300.0
BACKOFF_S = (0.5, 8.0)   # first restart delay, doubling up to the second
STOP_DEADLINE_S = 9.5    # SIGTERM, then SIGKILL of what is left (children force themselves at 8 s)


def _prctl():  # type: ignore[no-untyped-def]
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()   # looked up here: a child between fork and exec must not import


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when ``kvstore up`` dies, even by SIGKILL (Linux)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


@dataclass
class Child:
    """One supervised process: how to start it again, and its crashes so far."""

    name: str
    argv: tuple[str, ...] | None      # None: not restartable (e.g. the private Redis)
    proc: subprocess.Popen
    crashes: list[float] = field(default_factory=list)   # monotonic instants of recent crashes
    restart_at: float | None = None


@dataclass
class Stack:
    """Child processes of one ``kvstore up``; stopped all at once (SIGTERM, then SIGKILL).

    :meth:`supervise` restarts a child that exited unasked, after a back-off (0.5 s doubling
    to 8 s), at most ``max_restarts`` times within ``RESTART_WINDOW_S``; one crash more is
    an error that stops the stack."""

    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    log_dir: str = "var/up/logs"
    env: dict[str, str] = field(default_factory=dict)   # added to each child's environment (tokens)
    max_restarts: int = MAX_RESTARTS
    children: dict[str, Child] = field(default_factory=dict)
    restarts: int = 0
    stopping: bool = False            # set once a stop began: a signal then kills the children
    handlers_installed: bool = False

    def start(self, name: str, *argv: str) -> None:
        self.children[name] = Child(name, tuple(argv), self._spawn(name, argv, "wb"))
        self.procs.append((name, self.children[name].proc))

    def adopt(self, name: str, proc: subprocess.Popen) -> None:
        """A process started elsewhere; stopped with the stack, never restarted."""
        self.children[name] = Child(name, None, proc)
        self.procs.append((name, proc))

    def _spawn(self, name: str, argv: tuple[str, ...], mode: str) -> subprocess.Popen:
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, f"{name}.log"), mode) as log:
            return subprocess.Popen([sys.executable, "-m", "kvstore.cli", *argv], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **self.env}, preexec_fn=_die_with_parent)

    def pid(self, name: str) -> int:
        return self.children[name].proc.pid

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = self.log_tail(name)
                raise RuntimeError(f"{name} exited with code {proc.returncode}; its log ends:\n{tail}")

    def supervise(self, now: float | None = None) -> None:
        """Restart children that exited (call it every fraction of a second). Raises
        RuntimeError when one cannot be restarted or crashed too often."""
        now = time.monotonic() if now is None else now
        for child in self.children.values():
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restart_at = None
                    child.proc = self._spawn(child.name, child.argv or (), "ab")
                    self.procs = [(n, child.proc if n == child.name else p) for n, p in self.procs]
                    self.restarts += 1
                    print(f"kvstore up: {child.name} restarted (pid {child.proc.pid})", flush=True)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            self.sweep([child.proc.pid], sockets=False)
            child.crashes = [t for t in child.crashes if now - t < RESTART_WINDOW_S] + [now]
            if child.argv is None or len(child.crashes) > self.max_restarts:
                why = "it cannot be restarted" if child.argv is None else \
                    f"{self.max_restarts} restarts within {RESTART_WINDOW_S:.0f} s already"
                raise RuntimeError(f"{child.name} exited ({how}); {why}; its log ends:\n"
                                   f"{self.log_tail(child.name)}")
            delay = min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (len(child.crashes) - 1))
            child.restart_at = now + delay
            print(f"kvstore up: {child.name} exited ({how}); restart {len(child.crashes)} of "
                  f"{self.max_restarts} in {delay:.1f} s (log: {self.log_dir}/{child.name}.log)", flush=True)

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> None:
        """SIGTERM every child (front door first), SIGKILL those still running after
        ``deadline_s``, then remove what a killed child left (its /dev/shm slab, its Unix
        sockets)."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + deadline_s
        killed = []
        for _, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed.append(proc.pid)
            if proc.returncode < 0:
                killed.append(proc.pid)
        self.sweep(killed)

    def sweep(self, pids: list[int], sockets: bool = True) -> None:
        """Unlink the shared-memory slabs of these (dead) children and (``sockets``) the
        data-plane sockets under the data directory (once every node has stopped)."""
        import glob
        for pid in pids:
            for path in glob.glob(f"/dev/shm/kvstore-{pid}-*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        root = os.path.dirname(os.path.abspath(self.log_dir))
        for path in glob.glob(os.path.join(root, "store", "*", "dataplane.sock")) if sockets else ():
            with contextlib.suppress(OSError):
                os.unlink(path)


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


STACK_MARK = ".kvstore-up"   # in a data directory kvstore up made, so it may wipe it


def fresh_data_dir(path: str, keep: bool) -> str | None:
    """Prepare ``kvstore up``'s data directory (0700): wiped at start unless ``keep``, but
    only when it is empty or one kvstore up made (it holds :data:`STACK_MARK`), so a wrong
    ``--data-dir`` never deletes someone's files. Returns an error message, or None."""
    if not keep and os.path.isdir(path) and os.listdir(path):
        made_here = os.path.exists(os.path.join(path, STACK_MARK)) or {"logs", "store"} <= set(os.listdir(path))
        if not made_here:   # (logs/ and store/: what kvstore up left before it marked its directories)
            return (f"--data-dir {path} is not empty and was not made by kvstore up (no {STACK_MARK} in it); "
                    f"it is wiped at start, so give an empty or new directory, or --keep-data to use it as it is")
        shutil.rmtree(path)
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)   # tokens, logs and SSD blocks of every tenant live below it
    open(os.path.join(path, STACK_MARK), "a").close()
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
    else:
        http_port = args.port or free_port(host)
        problem = None if port_is_free(host, http_port) else (
            f"port {http_port} on {host} is in use (another front door?); "
            "pick another with --port, or --port 0 for a free one")
        problem = problem or fresh_data_dir(args.data_dir, args.keep_data)
    if problem:
        print(f"kvstore up: {problem}", file=sys.stderr)
        return None
    return http_port


def run_up(args: argparse.Namespace) -> int:
    host = args.host
    http_port = preflight(args)
    if http_port is None:
        return 2
    stack = Stack(log_dir=os.path.join(args.data_dir, "logs"),
                  max_restarts=getattr(args, "max_restarts", MAX_RESTARTS))
    n_prefill, n_decode = getattr(args, "prefill_instances", 1), getattr(args, "decode_instances", 1)
    n_store = getattr(args, "store_nodes", 1)
    redis_url = getattr(args, "redis", None)
    store_ports = [free_port(host) for _ in range(n_store)]
    store_port = store_ports[0]
    engines = [(f"prefill-{i}", "prefill", free_port(host)) for i in range(n_prefill)]
    engines += [(f"decode-{i}", "decode", free_port(host)) for i in range(n_decode)]
    store = f"{host}:{store_port}"
    model = ["--model", args.model] if args.model else []
    t0 = time.monotonic()
    _install_stop_handlers(stack)
    stack.handlers_installed = True
    try:
        stack.env.update(stack_tokens(args.data_dir))
        keys_file = write_api_keys(args)
        private_redis = False
        if n_store > 1 and not redis_url:   # a cluster needs a registry: a private Redis
            from kvstore.cluster.redis_server import redact_url, start_private_redis
            os.makedirs(stack.log_dir, exist_ok=True)
            proc, redis_url = start_private_redis(os.path.join(stack.log_dir, "redis.log"), password=new_token())
            stack.adopt("redis", proc)
            print(f"redis          {redact_url(redis_url)}  (private, password in KVSTORE_REDIS_URL, "
                  f"no persistence)", flush=True)
            stack.env[REDIS_URL_ENV] = redis_url   # children read it there: no password on a command line
            private_redis = True
        # Engines and the scheduler find a cluster's nodes in Redis; a single node by address.
        redis_flags = [] if private_redis or not redis_url else ["--redis", redis_url]
        pool_flags = redis_flags if n_store > 1 else ["--store", store]
        for i, port in enumerate(store_ports):
            name = "store" if n_store == 1 else f"store-{i}"
            stack.start(name, "serve", "--host", host, "--port", str(port), "--dram", args.dram,
                        "--ssd", args.ssd, "--data-dir", os.path.join(args.data_dir, "store"),
                        "--node-id", name, *redis_flags,
                        # every node is on this host: the mapped slab serves them, and the
                        # transfer engine (which listens on every interface) stays off
                        "--transfer-engine", "off")
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
    except (_Stopped, KeyboardInterrupt) as exc:
        print(f"kvstore up: {exc or 'SIGINT'}: stopping", flush=True)
        return 0
    finally:
        stack.stopping = True   # a signal from here on kills the children, never unwinds
        stack.stop()
        print("stopped all services", flush=True)


class _Stopped(BaseException):
    """Raised by the signal handler of ``kvstore up`` to unwind to its ``finally``."""


def _install_stop_handlers(stack: Stack) -> None:
    """SIGTERM/SIGINT: the first unwinds to the caller's stop of every child (raising
    :class:`_Stopped`); one once ``stack.stopping`` is set kills every child at once."""
    def handler(signum: int, _frame: object) -> None:
        if not stack.stopping:
            stack.stopping = True
            raise _Stopped(signal.Signals(signum).name)
        for _, proc in stack.procs:
            if proc.poll() is None:
                proc.kill()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _serve_until_signal(stack: Stack) -> None:
    """Supervise the children until SIGTERM/SIGINT, then return (the caller stops them)."""
    if not stack.handlers_installed:
        _install_stop_handlers(stack)
        stack.handlers_installed = True
    try:
        while True:
            stack.supervise()
            time.sleep(0.2)
    except (_Stopped, KeyboardInterrupt) as exc:
        stack.stopping = True
        print(f"kvstore up: {exc or 'SIGINT'}: stopping", flush=True)


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
