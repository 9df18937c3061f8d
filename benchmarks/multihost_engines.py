"""Engines and the front door on hosts of a :class:`~benchmarks.multihost.Cluster`: the
built-in engines (``kvstore engine``) and the HTTP front door (``kvstore scheduler``) in
hosts of their own, each bound to its host's address, all in cluster mode: the store nodes
come from the registry in Redis (``KVSTORE_REDIS_URL``, not on a command line: it holds
Redis's password), blocks cross hosts through the Mooncake transfer engine, and the KV events
of the store nodes and the prefill engines reach the front door's index replica through the
same Redis. Used by ``tests/kvstore/cluster/test_multihost_engines.py``; vLLM inside a host is
benchmarks/multihost_vllm.py.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

from benchmarks.multihost import ROOT, Cluster, stop_all

ENGINE_PORT, FRONT_DOOR_PORT = 50061, 8000


class Stack:
    """Built-in engines and a front door on the hosts of ``cluster``; :meth:`close` stops
    them (the cluster's own close stops its nodes and Redis)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.engine_token = secrets.token_hex(16)
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), KVSTORE_STORE_TOKEN=cluster.token,
                        KVSTORE_ENGINE_TOKEN=self.engine_token, KVSTORE_REDIS_URL=cluster.redis_url,
                        KVSTORE_EVENTS_URL=cluster.redis_url, GLOG_minloglevel="2")
        self.env.pop("KVSTORE_METRICS_TOKEN", None)

    def _start(self, name: str, host: int, argv: list[str]) -> subprocess.Popen:
        log = open(self.cluster.workdir / f"{name}.log", "ab")
        self.procs[name] = self.cluster.topology.popen(
            host, [sys.executable, "-m", "launcher", "--log-level", "WARNING", *argv], stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(ROOT), env=self.env)
        return self.procs[name]

    def engine_address(self, host: int) -> str:
        return f"{self.cluster.topology.address(host)}:{ENGINE_PORT}"

    def start_engine(self, name: str, role: str, host: int) -> None:
        self._start(name, host, ["engine", "--role", role, "--host", self.cluster.topology.address(host),
                                 "--port", str(ENGINE_PORT), "--engine-id", name, "--no-profile",
                                 "--max-model-len", "1024"])

    def wait_engine(self, name: str, host: int, timeout_s: float = 120.0) -> None:
        with grpc.insecure_channel(self.engine_address(host)) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                raise RuntimeError(f"engine {name} not ready: {self.log_tail(name)}") from None

    def start_front_door(self, host: int, prefill: list[int], decode: list[int]) -> str:
        """The front door on ``host`` over the engines of those hosts; its URL once /health answers."""
        url = f"http://{self.cluster.topology.address(host)}:{FRONT_DOOR_PORT}"
        proc = self._start("frontdoor", host, [
            "scheduler", "--prefill", ",".join(self.engine_address(h) for h in prefill),
            "--decode", ",".join(self.engine_address(h) for h in decode), "--host", self.cluster.topology.address(host),
            "--port", str(FRONT_DOOR_PORT), "--max-model-len", "1024"])
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                    if resp.status == 200:
                        return url
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"front door not ready on {url}: {self.log_tail('frontdoor')}")
            time.sleep(0.2)

    def log_tail(self, name: str) -> str:
        path = Path(self.cluster.workdir) / f"{name}.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def close(self) -> None:
        stop_all(self.procs.values())

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def complete(url: str, prompt: list[int], max_tokens: int = 2) -> dict[str, Any]:
    """POST /v1/completions; the answer."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def metrics(url: str, token: str | None = None) -> dict[str, float]:
    """A Prometheus page as ``name{labels}`` → value (comments dropped)."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
