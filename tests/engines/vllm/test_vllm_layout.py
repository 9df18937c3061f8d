"""The connector's settings and its view of vLLM's paged KV tensors (engines/vllm/), without
a vLLM engine: bad settings are refused with the valid ones named; a block's segments are the
layers' slices of that block, in layer order."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engines.vllm.layout import PagedBlocks, PagedLayout, checkpoint_quantized, model_variant
from engines.vllm.pool_link import ConnectorConfig, PoolLink
from kvstore.errors import InvalidArgument
from kvstore.index.keys import KVLayout


def test_settings_come_from_the_extra_config_and_bad_ones_are_named(monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_STORE_TOKEN", "secret")
    cfg = ConnectorConfig.from_extra({"kvstore.store": "127.0.0.1:7000", "kvstore.timeout_s": "2.5",
                                      "lmcache.other": 1})
    assert (cfg.store, cfg.timeout_s, cfg.store_token, cfg.on_load_error) == ("127.0.0.1:7000", 2.5, "secret",
                                                                               "recompute")
    with pytest.raises(InvalidArgument, match="kvstore.store_token"):
        ConnectorConfig.from_extra({"kvstore.stroe": "x:1"})
    with pytest.raises(InvalidArgument, match="recompute"):
        ConnectorConfig.from_extra({"kvstore.on_load_error": "ignore"})
    with pytest.raises(InvalidArgument, match="timeout_s"):
        ConnectorConfig.from_extra({"kvstore.timeout_s": float("nan")})
    with pytest.raises(InvalidArgument, match="host:port"):
        ConnectorConfig.from_extra({"kvstore.store": "nowhere"})
    with pytest.raises(InvalidArgument, match="timeout_s"):          # not a bare ValueError
        ConnectorConfig.from_extra({"kvstore.timeout_s": "abc"})
    with pytest.raises(InvalidArgument, match="did you mean 'kvstore.store'"):   # was ignored: the default store
        ConnectorConfig.from_extra({"store": "10.0.0.5:50051"})


def test_the_redis_url_comes_from_the_environment_unless_the_extra_config_names_one(monkeypatch) -> None:
    monkeypatch.delenv("KVSTORE_REDIS_URL", raising=False)
    assert ConnectorConfig.from_extra({}).redis is None
    monkeypatch.setenv("KVSTORE_REDIS_URL", "redis://:pw@198.18.0.1:6379/0")
    assert ConnectorConfig.from_extra({}).redis == "redis://:pw@198.18.0.1:6379/0"
    assert ConnectorConfig.from_extra({"kvstore.redis": "redis://198.18.0.2:6379/0"}).redis == "redis://198.18.0.2:6379/0"


def test_a_block_is_its_slice_of_every_layer_in_order() -> None:
    layers = {f"layer.{i}": torch.arange(4 * 2 * 8 * 6, dtype=torch.float32).reshape(4, 2, 8, 6) + 1000 * i
              for i in range(3)}
    paged = PagedBlocks(layers, num_blocks=4)
    assert paged.block_bytes == 3 * 2 * 8 * 6 * 4 and paged.layer_shape == (2, 8, 6)
    seg = paged.segments(2)
    want = b"".join(t[2].numpy().tobytes() for t in layers.values())
    assert seg.tobytes() == want
    seg.scatter(np.zeros(seg.nbytes, dtype=np.uint8))      # writes go to vLLM's tensors themselves
    assert all(float(t[2].abs().sum()) == 0 and float(t[1].abs().sum()) > 0 for t in layers.values())
    with pytest.raises(InvalidArgument, match="outside"):
        paged.segments(4)
    split = PagedBlocks({"l": torch.zeros(2, 5, 8, 2, 6)}, num_blocks=5)   # keys and values apart
    assert len(split.segments(0).parts) == 2
    with pytest.raises(InvalidArgument, match="block dimension"):
        PagedBlocks({"l": torch.zeros(3, 7)}, num_blocks=5)


def test_namespaces_and_layouts_key_apart() -> None:
    lay = PagedLayout("m", "r", KVLayout("float32", 2, 2, 64, 32))
    tokens = list(range(100))
    assert lay.keys(tokens, "a") != lay.keys(tokens, "b")
    assert lay.keys(tokens, None) == lay.keys(tokens, "default")
    assert len(lay.keys(tokens, "a")) == 3
    other = PagedLayout("m", "r", KVLayout("bfloat16", 2, 2, 64, 32))
    assert lay.keys(tokens, "a")[0] != other.keys(tokens, "a")[0]
    # a LoRA adapter's identity is the key spec's adapter field (docs/key-spec.md, field 6)
    assert lay.extras("a", "lora 0123").adapter == "lora 0123" and lay.extras("a").adapter is None
    assert lay.keys(tokens, "a", adapter="lora 0123")[0] != lay.keys(tokens, "a")[0]
    assert lay.tags(tokens, "a", "lora 0123")[0] != lay.tags(tokens, "a")[0]


def test_a_pool_that_cannot_be_reached_is_a_miss_and_backs_off() -> None:
    from launcher.supervisor import free_port
    port = free_port()
    link = PoolLink(ConnectorConfig(store=f"127.0.0.1:{port}", timeout_s=1))
    assert link.lookup([b"k" * 32]) == (0, ()) and link.failures == 1
    assert link.lookup([b"k" * 32]) == (0, ()) and link.failures == 1   # backing off: not asked again
    link.close()


def test_a_save_names_the_requests_namespace_to_the_pool(make_dram) -> None:
    """The connector's saves carry the request's namespace (its ``cache_salt``, as its keys
    are salted; a salt that is not a namespace under a stable ``salt-`` name) to a real store
    node over the same-host path: the node's tenant books own the blocks, and a tenant over
    its quota saves nothing without the link backing off."""
    from kvstore.node import StoreNode
    from kvstore.pool.pool import KVPool
    from kvstore.pool.tenants import attach, charge, namespace_stats
    lay = PagedLayout("m", "r", KVLayout("float32", 2, 2, 8, 4))
    from scheduler.routing.tenancy import namespace_from_authorization
    tenant = namespace_from_authorization("Bearer sk-tenant-a")     # what the front door sends
    assert lay.namespace(tenant) == tenant and lay.namespace("public") == "public"
    assert lay.namespace(None) == "default"
    odd = lay.namespace("caf\u00e9 " * 100)
    assert odd.startswith("salt-") and odd == lay.namespace("caf\u00e9 " * 100) != lay.namespace("cafe")
    own = lay.namespace("my-secret-salt-9f8e7d")    # a client's own salt, sent straight to vLLM
    assert own.startswith("salt-") and "my-secret" not in own and own == lay.namespace("my-secret-salt-9f8e7d")
    pool = KVPool([make_dram(16 << 20)])
    books = attach(pool)
    node = StoreNode.serve(pool)
    link = PoolLink(ConnectorConfig(store=node.address, timeout_s=5))
    try:
        paged = PagedBlocks({"l": torch.arange(8 * 2 * 4 * 8, dtype=torch.float32).reshape(8, 2, 4, 8)}, num_blocks=8)
        tokens = list(range(4 * 4))
        for salt, ids in ((tenant, [0, 1]), ("caf\u00e9 " * 100, [2, 3])):
            keys = lay.keys(tokens, salt)[:2]
            assert link.save([(k, paged.segments(b)) for k, b in zip(keys, ids)], None, lay.namespace(salt)) == 2
            assert [books.namespace_of(k) for k in keys] == [lay.namespace(salt)] * 2
        stats = namespace_stats(pool)
        assert stats[tenant].blocks == 2 and stats[odd].blocks == 2 and "" not in stats
        books.quotas.set("key-q", charge(paged.block_bytes))   # one block's pages: room for one block
        first, second = lay.keys(tokens, "key-q")[:2]
        assert link.save([(first, paged.segments(4))], None, "key-q") == 1
        pool.pin([first], hard=True)
        assert link.save([(second, paged.segments(5))], first, "key-q") == 0
        assert link.failures == 0 and pool.get(second) is None
    finally:
        link.close()
        node.stop(grace_s=None)


def test_a_trainer_checkpoints_optimizer_state_is_not_in_the_model_identity(tmp_path) -> None:
    """A checkpoint saved by a Trainer (``checkpoint-1000``: model.safetensors beside
    optimizer.pt, scheduler.pt, rng_state.pth, training_args.bin) is keyed by the weights
    vLLM loads, its safetensors: the optimizer state (several times the weights) was read at
    every start and keyed alike weights apart. Without safetensors the other weight files
    count."""
    from engines.checkpoint_identity import model_identity

    ckpt = tmp_path / "checkpoint-1000"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    (ckpt / "model.safetensors").write_bytes(b"weights" * 1000)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        (ckpt / name).write_bytes(b"state one")
    before = model_identity(str(ckpt), None)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        (ckpt / name).write_bytes(b"another state")
    assert model_identity(str(ckpt), None) == before
    (ckpt / "model.safetensors").write_bytes(b"weights" * 999 + b"other")   # another size (memo: size, mtime)
    assert model_identity(str(ckpt), None) != before
    (ckpt / "model.safetensors").unlink()                  # a .bin checkpoint: its .bin is hashed
    (ckpt / "pytorch_model.bin").write_bytes(b"bin weights")
    bin_one = model_identity(str(ckpt), None)
    (ckpt / "pytorch_model.bin").write_bytes(b"other bin weights")
    assert model_identity(str(ckpt), None) != bin_one


def test_a_model_with_latent_attention_is_refused_at_start_with_its_cause(tmp_path, monkeypatch) -> None:
    """An MLA model (DeepSeek-V2's multi-head latent attention: one latent cache per layer)
    got through to ``register_kv_caches`` and stopped there on a byte count that named no
    cause (the layout's K and V made twice its block)."""
    pytest.importorskip("vllm")
    from transformers import DeepseekV2Config
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    DeepseekV2Config(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                     q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                     n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
                     ).save_pretrained(tmp_path)
    model = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), skip_tokenizer_init=True, dtype="float32")
    assert model.use_mla
    with pytest.raises(InvalidArgument, match="latent attention"):
        PagedLayout.from_vllm(VllmConfig(model_config=model, cache_config=CacheConfig(block_size=32)))


def test_quantization_at_load_and_config_overrides_key_apart_and_the_front_door_agrees(tmp_path, monkeypatch):
    """One checkpoint served with --quantization fp8_per_tensor (weights quantized at load) or with
    --hf-overrides (its config changed, e.g. the rope) computes other KV than served plain,
    from the same files: the revision cannot tell them apart, so the connector keys both
    (a plain instance's keys stay as they were), and the front door given the same flags
    keys as the connector does."""
    pytest.importorskip("vllm")
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from scheduler.vllm.instances import VLLMModel

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"weights")   # hashed, never loaded here

    def connector(**kw) -> PagedLayout:
        model = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), skip_tokenizer_init=True,
                            dtype="bfloat16", **kw)
        return PagedLayout.from_vllm(VllmConfig(model_config=model, cache_config=CacheConfig(block_size=32)))

    tokens = list(range(64))
    plain, fp8 = connector(), connector(quantization="fp8_per_tensor")
    rope = connector(hf_overrides={"rope_theta": 5000.0})
    assert plain.variant == () and fp8.variant == (("quantization", "fp8_per_tensor"),)
    assert rope.variant == (("hf_overrides", '{"rope_theta":5000.0}'),)
    first = {lay.keys(tokens, "t")[0] for lay in (plain, fp8, rope)}
    assert len(first) == 3                                       # three KVs, three keys
    assert plain.keys(tokens, "t") == PagedLayout(plain.model_id, plain.revision, plain.layout).keys(tokens, "t")
    flags = ({}, {"quantization": "fp8_per_tensor"}, {"hf_overrides": {"rope_theta": 5000.0}})
    for lay, kw in zip((plain, fp8, rope), flags):
        door = VLLMModel.from_dir(str(tmp_path), 32, "bfloat16", **kw)
        assert door.keys(tokens, "t") == lay.keys(tokens, "t")
    assert model_variant("awq", None, prequantized=True) == ()   # its weights are in the revision
    assert model_variant("FP8", None, prequantized=False) == (("quantization", "fp8"),)
    text = {"text_config": {"quantization_config": {"quant_method": "fp8"}}}   # a multimodal checkpoint's
    assert checkpoint_quantized(text, str(tmp_path)) and not checkpoint_quantized({}, str(tmp_path))


@pytest.mark.parametrize("declares", ["compression_config", "hf_quant_config.json"])
def test_a_checkpoint_that_declares_its_quantization_is_keyed_alike_by_connector_and_front_door(
        tmp_path, monkeypatch, declares):
    """vLLM finds a checkpoint's own quantization in more places than config.json's
    quantization_config; the front door must see it where vLLM does, or one side keys a
    method the other does not and no hit estimate matches."""
    pytest.importorskip("vllm")
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from scheduler.vllm.instances import VLLMModel

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"weights")
    config = json.loads((tmp_path / "config.json").read_text())
    flags: dict = {}
    if declares == "compression_config":
        config["compression_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                        "config_groups": {}}
    else:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}))
        flags = {"quantization": "modelopt"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), skip_tokenizer_init=True,
                        dtype="bfloat16", **flags)
    lay = PagedLayout.from_vllm(VllmConfig(model_config=model, cache_config=CacheConfig(block_size=32)))
    door = VLLMModel.from_dir(str(tmp_path), 32, "bfloat16", **flags)
    assert lay.variant == door.paged.variant == ()
    tokens = list(range(64))
    assert door.keys(tokens, "t") == lay.keys(tokens, "t")
    with pytest.raises(InvalidArgument, match="cannot be keyed"):
        model_variant(None, lambda config: config, prequantized=False)


def test_keys_of_one_rank_and_one_kv_cache_group_are_unchanged_and_shards_and_groups_key_apart() -> None:
    """A TP-1 instance of a model with one KV-cache group keys its blocks as before tensor
    parallelism and hybrid models were served (the pool's blocks stay valid); a rank's shard
    and a hybrid model's group each add their own extras."""
    lay = PagedLayout("m", "r", KVLayout("float32", 2, 2, 64, 32), variant=(("quantization", "fp8"),))
    tokens = list(range(70))
    assert lay.keys(tokens, "a", adapter="lora x")[1].hex() == \
        "c1e9ac1945c8c3a27ba8eaecfa8f0e24e8fd70c49e323365f5bdf2b810e8ae1c"
    assert lay.tags(tokens, "a")[0].hex() == "173fffd6b779ed1a"
    tp = PagedLayout("m", "r", KVLayout("float32", 2, 1, 64, 32), tp_size=2)
    shards = {tp.for_rank(r).keys(tokens, "a")[0] for r in (0, 1)}
    assert len(shards) == 2 and tp.extras("a").other[-1] == ("tp", 0, 2)
    with pytest.raises(InvalidArgument, match="rank 2"):
        tp.for_rank(2)
    sliding = PagedLayout("m", "r", KVLayout("float32", 2, 2, 64, 32), group=(0, "sliding", 64))
    assert sliding.extras("a").other[-1] == ("group", 0, "sliding", 64)
    assert sliding.keys(tokens, "a")[0] != PagedLayout("m", "r", sliding.layout, group=(1, "full", None)).keys(
        tokens, "a")[0]


def test_pipeline_parallelism_is_refused_with_its_measured_cause(tmp_path, monkeypatch) -> None:
    pytest.importorskip("vllm")
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    from engines.vllm.layout import PP_REFUSED
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"weights")   # hashed, never loaded here
    model = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), skip_tokenizer_init=True, dtype="float32")

    def layout(**par: int) -> PagedLayout:
        return PagedLayout.from_vllm(VllmConfig(model_config=model, cache_config=CacheConfig(block_size=32),
                                                parallel_config=ParallelConfig(**par)))
    with pytest.raises(InvalidArgument, match="sync_and_gather_intermediate_tensors") as err:
        layout(pipeline_parallel_size=2)
    assert PP_REFUSED in str(err.value)
    assert (layout(tensor_parallel_size=2).tp_size, layout(tensor_parallel_size=2).layout.num_kv_heads) == (2, 1)
    with pytest.raises(InvalidArgument, match="KV heads"):
        layout(tensor_parallel_size=4)
