"""The SSD tier: blocks in LMDB under a data directory, each with its checksum, and usage
accounting that survives restart (it is rebuilt from what is on disk when opened)."""
from __future__ import annotations

import os
import struct
from typing import Iterator

import lmdb
import xxhash

from kvstore.errors import CapacityError, IntegrityError
from kvstore.tiers.base import Tier, register_tier

_META = struct.Struct("<QQQ")  # size, checksum, write sequence


@register_tier("ssd")
class SsdTier(Tier):
    """Blocks in an LMDB environment at ``path``.

    Two named databases: ``blocks`` (key → bytes) and ``meta`` (key → size, checksum, write
    sequence). Both change in one transaction, so a block is on disk completely or not at all.
    ``fsync``: ``"never"`` (fast; the OS flushes) or ``"commit"`` (each put is durable).
    """

    def __init__(self, capacity_bytes: int, path: str, fsync: str = "never") -> None:
        super().__init__(capacity_bytes)
        if fsync not in ("never", "commit"):
            raise ValueError(f"ssd fsync policy must be 'never' or 'commit', got {fsync!r}")
        os.makedirs(path, exist_ok=True)
        self.path = path
        # LMDB needs room beyond the payload for its B-tree and page rounding.
        map_size = capacity_bytes * 2 + (64 << 20)
        self._env = lmdb.open(path, map_size=map_size, max_dbs=2, sync=fsync == "commit",
                              metasync=fsync == "commit", readahead=False, lock=True)
        self._data = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")
        self._sizes: dict[bytes, int] = {}
        self._seq = 0
        with self._env.begin(db=self._meta) as txn:
            rows = []
            for key, raw in txn.cursor():
                size, _, seq = _META.unpack(raw)
                rows.append((seq, bytes(key), size))
        for seq, key, size in sorted(rows):
            self._sizes[key] = size
            self._seq = max(self._seq, seq)
        self._used = sum(self._sizes.values())

    @property
    def used_bytes(self) -> int:
        return self._used

    def put(self, key: bytes, data: bytes | memoryview, checksum: int) -> None:
        if key in self._sizes:
            return
        size = len(data)
        if size > self.capacity_bytes:
            raise CapacityError(f"ssd: a {size}-byte block exceeds the tier's capacity")
        if self._used + size > self.capacity_bytes:
            raise CapacityError(f"ssd: {size} bytes do not fit; {self._used} of "
                                f"{self.capacity_bytes} bytes used")
        self._seq += 1
        try:
            with self._env.begin(write=True) as txn:
                txn.put(key, data, db=self._data)
                txn.put(key, _META.pack(size, checksum, self._seq), db=self._meta)
        except lmdb.MapFullError as exc:
            raise CapacityError(f"ssd: LMDB map full at {self.path}") from exc
        self._sizes[key] = size
        self._used += size

    def get(self, key: bytes) -> bytes | None:
        if key not in self._sizes:
            return None
        with self._env.begin(buffers=True) as txn:
            data = txn.get(key, db=self._data)
            meta = txn.get(key, db=self._meta)
            if data is None or meta is None:
                return None
            _, checksum, _ = _META.unpack(meta)
            ok = xxhash.xxh3_64_intdigest(data) == checksum
            out = bytes(data) if ok else None
        if out is None:
            self.remove(key)
            raise IntegrityError(f"ssd block {key.hex()[:16]} failed its checksum; dropped")
        return out

    def remove(self, key: bytes) -> int:
        size = self._sizes.pop(key, None)
        if size is None:
            return 0
        with self._env.begin(write=True) as txn:
            txn.delete(key, db=self._data)
            txn.delete(key, db=self._meta)
        self._used -= size
        return size

    def keys(self) -> Iterator[tuple[bytes, int]]:
        return iter(list(self._sizes.items()))

    def close(self) -> None:
        self._env.close()
