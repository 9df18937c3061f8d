"""The serving comparison: ``kvstore up --replay`` over vLLM as ``make demo`` runs it
(launcher/vllm_setups.py: vLLM alone with its own prefix caching, kvstore, recompute; the same
trace requests through the same front door on two vLLM instances of the bench checkpoint each),
its report written whole to ``benchmarks/results/serving.json`` with its ratios checked against
the targets below (kvstore / the other set-up). ``benchmarks/bench_vllm.py`` runs it after the
connectors; ``python benchmarks/vllm_serving.py`` runs it alone. The README's demo table is
generated from its JSON (``benchmarks/report.py``)."""
from __future__ import annotations

import argparse
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


def up_replay(extra: list[str], timeout_s: float) -> dict[str, Any]:
    """``kvstore up --replay`` of the trace with ``extra`` flags (``--requests``, ``--speed``,
    ``--setups``, ...): its JSON report, or ``{"error": ...}`` when it failed."""
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        out = Path(tmp) / "serving.json"
        cmd = [sys.executable, "-m", "launcher", "--log-level", "WARNING", "up", "--replay", str(TRACE), *extra,
               "--port", "0", "--data-dir", str(Path(tmp) / "up"), "--json", str(out)]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
        except subprocess.TimeoutExpired:
            return {"error": f"not done within {timeout_s:.0f} s"}
        print(proc.stdout[-6000:], flush=True)
        if proc.returncode != 0 or not out.exists():
            return {"error": f"kvstore up exited {proc.returncode}: {proc.stderr[-2000:]}"}
        return json.loads(out.read_text())


def run_serving(requests: int, timeout_s: float = 1200.0) -> dict[str, Any]:
    """Run the comparison on ``requests`` trace requests; its JSON report with ``targets`` and
    ``met`` added, or ``{"error": ...}`` when it failed."""
    report = up_replay(["--requests", str(requests)], timeout_s)
    if "error" in report:
        return report
    ratios = report["ratios"]
    report["targets"] = {k: f"{op} {bound}" for k, (op, bound) in SERVING_TARGETS.items()}
    report["met"] = {k: met(ratios.get(k), rule) for k, rule in SERVING_TARGETS.items()}
    return report


RESULTS = ROOT / "benchmarks" / "results" / "serving.json"


def measure(requests: int) -> dict[str, Any]:
    """Run the comparison and write :data:`RESULTS` (unless it failed); returns the report."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.run_info import write_results
    report = run_serving(requests)
    if "error" not in report:
        write_results(RESULTS, report)
        print(f"wrote {RESULTS.relative_to(ROOT)}", flush=True)
    for key, ok in report.get("met", {}).items():
        print(f"  {key:34s} {report['ratios'].get(key)!s:>22}  target {report['targets'][key]}: "
              f"{'met' if ok else 'NOT met'}", flush=True)
    return report


def plot(out_dir: Path) -> list[Path]:
    """The TTFT CDF and hit-ratio PNGs of :data:`RESULTS` in ``out_dir`` (docs/ holds the one
    the README shows)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from scheduler.replay.compare_setups import SetupComparison
    from scheduler.replay.plots import write_plots
    return write_plots(SetupComparison.from_dict(json.loads(RESULTS.read_text())), out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=100, help="trace requests to replay (default 100, as make demo)")
    p.add_argument("--plots", metavar="DIR", type=Path,
                   help="only draw serving.json's TTFT CDF and hit ratio PNGs in DIR (e.g. docs), run nothing")
    args = p.parse_args(argv)
    if args.plots:
        print("\n".join(f"wrote {path}" for path in plot(args.plots)))
        return 0
    return 1 if "error" in measure(args.requests) else 0


if __name__ == "__main__":
    sys.exit(main())
