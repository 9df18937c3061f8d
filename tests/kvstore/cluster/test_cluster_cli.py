"""``kvstore up --store-nodes 3`` end to end: a private Redis with a password (handed to the
children in KVSTORE_REDIS_URL, never on a command line), three store nodes registered in
it, engines and scheduler in cluster mode, a short trace replay with prefix hits, and every
service (Redis included) stopped at the end."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"


@pytest.mark.slow
def test_up_with_three_store_nodes_replays_through_the_cluster(tmp_path, redis_server):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "launcher", "up", "--engine", "builtin", "--store-nodes", "3",
                           "--replay", str(TRACE),
                           "--requests", "8", "--speed", "8", "--contiguous", "--no-compare", "--port", "0",
                           "--dram", "32MiB", "--ssd", "0",
                           "--data-dir", str(tmp_path / "up"), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["completed"] + report["rejected"] == 8 and report["failed"] == 0
    assert report["hit_ratio"] > 0                       # lookups found blocks across the nodes
    assert proc.stdout.count("store node ") == 3
    # the private Redis, on a Unix socket: a password, shown redacted, never in full
    assert re.search(r"unix://:\*\*\*@/\S+/redis-\d+\.sock\?db=0", proc.stdout), proc.stdout
    assert not re.search(r"(redis|unix)://:(?!\*\*\*@)", proc.stdout + proc.stderr)
    logs = tmp_path / "up" / "logs"
    assert {p.name for p in logs.iterdir()} >= {"redis.log", "store-0.log", "store-1.log", "store-2.log"}
    assert "stopped all services" in proc.stdout
