"""An engine's own prefix cache in device memory (the ``hbm`` tier, docs/architecture.md §3.3):
block key → block tensor on the engine's device, least recently used evicted first.

With an ``index`` (a :class:`kvstore.events.PublishingIndex` named after the engine) every
block it takes and every block it evicts is a KV event (``BlockStored``/``BlockRemoved``,
tier ``hbm``) on the channel the store nodes publish to, so the scheduler's
:class:`kvstore.events.IndexReplica` sees each engine's cache as it is — no guess on the
scheduler's side — and :meth:`LocalBlockCache.snapshot` is what the replica resynchronises
from after a lost event (the engine's ``Snapshot`` RPC).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvstore.events.event import NodeSnapshot
from kvstore.events.publisher import PublishingIndex, snapshot_of
from kvstore.index.prefix_index import PrefixIndex

HBM = "hbm"


class LocalBlockCache:
    """At most ``capacity_blocks`` blocks, each under its local id (the pool key followed by
    the engine's identity tag) with its pool key (what events and snapshots name). Not
    thread-safe: the engine serialises use. ``node_id``: the engine id the events carry."""

    def __init__(self, capacity_blocks: int, index: PublishingIndex | None = None, node_id: str = "") -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, tuple[bytes, torch.Tensor]] = OrderedDict()
        self.index: PrefixIndex = index if index is not None else PrefixIndex()
        self.node_id = index.node_id if index is not None else node_id
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def prefix(self, local_ids: Sequence[bytes]) -> list[torch.Tensor]:
        """Tensors of the longest cached prefix of ``local_ids`` (touched tail-first, so
        eviction takes a chain's tail before its head)."""
        out = []
        for lid in local_ids:
            entry = self._blocks.get(lid)
            if entry is None:
                break
            out.append(entry[1])
        for lid in reversed(local_ids[:len(out)]):
            self._blocks.move_to_end(lid)
        self.hits += len(out)
        return out

    def put_chain(self, items: Sequence[tuple[bytes, bytes, torch.Tensor]]) -> None:
        """Keep ``(local id, pool key, tensor)`` blocks of one chain, head first."""
        if self.capacity_blocks <= 0:
            return
        for lid, key, tensor in reversed(items):
            if lid not in self._blocks:
                self.index.add(key, self.node_id, HBM, tensor.numel() * tensor.element_size())
            self._blocks[lid] = (key, tensor)
            self._blocks.move_to_end(lid)
        while len(self._blocks) > self.capacity_blocks:
            _, (key, _) = self._blocks.popitem(last=False)
            self.index.remove(key, self.node_id, HBM)
            self.evictions += 1

    def snapshot(self) -> NodeSnapshot:
        """Every cached block as of the last event published (epoch and seq 0 without a
        publishing index)."""
        return snapshot_of(self.index, self.node_id)

    def close(self) -> None:
        """Send the events still queued and stop publishing."""
        if isinstance(self.index, PublishingIndex):
            self.index.close()
