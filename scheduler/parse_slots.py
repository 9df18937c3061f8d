"""Parsing a large request body off the front door's event loop, one at a time per tenant.

Decoding, ``json.loads``, validating and tokenizing a body are CPU work: on the event loop a
29 MiB body of a million empty chat messages (74 kB gzipped) held every other tenant's streams
and the store's health check for 2.2 s. A body that is large (:data:`LARGE_BODY_BYTES` or
more) or sent compressed is therefore parsed in a worker thread, and each tenant has one
such parse at a time (:class:`ParseSlots`): one tenant's large bodies wait for each other, not
other tenants' requests. A tenant's slot is held until its worker thread returns, even when
the client hangs up first, so hanging up frees nothing early."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from scheduler.openai_api import APIError

T = TypeVar("T")

LARGE_BODY_BYTES = 256 << 10   # a body of this many bytes or more (as sent) is parsed off the event loop
MAX_PARSE_WAITING = 8          # a tenant's large bodies waiting for its parse slot; one more is a 429
REASON_PARSE_WAITING = "tenant_parse_waiting"


class ParseSlots:
    """One worker-thread parse at a time per tenant, at most ``max_waiting`` waiting behind
    it. ``refused``: called once per body refused (for a metric). Event-loop only."""

    def __init__(self, max_waiting: int = MAX_PARSE_WAITING, refused: Callable[[], None] | None = None) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self._refused = refused
        self._tenants: dict[str, tuple[asyncio.Lock, list[int]]] = {}   # tenant -> (slot, [users])

    def users(self, tenant: str) -> int:
        """Bodies of ``tenant`` being parsed or waiting (0 or 1 being parsed)."""
        entry = self._tenants.get(tenant)
        return entry[1][0] if entry is not None else 0

    async def run(self, tenant: str, work: Callable[[], T]) -> T:
        """``work()`` in a worker thread once ``tenant``'s slot is free; its result or its
        exception. Raises APIError 429 (``tenant_parse_waiting``, ``Retry-After: 1``) when
        ``max_waiting`` of the tenant's bodies already wait. Cancelled while the thread runs,
        it returns at once and the slot is let go when the thread ends."""
        entry = self._tenants.get(tenant)
        if entry is None:
            entry = self._tenants[tenant] = (asyncio.Lock(), [0])
        lock, users = entry
        if users[0] > self.max_waiting:
            if self._refused is not None:
                self._refused()
            raise APIError(429, f"this API key already has {users[0]} large request bodies being parsed or "
                                f"waiting to be; send fewer at once", "rate_limit", REASON_PARSE_WAITING,
                           {"Retry-After": "1"})
        users[0] += 1
        try:
            await lock.acquire()
        except BaseException:
            self._leave(tenant, entry)
            raise
        future = asyncio.get_running_loop().run_in_executor(None, work)
        future.add_done_callback(lambda f: self._done(tenant, entry, f))
        return await asyncio.shield(future)

    def _done(self, tenant: str, entry: tuple[asyncio.Lock, list[int]], future: asyncio.Future[T]) -> None:
        if not future.cancelled():
            future.exception()          # retrieved: a caller that left would not
        entry[0].release()
        self._leave(tenant, entry)

    def _leave(self, tenant: str, entry: tuple[asyncio.Lock, list[int]]) -> None:
        entry[1][0] -= 1
        if entry[1][0] == 0 and self._tenants.get(tenant) is entry:
            del self._tenants[tenant]
