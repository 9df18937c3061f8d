"""KV events and node snapshots: what a pool tells the scheduler's replicas of its index.

A node numbers its events 1, 2, 3, … within an *epoch* (the node process's start time in
ns, so a restarted node has a larger epoch). Every epoch opens with ``NodeCleared`` at seq 1.
On the wire (a Redis Stream entry) an event is a flat map of byte strings, never pickle.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

WIRE_VERSION = b"1"


class EventKind(enum.StrEnum):
    """What happened to the node's copies."""

    BLOCK_STORED = "BlockStored"      # a copy of ``key`` is now readable in ``tier``
    BLOCK_REMOVED = "BlockRemoved"    # the copy of ``key`` in ``tier`` is gone
    NODE_CLEARED = "NodeCleared"      # every copy the node held is gone (start, stop, clear)


class KVEvent(NamedTuple):
    """One change of a node's index. ``size`` in bytes; ``ts`` is ``time.time()`` when the
    index changed (for lag measurement); ``key``/``tier``/``size`` are empty for
    ``NODE_CLEARED``. Immutable; a NamedTuple because every block a node stores or drops
    makes one (a tuple is built about 5x faster than a frozen dataclass)."""

    node: str
    epoch: int
    seq: int
    kind: EventKind
    key: bytes = b""
    tier: str = ""
    size: int = 0
    ts: float = 0.0

    def to_fields(self) -> dict[bytes, bytes]:
        """The Redis Stream entry of this event."""
        return {b"v": WIRE_VERSION, b"node": self.node.encode(), b"epoch": b"%d" % self.epoch,
                b"seq": b"%d" % self.seq, b"kind": self.kind.value.encode(), b"key": self.key,
                b"tier": self.tier.encode(), b"size": b"%d" % self.size, b"ts": repr(self.ts).encode()}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> KVEvent:
        """Parse a Redis Stream entry. Raises ValueError for a malformed or foreign entry."""
        if fields.get(b"v") != WIRE_VERSION:
            raise ValueError(f"KV event of unknown wire version {fields.get(b'v')!r}")
        try:
            return cls(fields[b"node"].decode(), int(fields[b"epoch"]), int(fields[b"seq"]),
                       EventKind(fields[b"kind"].decode()), bytes(fields[b"key"]),
                       fields[b"tier"].decode(), int(fields[b"size"]), float(fields[b"ts"]))
        except (KeyError, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed KV event: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """Every copy a node holds, as of its event ``seq`` in ``epoch``: applying the node's
    events after ``seq`` to this state gives its state at any later seq.
    ``entries``: (key, tier, size in bytes) per copy."""

    node: str
    epoch: int
    seq: int
    entries: tuple[tuple[bytes, str, int], ...]
