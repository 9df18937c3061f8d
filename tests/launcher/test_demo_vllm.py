"""``kvstore up --replay`` as ``make demo`` runs it, with no ``--engine`` (vLLM): three set-ups —
vLLM alone, kvstore, recompute — one after another on the same 10 trace requests, each on two
vLLM instances of the bench checkpoint. Each instance's own KV cache is cut to 1,280 tokens
here, below the requests' working set (1,760), so that what the pool adds shows in ten
requests; it still holds the longest prompt beside a short one, so the front door's
decode-capacity admission refuses none. Then ``kvstore up`` as the README starts it, serving
until SIGTERM."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RATIOS = ("ttft_p50_kvstore_vs_vllm", "ttft_p99_kvstore_vs_vllm", "goodput_kvstore_vs_vllm",
          "ttft_p50_kvstore_vs_recompute", "prefill_tokens_kvstore_vs_vllm")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    tmp = tmp_path_factory.mktemp("demo-vllm")
    out, plots = tmp / "demo.json", tmp / "plots"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp / "cache"))    # the bench checkpoint is written there
    proc = subprocess.run([sys.executable, "-m", "launcher", "up", "--replay", str(TRACE), "--requests", "10",
                           "--speed", "10", "--port", "0", "--data-dir", str(tmp / "up"), "--json", str(out),
                           "--plots", str(plots), "--vllm-kv-cache", "40MiB", "--vllm-max-model-len", "1088",
                           "--dram", "512MiB"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), plots


@pytest.mark.slow
@pytest.mark.timeout(600)   # the fixture's six vLLM start-ups and three 18-s replays: 2-2.5 min on 2 cores
def test_kvstore_up_without_engine_runs_vllm_in_three_setups_on_the_same_requests(demo) -> None:
    proc, report, plots = demo
    setups = report["setups"]
    assert list(setups) == ["vllm", "kvstore", "recompute"]
    assert "vLLM kv_both" in proc.stdout and "kvstore connector on" in proc.stdout
    for name, run in setups.items():
        r = run["report"]
        # every request is served; with caches this small the front door may refuse one
        # early when an instance's KV would be full (429 decode_capacity, before any prefill)
        assert (r["requests_sent"], r["failed"], r["skipped"]) == (10, 0, 0), name
        assert r["completed"] >= 8 and set(r["rejected_by_reason"]) <= {"decode_capacity"}, (name, r)
        assert r["prompt_tokens"] == setups["recompute"]["report"]["prompt_tokens"] > 0
    # the pool only in kvstore; no reuse at all in recompute
    assert setups["recompute"]["hit_tokens"]["local"] == setups["recompute"]["hit_tokens"]["pool"] == 0
    assert setups["vllm"]["hit_tokens"]["pool"] == 0
    assert setups["kvstore"]["memory_bytes"]["pool_dram"] == 512 << 20
    assert setups["vllm"]["memory_bytes"] == setups["recompute"]["memory_bytes"] == {"instances_kv": 2 * (40 << 20)}
    # the share of the completed requests' prompt tokens each set-up computed
    computed = {name: run["report"]["prefill_tokens"] / sum(q["prompt_tokens"] for q in run["requests"]
                                                           if q["status"] == "ok")
                for name, run in setups.items()}
    assert computed["kvstore"] < computed["vllm"] < computed["recompute"] == 1.0
    ratios = report["ratios"]
    for key in RATIOS:
        assert ratios[key] is not None and ratios[key] > 0, key
    assert ratios["prefill_tokens_kvstore_vs_vllm"] == pytest.approx(
        setups["kvstore"]["report"]["prefill_tokens"] / setups["vllm"]["report"]["prefill_tokens"])
    # greedy: the loaded KV gives the tokens recomputing gives, in every set-up
    assert report["output_match_vs_recompute"]["kvstore"] == report["output_match_vs_recompute"]["vllm"] == 1.0
    assert report["settings"]["instance_kv_vs_working_set"] < 1.0
    for key in ("date", "commit", "machine"):
        assert report["settings"][key]
    assert "kvstore / vLLM" in proc.stdout and "stopped all services" in proc.stdout
    for name in ("demo_ttft_cdf.png", "demo_hit_ratio.png"):
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_each_instance_gets_cores_of_its_own_where_there_are_enough() -> None:
    from launcher.vllm_setups import cpu_sets
    assert cpu_sets(2, [0, 1]) == [(0,), (1,)]
    assert cpu_sets(2, [0, 1, 2, 3, 4]) == [(0, 1), (2, 3)]
    assert cpu_sets(3, [0, 1]) == [(), (), ()]      # fewer cores than instances: none pinned


def _kvctl_finds_the_prompts_blocks(env: dict[str, str], prompt: str, prompt_tokens: int) -> None:
    """``kvctl lookup --prompt`` after ``kvstore up`` over vLLM keys the prompt as the connector
    did (the record's key spec, the checkpoint's tokenizer) and finds every full block of it
    in the pool, saved there by the instance that served it."""
    import time

    from tests.helpers.kvctl_helpers import kvctl
    env = {k: v for k, v in env.items() if not k.startswith("KVSTORE_")}
    deadline = time.monotonic() + 30
    while True:          # the connector saves a request's blocks as it finishes: wait for them
        rc, doc, err = kvctl(env, "lookup", "--prompt", prompt)
        assert rc == 0, err
        if doc["held_prefix_blocks"] == len(doc["blocks"]) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert doc["tokens"] == prompt_tokens and doc["namespace"] == "public", doc
    assert doc["key_spec_from"].startswith("kvstore up's vLLM connector")
    assert len(doc["blocks"]) == prompt_tokens // doc["block_size"] > 0
    assert doc["held_prefix_blocks"] == len(doc["blocks"]), doc
    rc, doc, err = kvctl(env, "lookup", "--prompt", prompt, "--tenant", "sk-someone-else")
    assert rc == 0 and doc["held_prefix_blocks"] == 0, err      # another tenant's keys differ


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kvstore_up_serves_over_vllm_until_sigterm_stops_every_instance(tmp_path) -> None:
    """``kvstore up`` as the README starts it (vLLM, no --replay): it serves completions through
    its front door, records itself for kvctl, holds each instance's port (another user cannot
    bind it) and on SIGTERM stops every vLLM instance (they run in sessions of their own)."""
    import json as _json
    import re
    import shutil
    import signal
    import tempfile
    import time
    import urllib.request

    import psutil

    from tests.helpers.other_user import SYSTEM_PYTHON, binds_as_nobody
    from tests.helpers.process_lines import collect_lines
    # a short data directory: the instances' KV-event sockets live in it (107 bytes at most)
    data_dir = tempfile.mkdtemp(prefix="kvup-", dir="/tmp")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_RUNTIME_DIR=str(tmp_path / "run"))
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "up", "--port", "0", "--data-dir", data_dir,
                             "--vllm-kv-cache", "40MiB", "--vllm-max-model-len", "1088", "--dram", "256MiB"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, ready = collect_lines(proc, "serving;")
    try:
        deadline = time.monotonic() + 300
        while not ready.wait(0.5):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
        out = "".join(lines)
        url = re.search(r"^front door +(http://\S+)", out, re.M).group(1)
        ports = [int(p) for p in re.findall(r"^vLLM kv_both .* http://127\.0\.0\.1:(\d+)", out, re.M)]
        assert len(ports) == 2 and "kvctl          finds this stack" in out, out
        prompt = "the same words again and again, " * 12
        body = _json.dumps({"prompt": prompt, "max_tokens": 3}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            usage = _json.loads(r.read())["usage"]
        assert usage["completion_tokens"] == 3
        _kvctl_finds_the_prompts_blocks(env, prompt, usage["prompt_tokens"])
        if os.geteuid() == 0 and SYSTEM_PYTHON:
            assert binds_as_nobody("127.0.0.1", ports[0]) == ["EADDRINUSE"] * 8
        instances = [p for p in psutil.process_iter(["cmdline"])
                     if "engines.vllm.api_server" in (p.info["cmdline"] or [])
                     and any(str(port) in (p.info["cmdline"] or []) for port in ports)]
        assert len(instances) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0          # serving, a stop asked for (130 when it cuts a start or a replay)
        _, alive = psutil.wait_procs(instances, timeout=30)
        assert not alive, [p.pid for p in alive]
        assert "kvstore up: SIGTERM: stopping" in "".join(lines) and "stopped all services" in "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(data_dir, ignore_errors=True)
