"""The command lines as a user runs them: ``kvstore up --replay`` end to end on the vendored
trace, ``kvstore serve`` with ``kvctl`` against it, and ``--help``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.supervisor import free_port

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"


def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_up_replays_the_first_20_requests_of_the_trace_once(tmp_path):
    """One run (--no-compare) of 20 consecutive requests (--contiguous); the pool on against off
    comparison, kvstore up --replay's default, is tests/launcher/test_demo.py."""
    out = tmp_path / "report.json"
    proc = run("launcher", "up", "--engine", "builtin", "--replay", str(TRACE), "--requests", "20", "--speed", "10",
               "--contiguous", "--no-compare", "--port", "0", "--data-dir", str(tmp_path / "up"), "--json", str(out),
               timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["requests_sent"] == 20
    assert report["completed"] + report["rejected"] == 20 and report["failed"] == 0
    assert report["hit_ratio"] > 0
    assert report["hit_ratio"] <= report["best_possible_hit_ratio"] + 1e-9
    assert "prefix hit ratio" in proc.stdout and "stopped all services" in proc.stdout


@pytest.fixture()
def store_node(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--port", str(port),
                             "--dram", "4MiB", "--ssd", "16MiB", "--data-dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()                           # logs go to stderr
        assert "serving on" in line, line
        yield f"127.0.0.1:{port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:                                 # never leave a node behind
            proc.kill()
            proc.wait()


def test_kvctl_tiers_and_evict(store_node):
    from kvstore.client import StoreClient
    with StoreClient(store_node) as client:
        for i in range(6):
            assert client.put((b"block-%d" % i).ljust(32, b"."), os.urandom(1 << 20)).ok
    tiers = run("kvstore.kvctl", "--store", store_node, "tiers", "--json")
    assert tiers.returncode == 0, tiers.stderr
    first = run("kvstore.kvctl", "--json", "--store", store_node, "tiers")     # --json before the command too
    assert first.returncode == 0 and json.loads(first.stdout)["tiers"], first.stderr
    stats = {t["name"]: t for t in json.loads(tiers.stdout)["tiers"]}
    assert stats["dram"]["capacity_bytes"] == 4 << 20
    assert stats["dram"]["blocks"] + stats["ssd"]["blocks"] >= 6
    assert stats["dram"]["demotions"] >= 2                      # 6 MiB through a 4 MiB DRAM tier
    evict = run("kvstore.kvctl", "--store", store_node, "evict", "--tier", "dram", "--bytes", "1MiB")
    assert evict.returncode == 0 and "evicted 1 block," in evict.stdout, evict.stdout + evict.stderr
    table = run("kvstore.kvctl", "--store", store_node, "tiers")
    assert table.returncode == 0 and "dram" in table.stdout and "evictions" in table.stdout
    bad = run("kvstore.kvctl", "--store", store_node, "evict", "--tier", "tape", "--bytes", "1")
    assert bad.returncode == 1 and "no tier 'tape'" in bad.stderr
    huge = run("kvstore.kvctl", "--store", store_node, "evict", "--tier", "dram", "--bytes", "9" * 23)
    assert huge.returncode == 1 and "--bytes: an eviction is at most 2**64 - 1 bytes" in huge.stderr, huge.stderr


def test_kvctl_tiers_shows_a_small_holding_not_as_zero(store_node):
    """One 8 KiB block (2 pages of DRAM) is 0.0078 MiB: the table printed 0.0 for it."""
    from kvstore.client import StoreClient
    with StoreClient(store_node) as client:
        assert client.put(b"small".ljust(32, b"."), os.urandom(8192)).ok
    table = run("kvstore.kvctl", "--store", store_node, "tiers")
    assert table.returncode == 0, table.stderr
    dram = next(line for line in table.stdout.splitlines() if line.startswith("dram"))
    assert "0.0078" in dram.split(), dram


def test_a_second_node_on_a_used_port_is_refused(store_node, tmp_path):
    port = store_node.rsplit(":", 1)[1]
    proc = run("launcher", "serve", "--port", port, "--node-id", "impostor", "--dram", "1MiB",
               "--ssd", "0", "--data-dir", str(tmp_path / "b"))
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port} (port in use" in proc.stderr


def test_kvctl_rejects_a_key_that_is_not_a_block_key(store_node):
    proc = run("kvstore.kvctl", "--store", store_node, "pin", "deadbeef")
    assert proc.returncode == 1 and "not a block key" in proc.stderr
    assert "--full-keys" in proc.stderr            # ls prints 16 hex digits: where the whole key is
    proc = run("kvstore.kvctl", "--store", store_node, "inspect", "zz")
    assert proc.returncode == 1 and "'zz' is not a block key: a key is hex digits" in proc.stderr
    assert "fromhex" not in proc.stderr


def test_kvctl_reports_an_unreachable_node():
    proc = run("kvstore.kvctl", "--store", f"127.0.0.1:{free_port()}", "--timeout", "2", "tiers")
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr


def test_kvctl_refuses_an_address_that_is_not_host_port():
    for bad in ("127.0.0.1:99999", "127.0.0.1:0", "localhost"):
        proc = run("kvstore.kvctl", "--store", bad, "--timeout", "2", "tiers")
        assert proc.returncode == 1 and f"--store {bad!r} is not host:port" in proc.stderr, proc.stderr


def test_serve_rejects_a_bad_size(tmp_path):
    proc = run("launcher", "serve", "--dram", "lots", "--data-dir", str(tmp_path))
    assert proc.returncode == 2 and "cannot read 'lots' as a size" in proc.stderr


@pytest.mark.parametrize("flags,message", [
    (("--lease-ttl", "nan"), "lease_ttl_s must be a finite number"),          # served, its leases never ending
    (("--lease-ttl", "inf"), "lease_ttl_s must be a finite number"),
    (("--reservation-timeout", "nan"), "reservation_timeout_s must be a finite number"),
    (("--dram", "99999999TiB"), "capacity must be a whole number of bytes in (0, 2**63)"),   # an OverflowError
])
def test_serve_rejects_a_setting_it_cannot_run_with(tmp_path, flags, message):
    proc = run("launcher", "serve", "--port", "0", "--ssd", "0", "--data-dir", str(tmp_path), *flags)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("command", ["serve", "engine", "scheduler", "up", "replay"])
def test_help_explains_each_command(command):
    proc = run("launcher", command, "--help")
    assert proc.returncode == 0 and "usage: kvstore " + command in proc.stdout


def test_replay_takes_its_api_key_from_openai_api_key(monkeypatch):
    """As the openai SDK does: a key in the environment, not in argv where ps shows it."""
    from launcher.cli import build_parser
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
    assert build_parser().parse_args(["replay", "--target", "http://127.0.0.1:1"]).api_key == "sk-from-env"
    args = build_parser().parse_args(["replay", "--target", "http://127.0.0.1:1", "--api-key", "sk-flag"])
    assert args.api_key == "sk-flag"
    monkeypatch.delenv("OPENAI_API_KEY")
    assert build_parser().parse_args(["replay", "--target", "http://127.0.0.1:1"]).api_key is None


@pytest.mark.parametrize("argv, message", [
    (["engine", "--role", "prefill", "--port", "99999"], "argument --port: a port is 0-65535, got 99999"),
    (["engine", "--role", "decode", "--metrics-port", "70000"], "argument --metrics-port: a port is 0-65535"),
    (["scheduler", "--port", "-1"], "argument --port: a port is 0-65535, got -1"),
    (["up", "--port", "http"], "argument --port: not a port number: 'http'"),
    (["serve", "--control-port", "65536"], "argument --control-port: a port is 0-65535"),
    (["scheduler", "--prefill", "nonsense", "--decode", "127.0.0.1:5"], "not a host:port address"),
    (["scheduler", "--prefill", "127.0.0.1:1,h:0", "--decode", "127.0.0.1:5"], "'h:0'"),
    (["engine", "--role", "prefill", "--store", "127.0.0.1"], "argument --store: not a host:port address"),
    (["up", "--setups", "vllm,sglang"], "argument --setups: sglang: not a set-up (choose from vllm, kvstore, "
                                        "recompute)"),
])
def test_ports_and_addresses_are_checked_before_anything_starts(argv, message, capsys):
    """Every command refuses a port out of range or an address without one at once, naming
    the flag (an engine served on a random port instead, a scheduler died with a traceback
    after waiting for its engines, or waited 60 s for 'nonsense')."""
    from launcher.cli import build_parser
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    args = build_parser().parse_args(["scheduler", "--prefill", "127.0.0.1:1,localhost:2", "--decode", "[::1]:5",
                                      "--port", "0"])
    assert args.port == 0 and args.prefill == "127.0.0.1:1,localhost:2"
    assert build_parser().parse_args(["up", "--setups", "kvstore, vllm"]).setups == ("vllm", "kvstore")   # run order


def test_engine_names_a_device_it_cannot_use_in_one_line():
    """``kvstore engine --device cuda`` on a machine without CUDA ended in a traceback
    (``Torch not compiled with CUDA enabled``, from the model's ``.to``); the HBM tier's
    one-line refusal is now the engine's too, as is a name torch does not know."""
    import torch
    cases = [("tpu9", "--device 'tpu9': not a torch device")]
    if not torch.cuda.is_available():
        cases.append(("cuda", "--device 'cuda': torch sees no CUDA device here"))
    for device, said in cases:
        proc = run("launcher", "engine", "--role", "decode", "--port", "0", "--device", device)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_no_store_with_a_redis_given_on_the_command_line_is_refused(monkeypatch, capsys):
    """``--no-store --redis URL`` asks for no pool and for a cluster's pool at once. The
    environment's ``KVSTORE_REDIS_URL`` alone (set on a cluster's hosts) is not a contradiction:
    ``--no-store`` ignores it (tests/launcher/test_pool_off.py serves a request that way)."""
    from launcher.cli import main
    monkeypatch.setenv("KVSTORE_REDIS_URL", "redis://127.0.0.1:1/0")
    argv = ["scheduler", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--no-store"]
    assert main([*argv, "--redis", "redis://127.0.0.1:2/0"]) == 2
    assert "--no-store and --redis contradict each other" in capsys.readouterr().err


def test_up_max_model_len_is_the_vllm_instances_context_length_too():
    """``kvstore up --max-model-len`` was ignored over vLLM (its instances took
    --vllm-max-model-len's 8192): it now sets both; without it each engine keeps its default."""
    from launcher.cli import UP_MAX_MODEL_LEN, build_parser, up_defaults
    args = build_parser().parse_args(["up", "--max-model-len", "4096"])
    assert up_defaults(args) and (args.max_model_len, args.vllm_max_model_len) == (4096, 4096)
    args = build_parser().parse_args(["up"])
    assert up_defaults(args) and args.max_model_len == args.vllm_max_model_len == 8192
    args = build_parser().parse_args(["up", "--engine", "builtin"])
    assert not up_defaults(args) and args.max_model_len == UP_MAX_MODEL_LEN


def test_kvstore_raises_its_open_files_limit_to_the_hard_limit():
    """Each connection takes a descriptor: a service started with a soft limit of 1,024 was
    soon out of them. A kvstore command raises the soft limit to the hard one at start."""
    import resource
    import subprocess
    import sys
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    code = ("import resource, launcher.cli as c; c.raise_fd_limit(); "
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, "
                          f"({min(256, hard)}, {hard})); {code}"], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.split()
    assert [int(x) for x in out] == [hard, hard]


def test_scheduler_on_a_taken_port_says_so_at_once():
    """``kvstore scheduler --port P`` with P taken waited up to 60 s for its engines before
    it found out; it now says so before anything else."""
    import socket
    import subprocess
    import sys
    import time
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "launcher", "scheduler", "--port", str(port), "--prefill",
                               "127.0.0.1:1", "--decode", "127.0.0.1:1"], capture_output=True, text=True, timeout=60,
                              cwd=ROOT)
    assert proc.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 30
