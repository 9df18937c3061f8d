"""Running kvctl as a user does (a subprocess, ``--json`` parsed), isolated from any
``kvstore up`` record and token of the machine it runs on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-store-token-0123456789"


def kvctl_env(tmp_path: Path, token: str | None = TOKEN, redis_url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVSTORE_STORE_TOKEN", "KVSTORE_REDIS_URL", "KVSTORE_ENGINE_TOKEN")}
    env["KVSTORE_UP_FILE"] = str(tmp_path / "no-stack" / "up.json")
    env["PYTHONPATH"] = str(ROOT)
    if token:
        env["KVSTORE_STORE_TOKEN"] = token
    if redis_url:
        env["KVSTORE_REDIS_URL"] = redis_url
    return env


def kvctl(env: dict[str, str], *argv: str, json_out: bool = True) -> tuple[int, Any, str]:
    """(exit code, parsed JSON stdout or the text, stderr) of ``python -m kvstore.kvctl ARGV --json``."""
    # a generous --timeout: the test machine is shared and loaded
    timeout = [] if "--timeout" in argv else ["--timeout", "60"]
    proc = subprocess.run([sys.executable, "-m", "kvstore.kvctl", *timeout, *argv, *(["--json"] if json_out else [])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    out: Any = proc.stdout
    if json_out and proc.stdout.strip():
        out = json.loads(proc.stdout)
    return proc.returncode, out, proc.stderr


def block(i: int, tag: bytes = b"k") -> bytes:
    """A 32-byte block key."""
    return (tag + b"-%04d" % i).ljust(32, b".")
