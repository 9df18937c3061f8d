"""Block checksums: xxh3-64 of a block's bytes, taken at put and verified on every read from
SSD and wherever bytes cross a process boundary (gRPC, a mapped slab). A mismatch is a miss,
a dropped block and a counter, never wrong bytes."""
from __future__ import annotations

from typing import Any

import xxhash

ALGORITHM = "xxh3_64"


def checksum_of(data: Any) -> int:
    """xxh3_64 of ``data`` (anything exposing a contiguous buffer), as an unsigned int."""
    return xxhash.xxh3_64_intdigest(data)


checksum_fn = xxhash.xxh3_64_intdigest  # :func:`checksum_of` without the Python frame, for per-block loops


def new_hasher() -> "xxhash.xxh3_64":
    """A streaming xxh3_64: ``update(chunk)`` in order, then ``intdigest()`` equals
    :func:`checksum_of` of the concatenated chunks."""
    return xxhash.xxh3_64()
