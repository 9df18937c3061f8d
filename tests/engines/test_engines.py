"""Prefill and decode engines with a real store node over gRPC: disaggregated generation is
token-identical to one uninterrupted greedy ``generate``, with and without prefix hits."""
from __future__ import annotations

import pytest
import torch

from engines.decode import DecodeEngine
from engines.kv import build_cache, slice_bytes, to_tensor
from engines.model import ModelConfig, load_model
from engines.prefill import PrefillEngine
from kvstore.client import StoreClient
from kvstore.errors import InvalidArgument
from kvstore.pool.pool import KVPool
from kvstore.service import serve_store
from kvstore.tiers import TIERS

BS = 16


@pytest.fixture(scope="module")
def lm():
    return load_model(ModelConfig(block_size=BS))


@pytest.fixture()
def store(tmp_path):
    pool = KVPool([TIERS["dram"](32 << 20), TIERS["ssd"](64 << 20, path=str(tmp_path / "ssd"))])
    server, port = serve_store(pool)
    client = StoreClient(f"127.0.0.1:{port}")
    yield client, pool
    client.close()
    server.stop(0).wait()
    pool.close()


def reference(lm, prompt: list[int], n: int) -> list[int]:
    """One uninterrupted greedy generate of the same model."""
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def disaggregated(prefill: PrefillEngine, decode: DecodeEngine, prompt: list[int], n: int):
    r = prefill.prefill("req", prompt, "tenant")
    steps = decode.decode("req", prompt, r.first_token, r.block_keys, r.tail_kv, n, namespace="tenant")
    tokens = [s.token for s in steps]
    return r, tokens


def prompt_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


@pytest.mark.parametrize("length", [5, 3 * BS, 4 * BS + 7])
def test_cold_prompt_is_token_identical(lm, store, length):
    client, _ = store
    prefill, decode = PrefillEngine(lm, client, local_cache_blocks=0), DecodeEngine(lm, client)
    prompt = prompt_of(length, length)
    r, tokens = disaggregated(prefill, decode, prompt, 12)
    assert r.cached_tokens == 0 and r.loaded_blocks == 0
    assert r.computed_tokens == length
    assert r.stored_blocks == length // BS
    assert tokens == reference(lm, prompt, 12)


@pytest.mark.parametrize("local_cache_blocks", [0, 64])
def test_cached_prefix_is_token_identical_and_only_suffix_computed(lm, store, local_cache_blocks):
    client, pool = store
    prefill, decode = PrefillEngine(lm, client, local_cache_blocks=local_cache_blocks), DecodeEngine(lm, client)
    first = prompt_of(1, 4 * BS + 3)
    disaggregated(prefill, decode, first, 4)
    hits_before = sum(s.hits for s in pool.stats())
    second = first[:4 * BS] + prompt_of(2, 9)          # shares 4 full blocks
    r, tokens = disaggregated(prefill, decode, second, 12)
    assert r.loaded_blocks == 4
    assert r.cached_tokens == 4 * BS
    assert r.computed_tokens == 9                       # only the suffix
    assert r.stored_blocks == 0                         # 4*BS+9 tokens: no new full block
    assert tokens == reference(lm, second, 12)
    pool_hits = sum(s.hits for s in pool.stats()) - hits_before
    # decode always reads its 4 blocks from the pool; prefill does too without a local cache
    assert pool_hits == (8 if local_cache_blocks == 0 else 4)


def test_fully_cached_prompt_computes_the_last_token(lm, store):
    client, _ = store
    prefill, decode = PrefillEngine(lm, client, local_cache_blocks=0), DecodeEngine(lm, client)
    prompt = prompt_of(3, 3 * BS)
    disaggregated(prefill, decode, prompt, 2)
    r, tokens = disaggregated(prefill, decode, prompt, 8)
    assert r.loaded_blocks == 3
    assert r.cached_tokens == 3 * BS - 1                # never the last prompt token
    assert r.computed_tokens == 1
    assert tokens == reference(lm, prompt, 8)
    longer = prompt + prompt_of(4, 5)
    r, tokens = disaggregated(prefill, decode, longer, 8)
    assert r.cached_tokens == 3 * BS and r.computed_tokens == 5
    assert tokens == reference(lm, longer, 8)


def test_decode_recomputes_blocks_missing_from_the_pool(lm, store):
    client, pool = store
    prefill, decode = PrefillEngine(lm, client, local_cache_blocks=0), DecodeEngine(lm, client)
    prompt = prompt_of(5, 3 * BS + 2)
    r = prefill.prefill("req", prompt, "tenant")
    pool.remove(r.block_keys[1])
    steps = decode.decode("req", prompt, r.first_token, r.block_keys, r.tail_kv, 6, namespace="tenant")
    tokens = [s.token for s in steps]
    assert decode.recomputed_tokens == len(prompt) - BS
    assert tokens == reference(lm, prompt, 6)


def test_tenants_do_not_share_blocks(lm, store):
    client, _ = store
    prefill = PrefillEngine(lm, client, local_cache_blocks=0)
    prompt = prompt_of(6, 3 * BS + 1)
    assert prefill.prefill("a1", prompt, "tenant-a").cached_tokens == 0
    assert prefill.prefill("b1", prompt, "tenant-b").cached_tokens == 0
    assert prefill.prefill("a2", prompt, "tenant-a").cached_tokens == 3 * BS


def test_kv_bytes_round_trip_bit_identical(lm):
    prompt = prompt_of(7, 2 * BS)
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    blocks = [slice_bytes(cache, 0, BS), slice_bytes(cache, BS, 2 * BS)]
    rebuilt = build_cache(blocks, lm.layout, lm.dtype, lm.device)
    for a, b in zip(cache.layers, rebuilt.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert to_tensor(blocks[0], lm.layout, lm.dtype).shape == (2, 2, 2, BS, 16)


def test_bad_requests_are_rejected(lm, store):
    client, _ = store
    prefill, decode = PrefillEngine(lm, client), DecodeEngine(lm, client)
    with pytest.raises(InvalidArgument, match="empty"):
        prefill.prefill("r", [], "t")
    with pytest.raises(InvalidArgument, match="vocabulary"):
        prefill.prefill("r", [3, 9999], "t")
    with pytest.raises(InvalidArgument, match="limit"):
        prefill.prefill("r", [3] * (lm.max_model_len + 1), "t")
    with pytest.raises(InvalidArgument, match="block keys"):
        list(decode.decode("r", [3] * (2 * BS), 5, [], b"", 4))
    with pytest.raises(InvalidArgument, match="first_token 4294967295 outside the vocabulary"):  # was IndexError
        list(decode.decode("r", [3] * 5, 2**32 - 1, [], b"", 4))


def _evict_everything(client: StoreClient) -> None:
    """A forced eviction of every tier (DRAM demotes to SSD, then SSD drops)."""
    for tier in ("dram", "ssd"):
        client.evict(tier, 1 << 30)


def test_local_hits_the_pool_lost_are_put_back_so_decode_recomputes_nothing(lm, store):
    """No drift: the pool evicted a prompt's blocks, the prefill engine still has them in its
    own cache. It serves them (cached_tokens says so), puts them back, and decode reads them
    from the pool: nothing the response calls cached is recomputed."""
    client, pool = store
    prefill, decode = PrefillEngine(lm, client, local_cache_blocks=64), DecodeEngine(lm, client)
    prompt = prompt_of(11, 4 * BS + 3)
    r, _ = disaggregated(prefill, decode, prompt, 2)
    assert r.stored_blocks == 4 and client.lookup(r.block_keys).blocks == 4
    _evict_everything(client)
    assert client.lookup(r.block_keys).blocks == 0
    r, tokens = disaggregated(prefill, decode, prompt, 8)
    assert r.cached_tokens == 4 * BS and r.loaded_blocks == 4      # from the engine's own cache
    assert prefill.restored_blocks == 4 and r.stored_blocks == 0
    assert client.lookup(r.block_keys).blocks == 4                   # the pool has them again
    assert decode.recomputed_tokens == 0
    assert r.tail_tokens == 3
    assert tokens == reference(lm, prompt, 8)


def test_a_pool_that_lost_the_middle_of_a_local_prefix_gets_it_back(lm, store):
    client, pool = store
    prefill, decode = PrefillEngine(lm, client, local_cache_blocks=64), DecodeEngine(lm, client)
    prompt = prompt_of(12, 5 * BS + 1)
    r, _ = disaggregated(prefill, decode, prompt, 2)
    pool.remove(r.block_keys[2])
    assert client.lookup(r.block_keys).blocks == 2
    r, tokens = disaggregated(prefill, decode, prompt, 6)
    assert prefill.restored_blocks == 1 and client.lookup(r.block_keys).blocks == 5
    assert decode.recomputed_tokens == 0 and tokens == reference(lm, prompt, 6)


def test_kv_the_pool_cannot_take_goes_to_decode_with_the_result(lm, tmp_path):
    """A pool that cannot be reached: prefill hands decode the KV of every prompt token, so
    decode recomputes none of what prefill reused or computed."""
    pool = KVPool([TIERS["dram"](8 << 20)])
    server, port = serve_store(pool)
    client = StoreClient(f"127.0.0.1:{port}", timeout_s=2)
    try:
        prefill, decode = PrefillEngine(lm, client, local_cache_blocks=64), DecodeEngine(lm, client)
        prompt = prompt_of(13, 3 * BS + 5)
        disaggregated(prefill, decode, prompt, 2)
        server.stop(0).wait()                                        # the pool goes away
        r, tokens = disaggregated(prefill, decode, prompt, 6)
        assert r.cached_tokens == 3 * BS and r.tail_tokens == len(prompt)
        assert decode.recomputed_tokens == 0 and tokens == reference(lm, prompt, 6)
    finally:
        client.close()
        server.stop(0).wait()
        pool.close()


def test_decode_rejects_a_tail_that_does_not_start_on_a_block_boundary(lm, store):
    client, _ = store
    prefill, decode = PrefillEngine(lm, client, local_cache_blocks=0), DecodeEngine(lm, client)
    prompt = prompt_of(14, 2 * BS + 3)
    r = prefill.prefill("req", prompt, "tenant")
    longer = prompt + [5]
    with pytest.raises(InvalidArgument, match="block boundary"):
        list(decode.decode("req", longer, r.first_token, r.block_keys, r.tail_kv, 4))


def test_a_block_of_other_tokens_under_a_colliding_key_is_a_miss(lm, store, monkeypatch):
    """A key spec too weak to tell two prompts apart (forced: keys that ignore the tokens):
    the second prompt's prefill and decode read the first prompt's blocks under its keys,
    find their identity tags wrong, count them and recompute — the tokens are those of an
    uncached run and ``cached_tokens`` is 0."""
    import engines.prefill as prefill_module
    from kvstore.index.keys import block_keys

    client, _ = store
    prompt_a, prompt_b = prompt_of(31, 3 * BS + 5), prompt_of(32, 3 * BS + 5)
    want = reference(lm, prompt_b, 6)
    monkeypatch.setattr(prefill_module, "block_keys",
                        lambda tokens, bs, extras: block_keys([7] * len(tokens), bs, extras))
    prefill, decode = PrefillEngine(lm, client), DecodeEngine(lm, client)
    ra = prefill.prefill("a", prompt_a, "tenant")
    assert ra.stored_blocks == 3
    rb = prefill.prefill("b", prompt_b, "tenant")
    assert rb.block_keys == ra.block_keys                  # the keys collide ...
    assert rb.cached_tokens == 0 and prefill.identity.mismatches == 1   # ... the blocks are not reused
    tokens = [s.token for s in decode.decode("b", prompt_b, rb.first_token, rb.block_keys, rb.tail_kv, 6,
                                             namespace="tenant")]
    assert tokens == want
    assert decode.identity.mismatches == 1 and decode.recomputed_tokens == len(prompt_b)
    again = prefill.prefill("a2", prompt_a, "tenant")      # the first prompt still hits its own blocks
    assert again.cached_tokens == 3 * BS and prefill.identity.mismatches == 1
