"""A vLLM server started by :class:`engines.vllm.launch.VLLMServer` does not outlive the process
that started it, even when that process is killed by SIGKILL (no clean-up of its own runs):
its API server gets SIGTERM and stops its engine core, and the port is free again."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow

# The starting process: one plain vLLM server (no connector), ready, then its process group's
# members printed and a sleep until it is killed.
_STARTER = """
import json, sys, time
import psutil
from engines.vllm.launch import VLLMServer, VLLMServerSpec
from launcher.supervisor import free_port
spec = VLLMServerSpec(sys.argv[1], free_port(), "kv_both", kv_cache_bytes=32 << 20, max_model_len=1024,
                      connector=False)
server = VLLMServer(spec, sys.argv[2])
server.wait_ready(300)
top = psutil.Process(server.proc.pid)
print(json.dumps({"port": spec.port, "pids": [top.pid] + [c.pid for c in top.children(recursive=True)],
                  "tmp": server.tmp_dir}), flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(360)
def test_a_server_dies_with_the_process_that_started_it_even_by_sigkill(tmp_path) -> None:
    from engines.vllm.checkpoint import write_checkpoint
    model_dir = write_checkpoint(str(tmp_path / "tiny-llama"), "tiny", max_model_len=1024)
    log = tmp_path / "vllm.log"
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, model_dir, str(log)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    procs: list = []
    started: dict = {}
    try:
        seen = []
        for line in starter.stdout:          # the starter's own lines (warnings) before its JSON
            seen.append(line)
            if line.startswith("{"):
                break
        assert seen and seen[-1].startswith("{"), "".join(seen)
        started = json.loads(seen[-1])
        for pid in started["pids"]:
            with contextlib.suppress(psutil.NoSuchProcess):     # a short-lived helper may be gone already
                procs.append(psutil.Process(pid))
        assert len(procs) >= 2, started          # the API server and its engine core
        starter.kill()                           # SIGKILL: nothing of the starter's own runs
        starter.wait(10)
        _, alive = psutil.wait_procs(procs, timeout=60)
        assert not alive, ([p.pid for p in alive], log.read_text()[-2000:])
        held = [c for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == started["port"]]
        assert not held, held
    finally:
        for p in procs:
            if p.is_running():
                os.kill(p.pid, signal.SIGKILL)
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        if started.get("tmp"):
            shutil.rmtree(started["tmp"], ignore_errors=True)   # its starter, killed, could not
