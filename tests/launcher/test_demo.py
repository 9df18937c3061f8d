"""``kvstore up --engine builtin --replay`` on 20 requests: the stack started as
separate processes (``python -m launcher up``), the conversations with the most turns in the
window replayed twice on the same engines — pool on, then pool off (every prompt recomputed)
— the two side by side, the JSON report and the PNG plots."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_demo_replays_20_requests_with_the_pool_on_and_off(tmp_path):
    out, plots = tmp_path / "demo.json", tmp_path / "plots"
    proc = subprocess.run([sys.executable, "-m", "launcher", "up", "--engine", "builtin", "--replay", str(TRACE),
                           "--requests", "20", "--speed", "30", "--port", "0", "--data-dir", str(tmp_path / "up"),
                           "--json", str(out), "--plots", str(plots)],
                          cwd=ROOT, capture_output=True, text=True, timeout=420, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    pool, off = report["pool"], report["recompute"]
    for run in (pool, off):   # both complete every request
        counts = (run["requests_sent"], run["completed"], run["rejected"], run["failed"], run["skipped"])
        assert counts == (20, 20, 0, 0, 0)
        assert run["prompt_tokens"] == pool["prompt_tokens"] > 0
    assert pool["settings"]["prefix_cache"] is True and off["settings"]["prefix_cache"] is False
    # what is replayed has reuse, the pool serves it, pool off serves none of it
    assert pool["best_possible_hit_ratio"] >= 0.3
    assert pool["hit_ratio"] > off["hit_ratio"] == 0.0 and off["cached_tokens"] == 0
    assert pool["prefill_tokens"] < off["prefill_tokens"] == off["prompt_tokens"]
    ratios = report["ratios"]
    assert ratios["prefill_tokens_pool_vs_recompute"] == pytest.approx(pool["prefill_tokens"] / off["prefill_tokens"])
    assert ratios["ttft_p50_pool_vs_recompute"] == pytest.approx(pool["ttft_p50_s"] / off["ttft_p50_s"])
    assert report["settings"]["requests"] == 20 and report["settings"]["window_s"] == 180.0
    # side by side on stdout, with the on/off ratios
    assert "pool off (recompute)" in proc.stdout and "on / off" in proc.stdout
    assert "prefill tokens computed" in proc.stdout and "stopped all services" in proc.stdout
    for name in ("demo_ttft_cdf.png", "demo_hit_ratio.png"):
        data = (plots / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
