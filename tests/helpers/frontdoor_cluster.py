"""The services the front door tests run on: a real store node (DRAM + SSD tiers), one
prefill and one decode engine of the tiny model, and front doors on 127.0.0.1 in an event
loop of their own thread; HTTP helpers (``call``, ``complete``, ``sse_events``) and the
module-scoped fixtures ``cluster``, ``door`` and ``url`` (import ``cluster_fixture``,
``door_fixture``, ``url_fixture`` into a test module)."""
from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
import torch

from engines.server import start_engine
from kvstore.pool.pool import KVPool
from kvstore.service import serve_store
from kvstore.tiers import TIERS
from scheduler.config import FrontdoorConfig
from scheduler.frontdoor.app import RunningFrontdoor, start_frontdoor

BS = 16


class LoopThread:
    """An event loop in a daemon thread: the front door lives there, tests call it over HTTP."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Cluster:
    """A store node, one prefill and one decode engine, and a front door on each config asked
    for (:meth:`frontdoor`), all on 127.0.0.1."""

    def __init__(self, tmp: str) -> None:
        self.pool = KVPool([TIERS["dram"](32 << 20), TIERS["ssd"](64 << 20, path=f"{tmp}/ssd")])
        self.store_server, port = serve_store(self.pool)
        self.store = f"127.0.0.1:{port}"
        self.servers = []
        self.prefill = self.engine("prefill", "prefill-0")
        self.decode = self.engine("decode", "decode-0")
        self.loop = LoopThread()
        self.doors: list[RunningFrontdoor] = []

    def engine(self, role: str, engine_id: str | None) -> str:
        server, port = start_engine(role, self.store, block_size=BS, engine_id=engine_id)
        self.servers.append(server)
        return f"127.0.0.1:{port}"

    def frontdoor(self, config: FrontdoorConfig | None = None, prefill: str | list[str] | None = None) -> str:
        return self.start(config, prefill).url

    def start(self, config: FrontdoorConfig | None = None,
              prefill: str | list[str] | None = None) -> RunningFrontdoor:
        addresses = [prefill] if isinstance(prefill, str) else (prefill or [self.prefill])
        door = self.loop.run(start_frontdoor(addresses, [self.decode], self.store, config=config))
        self.doors.append(door)
        return door

    def close(self) -> None:
        for door in self.doors:
            self.loop.run(door.stop())
        self.loop.close()
        for server in self.servers:
            server.stop(None).wait()
        self.store_server.stop(None).wait()
        self.pool.close()


@pytest.fixture(scope="module", name="cluster")
def cluster_fixture(tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(str(tmp_path_factory.mktemp("frontdoor")))
    yield c
    c.close()


@pytest.fixture(scope="module", name="door")
def door_fixture(cluster: Cluster) -> RunningFrontdoor:
    return cluster.start()


@pytest.fixture(scope="module", name="url")
def url_fixture(door: RunningFrontdoor) -> str:
    return door.url


def call(url: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """POST (GET when no body) and return (status, headers, body bytes), errors included."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def complete(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    status, _, data = call(url, "/v1/completions", body, headers)
    assert status == 200, data
    return json.loads(data)


def sse_events(data: bytes) -> list[Any]:
    lines = [ln[len(b"data: "):] for ln in data.split(b"\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def prompt_of(seed: int, n: int) -> list[int]:
    """``n`` token ids drawn with ``seed`` from the tiny model's vocabulary (specials excluded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()
