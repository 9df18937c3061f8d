"""A vLLM engine in a process of its own, driven by the connector tests through
tests/helpers/vllm_engine.py: each vLLM engine keeps process-wide state (its KV connector
among it), so every engine a test needs runs in a process of its own.

The processes are forked from a multiprocessing fork server that has imported vLLM once
(:mod:`tests.helpers.vllm_preload`): an engine then starts in the seconds its model and KV
cache take, not the ~8 s of importing vLLM again. :func:`serve` is the process's body: it
builds ``vllm.LLM(model=model_dir, **settings)`` (``kv_transfer_config`` among the
settings) in the environment ``env`` (all of it, :data:`ENV` among it), writes its
stdout and stderr to ``log_path``, and answers requests on ``conn`` (a multiprocessing
connection) until the other end closes it:

    {"op": "generate", "prompt": [ids], "salt": "A" | None, "max_tokens": 8, "lora": DIR | None}
        -> {"tokens": [ids], "cached": num_cached_tokens}
    {"op": "stats"}  -> the worker-side connector's ConnectorStats as a dict (or {})
    {"op": "sched"}  -> the scheduler's side: {"requests": requests it still holds, "pinned":
                        vLLM blocks the connector's saves pin, "stats": its ConnectorStats}
    {"op": "reset"}  -> {"ok": LLM.reset_prefix_cache(reset_connector=True)}

Its first message is ``{"ready": True}`` once the engine is built.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}   # offline; the engine core in-process


def serve(conn: Any, model_dir: str, settings: dict, env: dict[str, str], log_path: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)         # vLLM logs to both streams
    os.dup2(log, 2)
    from vllm import LLM

    llm = LLM(model=model_dir, **settings)
    conn.send({"ready": True})
    try:
        while True:
            try:
                req = conn.recv()
            except EOFError:
                break
            conn.send(answer(llm, req))
    finally:
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None:       # stops a TP engine's worker processes too
            engine_core.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()


def answer(llm: Any, req: dict) -> dict:
    if req["op"] == "generate":
        from vllm import SamplingParams
        prompt = {"prompt_token_ids": req["prompt"]}
        if req.get("salt"):
            prompt["cache_salt"] = req["salt"]
        sp = SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0, ignore_eos=True)
        lora = None
        if req.get("lora"):   # a LoRA adapter's directory (the engine needs enable_lora)
            from vllm.lora.request import LoRARequest
            lora = LoRARequest("adapter", 1, req["lora"])
        out = llm.generate([prompt], sp, use_tqdm=False, lora_request=lora)[0]
        return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0}
    if req["op"] == "stats":
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        conn = get_kv_transfer_group() if has_kv_transfer_group() else None
        stats = getattr(conn, "stats", None)
        return dataclasses.asdict(stats) if stats is not None else {}
    if req["op"] == "sched":   # the engine core runs in this process (no multiprocessing)
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        conn = sched.connector
        return {"requests": len(sched.requests), "pinned": getattr(conn, "_pinned", 0),
                "stats": dataclasses.asdict(conn.stats) if conn is not None else {}}
    if req["op"] == "reset":
        return {"ok": llm.reset_prefix_cache(reset_connector=True)}
    raise ValueError(f"unknown op {req['op']!r}")
