"""Admin operations on one pool's books: list and inspect blocks, remove them, flush
tiers or a namespace, evict with a report (demoted versus dropped), demote and promote
single blocks. The store's Admin gRPC service (kvstore/admin/service.py) calls these.

They work on the pool's placement (its per-tier books, pins and chain links) under the
pool's lock, through :func:`_books`, the one place that reaches inside
:class:`kvstore.pool.pool.KVPool`. The same rules as the pool's own moves hold: a leased copy
is never dropped (a reader is copying it), the index forgets a copy before its bytes go.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.pool.ledger import BlockMeta
from kvstore.pool.placement import Placement
from kvstore.pool.tenants import TenantBooks, tenants_of


@dataclass(frozen=True, slots=True)
class BlockView:
    """One block on a node. ``tiers``: the tiers holding a copy, fastest first; ``pin``:
    ``hard``, ``soft`` or ``""``; ``pin_ttl_s``: seconds left on a soft pin; ``leased``: a
    reader holds a copy now; ``parent``: the key it extends in its prefix chain (b"" for a
    chain head or unknown); ``checksum``: xxh3-64 taken at put."""

    key: bytes
    namespace: str
    size: int
    tiers: tuple[str, ...]
    pin: str = ""
    pin_ttl_s: float = 0.0
    leased: bool = False
    parent: bytes = b""
    checksum: int = 0


@dataclass(slots=True)
class FlushReport:
    """``tiers``: every tier the flush went through; ``left``: blocks it left, by reason
    (``pinned`` or ``leased``); ``success``: nothing was left behind."""

    tiers: list[str]
    dropped_blocks: int = 0
    freed_bytes: int = 0
    left: dict[str, int] = field(default_factory=dict)

    @property
    def success(self) -> bool:
        return not any(self.left.values())


@dataclass(slots=True)
class EvictReport:
    """``demoted``: blocks copied to the next tier (still served from there); ``dropped``:
    blocks gone from the node; ``reason``: why fewer than the bytes asked were freed."""

    tier: str
    asked_bytes: int
    freed_bytes: int = 0
    demoted: int = 0
    dropped: int = 0
    reason: str = ""


@dataclass(slots=True)
class MoveReport:
    """Per key of a demote, promote or remove: ``done`` keys, and ``failed`` key -> why."""

    done: list[bytes] = field(default_factory=list)
    freed_bytes: int = 0
    failed: dict[bytes, str] = field(default_factory=dict)


def _books(pool: Any) -> tuple[Placement, Any]:
    """The pool's placement and lock (the only access to the pool's private state)."""
    return pool._place, pool._lock


def _settle(pool: Any) -> None:
    """Do the byte work the locked changes planned (a demotion's write into a slow tier, a
    promotion's copy, a slow tier's deletes: kvstore/pool/moves.py), after the lock."""
    pool._mover.settle()


def _view(place: Placement, key: bytes, books: TenantBooks, now: float) -> BlockView | None:
    metas: list[BlockMeta] = []
    tiers: list[str] = []
    for tier, book in zip(place.tiers, place.books):
        meta = book.blocks.get(key)
        if meta is not None:
            metas.append(meta)
            tiers.append(tier.name)
    if not metas:
        return None
    pin = place.pins.get(key)
    kind, ttl = "", 0.0
    if pin is not None and pin.active(now):
        kind, ttl = ("hard", 0.0) if pin.hard else ("soft", max(0.0, pin.until - now))
    return BlockView(key, books.namespace_of(key), metas[0].size, tuple(tiers), kind, ttl,
                     any(m.leased(now) for m in metas), place.parents.get(key, b""), metas[0].checksum)


def _held_keys(place: Placement, tier: str | None) -> Iterator[bytes]:
    """Each key held (in ``tier`` only, when named) once, fastest tier's order first."""
    levels = range(len(place.tiers)) if tier is None else [place.level_of(tier)]
    seen: set[bytes] = set()
    for level in levels:
        for key in place.books[level].blocks:
            if key not in seen:
                seen.add(key)
                yield key


def list_blocks(pool: Any, tier: str | None = None, namespace: str | None = None,
                key_prefix: str = "", limit: int = 0) -> tuple[list[BlockView], int]:
    """Blocks held (``tier``: with a copy there; ``namespace``: owned by it, ``""`` the
    unattributed; ``key_prefix``: hex the key starts with), up to ``limit`` (0: all), and
    how many matched in all. Raises InvalidArgument for an unknown tier or bad hex."""
    prefix = _hex_prefix(key_prefix) if key_prefix else ""
    books = tenants_of(pool)
    place, lock = _books(pool)
    out: list[BlockView] = []
    total = 0
    with lock:
        now = time.monotonic()
        for key in _held_keys(place, tier):
            if namespace is not None and books.namespace_of(key) != namespace:
                continue
            if prefix and not key.hex().startswith(prefix):
                continue
            total += 1
            if not limit or len(out) < limit:
                view = _view(place, key, books, now)
                if view is not None:
                    out.append(view)
    return out, total


def inspect(pool: Any, key: bytes) -> BlockView | None:
    """The block's copies, size, namespace, pin, lease and chain parent; None if not held."""
    books = tenants_of(pool)
    place, lock = _books(pool)
    with lock:
        return _view(place, key, books, time.monotonic())


def _hex_prefix(text: str) -> str:
    text = text.lower()
    if not text or any(c not in "0123456789abcdef" for c in text):
        raise InvalidArgument(f"a key prefix is 1 or more hex digits, got {text!r}")
    return text


def resolve(pool: Any, keys: Sequence[bytes], prefixes: Sequence[str]) -> list[bytes]:
    """``keys`` followed by every held key that starts with one of the hex ``prefixes``
    (each once, in that order). Raises InvalidArgument for bad hex."""
    wanted = [_hex_prefix(p) for p in prefixes]
    out = list(dict.fromkeys(keys))
    if wanted:
        place, lock = _books(pool)
        with lock:
            have = set(out)
            for key in _held_keys(place, None):
                if key not in have and any(key.hex().startswith(p) for p in wanted):
                    out.append(key)
                    have.add(key)
    return out


def remove(pool: Any, keys: Sequence[bytes]) -> MoveReport:
    """Drop every copy of each key (and its pin); a key not held or with a leased copy is
    reported in ``failed`` and left as it is."""
    place, lock = _books(pool)
    report = MoveReport()
    with lock:
        now = time.monotonic()
        for key in keys:
            levels = [lv for lv, book in enumerate(place.books) if key in book.blocks]
            if not levels:
                report.failed[key] = "not held on this node"
            elif any(place.books[lv].blocks[key].leased(now) for lv in levels):
                report.failed[key] = "leased by a reader; try again once the read ends"
            else:
                report.freed_bytes += sum(place.drop(lv, key) for lv in levels)
                report.done.append(key)
    _settle(pool)
    return report


def flush(pool: Any, tier: str | None = None, namespace: str | None = None, force: bool = False) -> FlushReport:
    """Drop every block of ``tier`` (default: every tier; a lower tier is not filled by
    demotion) owned by ``namespace`` (default: any). Pinned blocks stay unless ``force``
    (their pins go with them then); leased copies always stay. Raises InvalidArgument for
    an unknown tier."""
    books = tenants_of(pool)
    place, lock = _books(pool)
    with lock:
        levels = range(len(place.tiers)) if tier is None else [place.level_of(tier)]
        report = FlushReport([place.tiers[lv].name for lv in levels])
        now = time.monotonic()
        for level in levels:
            book = place.books[level]
            for key in list(book.blocks):
                if namespace is not None and books.namespace_of(key) != namespace:
                    continue
                meta = book.blocks[key]
                pin = place.pins.get(key)
                if meta.leased(now):
                    report.left["leased"] = report.left.get("leased", 0) + 1
                elif pin is not None and pin.active(now) and not force:
                    kind = "hard-pinned" if pin.hard else "soft-pinned"
                    report.left[kind] = report.left.get(kind, 0) + 1
                else:
                    report.freed_bytes += place.drop(level, key)
                    report.dropped_blocks += 1
    _settle(pool)
    return report


def evict(pool: Any, tier: str, nbytes: int) -> EvictReport:
    """Evict at least ``nbytes`` from ``tier`` in policy order, as the pool does (tails
    first, demoting where the next tier has room; never leased or hard-pinned blocks),
    saying how many were demoted and how many dropped, and why it fell short if it did."""
    if nbytes < 0:
        raise InvalidArgument(f"bytes to evict must be >= 0, got {nbytes}")
    place, lock = _books(pool)
    with lock:
        level = place.level_of(tier)
        report = EvictReport(place.tiers[level].name, nbytes)
        book = place.books[level]
        held, blocks = set(book.blocks), 0
        while report.freed_bytes < nbytes:
            size = place.evict_victim(level)
            if size is None:
                left = len(book.blocks)
                report.reason = (f"{tier} is empty" if not left else
                                 f"the {left} blocks left in {tier} are leased or hard-pinned")
                break
            report.freed_bytes += size
            blocks += 1
    _settle(pool)   # demotions into a slow tier are counted once written
    with lock:
        # evicted blocks still held by a lower tier: demoted now, or copied there before (a
        # block promoted keeps its lower copy) — either way still served by this node
        gone = held - set(book.blocks)
        lower = [place.books[i].blocks for i in range(level + 1, len(place.books))]
        report.demoted = min(blocks, sum(1 for key in gone if any(key in b for b in lower)))
        report.dropped = blocks - report.demoted
    return report


def demote(pool: Any, keys: Sequence[bytes]) -> MoveReport:
    """Move each block's fastest copy one tier down (copied there, then dropped from its
    tier); a block already in the last tier, leased, or with no room below is reported."""
    place, lock = _books(pool)
    report = MoveReport()
    moved: list[tuple[bytes, int]] = []   # (key, the tier it goes to)
    with lock:
        now = time.monotonic()
        for key in keys:
            level = next((lv for lv, b in enumerate(place.books) if key in b.blocks), None)
            if level is None:
                report.failed[key] = "not held on this node"
                continue
            meta = place.books[level].blocks[key]
            below = level + 1
            if below >= len(place.tiers):
                report.failed[key] = f"already in the last tier ({place.tiers[level].name})"
                continue
            if meta.leased(now):
                report.failed[key] = "leased by a reader; try again once the read ends"
                continue
            if key in place.books[below].blocks:
                place.books[level].counters.demotions += 1   # a copy there already: only the drop
            else:
                place.demote(level, key, meta)   # copied now, or (a slow tier) written after the lock
                if key not in place.books[below].blocks and (below, key) not in place.inflight:
                    report.failed[key] = f"no room in {place.tiers[below].name} (or its write failed)"
                    continue
            place.drop(level, key)
            moved.append((key, below))
    _settle(pool)
    with lock:
        for key, below in moved:
            if key in place.books[below].blocks:
                report.done.append(key)
            else:
                report.failed[key] = f"writing it to {place.tiers[below].name} failed"
    return report


def promote(pool: Any, keys: Sequence[bytes]) -> MoveReport:
    """Copy each block to the top tier (its lower copy stays); a block there already is
    done, one with no room in the top tier is reported."""
    place, lock = _books(pool)
    report = MoveReport()
    planned: list[bytes] = []
    with lock:
        for key in keys:
            level = next((lv for lv, b in enumerate(place.books) if key in b.blocks), None)
            if level is None:
                report.failed[key] = "not held on this node"
                continue
            if level > 0:
                place.promote(level, key)   # planned: the copy runs after the lock
                if (0, key) not in place.inflight:
                    report.failed[key] = f"no room in {place.tiers[0].name} (everything there is leased or pinned)"
                    continue
            planned.append(key)
    _settle(pool)
    with lock:
        for key in planned:
            if key in place.books[0].blocks:
                report.done.append(key)
            else:
                report.failed[key] = f"copying it to {place.tiers[0].name} failed"
    return report
