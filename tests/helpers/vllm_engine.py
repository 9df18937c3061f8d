"""vLLM engines for the connector tests (tests/engines/vllm/), each in a process of its own
forked from a server that has imported vLLM once (tests/helpers/vllm_driver.py): the engine
settings they share, the connector's transfer config, and the pool's view of a prompt's
blocks."""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.context
import os
import random
import time
from pathlib import Path

from engines.checkpoint_identity import model_identity
from engines.vllm.layout import PagedLayout
from kvstore.index.keys import KVLayout
from tests.helpers.vllm_driver import ENV, serve

BS = 32  # vLLM's CPU attention takes block sizes that are multiples of 32
ROOT = Path(__file__).resolve().parents[2]
ENGINE = {"dtype": "float32", "enforce_eager": True, "block_size": BS, "max_model_len": 1024,
          "kv_cache_memory_bytes": 32 << 20, "enable_prefix_caching": False, "seed": 0}


def connector(address: str, role: str) -> dict:
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "engines.vllm.connector",
            "kv_role": role, "kv_connector_extra_config": {"kvstore.store": address, "kvstore.timeout_s": 5}}


def _forkserver() -> multiprocessing.context.ForkServerContext:
    """The fork server the engines are forked from, with vLLM imported once
    (tests/helpers/vllm_preload.py); started with the first engine of this process."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.helpers.vllm_preload"])
    return ctx


class Engine:
    """One vLLM engine in a process of its own (tests/helpers/vllm_driver.py); its environment
    is this process's as it is now, with the driver's settings and ``env`` on top."""

    def __init__(self, model_dir: str, log_path: Path, env: dict[str, str] | None = None,
                 **settings: object) -> None:
        ctx = _forkserver()
        self.log_path = log_path
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, model_dir, {**ENGINE, **settings},
                                                    {**os.environ, **ENV, **(env or {})}, str(log_path)))
        self.proc.start()
        child.close()
        # an engine a test leaves open is closed at exit, before multiprocessing joins its
        # (non-daemonic) process, which would otherwise wait on its connection for ever
        atexit.register(self.close)
        assert self._read().get("ready")

    def _read(self) -> dict:
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(timeout=10)
            log = self.log_path.read_text()[-3000:] if self.log_path.exists() else "(it wrote no log)"
            raise RuntimeError(f"vLLM engine exited ({self.proc.exitcode}): {log}") from None

    def _ask(self, **req: object) -> dict:
        self.conn.send(req)
        return self._read()

    def generate(self, prompt: list[int], salt: str | None = "tenant-a", max_tokens: int = 8,
                 lora: str | None = None) -> tuple[list[int], int]:
        out = self._ask(op="generate", prompt=prompt, salt=salt, max_tokens=max_tokens, lora=lora)
        return out["tokens"], out["cached"]

    def stats(self) -> dict:
        return self._ask(op="stats")

    def sched(self) -> dict:
        """The scheduler's side: requests it holds, blocks the connector pins, its stats."""
        return self._ask(op="sched")

    def reset(self) -> bool:
        return bool(self._ask(op="reset")["ok"])

    def close(self) -> None:
        atexit.unregister(self.close)
        self.conn.close()           # the engine's loop ends at end of input
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def held(pool, model_dir: str, prompt: list[int], salt: str = "tenant-a", want: int | None = None,
         timeout_s: float = 10.0) -> int:
    """Blocks of ``prompt``'s chain the pool holds, once it holds ``want`` of them (a kv_both
    engine saves on a background thread, so its blocks land just after it answers). The keys
    are the key spec over vLLM's blocks, so a test computes them as the connector does."""
    paged = PagedLayout(*model_identity(model_dir, None), KVLayout("float32", 2, 2, 64, BS))
    keys = paged.keys(prompt, salt)
    deadline = time.monotonic() + timeout_s
    while True:
        found = pool.lookup(keys)
        n = found[0] if isinstance(found, tuple) else found.blocks
        if want is None or n >= want or time.monotonic() > deadline:
            return n
        time.sleep(0.02)


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]
