"""The front door's health checks: every ``interval_s`` each engine is asked for its load
(``Engine/Load``, one gRPC round trip, ``timeout_s`` at most) and the store node for its
health; an engine that refuses the check (gRPC error: not listening, crashed), or that gives
no answer within ``timeout_s`` in ``misses_to_down`` checks in a row (a busy engine may miss
one: a long prefill holds its process), or that fails a request (:meth:`Router.mark_down`),
is out of routing until a check succeeds again. :meth:`HealthChecker.report` is what ``GET /health``
answers: ``ok`` (HTTP 200), or HTTP 503 with the reasons (one line per part that is down)
and a status saying what that means: ``degraded`` (an engine or the store is down; requests
are still served — by the other instances, or recomputed without the pool) or
``unavailable`` (no prefill or no decode instance is up). The front door over vLLM checks
only the store here (``probe_engines=False``): its router watches the instances itself.

Over a cluster (a :class:`kvstore.cluster.ClusterClient` store), a store node the check finds
down — no answer, an error, gone from the registry without a clean stop — is dropped from
the router's index replica at once (:meth:`IndexReplica.drop_node`): its blocks stop
counting as hits, so no prefill is planned on a fetch that cannot happen. It is dropped once
per outage; an event from it when it is back resynchronises it from its snapshot."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from kvstore.errors import KVStoreError
from scheduler.frontdoor.tasks import cancel_and_wait
from scheduler.routing.router import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthReport:
    """``status``: ok / degraded / unavailable; ``reasons``: one line per part that is down."""

    status: str
    reasons: tuple[str, ...]

    @property
    def http_status(self) -> int:
        """200 when everything is up, else 503 (a probe sees that a part is down)."""
        return 200 if self.status == "ok" else 503


class HealthChecker:
    """Runs the checks in a task of the front door's event loop (:meth:`start`/:meth:`stop`)."""

    def __init__(self, router: Router, interval_s: float = 1.0, timeout_s: float = 1.0,
                 probe_engines: bool = True, misses_to_down: int = 3) -> None:
        if misses_to_down < 1:
            raise ValueError(f"misses_to_down must be >= 1, not {misses_to_down}")
        self.router = router
        self.misses_to_down = misses_to_down
        self.misses: dict[str, int] = {}    # engine id -> checks in a row without an answer
        self.probe_engines = probe_engines
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.store_down: str = ""
        self.rounds = 0          # checks completed
        self._task: asyncio.Task[None] | None = None
        self._store_probe: asyncio.Future[Any] | None = None
        self.nodes_down: set[str] = set()   # store nodes of a cluster down at the last check

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="health-checks")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.interval_s)

    async def check_once(self) -> None:
        """Ask every engine (in parallel) and the store once; update the router's ``down``."""
        clients = ([(e, p.client) for e, p in self.router.prefill.items()]
                   + [(e, d.client) for e, d in self.router.decode.items()]) if self.probe_engines else []
        results = await asyncio.gather(*(self._probe(client) for _, client in clients))
        for (engine_id, _), (error, timed_out) in zip(clients, results):
            if not error:
                self.misses.pop(engine_id, None)
                self.router.mark_up(engine_id)
                continue
            missed = self.misses[engine_id] = self.misses.get(engine_id, 0) + 1 if timed_out else self.misses_to_down
            if missed >= self.misses_to_down:
                self.router.mark_down(engine_id, f"{error} ({missed} checks in a row)" if timed_out else error)
        await self._check_store()
        self.rounds += 1

    async def _probe(self, client: Any) -> tuple[str, bool]:
        """("", False) when the engine answered; else (the reason, whether it only timed out)."""
        try:
            async with asyncio.timeout(self.timeout_s):   # not wait_for: it can drop stop()'s cancel
                await client.load()
            return "", False
        except TimeoutError:
            return f"no answer to a health check within {self.timeout_s:g} s", True
        except KVStoreError as exc:
            return f"health check failed: {exc}", False

    async def _check_store(self) -> None:
        store = self.router.store
        if store is None or not hasattr(store, "health"):
            return
        if self._store_probe is None or self._store_probe.done():   # never two probes at once
            self._store_probe = asyncio.ensure_future(asyncio.to_thread(store.health))
        try:
            async with asyncio.timeout(self.timeout_s):
                status = await asyncio.shield(self._store_probe)
        except TimeoutError:
            self._mark_store(f"no answer to a health check within {self.timeout_s:g} s")
        except KVStoreError as exc:
            self._mark_store(f"health check failed: {exc}")
        else:
            self._mark_store("" if str(status).upper() in ("SERVING", "OK") else f"health {status}")
        if self._store_probe.done():
            self._forget_nodes_down(getattr(store, "problems", ()))

    def _forget_nodes_down(self, problems: Any) -> None:
        """Drop each store node newly down from the router's replica (module docstring)."""
        down = {p.node_id for p in problems}
        replica = self.router.replica
        for node in down - self.nodes_down:
            if replica is not None:
                blocks = replica.drop_node(node)
                log.warning("store node %s is down: its %d blocks are no longer hits until it is back", node, blocks)
        self.nodes_down = down

    def _mark_store(self, reason: str) -> None:
        if reason and not self.store_down:
            log.warning("store is down (prompts are recomputed, not loaded): %s", reason)
        elif self.store_down and not reason:
            log.info("store is up again")
        self.store_down = reason

    def engines(self) -> list[tuple[str, str]]:
        """(role, engine id) of every prefill and decode instance the router knows."""
        r = self.router
        return [(role, e) for role, pool in (("prefill", r.prefill), ("decode", r.decode)) for e in pool]

    def parts(self) -> list[tuple[str, str, bool]]:
        """(role, instance, up) of every engine and of the store (when there is one), as the
        last checks found them (``kvstore_scheduler_up``)."""
        store = [("store", "store", not self.store_down)] if self.router.store is not None else []
        return [*((role, e, e not in self.router.down) for role, e in self.engines()), *store]

    def report(self) -> HealthReport:
        r = self.router
        reasons = [f"{role} {e}: {r.down[e]}" for role, e in self.engines() if e in r.down]
        if self.store_down:
            effect = getattr(r.store, "down_effect", "prompts are recomputed")
            reasons.append(f"store: {self.store_down} ({effect})")
        if not r.serving("prefill") or not r.serving("decode"):
            return HealthReport("unavailable", tuple(reasons))
        return HealthReport("degraded" if reasons else "ok", tuple(reasons))
