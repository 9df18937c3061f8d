"""The front doors' large-body parse slots (scheduler/frontdoor/parse_slots.py): one worker-thread
parse at a time per tenant, other tenants never wait behind it, a bounded queue per tenant
(a 429 past it), and a slot held until the thread ends even when its caller leaves first.
Real threads and a real event loop; the work blocks on events the test sets."""
from __future__ import annotations

import asyncio
import threading

import pytest

from scheduler.frontdoor.openai_api import APIError
from scheduler.frontdoor.parse_slots import REASON_PARSE_FULL, REASON_PARSE_WAITING, ParseSlots


def blocked(release: threading.Event, started: threading.Event, value: str):
    def work() -> str:
        started.set()
        assert release.wait(10), "the test never released the work"
        return value
    return work


async def until(predicate, what: str) -> None:
    async with asyncio.timeout(10):
        while not predicate():
            await asyncio.sleep(0.005)
    assert predicate(), what


def test_one_parse_per_tenant_and_other_tenants_do_not_wait():
    async def go():
        slots = ParseSlots(threads=2)
        release, started = threading.Event(), threading.Event()
        first = asyncio.create_task(slots.run("a", blocked(release, started, "a1")))
        await until(started.is_set, "a's first parse started")
        second_started, second_release = threading.Event(), threading.Event()
        second = asyncio.create_task(slots.run("a", blocked(second_release, second_started, "a2")))
        await until(lambda: slots.users("a") == 2, "a's second body waiting")
        # b is served while a's parse holds a's slot
        assert await slots.run("b", lambda: "b1") == "b1"
        assert not second_started.is_set() and not first.done()
        release.set()
        assert await first == "a1"
        await until(second_started.is_set, "a's second parse started once the first ended")
        second_release.set()
        assert await second == "a2"
        assert slots.users("a") == 0
    asyncio.run(go())


def test_past_max_waiting_a_tenant_gets_a_429_and_the_metric_counts_it():
    async def go():
        refused = []
        slots = ParseSlots(max_waiting=2, refused=refused.append, threads=2)
        release, started = threading.Event(), threading.Event()
        tasks = [asyncio.create_task(slots.run("a", blocked(release, started, f"a{i}"))) for i in range(3)]
        await until(lambda: slots.users("a") == 3, "one parse and two waiting")
        with pytest.raises(APIError) as err:
            await slots.run("a", lambda: "too many")
        assert err.value.status == 429 and err.value.code == REASON_PARSE_WAITING
        assert err.value.headers.get("Retry-After") == "1" and "3 large request bodies" in str(err.value)
        assert refused == [REASON_PARSE_WAITING]
        assert await slots.run("b", lambda: "b") == "b"          # another tenant is not refused
        release.set()
        assert await asyncio.gather(*tasks) == ["a0", "a1", "a2"]
        assert slots.users("a") == 0
    asyncio.run(go())


def test_a_caller_that_leaves_keeps_the_slot_until_its_thread_ends():
    async def go():
        slots = ParseSlots()
        release, started = threading.Event(), threading.Event()
        first = asyncio.create_task(slots.run("a", blocked(release, started, "a1")))
        await until(started.is_set, "a's parse started")
        first.cancel()                                   # the client hung up
        with pytest.raises(asyncio.CancelledError):
            await first
        nxt_started, nxt_release = threading.Event(), threading.Event()
        nxt = asyncio.create_task(slots.run("a", blocked(nxt_release, nxt_started, "a2")))
        await asyncio.sleep(0.2)
        assert not nxt_started.is_set() and slots.users("a") == 2   # the thread still runs: the slot is held
        release.set()
        await until(nxt_started.is_set, "a's next parse started once the first thread ended")
        nxt_release.set()
        assert await nxt == "a2"
        assert slots.users("a") == 0
    asyncio.run(go())


def test_errors_of_the_work_reach_the_caller_and_free_the_slot():
    async def go():
        slots = ParseSlots()

        def bad() -> str:
            raise APIError(400, "not JSON", code="invalid_json")
        with pytest.raises(APIError, match="not JSON"):
            await slots.run("a", bad)
        assert slots.users("a") == 0
        assert await slots.run("a", lambda: "ok") == "ok"
    asyncio.run(go())


def test_a_caller_cancelled_while_it_waits_gives_its_place_back_and_the_total_is_bounded():
    async def go():
        refused = []
        slots = ParseSlots(max_total=3, refused=refused.append, threads=2)
        release, started = threading.Event(), threading.Event()
        first = asyncio.create_task(slots.run("a", blocked(release, started, "a1")))
        await until(started.is_set, "a's parse started")
        waiting = asyncio.create_task(slots.run("a", lambda: "never"))
        other = asyncio.create_task(slots.run("b", blocked(release, threading.Event(), "b1")))
        await until(lambda: slots.users("a") == 2 and slots.users("b") == 1, "three bodies in")
        with pytest.raises(APIError) as err:                     # a third tenant: the total is full
            slots.check("c")                                     # (asked before a large body is read)
        assert err.value.status == 429 and err.value.code == REASON_PARSE_FULL and refused == [REASON_PARSE_FULL]
        waiting.cancel()                                         # its client left while it waited
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert slots.users("a") == 1
        release.set()
        assert await first == "a1" and await other == "b1"
        assert await slots.run("c", lambda: "c") == "c"           # room again
        assert slots.users("a") == slots.users("b") == slots.users("c") == 0
        slots.close()
    asyncio.run(go())


def test_with_one_thread_a_tenants_next_body_queues_behind_the_others():
    async def go():
        slots = ParseSlots()                                     # the front door's: one parse thread
        order: list[str] = []
        release, started = threading.Event(), threading.Event()

        def then(name: str, work=None):
            def run() -> str:
                if work is not None:
                    work()
                order.append(name)
                return name
            return run
        a1 = asyncio.create_task(slots.run("a", then("a1", blocked(release, started, "a1"))))
        await until(started.is_set, "a's first parse started")
        a2 = asyncio.create_task(slots.run("a", then("a2")))     # waits for a's slot
        b1 = asyncio.create_task(slots.run("b", then("b1")))     # waits for the thread
        await until(lambda: slots.users("a") == 2 and slots.users("b") == 1, "all three in")
        release.set()
        assert await asyncio.gather(a1, a2, b1) == ["a1", "a2", "b1"]
        assert order == ["a1", "b1", "a2"]                       # b did not wait behind a's second
        slots.close()
    asyncio.run(go())
