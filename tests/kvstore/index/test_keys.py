"""The key spec (kvstore/index/keys.py): chained block keys, the extras encoding, and the
usable-prefix rule of docs/key-spec.md §1."""
from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.index.keys import KeyExtras, KVLayout, block_keys, encode_extras, usable_prefix_tokens

REPO = Path(__file__).resolve().parents[3]
BLOCK_SIZES = [16, 256]

_CHILD = """
import sys
from kvstore.index.keys import KeyExtras, block_keys
extras = KeyExtras(model="m", namespace="tenant", other=(None, (), (1, "a")))
keys = block_keys(list(range(int(sys.argv[1]) * 3 + 7)), int(sys.argv[1]), extras)
print(",".join(k.hex() for k in keys))
"""


_WRITER = """
import sys
from kvstore.client import StoreClient
from kvstore.index.keys import KeyExtras, block_keys
address, namespace = sys.argv[1], sys.argv[2]
extras = KeyExtras(model="m", namespace=namespace, other=(None, (), (1, "a", b"b")))
keys = block_keys(list(range(16 * 3 + 5)), 16, extras)
with StoreClient(address) as client:
    results = client.put_blocks([(k, bytes([i]) * 64) for i, k in enumerate(keys)])
print(hash("kvstore"), sum(r.ok and not r.existed for r in results))
"""

_READER = """
import sys
from kvstore.client import StoreClient
from kvstore.index.keys import KeyExtras, block_keys
address, namespace = sys.argv[1], sys.argv[2]
extras = KeyExtras(model="m", namespace=namespace, other=(None, (), (1, "a", b"b")))
keys = block_keys(list(range(16 * 3 + 5)), 16, extras)
other = block_keys(list(range(16 * 3 + 5)), 16, KeyExtras(model="m", namespace=namespace + "-x"))
with StoreClient(address) as client:
    print(hash("kvstore"), client.lookup(keys).blocks, client.lookup(other).blocks)
"""


def _run(script: str, hashseed: str | None, *args: str) -> list[int]:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if hashseed is not None:
        env["PYTHONHASHSEED"] = hashseed
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [int(x) for x in out.stdout.split()]


@pytest.mark.parametrize("writer_seed, reader_seed", [(None, "random"), ("random", "1"), ("1", "2"),
                                                      ("2", None)])
def test_writer_and_reader_processes_agree_over_grpc(store_node, writer_seed, reader_seed) -> None:
    """A writer process puts 3 blocks into a real store node over gRPC; a reader
    process with another PYTHONHASHSEED keys the same tokens and extras (None, (), a tuple):
    3 hits. Each pair has its own namespace, so only its own writer can give those hits."""
    _, address = store_node
    namespace = f"tenant-{writer_seed}-{reader_seed}"
    w_hash, stored = _run(_WRITER, writer_seed, address, namespace)
    r_hash, hits, other_hits = _run(_READER, reader_seed, address, namespace)
    assert stored == 3 and hits == 3 and other_hits == 0
    if {writer_seed, reader_seed} == {"1", "2"}:
        assert w_hash != r_hash  # the seeds really differ: Python's hash() does


def _reference_keys(tokens: list[int], block_size: int, extras_bytes: bytes) -> list[bytes]:
    """The key spec written again from docs/key-spec.md (section 1), SHA-256."""
    parent = hashlib.sha256(b"kvstore.root.v1" + extras_bytes).digest()
    keys = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        data = b"kvstore.block.v1" + parent + struct.pack("<I", block_size)
        data += b"".join(struct.pack("<I", t) for t in block)
        parent = hashlib.sha256(data).digest()
        keys.append(parent)
    return keys


def _lp(tag: bytes, raw: bytes) -> bytes:
    return tag + struct.pack("<I", len(raw)) + raw


def _str_value(v: str) -> bytes:
    return _lp(b"\x01", v.encode())


def _int_value(v: int) -> bytes:
    return _lp(b"\x03", str(v).encode())


def test_key_spec_layout_reproduces_the_keys() -> None:
    """Another implementation following docs/key-spec.md's byte layout gets the same keys."""
    extras = KeyExtras(model="llama", revision="r2", layout=KVLayout("bfloat16", 32, 8, 128, 16),
                       adapter="lora-x", adapter_version=None, salt="s", mm_hashes=("img", b"\x01"),
                       namespace="key-1", other=(None, 7, 1.5, True, ("a",)))
    s, i = _str_value, _int_value
    expected = (b"KVX\x01" + b"\x01" + s("sha256") + b"\x02" + i(1) + b"\x03" + s("llama") + b"\x04" + s("r2")
                + b"\x05" + b"\x06" + struct.pack("<I", 5) + s("bfloat16") + i(32) + i(8) + i(128) + i(16)
                + b"\x06" + s("lora-x") + b"\x07" + b"\x00" + b"\x08" + s("s")
                + b"\x09" + b"\x06" + struct.pack("<I", 2) + s("img") + _lp(b"\x02", b"\x01")
                + b"\x0a" + s("key-1")
                + b"\x0b" + b"\x06" + struct.pack("<I", 5) + b"\x00" + i(7) + b"\x05" + struct.pack("<d", 1.5)
                + b"\x04\x01" + b"\x06" + struct.pack("<I", 1) + s("a"))
    assert encode_extras(extras) == expected
    toks = _tokens(16 * 4 + 3, seed=5)
    assert block_keys(toks, 16, extras) == _reference_keys(toks, 16, expected)


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


@pytest.mark.parametrize("hash_name", ["sha256", "xxh3_128"])
def test_a_chain_goes_on_from_its_parent_key(hash_name: str) -> None:
    """What a reader that saw only the tail of a prompt (vLLM's KV events) computes from the
    key of the block before it is the whole prompt's tail."""
    x = KeyExtras(namespace="t", hash_name=hash_name)
    a, b = _tokens(2 * 16, seed=3), _tokens(3 * 16 + 5, seed=4)
    whole = block_keys(a + b, 16, x)
    assert block_keys(b, 16, x, parent=whole[1]) == whole[2:]
    assert block_keys(b, 16, x, parent=whole[0]) != whole[2:]
    for bad in (whole[1][:-1], bytearray(whole[1]), "k" * len(whole[1])):
        with pytest.raises(InvalidArgument, match="parent"):
            block_keys(b, 16, x, parent=bad)  # type: ignore[arg-type]


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


@pytest.mark.parametrize("make", [
    lambda: KVLayout("float32", True, 2, 32, 16),
    lambda: KVLayout("float32", 2, 2, 32, 0),
    lambda: KVLayout(None, 2, 2, 32, 16),
    lambda: KeyExtras(model=1),
    lambda: KeyExtras(namespace=None),
    lambda: KeyExtras(adapter=b"X"),
    lambda: KeyExtras(mm_hashes=(1,)),
    lambda: KeyExtras(layout=("float32", 2, 2, 32, 16)),
], ids=["bool-layers", "zero-block", "dtype-none", "model-int", "namespace-none", "adapter-bytes",
        "mm-hash-int", "layout-tuple"])
def test_extras_fields_are_strictly_typed(make) -> None:
    with pytest.raises(InvalidArgument):
        make()


def test_equal_but_differently_typed_extras_never_share_a_root() -> None:
    toks = _tokens(16)
    seen = set()
    for other in [(1,), (True,), (1.0,), (("x", 1),), (("x", True),)]:
        for _ in range(2):  # the second call may come from the root memo
            seen.add(tuple(block_keys(toks, 16, KeyExtras(other=other))))
    assert len(seen) == 5
    assert KeyExtras(mm_hashes=["a"]).mm_hashes == ("a",)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_usable_prefix_never_includes_last_token(block_size: int) -> None:
    # A prompt of exactly 3 blocks, fully cached: the last token must still be computed.
    assert usable_prefix_tokens(3, block_size, 3 * block_size) == 3 * block_size - 1
    # 3 blocks + 5 tokens: all 3 cached blocks are usable.
    assert usable_prefix_tokens(3, block_size, 3 * block_size + 5) == 3 * block_size
    assert usable_prefix_tokens(0, block_size, 3 * block_size) == 0
    assert usable_prefix_tokens(1, block_size, 0) == 0
