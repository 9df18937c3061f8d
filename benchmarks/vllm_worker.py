"""One set-up of benchmarks/bench_vllm.py: a fresh in-process vLLM engine that serves the
benchmark's prompts one at a time and writes what it measured.

Run by bench_vllm.py as ``PYTHON benchmarks/vllm_worker.py SPEC.json OUT.json`` with the
interpreter of the set-up's venv (kvstore's, or LMCache's own); it needs vLLM and the standard
library only. SPEC holds ``model``, ``llm`` (keyword arguments of ``vllm.LLM``),
``connector`` (``{"module", "class", "extra_config"}`` or null for recompute), ``warmup``
and ``requests`` (lists of ``{"id", "prompt_token_ids", "max_tokens"}``). The connector is
wrapped in benchmarks/vllm_timing.py's ``TimedConnector``; its module is imported before the
engine starts, and :func:`scan_safe_namespaces` keeps what it imports (llvmlite, for LMCache)
from killing the engine's start.

Per request: TTFT = ``first_token_ts - queued_ts`` of vLLM's own ``RequestStateStats``
(engine-core monotonic clock: from the request entering the scheduler's queue to its first
token, so a connector's lookup, load and any wait for an asynchronous load are inside it);
``num_cached_tokens`` of the ``RequestOutput``; the decode time ``last_token_ts -
first_token_ts``; the wall time of the ``generate`` call; the connector's totals of
vllm_timing.STATS accrued during the call. After each request the engine is stepped until its
scheduler holds nothing (:func:`drain`), as a server's engine loop would. The warm-up requests (a prompt, then the same
prompt again, so both store and load paths are warm) are served first and not counted.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMED_MODULE = "benchmarks.vllm_timing"


def kv_transfer_config(connector: dict | None) -> dict | None:
    """vLLM's ``kv_transfer_config`` that loads the timing subclass of ``connector``."""
    if connector is None:
        return None
    os.environ["BENCH_VLLM_BASE_CONNECTOR"] = f"{connector['module']}:{connector['class']}"
    return {"kv_connector": "TimedConnector", "kv_connector_module_path": TIMED_MODULE,
            "kv_role": "kv_both", "kv_connector_extra_config": connector.get("extra_config", {})}


@contextmanager
def scan_safe_namespaces(hidden: list[str]):
    """Hide, while the engine starts, module attributes that break vLLM's start-up scan.

    vLLM's CPU platform rebinds its Triton-kernel fallbacks at worker start by walking every
    module namespace in ``sys.modules`` and reading ``vars(value).get("kernel")``. llvmlite's
    lazy library handle (``llvmlite.binding.ffi.lib``, imported by LMCache through numba)
    answers ``vars()`` with a function wrapper, and the engine dies with AttributeError. Such
    values are taken out of their namespace for the engine's start and put back after; their
    names are appended to ``hidden``."""
    removed = []
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            try:
                ok = not hasattr(value, "__dict__") or isinstance(vars(value), Mapping)
            except TypeError:
                ok = True
            except Exception:  # noqa: BLE001 — anything vars() can raise would kill the scan too
                ok = False
            if not ok:
                removed.append((namespace, attr, value))
                hidden.append(f"{name}.{attr}")
                del namespace[attr]
    try:
        yield
    finally:
        for namespace, attr, value in removed:
            namespace[attr] = value


def serve_one(llm, req: dict) -> tuple[dict, float]:
    """Serve one request alone; returns its record and the wall time of the call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=req["max_tokens"], ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt_token_ids"])], params, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    m = out.metrics
    record = {"id": req["id"], "prompt_tokens": len(req["prompt_token_ids"]),
              "output_tokens": len(out.outputs[0].token_ids), "output_token_ids": list(out.outputs[0].token_ids),
              "num_cached_tokens": int(out.num_cached_tokens or 0),
              "ttft_s": m.first_token_ts - m.queued_ts if m is not None else None,
              "decode_s": m.last_token_ts - m.first_token_ts if m is not None else None,
              "wall_s": wall}
    return record, wall


def drain(llm, limit_s: float = 30.0) -> None:
    """Step the engine until its scheduler has nothing left (a finished request's blocks
    still held for a save, a connector's pins), as a server's engine loop does between
    requests; ``LLM.generate`` returns as soon as the last output is out."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)   # the in-process engine core
    if core is None:
        return
    deadline = time.perf_counter() + limit_s
    while core.scheduler.has_requests() and time.perf_counter() < deadline:
        llm.llm_engine.step()


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))
            and k != "block_size"}


def run(spec: dict) -> dict:
    t0 = time.perf_counter()
    kvt = kv_transfer_config(spec["connector"])
    from vllm import LLM
    if spec["connector"] is not None:  # import it now, so that the scan below sees what it imports
        importlib.import_module(spec["connector"]["module"])
    hidden: list[str] = []
    with scan_safe_namespaces(hidden):
        llm = LLM(model=spec["model"], kv_transfer_config=kvt, disable_log_stats=False, **spec["llm"])
    init_s = time.perf_counter() - t0
    stats = None
    if kvt is not None:
        from benchmarks.vllm_timing import STATS as stats
    for req in spec["warmup"]:
        serve_one(llm, req)
        drain(llm)
    if stats is not None:
        stats.reset()
    records = []
    for req in spec["requests"]:
        before = stats.snapshot() if stats else None
        record, _ = serve_one(llm, req)
        drain(llm)
        if stats is not None:
            record["connector"] = delta(stats.snapshot(), before)
        records.append(record)
        print(f"BENCH {record['id']:>6} prompt {record['prompt_tokens']:5d} cached {record['num_cached_tokens']:5d} "
              f"ttft {record['ttft_s'] * 1e3:8.1f} ms", flush=True)
    totals = stats.snapshot() if stats else None
    shutdown = getattr(llm.llm_engine, "shutdown", None)
    if callable(shutdown):
        shutdown()
    return {"init_s": init_s, "hidden_during_start": hidden, "requests": records, "connector_totals": totals,
            "run_s": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    spec_path, out_path = argv[1], argv[2]
    sys.path.insert(0, str(ROOT))
    spec = json.loads(Path(spec_path).read_text())
    result = run(spec)
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
