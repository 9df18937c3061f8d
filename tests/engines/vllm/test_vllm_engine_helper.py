"""The test helper's vLLM engine (tests/helpers/vllm_engine.py): a process that a test leaves
open does not keep the Python process that started it from exiting."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = """
import sys
from tests.helpers.vllm_engine import Engine

if __name__ == "__main__":
    engine = Engine(sys.argv[1], sys.argv[2])   # never closed
    print("ready", flush=True)
"""


def test_an_engine_left_open_is_closed_at_exit(tmp_path) -> None:
    from engines.vllm.checkpoint import write_checkpoint
    model_dir = write_checkpoint(str(tmp_path / "tiny-llama"), "tiny", max_model_len=1024)
    script = tmp_path / "leave_open.py"
    script.write_text(SCRIPT)
    try:
        done = subprocess.run([sys.executable, str(script), model_dir, str(tmp_path / "engine.log")], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung at exit with its vLLM engine open")
    assert done.returncode == 0 and "ready" in done.stdout, done.stderr[-3000:]
