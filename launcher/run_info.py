"""Where and when a figure was measured. Every benchmark writes its JSON through :func:`write_results`,
which adds ``run``: the UTC date and time, the commit (with ``-dirty`` when the tree differed
from it) and the machine (CPU model and cores, memory, GPU, OS, Python). ``benchmarks/report.py``
prints them above each generated table of docs/benchmarks.md."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]   # the checkout


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def commit() -> str:
    """The checked-out commit (12 hex digits), ``-dirty`` when tracked files differ from it;
    ``unknown`` outside a git checkout."""
    head = _git("rev-parse", "--short=12", "HEAD")
    if not head:
        return "unknown"
    return head + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpus() -> list[str]:
    """GPU names from ``nvidia-smi`` (none without it): no torch import, so a benchmark that
    does not use torch does not pay for it."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def machine() -> dict[str, Any]:
    mem = _memory_gib()
    gpus = _gpus()
    summary = f"{_cpu_model()}, {os.cpu_count()} cores" + (f", {mem:g} GiB" if mem else "")
    summary += f", {len(gpus)}x {gpus[0]}" if gpus else ", no GPU"
    return {"summary": summary, "cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": mem, "gpus": gpus,
            "os": platform.platform(), "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def run_info() -> dict[str, Any]:
    now = datetime.datetime.now(datetime.UTC)
    return {"date": now.strftime("%Y-%m-%d"), "time_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit(), "machine": machine()}


def write_results(path: Path | str, report: dict[str, Any], **dump: Any) -> Path:
    """Write ``report`` with its ``run`` (:func:`run_info`) to ``path`` as indented JSON,
    making the directory; ``dump`` goes to :func:`json.dumps` (e.g. ``default=str``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**report, "run": run_info()}, indent=2, **dump) + "\n")
    return path
