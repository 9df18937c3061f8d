"""The serving comparison of ``benchmarks/bench_vllm.py``: ``kvstore up --replay`` over vLLM as
``make demo`` runs it (launcher/vllm_setups.py: vLLM alone with its own prefix caching, kvstore,
recompute; the same trace requests through the same front door on two vLLM instances of the
bench checkpoint each), its report kept whole under ``serving`` and its ratios checked against
the targets below (kvstore / the other set-up)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"
# ratio -> (how it must compare, bound)
SERVING_TARGETS: dict[str, tuple[str, float]] = {
    "ttft_p50_kvstore_vs_vllm": ("<=", 0.6),
    "ttft_p99_kvstore_vs_vllm": ("<=", 0.8),
    "goodput_kvstore_vs_vllm": (">=", 1.2),
    "ttft_p50_kvstore_vs_recompute": ("<=", 0.4),
}


def met(value: float | None, rule: tuple[str, float]) -> bool:
    op, bound = rule
    return value is not None and (value <= bound if op == "<=" else value >= bound)


def run_serving(requests: int, timeout_s: float = 1200.0) -> dict[str, Any]:
    """Run the comparison on ``requests`` trace requests; its JSON report with ``targets`` and
    ``met`` added, or ``{"error": ...}`` when it failed."""
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        out = Path(tmp) / "serving.json"
        cmd = [sys.executable, "-m", "launcher", "--log-level", "WARNING", "up", "--replay", str(TRACE),
               "--requests", str(requests), "--port", "0", "--data-dir", str(Path(tmp) / "up"), "--json", str(out)]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
        except subprocess.TimeoutExpired:
            return {"error": f"not done within {timeout_s:.0f} s"}
        print(proc.stdout[-6000:], flush=True)
        if proc.returncode != 0 or not out.exists():
            return {"error": f"kvstore up exited {proc.returncode}: {proc.stderr[-2000:]}"}
        report = json.loads(out.read_text())
    ratios = report["ratios"]
    report["targets"] = {k: f"{op} {bound}" for k, (op, bound) in SERVING_TARGETS.items()}
    report["met"] = {k: met(ratios.get(k), rule) for k, rule in SERVING_TARGETS.items()}
    return report
