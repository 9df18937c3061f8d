"""Shared pieces of the fuzz targets (tests/test_fuzz_*.py): hypothesis settings for a short,
deterministic run (``make test``) or a long, random one (``make fuzz``), and the record of
executions per wire that the test session prints at its end (tests/conftest.py).

``KVSTORE_FUZZ_SCALE`` (default 1) multiplies every target's example count; ``make fuzz``
sets it (FUZZ_SCALE, default 20) and with it turns derandomization off, so each long run explores new inputs
(hypothesis prints the seed of a failing one).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import HealthCheck, settings

SCALE = max(1, int(os.environ.get("KVSTORE_FUZZ_SCALE", "1")))
LONG = SCALE > 1


@dataclass
class FuzzRun:
    """One target's run: ``wire`` names the decoder, ``executions`` inputs fed, ``seconds`` wall."""

    wire: str
    executions: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.executions / self.seconds if self.seconds else 0.0


RUNS: list[FuzzRun] = []


def fuzz_settings(examples: int) -> settings:
    """``examples`` inputs (times SCALE), no deadline per input (real servers answer them),
    no example database (runs stay independent of earlier ones), derandomized unless LONG."""
    return settings(max_examples=examples * SCALE, deadline=None, derandomize=not LONG, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much],
                    print_blob=True)


class Counter:
    """Counts the inputs a target fed (``counter()`` once per input)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


def run_target(wire: str, target: Callable[[], None], counter: Counter) -> FuzzRun:
    """Run a hypothesis-decorated ``target`` (it calls ``counter()`` per input) and record
    its executions per second under ``wire``."""
    t0 = time.perf_counter()
    target()
    run = FuzzRun(wire, counter.n, time.perf_counter() - t0)
    RUNS.append(run)
    return run


def summary_lines() -> list[str]:
    """One line per target run this session, and the total."""
    if not RUNS:
        return []
    lines = [f"{r.wire:<34} {r.executions:>8} inputs {r.seconds:>8.2f} s {r.per_second:>9.1f}/s" for r in RUNS]
    total_n, total_s = sum(r.executions for r in RUNS), sum(r.seconds for r in RUNS)
    lines.append(f"{'all wires':<34} {total_n:>8} inputs {total_s:>8.2f} s (scale {SCALE})")
    return lines
