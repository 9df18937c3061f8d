"""Block identity, checked on read: a key is a hash, and two token sequences whose keys
collide (possible by construction with a short or weak digest, e.g. the ``xxh3_128`` key
spec) must never hand one reader the other's KV.

A writer that knows a block's tokens appends to its bytes an 8-byte *tag*: a fingerprint of
everything the key stands for (the extras, the block size and every token up to the end of
the block), chained like the key spec but with a different hash function (BLAKE2b-256 with
its own personalisation, keyed by nothing the key's hash computed)::

    s_-1 = BLAKE2b-256(person="kvstore.id.root", encode_extras(extras))
    s_i  = BLAKE2b-256(person="kvstore.id.blk",  s_{i-1} ‖ u32le(block_size) ‖ u32le(t_0) … )
    tag_i = s_i[:8]

A reader computes the tags of the tokens it holds and checks the last 8 bytes of each block
it reads: a block whose tag differs (another sequence's block under a colliding key, or a
block written without a tag) is a miss, counted by :class:`IdentityCheck`. Keys collide by
accident with odds 2**-128 or less; finding a block that collides in the key *and* passes
the tag needs a second preimage of the tag chain as well. The tag travels as part of the
block's bytes, so the store's checksums cover it and no wire, tier or index changes
(docs/key-spec.md, "Collisions: the identity tag").
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.index.keys import KeyExtras, _tokens_u32le, encode_extras
from kvstore.tiers.buffers import Segments, as_u8

log = logging.getLogger(__name__)
TAG_BYTES = 8


def block_tags(tokens: Sequence[int] | np.ndarray, block_size: int, extras: KeyExtras) -> list[bytes]:
    """The identity tag (8 bytes) of each full block of ``tokens``, head first:
    ``len(tokens) // block_size`` tags, tag ``i`` depending on the extras and every token up
    to the end of block ``i``. Raises InvalidArgument for bad tokens (as the key spec)."""
    raw = _tokens_u32le(tokens)
    state = hashlib.blake2b(encode_extras(extras), digest_size=32, person=b"kvstore.id.root").digest()
    count = int(block_size).to_bytes(4, "little")
    step = block_size * 4
    tags: list[bytes] = []
    for off in range(0, len(raw) - step + 1, step):
        h = hashlib.blake2b(state, digest_size=32, person=b"kvstore.id.blk")
        h.update(count)
        h.update(raw[off:off + step])
        state = h.digest()
        tags.append(state[:TAG_BYTES])
    return tags


def seal(data: Any, tag: bytes) -> Any:
    """The block as stored: ``data`` followed by its tag. Bytes give bytes; a
    :class:`Segments` (or an array) gives a Segments with the tag as its last part, so the
    pool gathers it with no staging copy."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data) + tag
    parts = data.parts if isinstance(data, Segments) else [as_u8(data)]
    return Segments([*parts, np.frombuffer(tag, dtype=np.uint8)])


def tag_buffer() -> np.ndarray:
    """A buffer for a block's tag, to end the :class:`Segments` a sealed block is read into."""
    return np.empty(TAG_BYTES, dtype=np.uint8)


class IdentityCheck:
    """Checks the tags of blocks read back and counts the misses (``mismatches``); logs the
    1st, 2nd, 4th, 8th, ... so a flood of them stays a few lines. Thread-safe enough for a
    counter (an int incremented under the GIL)."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.mismatches = 0

    def _miss(self, key: bytes) -> None:
        self.mismatches += 1
        n = self.mismatches
        if n & (n - 1) == 0:
            log.warning("%s: block %s holds another token sequence's KV (identity tag mismatch: a key "
                        "collision or a block written without a tag); read as a miss (%d so far)",
                        self.who, key.hex()[:16], n)

    def unseal(self, key: bytes, data: bytes | None, tag: bytes) -> bytes | None:
        """``data`` without its tag when the tag is ``tag``; None for a miss (``data`` None,
        or a mismatch, counted)."""
        if data is None:
            return None
        if len(data) < TAG_BYTES or data[-TAG_BYTES:] != tag:
            self._miss(key)
            return None
        return data[:-TAG_BYTES]

    def verify(self, key: bytes, read_tag: np.ndarray, tag: bytes) -> bool:
        """Whether a tag read into ``read_tag`` (from :func:`tag_buffer`) is ``tag``; a
        mismatch is counted."""
        if read_tag.tobytes() == tag:
            return True
        self._miss(key)
        return False

    def prefix(self, keys: Sequence[bytes], blocks: Sequence[bytes | None], tags: Sequence[bytes]) -> list[bytes]:
        """The unsealed bytes of the longest run of leading blocks that are present and
        carry their tags (the rest is recomputed)."""
        out: list[bytes] = []
        for key, data, tag in zip(keys, blocks, tags):
            data = self.unseal(key, data, tag)
            if data is None:
                break
            out.append(data)
        return out
