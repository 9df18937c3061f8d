"""The cluster simulator (``kvstore simulate``): Mooncake's trace replayed in virtual time
against the real scheduler (:mod:`scheduler.policy.conductor`, :mod:`scheduler.policy.baselines`), the
real prefix index, and cost-model engines (:mod:`engines.cost_model`).

    from scheduler.sim import SimConfig, simulate
    result = simulate(SimConfig(policy="conductor", speed=2.0), "data/traces/conversation_trace.jsonl")
"""
from __future__ import annotations

import time
from pathlib import Path

from scheduler.sim.config import ADMISSIONS, TOPOLOGIES, SimConfig
from scheduler.sim.metrics import SimResult
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import load_workload, make_requests

__all__ = ["ADMISSIONS", "TOPOLOGIES", "SimConfig", "SimResult", "Simulator", "simulate"]


def simulate(cfg: SimConfig, trace_path: str | Path, limit: int | None = None, progress=None) -> SimResult:
    """Run ``cfg`` over the first ``limit`` requests (all when None) of the trace."""
    trace, keys = load_workload(trace_path, limit)
    start = time.perf_counter()
    sim = Simulator(cfg, make_requests(trace, keys, cfg.speed))
    reqs = sim.run(progress)
    return sim.summarize(reqs, time.perf_counter() - start)
