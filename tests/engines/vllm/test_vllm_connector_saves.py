"""Saves that never hold a request (engines/vllm/connector_scheduler.py pins): a kv_both
engine whose save cannot finish answers, and its scheduler keeps nothing of the request but
pins on the blocks being copied out. Real vLLM on the CPU, a real store node process."""
from __future__ import annotations

import signal
import time

import pytest

pytest.importorskip("vllm")

from tests.helpers.vllm_engine import BS, Engine, connector, prompt_of  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from engines.vllm.checkpoint import write_checkpoint
    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-llama"), "tiny", max_model_len=1024)


def test_a_finished_kv_both_request_is_released_while_its_save_is_in_flight(model_dir, spawn_store_node,
                                                                            tmp_path) -> None:
    """A save that cannot finish (the store node stopped: the put waits for its timeout)
    holds no request: when vLLM answers, its scheduler holds nothing, only pins on the
    blocks being copied out; they are released once the save is given up, and the request
    is answered right."""
    proc, address = spawn_store_node("node-frozen", "--dram", "64MiB", "--ssd", "0", "--transfer-engine", "off")
    conn = connector(address, "kv_both")
    conn["kv_connector_extra_config"]["kvstore.timeout_s"] = 4
    engine = Engine(model_dir, tmp_path / "frozen.log", kv_transfer_config=conn)
    try:
        engine.generate(prompt_of(51, 2 * BS + 3), max_tokens=2)   # connected, the pool answers
        proc.send_signal(signal.SIGSTOP)
        try:
            tokens, cached = engine.generate(prompt_of(52, 4 * BS + 3), max_tokens=4)
            during = engine.sched()
        finally:
            proc.send_signal(signal.SIGCONT)
        assert cached == 0 and len(tokens) == 4
        assert during["requests"] == 0             # the request is gone: nothing waits for its save
        assert during["pinned"] == 4               # ... but its 4 prompt blocks are pinned, still being read
        deadline = time.monotonic() + 60           # pins are released on a step after the save gives up
        while engine.sched()["pinned"] and time.monotonic() < deadline:
            engine.generate(prompt_of(53, 5), max_tokens=1)
            time.sleep(0.2)
        assert engine.sched()["pinned"] == 0
    finally:
        engine.close()
