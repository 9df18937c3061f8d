"""Block identity tags (kvstore/identity.py): a fingerprint of what a key stands for, made
with another hash function than the key's, stored at the end of the block and checked by
the reader."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.client import StoreClient
from kvstore.identity import TAG_BYTES, IdentityCheck, block_tags, seal, tag_buffer
from kvstore.index.keys import KeyExtras, block_keys
from kvstore.tiers.buffers import Segments

BS = 4


@pytest.mark.parametrize("hash_name", ["sha256", "xxh3_128"])
def test_tags_follow_everything_the_key_stands_for(hash_name: str) -> None:
    extras = KeyExtras(model="m", namespace="a", hash_name=hash_name)
    tokens = list(range(3 * BS + 1))
    tags = block_tags(tokens, BS, extras)
    assert len(tags) == 3 and all(len(t) == TAG_BYTES for t in tags) and len(set(tags)) == 3
    assert tags == block_tags(np.array(tokens, dtype=np.uint32), BS, extras)
    keys = block_keys(tokens, BS, extras)
    assert all(t not in k for t, k in zip(tags, keys))          # not a slice of the key
    changed = tokens.copy()
    changed[BS + 1] += 1                                        # block 1 changes: tags 1 and 2 do
    other = block_tags(changed, BS, extras)
    assert other[0] == tags[0] and other[1] != tags[1] and other[2] != tags[2]
    assert block_tags(tokens, BS, KeyExtras(model="m", namespace="b", hash_name=hash_name))[0] != tags[0]
    assert block_tags(tokens[:2 * BS], 2 * BS, extras)[0] != tags[1]


def test_seal_and_unseal() -> None:
    check = IdentityCheck("test")
    tag, other = block_tags(list(range(BS)), BS, KeyExtras())[0], b"\0" * TAG_BYTES
    sealed = seal(b"kv bytes", tag)
    assert sealed == b"kv bytes" + tag and check.unseal(b"k", sealed, tag) == b"kv bytes"
    assert check.unseal(b"k", sealed, other) is None and check.mismatches == 1
    assert check.unseal(b"k", None, tag) is None and check.unseal(b"k", b"1234", tag) is None
    assert check.mismatches == 2
    parts = [np.arange(4, dtype=np.uint8), np.arange(4, 8, dtype=np.uint8)]
    seg = seal(Segments(parts), tag)
    assert isinstance(seg, Segments) and seg.tobytes() == bytes(range(8)) + tag
    blocks = [seal(b"a", tag), seal(b"b", other), seal(b"c", tag)]
    assert check.prefix([b"1", b"2", b"3"], blocks, [tag, tag, tag]) == [b"a"]


def test_a_colliding_key_is_a_miss_for_the_second_reader(store_node) -> None:
    """Two token sequences forced onto one key in a real store: the writer of the first
    stores its block; a reader of the second gets the bytes under the key, and the tag says
    they are not its tokens' KV — a miss, counted; the first's reader still hits."""
    _, address = store_node
    extras = KeyExtras(model="m", namespace="t", hash_name="xxh3_128")
    seq_a, seq_b = [1] * BS, [2] * BS
    key = block_keys(seq_a, BS, extras)[0]                      # the key both are stored under
    tag_a, tag_b = block_tags(seq_a, BS, extras)[0], block_tags(seq_b, BS, extras)[0]
    check = IdentityCheck("reader")
    with StoreClient(address) as client:
        assert client.put_blocks([(key, seal(b"KV of sequence a", tag_a))])[0].ok
        got = client.get_blocks([key])[0]
        assert check.unseal(key, got, tag_b) is None and check.mismatches == 1
        assert check.unseal(key, got, tag_a) == b"KV of sequence a"
        out, read_tag = np.empty(16, dtype=np.uint8), tag_buffer()
        assert client.get_into([key], [Segments([out, read_tag])]) == [16 + TAG_BYTES]
        assert not check.verify(key, read_tag, tag_b) and check.mismatches == 2
        assert check.verify(key, read_tag, tag_a) and out.tobytes() == b"KV of sequence a"
