"""Parsing a large request body off the front door's event loop, one at a time per tenant.

Decoding, ``json.loads``, validating and tokenizing a body are CPU work: on the event loop a
29 MiB body of a million empty chat messages (74 kB gzipped) held every other tenant's streams
and the store's health check for 2.2 s. A body that is large (:data:`LARGE_BODY_BYTES` or
more, as sent or as decoded) is therefore parsed in a worker thread of the front door's own
(:data:`PARSE_THREADS`, never the event loop's default executor, which the router's pool
lookups and the store's health check use), and each tenant has one such parse at a time
(:class:`ParseSlots`): one tenant's large bodies wait for each other, not other tenants'
requests. A tenant's slot is held until its worker thread returns, even when the client
hangs up first, so hanging up frees nothing early. The tenant is what the ``Authorization``
header names: without API keys any bearer token is one, so :data:`MAX_PARSE_TOTAL` bounds
the bodies parsed or waiting across tenants too."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from scheduler.frontdoor.openai_api import APIError

T = TypeVar("T")

LARGE_BODY_BYTES = 256 << 10   # a body of this many bytes or more (as sent) is parsed off the event loop
MAX_PARSE_WAITING = 8          # a tenant's large bodies waiting for its parse slot; one more is a 429
MAX_PARSE_TOTAL = 64           # large bodies parsed or waiting, all tenants; one more is a 429
# Threads parsing large bodies: one, since json.loads holds the GIL and a second only took it
# from the event loop more (another caller's median latency was about twice as high with two).
PARSE_THREADS = 1
REASON_PARSE_WAITING = "tenant_parse_waiting"
REASON_PARSE_FULL = "parse_queue_full"


class ParseSlots:
    """One worker-thread parse at a time per tenant, at most ``max_waiting`` waiting behind
    it, at most ``max_total`` parsed or waiting in all, on ``threads`` threads of its own
    (:data:`PARSE_THREADS`; with one, a tenant's next body queues behind every other
    tenant's already queued: one each at most). ``refused``: called with the reason of each body refused (for a metric).
    Event-loop only."""

    def __init__(self, max_waiting: int = MAX_PARSE_WAITING, refused: Callable[[str], None] | None = None,
                 max_total: int = MAX_PARSE_TOTAL, threads: int = PARSE_THREADS) -> None:
        if max_waiting < 0 or max_total < 1:
            raise ValueError(f"max_waiting must be >= 0 and max_total >= 1, got {max_waiting}, {max_total}")
        self.max_waiting, self.max_total = max_waiting, max_total
        self._refused = refused
        self._tenants: dict[str, tuple[asyncio.Lock, list[int]]] = {}   # tenant -> (slot, [users])
        self._total = 0
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvstore-parse")

    def users(self, tenant: str) -> int:
        """Bodies of ``tenant`` being parsed or waiting (0 or 1 being parsed)."""
        entry = self._tenants.get(tenant)
        return entry[1][0] if entry is not None else 0

    async def run(self, tenant: str, work: Callable[[], T]) -> T:
        """``work()`` in a worker thread once ``tenant``'s slot is free; its result or its
        exception. Raises APIError 429 (``Retry-After: 1``): ``tenant_parse_waiting`` when
        ``max_waiting`` of the tenant's bodies already wait, ``parse_queue_full`` when
        ``max_total`` bodies are parsed or waiting. Cancelled while the thread runs, it
        returns at once and the slot is let go when the thread ends."""
        self.check(tenant)
        entry = self._tenants.get(tenant)
        if entry is None:
            entry = self._tenants[tenant] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        self._total += 1
        try:
            await lock.acquire()
        except BaseException:
            self._leave(tenant, entry)
            raise
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, work)
        except BaseException:
            lock.release()
            self._leave(tenant, entry)
            raise
        future.add_done_callback(lambda f: self._done(tenant, entry, f))
        return await asyncio.shield(future)

    def check(self, tenant: str) -> None:
        """Raises the APIError 429 :meth:`run` would raise for one more of ``tenant``'s
        bodies now (the front doors ask before reading a body whose ``Content-Length`` is
        large, so a refusal does not cost the read)."""
        if self._total >= self.max_total:
            raise self._refuse(REASON_PARSE_FULL, f"the server already has {self._total} large request bodies "
                                                  "being parsed or waiting to be; retry shortly")
        users = self.users(tenant)
        if users > self.max_waiting:
            raise self._refuse(REASON_PARSE_WAITING, f"this API key already has {users} large request bodies "
                                                     "being parsed or waiting to be; send fewer at once")

    def _refuse(self, reason: str, message: str) -> APIError:
        if self._refused is not None:
            self._refused(reason)
        return APIError(429, message, "rate_limit", reason, {"Retry-After": "1"})

    def _done(self, tenant: str, entry: tuple[asyncio.Lock, list[int]], future: asyncio.Future[T]) -> None:
        if not future.cancelled():
            future.exception()          # retrieved: a caller that left would not
        entry[0].release()
        self._leave(tenant, entry)

    def _leave(self, tenant: str, entry: tuple[asyncio.Lock, list[int]]) -> None:
        self._total -= 1
        entry[1][0] -= 1
        if entry[1][0] == 0 and self._tenants.get(tenant) is entry:
            del self._tenants[tenant]

    def close(self) -> None:
        """Let the worker threads go once their parses end (the front door's stop)."""
        self._executor.shutdown(wait=False)
