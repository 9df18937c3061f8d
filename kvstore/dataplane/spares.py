"""The spare-slot stock of a same-host writer: slab slots the node reserved ahead, before
their block's key was known, so that a put of a block of a size the writer keeps putting is
one COMMIT round trip instead of RESERVE + COMMIT (kvstore/dataplane/host.py
``reserve_spares``; granted after a commit's reply, kvstore/wire/frame_codec.py)."""
from __future__ import annotations

import threading

from kvstore.dataplane.control import Control
from kvstore.wire.types import SlotGrant

SPARE_STOCK = 4           # spare slots a writer keeps of the size it puts, asked for ahead
COPY_MARGIN_S = 0.05      # a slot is written only if the copy surely ends before its write-by time,
MIN_COPY_BYTES_PER_S = 100e6  # assuming at least this copy rate


def in_time(slot: SlotGrant, size: int, now: float) -> bool:
    """Whether a copy of ``size`` bytes started at ``now`` (monotonic seconds) surely ends
    before the slot's write-by time (assuming at least :data:`MIN_COPY_BYTES_PER_S`, plus
    :data:`COPY_MARGIN_S`); a slot without one (0) is always in time."""
    return not slot.write_by or now + COPY_MARGIN_S + size / MIN_COPY_BYTES_PER_S <= slot.write_by


class SpareStock:
    """Spare slots in stock, by block size, for one control channel. ``lock`` guards
    ``by_size``; :meth:`restock` and :meth:`pop` are called with it held."""

    def __init__(self, control: Control) -> None:
        self.control = control
        self.by_size: dict[int, list[SlotGrant]] = {}  # size -> spare slots in stock
        self.lock = threading.Lock()

    def ask(self, sizes: list[int]) -> tuple[tuple[int, int], list[int]]:
        """(size, count) of spare slots to ask for at this commit, and the spare slots to
        give back with it. A writer keeps spares of the size it puts now only: enough of
        the window's last block size for the next window like it, at least
        :data:`SPARE_STOCK`; spares of other sizes go back (the node also caps what one
        connection holds). Nothing is asked while a grant is owed or the stock is more
        than half full."""
        if not self.control.spares or self.control.spares_owed:
            return (0, 0), []
        size = sizes[-1]
        want = max(SPARE_STOCK, sum(s == size for s in sizes))
        with self.lock:
            in_stock = len(self.by_size.get(size, ()))
            if in_stock * 2 > want:
                return (0, 0), []
            unused = [g.res_id for s, stock in self.by_size.items() if s != size for g in stock]
            self.by_size = {size: self.by_size.get(size, [])}
        return (size, want - in_stock), unused

    def restock(self, size: int) -> None:
        """Take in the spare grants the node sent (lock held): those arrived, or all owed
        when none of ``size`` is in stock. With spares in stock, a grant still owed is read
        by the next round trip (after its request went out), not on the put's path."""
        ctl = self.control
        if not ctl.spares_owed or not self.by_size.get(size):
            self.stock(ctl.take_spares(wait=ctl.spares_owed > 0))

    def pop(self, size: int, now: float, give_back: list[int]) -> SlotGrant | None:
        """A spare slot of ``size`` a copy started at ``now`` surely fills in time (lock
        held), or None; the ones too near their write-by time, popped on the way, go to
        ``give_back`` (never written)."""
        stock = self.by_size.get(size)
        while stock:
            g = stock.pop()
            if in_time(g, size, now):
                return g
            give_back.append(g.res_id)
        return None

    def stock(self, grants: list[tuple[int, SlotGrant]]) -> None:
        """Keep spare slots granted by the node, as (size, slot)."""
        for size, g in grants:
            self.by_size.setdefault(size, []).append(g)
