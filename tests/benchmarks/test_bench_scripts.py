"""Every benchmark script that parses arguments starts: ``--help`` runs its module-level
imports (its helpers included) and prints its usage. ``make bench`` runs them only on request, so a helper
moved or renamed (an import of a helper from a module that no longer has it) would otherwise
fail unseen until a full ``make bench``."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("bench_*.py") if "argparse" in p.read_text())


def test_the_scripts_with_arguments_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"bench_vllm.py", "bench_dataplane.py", "bench_simulate.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_script_imports_and_prints_its_usage(script: Path):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                          timeout=120, cwd=BENCH.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"usage: {script.name}"), done.stdout[:500]
