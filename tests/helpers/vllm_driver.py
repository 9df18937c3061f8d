"""A vLLM engine in a process of its own, driven over stdin/stdout by the connector tests
(tests/engines/vllm/test_vllm_connector.py): each vLLM engine keeps process-wide state (its KV connector
among it), so every engine a test needs runs here.

    python tests/helpers/vllm_driver.py MODEL_DIR SETTINGS_JSON

``SETTINGS_JSON``: keyword arguments of ``vllm.LLM`` beyond the model (``kv_transfer_config``
among them). Requests come as JSON lines on stdin and answers go to stdout as lines starting
with ``@@ `` (vLLM logs to the same streams):

    {"op": "generate", "prompt": [ids], "salt": "A" | null, "max_tokens": 8, "lora": DIR (optional)}
        -> {"tokens": [ids], "cached": num_cached_tokens}
    {"op": "stats"}  -> the worker-side connector's ConnectorStats as a dict (or {})
    {"op": "sched"}  -> the scheduler's side: {"requests": requests it still holds, "pinned":
                        vLLM blocks the connector's saves pin, "stats": its ConnectorStats}
    {"op": "reset"}  -> {"ok": LLM.reset_prefix_cache(reset_connector=True)}
    {"op": "quit"}
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from vllm import LLM, SamplingParams

    model_dir, settings = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model_dir, **settings)
    say({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        if req["op"] == "generate":
            prompt = {"prompt_token_ids": req["prompt"]}
            if req.get("salt"):
                prompt["cache_salt"] = req["salt"]
            sp = SamplingParams(max_tokens=req.get("max_tokens", 8), temperature=0, ignore_eos=True)
            lora = None
            if req.get("lora"):   # a LoRA adapter's directory (the engine needs enable_lora)
                from vllm.lora.request import LoRARequest
                lora = LoRARequest("adapter", 1, req["lora"])
            out = llm.generate([prompt], sp, use_tqdm=False, lora_request=lora)[0]
            say({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0})
        elif req["op"] == "stats":
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
            conn = get_kv_transfer_group() if has_kv_transfer_group() else None
            stats = getattr(conn, "stats", None)
            say(dataclasses.asdict(stats) if stats is not None else {})
        elif req["op"] == "sched":   # the engine core runs in this process (no multiprocessing)
            sched = llm.llm_engine.engine_core.engine_core.scheduler
            conn = sched.connector
            say({"requests": len(sched.requests), "pinned": getattr(conn, "_pinned", 0),
                 "stats": dataclasses.asdict(conn.stats) if conn is not None else {}})
        elif req["op"] == "reset":
            say({"ok": llm.reset_prefix_cache(reset_connector=True)})


def say(obj: dict) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
