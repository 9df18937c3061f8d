"""The accounting tier: a tier that keeps sizes and checksums but no bytes, so a real
:class:`kvstore.pool.pool.KVPool` — its ledger, placement, eviction, demotion, pins and index —
can account for blocks whose payloads live elsewhere or nowhere (the cluster simulator,
``scheduler/sim/``, accounts whole clusters' KV this way in virtual time).

A pool over accounting tiers takes blocks with :meth:`kvstore.pool.pool.KVPool.account_chain`
(sizes only); a read hands the sink an empty view.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvstore.tiers import registry
from kvstore.tiers.base import Sink, Slot, T, TableTier, register_tier

_EMPTY = np.zeros(0, dtype=np.uint8)
_EMPTY.flags.writeable = False
UNBOUNDED = 1 << 62   # bytes: the capacity of a tier without a bound


@register_tier("accounting")
class AccountingTier(TableTier[tuple[int, int]]):
    """Books ``capacity_bytes`` of blocks without storing them. ``name``: the tier it stands
    in for (``hbm``, ``dram``, ``ssd``: what the index records); ``device``: likewise.

    Invariant: ``used_bytes`` is the sum of the committed sizes plus the open slots'.
    """

    holds_bytes = False

    def __init__(self, capacity_bytes: int = UNBOUNDED, name: str = registry.DRAM.name, device: str = "none") -> None:
        super().__init__(capacity_bytes)
        self.name = name
        self.device = device
        self._blocks: dict[bytes, tuple[int, int]] = {}   # key -> (size, checksum)

    def write(self, slot: Slot, offset: int, data: Any) -> None:
        """Nothing is kept."""

    def commit(self, slot: Slot, key: bytes, checksum: int) -> None:
        self._blocks[key] = (slot.size, checksum)
        self._reserved -= slot.size
        self._used += slot.size

    def abort(self, slot: Slot) -> None:
        self._reserved -= slot.size

    def read(self, key: bytes, sink: Sink[T]) -> T | None:
        return None if key not in self._blocks else sink(_EMPTY)

    def verify(self, key: bytes) -> bool:
        """No bytes, nothing to damage (raises KeyError for an absent key, as every tier)."""
        if key not in self._blocks:
            raise KeyError(key)
        return True

    def read_many(self, keys: Sequence[bytes], sinks: Sequence[Sink[T]]) -> list[T | None | Exception]:
        blocks = self._blocks
        return [None if k not in blocks else s(_EMPTY) for k, s in zip(keys, sinks)]

    def remove(self, key: bytes) -> int:
        entry = self._blocks.pop(key, None)
        if entry is None:
            return 0
        self._used -= entry[0]
        return entry[0]

