"""Tensor parallelism (engines/vllm/connector_scheduler.py, layout.py): each rank of a TP-2
vLLM engine stores and loads its own shard under its own keys; a prefix is a hit only as far
as every rank holds it; a rank that fails a load makes every rank recompute. Real vLLM on the
CPU (TP 2 runs there with the two cores bound by hand), engines one after the other on the
module's store node."""
from __future__ import annotations

import dataclasses
import time

import pytest

pytest.importorskip("vllm")

from engines.checkpoint_identity import model_identity  # noqa: E402
from engines.vllm.layout import PagedLayout  # noqa: E402
from kvstore.index.keys import KVLayout  # noqa: E402
from tests.helpers.vllm_engine import BS, Engine, connector, prompt_of  # noqa: E402

pytestmark = pytest.mark.slow
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}   # vLLM-CPU cannot bind two workers' threads itself here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from engines.vllm.checkpoint import write_checkpoint
    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-llama"), "tiny", max_model_len=1024)


def rank_keys(model_dir: str, prompt: list[int], rank: int, salt: str = "tenant-a") -> list[bytes]:
    """Rank ``rank``'s keys of a TP-2 engine of the tiny checkpoint (one KV head per rank)."""
    base = PagedLayout(*model_identity(model_dir, None), KVLayout("float32", 2, 1, 64, BS), tp_size=2)
    return base.for_rank(rank).keys(prompt, salt)


@pytest.fixture(scope="module")
def stored(model_dir, same_host_store, tmp_path_factory) -> dict:
    """A first TP-2 kv_both engine stores three prompts of 3 blocks and a tail, and computes
    the reference tokens of the prompts the tests send (under another tenant: nothing loaded,
    every token computed by vLLM), then stops."""
    pool, address = same_host_store
    logs = tmp_path_factory.mktemp("tp-logs")
    first = {name: prompt_of(seed, 3 * BS + 20) for name, seed in (("shared", 61), ("partial", 62), ("corrupt", 63))}
    sent = {"shared": first["shared"][:3 * BS] + prompt_of(64, 25), "corrupt": first["corrupt"]}
    a = Engine(model_dir, logs / "tp2-a.log", env=TP2_ENV, kv_transfer_config=connector(address, "kv_both"), **TP2)
    try:
        for prompt in first.values():
            a.generate(prompt)
        reference = {}
        for name, prompt in sent.items():
            tokens, cached = a.generate(prompt, salt="reference-tenant")
            assert cached == 0
            reference[name] = tokens
        deadline = time.monotonic() + 20   # background saves: let every rank's land
        while time.monotonic() < deadline and not all(
                pool.lookup(rank_keys(model_dir, p, r))[0] == 3 for p in first.values() for r in (0, 1)):
            time.sleep(0.1)
    finally:
        a.close()
    return {"first": first, "sent": sent, "reference": reference, "logs": logs}


def test_a_tp2_engine_loads_the_shards_an_earlier_tp2_engine_stored(stored, model_dir, same_host_store) -> None:
    pool, address = same_host_store
    first, sent = stored["first"], stored["sent"]
    for prompt in first.values():   # each rank's shard under its own keys
        assert [pool.lookup(rank_keys(model_dir, prompt, r))[0] for r in (0, 1)] == [3, 3]
    assert rank_keys(model_dir, first["shared"], 0) != rank_keys(model_dir, first["shared"], 1)
    # a prefix only one rank holds in full is a hit only as far as both hold it
    assert pool.remove(rank_keys(model_dir, first["partial"], 1)[1]) > 0
    # a rank that fails its load (a flipped byte in rank 1's second block) makes both recompute
    tier = pool.tiers[0]
    offset, size, _ = tier.locate(rank_keys(model_dir, first["corrupt"], 1)[1])
    tier._slab[offset + size // 2] ^= 0xFF
    b = Engine(model_dir, stored["logs"] / "tp2-b.log", env=TP2_ENV,
               kv_transfer_config=connector(address, "kv_both"), **TP2)
    try:
        tokens, cached = b.generate(sent["shared"])
        assert cached == 3 * BS and tokens == stored["reference"]["shared"]
        assert b.generate(first["partial"])[1] == BS
        tokens, _ = b.generate(sent["corrupt"])   # vLLM counts the blocks offered as cached, loaded or not
        assert tokens == stored["reference"]["corrupt"]
    finally:
        b.close()


def test_a_tp1_engine_never_loads_a_tp2_engines_blocks(stored, model_dir, same_host_store, tmp_path) -> None:
    pool, address = same_host_store
    prompt = stored["first"]["shared"]
    assert pool.lookup(rank_keys(model_dir, prompt, 0))[0] == 3
    tp1 = PagedLayout(*model_identity(model_dir, None), KVLayout("float32", 2, 2, 64, BS))
    assert pool.lookup(tp1.keys(prompt, "tenant-a"))[0] == 0
    assert tp1.keys(prompt, "t") == dataclasses.replace(tp1, tp_size=1).keys(prompt, "t")   # TP 1: keys unchanged
    engine = Engine(model_dir, tmp_path / "tp1.log", kv_transfer_config=connector(address, "kv_both"))
    try:
        assert engine.generate(prompt)[1] == 0
    finally:
        engine.close()
