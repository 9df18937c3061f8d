"""One token scheme on every port, through the real ports: engines' gRPC (no token / a wrong
token → UNAUTHENTICATED, the servicer never runs), the front door's API keys (401 in
OpenAI's shape, 200 with a key, /health open), a front door holding the wrong engine token
cannot start, and a ``kvstore up`` stack whose store and engine ports refuse a tokenless
caller."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engines.server import start_engine
from kvstore.auth import ENGINE_TOKEN_ENV, METRICS_TOKEN_ENV, STORE_TOKEN_ENV, bearer_metadata
from kvstore.errors import Unavailable
from kvstore.pool.pool import KVPool
from kvstore.service import serve_store
from kvstore.tiers import TIERS
from protos import engine_pb2 as epb
from protos import engine_pb2_grpc as epb_grpc
from protos import kvstore_pb2 as kpb
from protos import kvstore_pb2_grpc as kpb_grpc
from scheduler.config import FrontdoorConfig
from scheduler.frontdoor.api_keys import load_api_keys, read_keys_file
from scheduler.frontdoor.app import start_frontdoor
from tests.helpers.frontdoor_cluster import LoopThread, call

ROOT = Path(__file__).resolve().parents[2]
BS = 16
ENGINE_TOKEN = "engine-secret-1"
STORE_TOKEN = "store-secret-1"
KEYS = ("sk-alpha", "sk-beta")


class AuthedStack:
    """A store node and a prefill and a decode engine that each require their token."""

    def __init__(self, tmp: str) -> None:
        self.pool = KVPool([TIERS["dram"](16 << 20)])
        self.store_server, port = serve_store(self.pool, auth_token=STORE_TOKEN)
        self.store = f"127.0.0.1:{port}"
        self.servers, self.addresses = [], {}
        for role in ("prefill", "decode"):
            server, p = start_engine(role, self.store, block_size=BS, engine_id=f"{role}-a",
                                     store_token=STORE_TOKEN, auth_token=ENGINE_TOKEN)
            self.servers.append(server)
            self.addresses[role] = f"127.0.0.1:{p}"
        self.loop = LoopThread()
        self.doors: list = []

    def door(self, config: FrontdoorConfig):  # type: ignore[no-untyped-def]
        door = self.loop.run(start_frontdoor([self.addresses["prefill"]], [self.addresses["decode"]],
                                             self.store, config=config))
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


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[AuthedStack]:
    s = AuthedStack(str(tmp_path_factory.mktemp("auth")))
    yield s
    s.close()


@pytest.fixture(scope="module")
def keyed_url(stack: AuthedStack) -> str:
    return stack.door(FrontdoorConfig(store_auth_token=STORE_TOKEN, engine_auth_token=ENGINE_TOKEN,
                                      api_keys=frozenset(KEYS))).url


def _prefill(address: str, token: str | None) -> epb.PrefillResponse:
    with grpc.insecure_channel(address) as channel:
        return epb_grpc.EngineStub(channel).Prefill(
            epb.PrefillRequest(request_id="r1", prompt=list(range(3, 3 + 2 * BS + 1)), namespace="key-victim"),
            timeout=30, metadata=bearer_metadata(token))


def test_tokenless_calls_that_never_send_a_message_hold_no_worker(stack):
    """Calls without a token that send their headers and then nothing (a stream whose
    request iterator never yields) are refused at once: more of them than the store's 8
    and the engine's 16 workers leave both answering their token holders."""
    import threading
    stop = threading.Event()

    def never():
        stop.wait()
        yield b""

    channels = [grpc.insecure_channel(address) for address in [stack.store] * 12 + [stack.addresses["decode"]] * 20]
    try:
        calls = []
        for i, channel in enumerate(channels):
            method = "/kvstore.v1.KVStore/Put" if i < 12 else "/kvstore.engine.v1.Engine/Info"
            call_ = channel.stream_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            calls.append(call_.future(never(), timeout=60))
        for c in calls:
            with pytest.raises(grpc.RpcError) as err:
                c.result(timeout=20)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(stack.store) as channel:
            kpb_grpc.KVStoreStub(channel).Health(kpb.HealthRequest(), timeout=5,
                                                 metadata=bearer_metadata(STORE_TOKEN))
        with grpc.insecure_channel(stack.addresses["decode"]) as channel:
            epb_grpc.EngineStub(channel).Info(epb.InfoRequest(), timeout=5, metadata=bearer_metadata(ENGINE_TOKEN))
    finally:
        stop.set()
        for channel in channels:
            channel.close()


@pytest.mark.parametrize("token", [None, "wrong", ENGINE_TOKEN + "x"])
def test_engine_refuses_a_caller_without_its_token(stack, token):
    for role in ("prefill", "decode"):
        with grpc.insecure_channel(stack.addresses[role]) as channel:
            with pytest.raises(grpc.RpcError) as info:
                epb_grpc.EngineStub(channel).Info(epb.InfoRequest(), timeout=10, metadata=bearer_metadata(token))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        _prefill(stack.addresses["prefill"], token)   # another tenant's namespace: never runs
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(stack.addresses["decode"]) as channel:   # a server stream
        with pytest.raises(grpc.RpcError) as info:
            list(epb_grpc.EngineStub(channel).Decode(epb.DecodeRequest(request_id="d", prompt=[5, 6],
                                                                       namespace="key-victim", max_tokens=2),
                                                     timeout=10, metadata=bearer_metadata(token)))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_engine_serves_the_holder_of_its_token(stack):
    r = _prefill(stack.addresses["prefill"], ENGINE_TOKEN)
    assert r.request_id == "r1" and r.computed_tokens > 0


@pytest.mark.parametrize("value,served", [(f"bearer {ENGINE_TOKEN}", True), (f"BEARER {ENGINE_TOKEN}", True),
                                          (f"Bearer {ENGINE_TOKEN.upper()}", False),
                                          (f"Bearer  {ENGINE_TOKEN}", False), (f"Basic {ENGINE_TOKEN}", False),
                                          (ENGINE_TOKEN, False)])
def test_the_scheme_is_taken_in_any_case_and_the_token_only_exactly(stack, value, served):
    """RFC 7235 §2.1: the scheme is case-insensitive, as the front door's HTTP check takes it."""
    with grpc.insecure_channel(stack.addresses["decode"]) as channel:
        call = lambda: epb_grpc.EngineStub(channel).Info(epb.InfoRequest(), timeout=10,  # noqa: E731
                                                          metadata=(("authorization", value),))
        if served:
            assert call().engine_id
        else:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_front_door_with_the_wrong_engine_token_cannot_start(stack):
    config = FrontdoorConfig(store_auth_token=STORE_TOKEN, engine_auth_token="not-it", ready_timeout_s=10)
    with pytest.raises(Unavailable, match="UNAUTHENTICATED"):
        stack.door(config)


@pytest.mark.parametrize("headers,message", [
    ({}, "didn't provide an API key"),
    ({"Authorization": "Bearer sk-wrong"}, "Incorrect API key"),
    ({"Authorization": "Basic sk-alpha"}, "didn't provide an API key"),
    ({"Authorization": "Bearer sk-alpha2"}, "Incorrect API key"),
    ({"Authorization": "Bearer"}, "didn't provide an API key"),
])
def test_front_door_with_keys_answers_401_in_openai_shape(keyed_url, headers, message):
    for path, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/models", None), ("/metrics", None)):
        status, got_headers, data = call(keyed_url, path, body, headers)
        assert status == 401, (path, data)
        error = json.loads(data)["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert message in error["message"]
        assert got_headers.get("WWW-Authenticate", "").startswith("Bearer")


def test_front_door_serves_each_key_and_keeps_health_open(keyed_url):
    for key in KEYS:
        status, _, data = call(keyed_url, "/v1/completions", {"prompt": "hello there", "max_tokens": 3},
                               {"Authorization": f"Bearer {key}"})
        assert status == 200, data
        assert len(json.loads(data)["choices"][0]["token_ids"]) == 3
        status, _, data = call(keyed_url, "/metrics", None, {"Authorization": f"Bearer {key}"})
        assert status == 200 and b"# TYPE" in data
    status, _, data = call(keyed_url, "/health")
    assert status == 200 and json.loads(data)["status"]
    # refused keys are counted too (the counting middleware runs before the key check)
    assert call(keyed_url, "/v1/models", None, {"Authorization": "Bearer sk-nobody"})[0] == 401
    _, _, data = call(keyed_url, "/metrics", None, {"Authorization": f"Bearer {KEYS[0]}"})
    counted = [line for line in data.decode().splitlines()
               if line.startswith('kvstore_scheduler_http_responses_total{route="/v1/models",status="401"}')]
    assert counted and float(counted[0].split()[-1]) >= 1, data


def test_a_key_that_is_not_utf8_is_a_401_and_without_keys_a_tenant(stack, keyed_url):
    # urllib sends a header's characters as latin-1 bytes: b"\xff\xfe" and a UTF-8-encoded
    # surrogate are no UTF-8 text; both were a 500 (UnicodeEncodeError hashing the key)
    bad = [{"Authorization": "Bearer sk-\xff\xfe"}, {"Authorization": "Bearer \xed\xa0\x80"}]
    for headers in bad:
        for path, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 2}), ("/v1/models", None),
                           ("/metrics", None), ("/status.json", None)):
            status, _, data = call(keyed_url, path, body, headers)
            assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key", (path, data)
    open_url = stack.door(FrontdoorConfig(store_auth_token=STORE_TOKEN, engine_auth_token=ENGINE_TOKEN)).url
    for headers in bad:   # without keys the bytes sent name the tenant, as any other bearer token
        status, _, data = call(open_url, "/v1/completions", {"prompt": "hello", "max_tokens": 2}, headers)
        assert status == 200, data


def test_api_keys_file_and_flags(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenants\n  sk-one \n\nsk-two\n")
    assert read_keys_file(str(path)) == ["sk-one", "sk-two"]
    assert load_api_keys(["sk-three"], str(path)) == {"sk-one", "sk-two", "sk-three"}
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys((), str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="whitespace"):
        load_api_keys(["two words"])


@pytest.mark.slow
def test_kvstore_up_ports_refuse_a_tokenless_caller(tmp_path):
    """``kvstore up`` makes tokens when none is given: its store and engine ports refuse a
    caller without them and serve one holding those of ``auth.env``; its front door, given
    an API key, answers 401 without it and 200 with it."""
    env = {k: v for k, v in os.environ.items() if k not in (STORE_TOKEN_ENV, ENGINE_TOKEN_ENV, METRICS_TOKEN_ENV)}
    env["PYTHONPATH"] = str(ROOT)
    data = tmp_path / "up"
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "up", "--engine", "builtin", "--port", "0",
                             "--data-dir", str(data),
                             "--dram", "32MiB", "--ssd", "32MiB", "--api-key", "sk-up"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("serving"):
                break
        out = "".join(lines)
        assert "serving" in out, out
        store = re.search(r"store node\s+(\S+)", out).group(1)
        engines = re.findall(r"(?:prefill|decode) engine \S+ (\S+)", out)
        url = re.search(r"front door\s+(\S+)", out).group(1)
        assert len(engines) == 2, out
        tokens = dict(line.split("=", 1) for line in (data / "auth.env").read_text().split())
        assert (data / "auth.env").stat().st_mode & 0o777 == 0o600
        assert tokens[STORE_TOKEN_ENV] != tokens[ENGINE_TOKEN_ENV]
        for address in engines:
            with grpc.insecure_channel(address) as channel:
                stub = epb_grpc.EngineStub(channel)
                with pytest.raises(grpc.RpcError) as info:
                    stub.Info(epb.InfoRequest(), timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as info:   # the store's token is not the engines'
                    stub.Info(epb.InfoRequest(), timeout=10, metadata=bearer_metadata(tokens[STORE_TOKEN_ENV]))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert stub.Info(epb.InfoRequest(), timeout=10,
                                 metadata=bearer_metadata(tokens[ENGINE_TOKEN_ENV])).engine_id
        with grpc.insecure_channel(store) as channel:
            stub = kpb_grpc.KVStoreStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Stats(kpb.StatsRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Stats(kpb.StatsRequest(), timeout=10, metadata=bearer_metadata(tokens[STORE_TOKEN_ENV]))
        body = {"prompt": "hello", "max_tokens": 2}
        assert call(url, "/v1/completions", body)[0] == 401
        status, _, data_ = call(url, "/v1/completions", body, {"Authorization": "Bearer sk-up"})
        assert status == 200, data_
        # the scrape-only token: every metrics port and the front door's /metrics, nothing else
        scrape = {"Authorization": f"Bearer {tokens[METRICS_TOKEN_ENV]}"}
        metrics_urls = re.findall(r"metrics (http://\S+/metrics)", out)
        assert len(metrics_urls) == 3, out                       # the store node and both engines
        for metrics_url in metrics_urls:
            with urllib.request.urlopen(urllib.request.Request(metrics_url, headers=scrape), timeout=10) as r:
                assert r.status == 200 and b"kvstore_" in r.read()
        assert call(url, "/metrics", None, scrape)[0] == 200
        assert call(url, "/v1/completions", body, scrape)[0] == 401
        with grpc.insecure_channel(store) as channel, pytest.raises(grpc.RpcError) as info:
            kpb_grpc.KVStoreStub(channel).Stats(kpb.StatsRequest(), timeout=10,
                                                metadata=bearer_metadata(tokens[METRICS_TOKEN_ENV]))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # no token on any child's command line
        for pid in _children(proc.pid):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert tokens[STORE_TOKEN_ENV].encode() not in cmdline and b"sk-up" not in cmdline
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            rest = proc.communicate()[0]
    assert "stopped all services" in rest, "".join(lines) + rest


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []
