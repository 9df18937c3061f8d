"""The key spec (kvstore/index/keys.py): chained block keys, the extras encoding, and the
usable-prefix rule of DESIGN.md §3."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.index.keys import KeyExtras, block_keys, encode_extras, usable_prefix_tokens

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZES = [16, 256]

_CHILD = """
import sys
from kvstore.index.keys import KeyExtras, block_keys
extras = KeyExtras(model="m", namespace="tenant", other=(None, (), (1, "a")))
keys = block_keys(list(range(int(sys.argv[1]) * 3 + 7)), int(sys.argv[1]), extras)
print(",".join(k.hex() for k in keys))
"""


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, size=n).tolist()


def _keys_in_subprocess(block_size: int, hashseed: str | None) -> list[str]:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if hashseed is not None:
        env["PYTHONHASHSEED"] = hashseed
    out = subprocess.run([sys.executable, "-c", _CHILD, str(block_size)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip().split(",")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_keys_equal_across_processes_and_hash_seeds(block_size: int) -> None:
    runs = {seed: _keys_in_subprocess(block_size, seed) for seed in (None, "random", "1", "2")}
    here = block_keys(list(range(block_size * 3 + 7)), block_size,
                      KeyExtras(model="m", namespace="tenant", other=(None, (), (1, "a"))))
    assert len(here) == 3
    for seed, hexkeys in runs.items():
        assert hexkeys == [k.hex() for k in here], f"PYTHONHASHSEED={seed}"


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_shifted_token_values_change_the_key(block_size: int) -> None:
    toks = _tokens(block_size)
    toks[0], toks[1] = 100, 200
    shifted = list(toks)
    shifted[0], shifted[1] = 100 + 31, 200 - 1
    assert block_keys(toks, block_size, KeyExtras()) != block_keys(shifted, block_size, KeyExtras())


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_keys_are_chained(block_size: int) -> None:
    a = _tokens(3 * block_size, seed=1)
    b = list(a)
    b[0] += 1  # change only the head block
    ka, kb = block_keys(a, block_size, KeyExtras()), block_keys(b, block_size, KeyExtras())
    assert all(x != y for x, y in zip(ka, kb))
    c = list(a)
    c[-1] += 1  # change only the tail block
    kc = block_keys(c, block_size, KeyExtras())
    assert kc[:2] == ka[:2] and kc[2] != ka[2]


@pytest.mark.parametrize("left, right", [
    (KeyExtras(adapter="X"), KeyExtras(salt="X")),
    (KeyExtras(other=("ab", "c")), KeyExtras(other=("a", "bc"))),
    (KeyExtras(namespace="a"), KeyExtras(namespace="b")),
    (KeyExtras(model="m", revision="r1"), KeyExtras(model="m", revision="r2")),
    (KeyExtras(other=(None,)), KeyExtras(other=((),))),
    (KeyExtras(other=(1,)), KeyExtras(other=("1",))),
    (KeyExtras(other=(True,)), KeyExtras(other=(1,))),
], ids=["adapter-vs-salt", "ab+c-vs-a+bc", "namespace", "revision", "none-vs-empty", "int-vs-str",
        "bool-vs-int"])
def test_different_extras_give_different_keys(left: KeyExtras, right: KeyExtras) -> None:
    assert encode_extras(left) != encode_extras(right)
    toks = _tokens(16)
    assert block_keys(toks, 16, left) != block_keys(toks, 16, right)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_xxh3_is_opt_in_and_distinct(block_size: int) -> None:
    toks = _tokens(2 * block_size)
    sha = block_keys(toks, block_size, KeyExtras())
    xxh = block_keys(toks, block_size, KeyExtras(hash_name="xxh3_128"))
    assert [len(k) for k in sha] == [32, 32]
    assert [len(k) for k in xxh] == [16, 16]
    assert not {k[:16] for k in sha} & set(xxh)
    with pytest.raises(InvalidArgument, match="sha256"):
        KeyExtras(hash_name="md5")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_partial_tail_block_gets_no_key(block_size: int) -> None:
    toks = _tokens(2 * block_size + block_size - 1)
    keys = block_keys(toks, block_size, KeyExtras())
    assert len(keys) == 2
    assert keys == block_keys(toks[:2 * block_size], block_size, KeyExtras())
    assert block_keys(toks[:block_size - 1], block_size, KeyExtras()) == []
    assert block_keys([], block_size, KeyExtras()) == []


def test_numpy_and_list_tokens_agree() -> None:
    toks = _tokens(32)
    ref = block_keys(toks, 16, KeyExtras())
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        assert block_keys(np.asarray(toks, dtype=dtype), 16, KeyExtras()) == ref


@pytest.mark.parametrize("tokens, block_size, extras", [
    (np.zeros((2, 16), dtype=np.int64), 16, KeyExtras()),
    ([1, 2, -3, 4], 2, KeyExtras()),
    ([1, 2, 2**32, 4], 2, KeyExtras()),
    ([1.0, 2.0], 2, KeyExtras()),
    ([1, 2, 3, 4], 0, KeyExtras()),
    ([1, 2, 3, 4], -2, KeyExtras()),
    ([1, 2, 3, 4], 2, KeyExtras(other=(object(),))),
    ([1, 2, 3, 4], 2, KeyExtras(other=({"a": 1},))),
], ids=["2d", "negative", "too-large", "float", "block-size-0", "block-size-negative",
        "object-extra", "dict-extra"])
def test_bad_input_raises_invalid_argument(tokens, block_size: int, extras: KeyExtras) -> None:
    with pytest.raises(InvalidArgument):
        block_keys(tokens, block_size, extras)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_usable_prefix_never_includes_last_token(block_size: int) -> None:
    # A prompt of exactly 3 blocks, fully cached: the last token must still be computed.
    assert usable_prefix_tokens(3, block_size, 3 * block_size) == 3 * block_size - 1
    # 3 blocks + 5 tokens: all 3 cached blocks are usable.
    assert usable_prefix_tokens(3, block_size, 3 * block_size + 5) == 3 * block_size
    assert usable_prefix_tokens(0, block_size, 3 * block_size) == 0
    assert usable_prefix_tokens(1, block_size, 0) == 0
