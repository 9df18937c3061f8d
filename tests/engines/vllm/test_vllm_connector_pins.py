"""The connector's scheduler side without a running engine: vLLM's own config and block pool,
a real store node (tests/conftest.py) for the start-up probe. Saves pin the vLLM blocks they
read and release them once every rank reports the job; nothing holds a request."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engines.vllm.connector_scheduler import KVStoreWorkerMeta  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402

NUM_BLOCKS = 16


def scheduler_connector(tmp_path, monkeypatch, address: str, role: str, tp: int = 1, **extra):
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from engines.vllm.connector import KVStoreConnector
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if not (tmp_path / "config.json").exists():
        LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024
                    ).save_pretrained(tmp_path)
        (tmp_path / "pytorch_model.bin").write_bytes(b"weights")   # hashed, never loaded here
    model = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), skip_tokenizer_init=True, dtype="float32")
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_role=role,
                                kv_connector_module_path="engines.vllm.connector",
                                kv_connector_extra_config={"kvstore.store": address, **extra})
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=32), kv_transfer_config=transfer,
                        parallel_config=ParallelConfig(tensor_parallel_size=tp))
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=model.dtype)
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn",
                                                          "model.layers.1.self_attn.attn"], spec)])
    return KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv)


def block_pool():
    from vllm.v1.core.block_pool import BlockPool
    return BlockPool(NUM_BLOCKS, enable_caching=False, hash_block_size=32)


def test_only_a_producer_requires_its_kv_delivered(tmp_path, monkeypatch, same_host_store) -> None:
    _, address = same_host_store
    roles = {r: scheduler_connector(tmp_path, monkeypatch, address, r).requires_kv_delivery
             for r in ("kv_both", "kv_producer", "kv_consumer")}
    assert roles == {"kv_both": False, "kv_producer": True, "kv_consumer": False}


def test_a_save_pins_its_blocks_until_every_rank_reports_it(tmp_path, monkeypatch, same_host_store) -> None:
    from vllm.v1.outputs import KVConnectorOutput
    _, address = same_host_store
    conn = scheduler_connector(tmp_path, monkeypatch, address, "kv_both", tp=2)   # two ranks copy each job
    assert conn.tp_size == 2
    pool = block_pool()
    conn.bind_gpu_block_pool(pool)
    blocks = pool.get_new_blocks(3)           # a request's blocks (ref 1 each)
    ids = [b.block_id for b in blocks]
    job = conn._pin([0, *ids])                # the null block is never pinned
    assert job is not None and conn.has_pending_push_work()
    assert [pool.blocks[i].ref_cnt for i in ids] == [2, 2, 2] and pool.blocks[0].ref_cnt == 0
    pool.free_blocks(blocks)                  # the request finishes: vLLM frees its blocks
    free = pool.get_num_free_blocks()
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVStoreWorkerMeta({job: 1})))
    assert pool.get_num_free_blocks() == free and conn.has_pending_push_work()   # one rank of two
    two = KVStoreWorkerMeta({job: 1}).aggregate(KVStoreWorkerMeta({job: 1}))   # vLLM adds the ranks' answers
    assert two.done == {job: 2}
    conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVStoreWorkerMeta({job: 1})))
    assert pool.get_num_free_blocks() == free + 3 and not conn.has_pending_push_work()
    assert conn._pinned == 0


def test_pins_past_their_share_drop_the_save_never_the_request(tmp_path, monkeypatch, same_host_store) -> None:
    _, address = same_host_store
    conn = scheduler_connector(tmp_path, monkeypatch, address, "kv_both", **{"kvstore.max_pinned_fraction": 0.25})
    pool = block_pool()
    conn.bind_gpu_block_pool(pool)
    ids = [b.block_id for b in pool.get_new_blocks(12)]
    assert conn._pin(ids[:4]) is not None     # 4 of 16 blocks: the share
    assert conn._pin(ids[4:6]) is None and conn.stats.saves_dropped == 2
    assert conn.recorder.take().data["saves_dropped"] == 2   # vllm:kvstore_saves_dropped_blocks_total
    assert pool.blocks[ids[5]].ref_cnt == 1   # not pinned
    alone = scheduler_connector(tmp_path, monkeypatch, address, "kv_both")
    alone.bind_gpu_block_pool(pool)
    assert alone._pin(ids[4:12]) is not None   # 8 blocks, past the share, but no other pin: taken

    class Finished:
        request_id = "r1"
    assert conn.request_finished(Finished(), ids) == (False, None)
    assert conn.reset_cache() is True and conn._pinned == 4   # saves in flight keep their pins
    with pytest.raises(InvalidArgument, match="max_pinned_fraction"):
        scheduler_connector(tmp_path, monkeypatch, address, "kv_both", **{"kvstore.max_pinned_fraction": 0})


def test_a_hybrid_models_groups_are_keyed_apart_and_other_cache_kinds_are_refused() -> None:
    import torch
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from engines.vllm.layout import PagedLayout, kv_groups
    from kvstore.index.keys import KVLayout
    base = PagedLayout("m", "r", KVLayout("float32", 4, 2, 64, 32))
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=64)

    def config(*specs) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec([f"layers.{i}", f"layers.{i + 2}"], s) for i, s in enumerate(specs)])
    one = kv_groups(base, config(full))
    assert len(one) == 1 and one[0].paged == base                 # one group: the keys as they were
    sliding, whole = kv_groups(base, config(swa, full))
    assert (sliding.kind, sliding.window, sliding.window_blocks(), whole.window_blocks()) == ("sliding", 64, 2, None)
    assert sliding.paged.layout.num_layers == whole.paged.layout.num_layers == 2
    assert sliding.layer_names == ("layers.0", "layers.2")
    tokens = list(range(70))
    assert len({base.keys(tokens, "a")[0], sliding.paged.keys(tokens, "a")[0], whole.paged.keys(tokens, "a")[0]}) == 3
    cross = CrossAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    with pytest.raises(InvalidArgument, match="CrossAttentionSpec"):
        kv_groups(base, config(full, cross))
