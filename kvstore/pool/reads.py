"""The pool's read side: reads under a lease (one block or a batch), lookups, locked matches
and leases for readers that copy the bytes themselves. :class:`kvstore.pool.pool.KVPool` is
built on it.

One rule for every read (:meth:`PoolReads.read` and :meth:`PoolReads.read_many` share it):
find each key's fastest copy and hold it under a lease, counting hits and misses and
touching recency (``chain``: tail-first, so heads stay warm); copy the bytes outside the
lock; release the holds, dropping a copy that failed its checksum (a miss, counted); raise
LeaseExpired when the copies outlived the lease; then promote lower-tier hits to the top
tier (the copy runs outside the lock, kvstore/pool/moves.py).
"""
from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.errors import IntegrityError, InvalidArgument, LeaseExpired
from kvstore.index.prefix_index import PrefixIndex
from kvstore.pool.lease import Lease
from kvstore.pool.ledger import BlockMeta
from kvstore.pool.moves import Mover
from kvstore.pool.placement import Placement
from kvstore.pool.types import LookupResult, PoolSettings
from kvstore.tiers.base import Tier
from kvstore.tiers.buffers import copy_into, to_bytes

log = logging.getLogger(__name__)
# What a lookup is for (protos/kvstore.proto LookupPurpose; docs/metrics.md)
REUSE, HANDOFF, PROBE = "reuse", "handoff", "probe"
PURPOSES = (REUSE, HANDOFF, PROBE)
Sink = Callable[[Any], Any]
Found = tuple[int, int, BlockMeta]   # (index among the keys, level, the copy's books)


class PoolReads:
    """Reads, lookups and leases over a pool's placement (see the module docstring)."""

    tiers: list[Tier]
    node_id: str
    index: PrefixIndex
    settings: PoolSettings
    promote_on_hit: bool
    _lock: threading.RLock
    _place: Placement
    _mover: Mover
    _lease_ids: itertools.count[int]

    # -- the shared rule -------------------------------------------------------------------
    def _end_read(self, keys: Sequence[bytes], found: list[Found], corrupt: list[Found],
                  counted: bool = True) -> None:
        """Release the holds of a read; drop the copies that failed their checksum (with
        ``counted``, the read had counted them as hits: they become misses)."""
        with self._lock:
            for _, _, meta in found:
                meta.unhold()
            for i, level, meta in corrupt:
                book = self._place.books[level]
                if counted:
                    book.counters.hits -= 1
                    book.counters.misses += 1
                self._place.corrupt(level, keys[i], meta)

    def _after_read(self, keys: Sequence[bytes], found: list[Found], out: list[Any], deadline: float) -> None:
        """LeaseExpired when the copies ended after ``deadline``; else promote the hits from
        lower tiers (``out[i]`` None: not read)."""
        late = time.monotonic() - deadline
        if late > 0:
            what = f"block {keys[0].hex()[:16]}" if len(keys) == 1 else f"{len(found)} blocks"
            raise LeaseExpired(f"read of {what} outlived its lease by {late:.3f} s; "
                               f"the bytes may have been reused and were discarded")
        if self.promote_on_hit and any(level > 0 for _, level, _ in found):
            with self._lock:
                for i, level, _ in found:
                    if level > 0 and out[i] is not None:
                        self._place.promote(level, keys[i])
            self._mover.settle()

    # -- reads -----------------------------------------------------------------------------
    def read_many(self, keys: Sequence[bytes], sinks: Sink | Sequence[Sink],
                  lease_ttl_s: float | None = None, stop_at_miss: bool = False,
                  chain: bool = False, with_checksums: bool = False, after: bytes | None = None,
                  max_bytes: int | None = None) -> list[Any]:
        """``sink(view)`` for each key held, from its fastest tier, under one lease; None for
        a miss. ``sinks``: one for all keys or one per key; a view is a read-only uint8 array
        (a tensor for a device tier) valid only during the call. ``stop_at_miss``: the list
        ends at the first miss (that None included). ``chain``: the keys are one prefix chain
        (linked, and touched tail-first so heads stay warm); ``after``: the block the chain
        continues from, read by an earlier call — ``keys[0]`` is linked to it while it is
        held. ``max_bytes``: the list ends (with no None) after the hit that brings the bytes
        read to this many, so that a caller reads a long chain in bounded windows, each call
        going on from the last key it got. ``with_checksums``: each hit is
        (sink result, the block's xxh3_64 taken at put), for a caller that sends the bytes
        on and lets the receiver verify them end to end. A block failing its checksum is a
        miss, dropped and counted. Raises LeaseExpired when the copies outlived the lease
        (``lease_ttl_s``, default the pool's)."""
        sink_of = sinks if isinstance(sinks, (list, tuple)) else None
        found: list[Found] = []
        groups: dict[int, tuple[list[int], list[bytes], list[Sink]]] = {}  # level -> indices, keys, sinks
        with self._lock:
            deadline = time.monotonic() + (lease_ttl_s or self.settings.lease_ttl_s)
            place = self._place
            n = len(keys)
            budget = math.inf if max_bytes is None else max_bytes
            for i, key in enumerate(keys):
                if budget <= 0:
                    n = i
                    break
                hit = place.find(key)
                if hit is None:
                    if stop_at_miss:
                        n = i + 1
                        break
                    continue
                level, meta = hit
                meta.hold(deadline)
                budget -= meta.size
                found.append((i, level, meta))
                group = groups.get(level) or groups.setdefault(level, ([], [], []))
                group[0].append(i)
                group[1].append(key)
                group[2].append(sink_of[i] if sink_of is not None else sinks)  # type: ignore[arg-type]
            if chain:
                for i, _, _ in found:
                    if i > 0:
                        place.link(keys[i], keys[i - 1])
                if after is not None and found and found[0][0] == 0 and place.held(after):
                    place.link(keys[0], after)
            for i, level, _ in (reversed(found) if chain else found):
                place.books[level].policy.access(keys[i])
        out: list[Any] = [None] * n
        corrupt: list[Found] = []
        try:
            for level, (idx, level_keys, level_sinks) in groups.items():
                for i, v in zip(idx, self.tiers[level].read_many(level_keys, level_sinks)):
                    if isinstance(v, Exception):
                        if not isinstance(v, IntegrityError):
                            raise v
                        corrupt.append(next(f for f in found if f[0] == i))
                    else:
                        out[i] = v
        finally:
            self._end_read(keys, found, corrupt)
        self._after_read(keys, found, out, deadline)
        if with_checksums:
            for i, _, meta in found:
                if out[i] is not None:
                    out[i] = (out[i], meta.checksum)
        return out

    def read(self, key: bytes, sink: Sink, lease_ttl_s: float | None = None) -> Any:
        """``sink(view)`` of one block under a lease, or None on a miss: :meth:`read_many`
        with one key (the same rule, without the batch bookkeeping)."""
        with self._lock:
            deadline = time.monotonic() + (lease_ttl_s or self.settings.lease_ttl_s)
            hit = self._place.find(key)
            if hit is None:
                return None
            level, meta = hit
            meta.hold(deadline)
            self._place.books[level].policy.access(key)
        found: list[Found] = [(0, level, meta)]
        corrupt: list[Found] = []
        out = None
        try:
            out = self.tiers[level].read(key, sink)
        except IntegrityError:
            corrupt = found
        finally:
            self._end_read((key,), found, corrupt)
        if level > 0 or time.monotonic() > deadline:   # else the shared rule has nothing to do
            self._after_read((key,), found, [out], deadline)
        return out

    def get(self, key: bytes) -> bytes | None:
        """The block's bytes, or None on a miss. Raises LeaseExpired (see read_many)."""
        return self.read(key, to_bytes)

    def get_into(self, key: bytes, out: Any) -> int | None:
        """Copy the block into ``out`` (a contiguous numpy array or torch tensor of at least
        its size) with one copy; returns the bytes copied, or None on a miss."""
        return self.read(key, functools.partial(copy_into, out))

    def get_many(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        return self.read_many(keys, to_bytes, stop_at_miss=stop_at_miss)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """Batched :meth:`get_into`: block i into ``outs[i]``."""
        return self.read_many(keys, [functools.partial(copy_into, o) for o in outs])

    def get_chain(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        """Get a prefix chain (None for misses); recency is set tail-first, so heads stay."""
        return self.read_many(keys, to_bytes, stop_at_miss=stop_at_miss, chain=True)

    def scrub(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """Verify every copy this node holds of ``keys`` against the checksum taken at put —
        what a reader asks for when a block failed its checksum after crossing to it (the node
        trusts only its own check) — and drop each copy that fails, counted and logged as a
        read that finds one is. The copies are held meanwhile and hashed outside the lock.
        Returns (copies checked, copies dropped)."""
        held: list[Found] = []
        with self._lock:
            deadline = time.monotonic() + self.settings.lease_ttl_s
            for i, key in enumerate(keys):
                for level, book in enumerate(self._place.books):
                    meta = book.blocks.get(key)
                    if meta is not None:
                        meta.hold(deadline)
                        held.append((i, level, meta))
        bad: list[Found] = []
        try:
            for found in held:
                i, level, _ = found
                try:
                    ok = self.tiers[level].verify(keys[i])
                except KeyError:         # booked, its tier write not landed yet: nothing to check
                    ok = True
                if not ok:
                    bad.append(found)
        finally:
            for i, level, _ in bad:
                log.warning("block %s failed its checksum in tier %s on a reader's report; dropped",
                            keys[i].hex()[:16], self.tiers[level].name)
            self._end_read(keys, held, bad, counted=False)   # a scrub counted no hit
        return len(held), len(bad)

    # -- lookups and locked matches ----------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], purpose: str = REUSE,
               namespace: str | None = None) -> LookupResult:
        """Longest prefix of ``keys`` this node holds, and the fastest tier of each of those
        blocks. Changes no recency, renews no lease. ``purpose`` (:data:`PURPOSES`): what the
        caller looks for, so the node's lookup books measure reuse: a :data:`REUSE` lookup
        counts each block found as a lookup hit of its fastest tier (and a miss of the
        faster ones) and each block past the prefix as a miss of every tier, as a read
        counts; a :data:`HANDOFF` lookup counts the blocks found apart; a :data:`PROBE`
        (the node's own calls, a router planning, an operator) counts nothing. ``namespace``:
        the tenant looking, whose books count the blocks not found (kvstore/pool/tenants.py)."""
        with self._lock:
            match = self.index.match(keys, nodes=[self.node_id])
            tiers = tuple(match.per_node.get(self.node_id, ()))
            if purpose != PROBE:
                self._count_lookup(keys, tiers, purpose, namespace)
            return LookupResult(len(tiers), tiers)

    def _count_lookup(self, keys: Sequence[bytes], tiers: Sequence[str], purpose: str, namespace: str | None) -> None:
        place = self._place
        books = place.books
        if purpose == HANDOFF:
            for tier in tiers:
                books[place.levels[tier]].counters.handoff_lookups += 1
            return
        for tier in tiers:
            level = place.levels[tier]
            for faster in books[:level]:
                faster.counters.lookup_misses += 1
            books[level].counters.lookup_hits += 1
        missed = len(keys) - len(tiers)
        if missed > 0:
            for book in books:
                book.counters.lookup_misses += missed
        if place.tenants is not None:
            place.tenants.looked_up(keys, len(tiers), namespace)

    def contains(self, key: bytes) -> bool:
        """Whether this node holds ``key`` in some tier (renews nothing)."""
        with self._lock:
            return self._place.held(key)

    def acquire(self, keys: Sequence[bytes], ttl_s: float | None = None) -> Lease:
        """A locked match: lease the longest prefix of ``keys`` this node holds (the copy in
        its fastest tier) for ``ttl_s`` (default: the pool's lease TTL); :meth:`release` it."""
        with self._lock:
            deadline = time.monotonic() + (ttl_s or self.settings.lease_ttl_s)
            n, tiers = self.lookup(keys, PROBE)
            metas = [self._place.books[self._place.levels[t]].blocks[k] for k, t in zip(keys[:n], tiers)]
            for meta in metas:
                meta.hold(deadline)
            return Lease(next(self._lease_ids), tuple(keys[:n]), tuple(tiers), deadline, metas)

    def lease_many(self, keys: Sequence[bytes], ttl_s: float | None = None, stop_at_miss: bool = False,
                   chain: bool = False) -> tuple[Lease, list[str | None]]:
        """Lease each key's copy in its fastest tier for a reader that copies the bytes itself
        (a same-host reader of the mapped DRAM slab, kvstore/dataplane). Counts hits and
        misses and touches recency as a read does (``chain``: tail-first, linked), renews
        nothing else — a copy in a tier below the fastest is counted by the read that
        fetches it (the same-host reader copies only the fastest tier's, and reads the rest
        over gRPC), not here. Returns the lease (over the keys held) and, per key, the tier holding
        it or None for a miss; with ``stop_at_miss`` the list ends at the first miss. The
        caller must :meth:`release` the lease; its bytes are trustworthy only if the copy
        ended before ``lease.deadline`` (``time.monotonic()``)."""
        with self._lock:
            deadline = time.monotonic() + (ttl_s or self.settings.lease_ttl_s)
            place, books = self._place, self._place.books
            names = [t.name for t in self.tiers]
            tiers: list[str | None] = []
            held: list[bytes] = []
            metas: list[BlockMeta] = []
            for key in keys:
                hit = place.find(key, below=0)
                if hit is None:
                    tiers.append(None)
                    if stop_at_miss:
                        break
                    continue
                level, meta = hit
                meta.hold(deadline)
                tiers.append(names[level])
                held.append(key)
                metas.append(meta)
                if not chain:
                    books[level].policy.access(key)
            if chain:
                place.link_chain(held)
                for key, tier in reversed([(k, t) for k, t in zip(keys, tiers) if t is not None]):
                    books[place.levels[tier]].policy.access(key)
            return Lease(next(self._lease_ids), tuple(held), tuple(t for t in tiers if t), deadline, metas), tiers

    def release(self, lease: Lease) -> None:
        """End a lease. Raises InvalidArgument when it was released already."""
        with self._lock:
            if lease.released:
                raise InvalidArgument(f"lease {lease.id} was released already")
            lease.released = True
            for meta in lease._metas:
                meta.unhold()
