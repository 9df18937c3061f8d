"""An engine's own prefix cache in device memory (the ``hbm`` tier of DESIGN.md §4): block
key → block tensor on the engine's device, least recently used evicted first."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch


class LocalBlockCache:
    """At most ``capacity_blocks`` blocks. Not thread-safe: the engine serialises use."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def prefix(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """Tensors of the longest cached prefix of ``keys`` (touched tail-first, so eviction
        takes a chain's tail before its head)."""
        out = []
        for key in keys:
            t = self._blocks.get(key)
            if t is None:
                break
            out.append(t)
        for key in reversed(keys[:len(out)]):
            self._blocks.move_to_end(key)
        self.hits += len(out)
        return out

    def put_chain(self, items: Sequence[tuple[bytes, torch.Tensor]]) -> None:
        if self.capacity_blocks <= 0:
            return
        for key, tensor in reversed(items):
            self._blocks[key] = tensor
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
            self.evictions += 1
