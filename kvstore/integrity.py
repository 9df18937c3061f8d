"""Block checksums: xxh3-64 of a block's bytes, taken at put and verified on every read from
SSD and wherever bytes cross a process boundary (gRPC, a mapped slab). A mismatch is a miss,
a dropped block and a counter, never wrong bytes."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import xxhash

ALGORITHM = "xxh3_64"


# checksum_of(data) -> int: xxh3_64 of ``data`` (anything exposing a contiguous buffer), as an
# unsigned int. The C function itself, with no Python frame around it: per-block loops call it.
checksum_of: Callable[[Any], int] = xxhash.xxh3_64_intdigest


def new_hasher() -> xxhash.xxh3_64:
    """A streaming xxh3_64: ``update(chunk)`` in order, then ``intdigest()`` equals
    :func:`checksum_of` of the concatenated chunks."""
    return xxhash.xxh3_64()
