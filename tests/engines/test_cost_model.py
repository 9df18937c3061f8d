"""The cost model (engines/cost_model.py) against hand-computed figures."""
from __future__ import annotations

import pytest

from engines.cost_model import CostModel, HardwareProfile, load_model, load_profile
from kvstore.errors import InvalidArgument


@pytest.fixture
def a800() -> CostModel:
    return CostModel(load_model("llama3-70b"), load_profile("8xA800"))


def test_model_constants_are_mooncakes() -> None:
    m = load_model("llama3-70b")
    assert (m.layers, m.hidden, m.attn_coeff, m.linear_coeff) == (80, 8192, 4, 22)
    assert m.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2 == 327_680   # 320 KB per token


def test_prefill_flops_hand_computed(a800: CostModel) -> None:
    # 80 · (4 · 1000² · 8192 + 22 · 1000 · 8192²)
    assert a800.prefill_flops(1000) == pytest.approx(120_733_040_640_000)
    # cached prefix: only tokens 500..1000 are computed, attending to the whole prompt
    assert a800.prefill_flops(1000, 500) == pytest.approx(a800.prefill_flops(1000) - a800.prefill_flops(500))
    assert a800.prefill_flops(1000, 1000) == 0


def test_prefill_seconds_at_peak_times_mfu(a800: CostModel) -> None:
    # 8 GPUs × 312 TFLOP/s × MFU 0.5 = 1.248e15 FLOP/s
    assert a800.flops_per_s == pytest.approx(1.248e15)
    assert a800.prefill_s(1000) == pytest.approx(120_733_040_640_000 / 1.248e15)
    assert a800.prefill_s(8000, 4000) < a800.prefill_s(8000)


def test_decode_step_hand_computed(a800: CostModel) -> None:
    # weights 141.2 GB over 8 × 2.039 TB/s × MBU 0.6 = 9.7872 TB/s, plus 3 ms per step
    assert a800.decode_step_s(1, 0) == pytest.approx(0.003 + 141.2e9 / 9.7872e12)
    # 100k resident tokens add 100k × 327,680 bytes read per step
    assert a800.decode_step_s(8, 100_000) == pytest.approx(0.003 + (141.2e9 + 100_000 * 327_680) / 9.7872e12)
    assert a800.decode_step_s(0, 0) == 0.0
    assert a800.decode_step_s(64, 500_000) > a800.decode_step_s(8, 100_000)


def test_kv_capacity_and_transfer(a800: CostModel) -> None:
    # (8 × 80 GB × 0.9 usable − 141.2 GB weights) / 327,680 bytes per token
    assert a800.kv_capacity_tokens() == int((576e9 - 141.2e9) // 327_680) == 1_326_904
    assert a800.transfer_s(1e9, "network") == pytest.approx(0.01)      # 100 GB/s of NICs
    assert a800.transfer_s(1e9, "pcie") == pytest.approx(1e9 / 256e9)   # 8 × 32 GB/s
    with pytest.raises(InvalidArgument, match="valid"):
        a800.transfer_s(1, "carrier-pigeon")


@pytest.mark.parametrize("name", ["8xA800", "8xH800", "8xH200"])
def test_profiles_load_and_newer_is_faster(name: str, a800: CostModel) -> None:
    c = CostModel(load_model("llama3-70b"), load_profile(name))
    assert c.profile.gpus == 8
    assert c.prefill_s(8000) <= a800.prefill_s(8000)
    assert c.decode_step_s(16, 200_000) <= a800.decode_step_s(16, 200_000)


def test_bad_configs_are_named() -> None:
    with pytest.raises(InvalidArgument, match="known"):
        load_profile("8xTPU")
    with pytest.raises(InvalidArgument, match="mfu"):
        HardwareProfile("x", 8, 1e15, 8e10, 2e12, 4e11, 3.2e10, 1e11, mfu=1.5)


def test_cost_model_engine_has_the_real_engines_interface(a800: CostModel) -> None:
    from engines.cost_model import CostModelEngine, LoadedPrefix
    from engines.types import EngineLoad, PrefillBackend

    eng = CostModelEngine(a800, "P0", "prefill", block_size=512)
    assert isinstance(eng, PrefillBackend)
    eng.enqueue(4096)
    assert eng.load() == EngineLoad(1, 0, 4096)
    cold = eng.prefill("r0", range(4096), "t")
    assert eng.load() == EngineLoad(0, 1, 0)
    eng.prefill_done()
    assert cold.prefill_s == pytest.approx(a800.prefill_s(4096)) and cold.cached_tokens == 0
    assert cold.stored_blocks == 8 and cold.load_bytes == 0 and cold.load_tier == ""
    # 2 blocks in its own HBM, 4 more fetchable from the pool in 0.4 s.
    prefix = LoadedPrefix(6, 2, 0.4, 4 * 512 * 327_680, "dram")
    full = eng.prefill("r1", range(4096), "t", block_keys=[b"k"] * 8, prefix=prefix)
    assert full.loaded_blocks == 6 and full.cached_tokens == 6 * 512 and full.load_tier == "dram"
    assert full.prefill_s == pytest.approx(0.4 + a800.prefill_s(4096, 6 * 512))
    # The scheduler chose to recompute past block 3: one block fetched, its own two kept.
    part = eng.prefill("r2", range(4096), "t", 3, prefix=prefix)
    assert part.loaded_blocks == 3 and part.load_s == pytest.approx(0.1)
    assert part.load_bytes == 512 * 327_680
    assert eng.prefill("r3", range(4096), "t", 0, prefix=prefix).loaded_blocks == 2
    assert eng.decode_step_s(8, 10_000) == a800.decode_step_s(8, 10_000)
    with pytest.raises(InvalidArgument, match="valid|one of"):
        CostModelEngine(a800, "X", "both")
