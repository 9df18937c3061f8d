"""A vLLM server that ``kvstore up --engine vllm`` starts with an API key (VLLMServerSpec
``api_key``, only the front door holds it) answers no caller without it, on any path but
``/health``: vLLM's own key guards ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` only, and
serves completions on ``/invocations`` to anyone (with any ``cache_salt``: any tenant's
namespace in the pool). The read-only metrics token opens ``/metrics`` alone."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

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
    monkeypatch.setenv("KVSTORE_METRICS_TOKEN", SCRAPE)      # the server's environment is this one's
    spec = VLLMServerSpec(model_dir, free_port(), "kv_both", address, kv_cache_bytes=64 << 20,
                          max_model_len=2048, api_key=KEY)
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
    finally:
        server.stop(grace_s=10)
