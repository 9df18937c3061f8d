"""A vLLM server that ``kvstore up --engine vllm`` starts with an API key (VLLMServerSpec
``api_key``, only the front door holds it) answers no caller without it, on any path but
``/health``: vLLM's own key guards ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` only, and
serves completions on ``/invocations`` to anyone (with any ``cache_salt``: any tenant's
namespace in the pool). The read-only metrics token (``metrics_token``, which ``kvstore up``
gives every instance it starts) opens ``/metrics`` alone."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from engines.vllm.launch import SERVED_MODEL_NAME, VLLMServerSpec, start_servers  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "vllm-instance-key-0123456789"
SCRAPE = "metrics-scrape-token-0123456789"


def _call(url: str, body: dict | None = None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_only_the_key_holder_reaches_a_keyed_vllm_server(same_host_store, tmp_path, monkeypatch):
    from engines.vllm.checkpoint import write_checkpoint
    model_dir = write_checkpoint(str(tmp_path / "tiny-llama"), "tiny", max_model_len=2048)
    _, address = same_host_store
    monkeypatch.delenv("KVSTORE_METRICS_TOKEN", raising=False)   # the spec alone gives the server its token
    spec = VLLMServerSpec(model_dir, free_port(), "kv_both", address, kv_cache_bytes=64 << 20,
                          max_model_len=2048, api_key=KEY, metrics_token=SCRAPE)
    (server,) = start_servers([spec], tmp_path / "logs", ["keyed"], timeout_s=300)
    try:
        body = {"model": SERVED_MODEL_NAME, "prompt": "hello there", "max_tokens": 2,
                "cache_salt": "key-0123456789abcdef"}                      # any tenant's namespace
        assert _call(server.url + "/health") == 200                        # probes stay open
        for path in ("/invocations", "/v1/completions", "/tokenize", "/metrics"):
            assert _call(server.url + path, body if path != "/metrics" else None) == 401, path
        assert _call(server.url + "/v1/completions", body, KEY) == 200
        assert _call(server.url + "/metrics", None, KEY) == 200
        assert _call(server.url + "/metrics", None, SCRAPE) == 200                # the read-only token: metrics
        for path in ("/invocations", "/v1/completions", "/tokenize"):            # and nothing else
            assert _call(server.url + path, body, SCRAPE) == 401, path
        # vLLM's temporary files (ZeroMQ sockets, rendezvous file) in a directory of this user's alone
        tmp = Path(server.tmp_dir)
        assert tmp.stat().st_mode & 0o777 == 0o700 and any(p.is_socket() for p in tmp.iterdir())
    finally:
        server.stop(grace_s=10)
    assert not tmp.exists()                                                # removed at the stop


@pytest.mark.parametrize("setup", ["vllm", "kvstore", "recompute"])
def test_kvstore_up_gives_every_vllm_instance_its_key_and_the_stacks_metrics_token(setup, monkeypatch):
    """The instances of each of ``kvstore up``'s set-ups get the engines' token as their API
    key and the stack's metrics token (auth.env) for a scraper of their ``/metrics``."""
    import argparse
    import tempfile

    from launcher.vllm_setups import SETUPS, _specs
    monkeypatch.delenv("KVSTORE_METRICS_TOKEN", raising=False)
    tokens = {"KVSTORE_STORE_TOKEN": "store-token-0123456789", "KVSTORE_ENGINE_TOKEN": KEY,
              "KVSTORE_METRICS_TOKEN": SCRAPE}
    ports = iter(range(41000, 41010))
    with tempfile.TemporaryDirectory(prefix="kvup-", dir="/tmp") as data_dir:   # its KV-event socket paths fit
        args = argparse.Namespace(prefill_instances=1, decode_instances=1, topology="colocated", host="127.0.0.1",
                                  vllm_kv_cache="64MiB", vllm_max_model_len=2048, data_dir=data_dir)
        _, _, specs = _specs(args, SETUPS[setup], data_dir + "/model", "127.0.0.1:1", tokens, lambda: next(ports))
    assert len(specs) == 2
    for spec in specs:
        env = spec.env()
        assert (env["VLLM_API_KEY"], env["KVSTORE_METRICS_TOKEN"]) == (KEY, SCRAPE)
        assert KEY not in " ".join(spec.argv()) and SCRAPE not in " ".join(spec.argv())
