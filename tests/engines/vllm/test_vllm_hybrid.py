"""A hybrid model (engines/vllm/layout.py ``kv_groups``): a random Gemma-2 whose layers
alternate sliding-window attention (64 tokens) and full attention, so vLLM's hybrid allocator
gives two KV-cache groups. The connector stores each group's blocks under keys of their own
and a second request loads its prefix in both groups, the sliding one only its window. Real
vLLM on the CPU, the module's store node in this process."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from engines.checkpoint_identity import model_identity  # noqa: E402
from engines.vllm.layout import PagedLayout  # noqa: E402
from kvstore.index.keys import KVLayout  # noqa: E402
from tests.helpers.vllm_engine import BS, Engine, connector, prompt_of  # noqa: E402

pytestmark = pytest.mark.slow
GROUPS = ((0, "sliding", 64), (1, "full", None))   # vLLM's groups: layers 0 and 2, layers 1 and 3


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    from engines.vllm.checkpoint import write_gemma2_checkpoint
    return write_gemma2_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-gemma2"))


def group_keys(model_dir: str, prompt: list[int], group: tuple, salt: str = "tenant-a") -> list[bytes]:
    paged = PagedLayout(*model_identity(model_dir, None), KVLayout("float32", 2, 2, 64, BS), group=group)
    return paged.keys(prompt, salt)


def test_a_hybrid_models_second_request_loads_both_groups_the_sliding_one_only_its_window(
        gemma_dir, same_host_store, tmp_path) -> None:
    pool, address = same_host_store
    engine = Engine(gemma_dir, tmp_path / "gemma-kv.log", kv_transfer_config=connector(address, "kv_both"))
    try:
        first = prompt_of(71, 6 * BS + 20)
        second = first[:6 * BS] + prompt_of(72, 25)
        engine.generate(first)
        sliding, full = (group_keys(gemma_dir, first, g) for g in GROUPS)
        assert not set(sliding) & set(full)
        deadline = time.monotonic() + 20           # background saves: let both groups' land
        while time.monotonic() < deadline and (pool.lookup(sliding)[0], pool.lookup(full)[0]) != (6, 6):
            time.sleep(0.05)
        assert (pool.lookup(sliding)[0], pool.lookup(full)[0]) == (6, 6)
        loaded = engine.stats()["loaded_blocks"]
        tokens, cached = engine.generate(second)   # vLLM's own prefix cache is off: the pool's blocks
        assert cached == 6 * BS
        assert engine.stats()["loaded_blocks"] == loaded + 6 + 2   # full: 6; sliding: the window's 2
        assert engine.stats()["load_errors"] == 0
    finally:
        engine.close()
    log = (tmp_path / "gemma-kv.log").read_text()
    assert "Turning off hybrid kv cache manager" not in log
    plain = Engine(gemma_dir, tmp_path / "gemma-plain.log")
    try:
        assert tokens == plain.generate(second)[0]
    finally:
        plain.close()
