"""The SSD tier: blocks in LMDB under a data directory, each with its checksum (verified on
every read), usage accounting that survives restart (rebuilt from what is on disk when
opened), an LMDB map grown as needed and a configurable fsync policy."""
from __future__ import annotations

import errno
import os
import struct
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import lmdb
import numpy as np

from kvstore.errors import IntegrityError
from kvstore.integrity import checksum_of
from kvstore.tiers.base import Sink, Slot, T, TableTier, register_tier
from kvstore.tiers.buffers import host_u8, nbytes

_META = struct.Struct("<QQQ")  # size, checksum, write sequence
FSYNC_POLICIES = ("never", "commit")
_MIN_MAP = 64 << 20


@register_tier("ssd")
class SsdTier(TableTier):
    """Blocks in an LMDB environment at ``path``.

    Two named databases: ``blocks`` (key → bytes) and ``meta`` (key → size, checksum, write
    sequence); both change in one transaction, so a block is on disk completely or not at
    all. ``fsync``: ``"never"`` (the OS flushes; a machine crash may lose the last puts) or
    ``"commit"`` (each commit is durable). The map starts at ``initial_map_bytes`` (or twice
    what is on disk) and doubles on demand up to ``max_map_bytes`` (default: twice the
    capacity plus 64 MiB, room for LMDB's pages).

    ``write_fault``: a test hook, None in service. When set it is called with the key at each
    commit, before anything reaches LMDB; raising OSError there (ENOSPC, EIO) is a failed write.
    """

    def __init__(self, capacity_bytes: int, path: str, fsync: str = "never",
                 max_map_bytes: int | None = None, initial_map_bytes: int = _MIN_MAP) -> None:
        super().__init__(capacity_bytes)
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"ssd fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.max_map_bytes = max_map_bytes or 2 * capacity_bytes + _MIN_MAP
        on_disk = os.path.getsize(os.path.join(path, "data.mdb")) if os.path.exists(
            os.path.join(path, "data.mdb")) else 0
        self._env = lmdb.open(path, map_size=min(self.max_map_bytes, max(initial_map_bytes, 2 * on_disk)),
                              max_dbs=2, sync=fsync == "commit", metasync=fsync == "commit",
                              readahead=False, lock=True)
        self._data = self._env.open_db(b"blocks")
        self._meta = self._env.open_db(b"meta")
        self._blocks: dict[bytes, tuple[int, int]] = {}  # key -> (size, checksum), write order
        self._seq = 0
        self._readers = 0
        self._growing = False
        self._cv = threading.Condition()
        self.write_fault: Callable[[bytes], None] | None = None
        with self._env.begin(db=self._meta) as txn:
            rows = [(_META.unpack(raw), bytes(key)) for key, raw in txn.cursor()]
        for (size, checksum, seq), key in sorted(rows, key=lambda r: r[0][2]):
            self._blocks[key] = (size, checksum)
            self._seq = max(self._seq, seq)
        self._used = sum(size for size, _ in self._blocks.values())

    @property
    def map_bytes(self) -> int:
        return self._env.info()["map_size"]

    def write(self, slot: Slot, offset: int, data: Any) -> None:
        n = nbytes(data)
        if offset == 0 and n == slot.size and slot.data is None:
            slot.data = host_u8(data)  # a whole block in one write: keep a reference, no copy
            return
        if slot.data is None:
            slot.data = np.empty(slot.size, dtype=np.uint8)  # the block arrives in pieces
        np.copyto(slot.data[offset:offset + n], host_u8(data))

    def commit(self, slot: Slot, key: bytes, checksum: int) -> None:
        err = self.commit_many([(slot, key, checksum)])[0]
        if err is not None:
            raise err

    def commit_many(self, items: Sequence[tuple[Slot, bytes, int]]) -> list[Exception | None]:
        """One LMDB transaction for all blocks that pass the write-fault hook."""
        errors: list[Exception | None] = [None] * len(items)
        rows = []
        for i, (slot, key, checksum) in enumerate(items):
            try:
                if self.write_fault is not None:
                    self.write_fault(key)
            except OSError as exc:
                errors[i] = exc
                continue
            rows.append((i, slot, key, checksum, self._seq + len(rows) + 1))
        try:
            self._put_rows(rows)
        except OSError as exc:
            for i, *_ in rows:
                errors[i] = exc
            return errors
        for i, slot, key, checksum, seq in rows:
            self._blocks[key] = (slot.size, checksum)
            self._reserved -= slot.size
            self._used += slot.size
            self._seq = seq
            slot.data = None
        return errors

    def _put_rows(self, rows: list[tuple[int, Slot, bytes, int, int]]) -> None:
        while rows:
            try:
                with self._env.begin(write=True) as txn:
                    for _, slot, key, checksum, seq in rows:
                        txn.put(key, b"" if slot.data is None else slot.data, db=self._data)
                        txn.put(key, _META.pack(slot.size, checksum, seq), db=self._meta)
                return
            except lmdb.MapFullError:
                if not self._grow():
                    raise OSError(errno.ENOSPC, f"ssd: LMDB map full at {self.map_bytes} bytes "
                                                f"({self.path})") from None
            except lmdb.Error as exc:
                raise OSError(errno.EIO, f"ssd: LMDB write failed at {self.path}: {exc}") from exc

    def _grow(self) -> bool:
        """Double the map (up to ``max_map_bytes``) once no read is in flight."""
        new = min(self.max_map_bytes, 2 * self.map_bytes)
        if new <= self.map_bytes:
            return False
        with self._cv:
            self._growing = True
            self._cv.wait_for(lambda: self._readers == 0)
            try:
                self._env.set_mapsize(new)
            finally:
                self._growing = False
                self._cv.notify_all()
        return True

    @contextmanager
    def _reading(self) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: not self._growing)
            self._readers += 1
        try:
            yield
        finally:
            with self._cv:
                self._readers -= 1
                if self._readers == 0:
                    self._cv.notify_all()

    def abort(self, slot: Slot) -> None:
        self._reserved -= slot.size
        slot.data = None

    def _read_in(self, txn: lmdb.Transaction, key: bytes, sink: Sink[T]) -> T | None:
        info = self._blocks.get(key)
        if info is None:
            return None
        buf = txn.get(key, db=self._data)
        if buf is None:
            return None
        if len(buf) != info[0] or checksum_of(buf) != info[1]:
            raise IntegrityError(f"ssd block {key.hex()[:16]} failed its checksum")
        return sink(np.frombuffer(buf, dtype=np.uint8))

    def read(self, key: bytes, sink: Sink[T]) -> T | None:
        """Verifies the checksum before ``sink`` sees the bytes; the view is valid only
        during the call. Raises IntegrityError on a mismatch (the pool drops the block)."""
        if key not in self._blocks:
            return None
        with self._reading(), self._env.begin(buffers=True) as txn:
            return self._read_in(txn, key, sink)

    def read_many(self, keys: Sequence[bytes], sinks: Sequence[Sink[T]]) -> list[T | None | Exception]:
        """One read transaction for all keys; per-block exceptions are returned in place."""
        out: list[T | None | Exception] = []
        with self._reading(), self._env.begin(buffers=True) as txn:
            for key, sink in zip(keys, sinks):
                try:
                    out.append(self._read_in(txn, key, sink))
                except Exception as exc:  # noqa: BLE001 — handed back per block to the pool
                    out.append(exc)
        return out

    def remove(self, key: bytes) -> int:
        info = self._blocks.pop(key, None)
        if info is None:
            return 0
        with self._env.begin(write=True) as txn:
            txn.delete(key, db=self._data)
            txn.delete(key, db=self._meta)
        self._used -= info[0]
        return info[0]


    def close(self) -> None:
        self._env.close()
