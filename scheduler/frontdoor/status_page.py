"""The front door's status page: ``GET /status`` (an HTML dashboard, scheduler/frontdoor/static/) and
``GET /status.json`` (the feed its script polls every 2 s).

The feed holds: the store nodes (each one's tiers: capacity, used bytes, blocks, lookup hits
and misses, read hits and misses; a node that does not answer is listed down with the
reason), the hit ratios over the last :data:`WINDOW_S` seconds and their history — prompt
tokens cached / prompt tokens (reuse: what the clients are told as ``cached_tokens``), by
source, and the hand-off to decode / prompt tokens apart, from the front door's own counters;
blocks found / blocks looked up by the nodes' reuse lookups, and blocks served / blocks read,
from the nodes' tier counters (docs/metrics.md) — each
engine instance's queue (requests routed and not yet prefilled; decodes running; down with
the reason) and admissions and rejections by reason (totals and over the window).

History comes from samples taken every ``sample_s`` seconds by a task of the front door's
event loop (and at each feed request, at most one a second), kept for :data:`HISTORY_S`.

The HTML and its script hold no data, so ``/status`` is served without an API key (a
browser cannot send one when it navigates); ``/status.json`` takes the front door's API key
like every other path. The page reads the key from the URL's fragment (``/status#key=K``:
the fragment never leaves the browser) or asks for it, and keeps it in the tab's session
storage.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvstore.errors import KVStoreError
from scheduler.frontdoor.tasks import cancel_and_wait

if TYPE_CHECKING:
    from kvstore.client import StoreClient
    from scheduler.frontdoor.server import Frontdoor

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
PAGE_PATHS = ("/status", "/status.js")   # served without an API key: they hold no data
WINDOW_S = 300.0       # the hit ratio and admission counts the page headlines
HISTORY_S = 900.0      # samples kept for the history chart
MIN_REFRESH_S = 1.0    # a feed request samples anew at most this often
# The page runs its own script and reads its own feed, nothing else: no other origin's
# script, style, image or frame, no framing by another page (clickjacking the key form),
# no sniffing the script as another type, and no key-bearing URL sent on as a Referer.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; connect-src 'self'; "
                               "style-src 'self' 'unsafe-inline'; img-src 'self'; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True, slots=True)
class Sample:
    """Cumulative counters at wall-clock ``t`` (seconds since the epoch)."""

    t: float
    prompt_tokens: float
    cached_tokens: float
    lookup_hits: int      # blocks the nodes' reuse lookups found
    lookup_asked: int     # blocks they looked up
    read_hits: int        # blocks the nodes served
    read_asked: int       # blocks read of them
    admitted: float
    rejected: float
    handoff_tokens: float = 0.0
    by_source: tuple[tuple[str, float], ...] = ()


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _ratios(a: Sample, b: Sample) -> dict[str, Any]:
    """The ratios between two samples: ``tokens`` (cached / prompt tokens), ``handoff``
    (hand-off / prompt tokens), ``lookups`` (blocks found / looked up), ``reads`` (served / read)."""
    prompt = b.prompt_tokens - a.prompt_tokens
    return {"tokens": _ratio(b.cached_tokens - a.cached_tokens, prompt),
            "handoff": _ratio(b.handoff_tokens - a.handoff_tokens, prompt),
            "lookups": _ratio(b.lookup_hits - a.lookup_hits, b.lookup_asked - a.lookup_asked),
            "reads": _ratio(b.read_hits - a.read_hits, b.read_asked - a.read_asked)}


def _counter(metric: Any) -> dict[str, float]:
    """A labelled prometheus-client Counter's ``_total`` samples by their one label's value."""
    out: dict[str, float] = {}
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                out[next(iter(s.labels.values()), "")] = s.value
    return out


class StatusFeed:
    """What ``/status.json`` answers for one front door. :meth:`install` adds the routes and
    the sampling task (started and stopped with the app)."""

    def __init__(self, door: Frontdoor, sample_s: float = 5.0) -> None:
        self.door = door
        self.sample_s = sample_s
        self.samples: deque[Sample] = deque()
        self.nodes: list[dict[str, Any]] = []
        self._clients: dict[str, StoreClient] = {}
        self._lock = asyncio.Lock()

    # -- wiring ------------------------------------------------------------------------------
    def install(self, app: web.Application) -> None:
        app.router.add_get("/status", self.page)
        app.router.add_get("/status.js", self.script)
        app.router.add_get("/status.json", self.feed)
        app.cleanup_ctx.append(self._sampling)

    async def _sampling(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(self._run(), name="status-samples")
        yield
        await cancel_and_wait(task)
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a failed sample must not end the sampling
                log.exception("status page: sample failed")
            await asyncio.sleep(self.sample_s)

    # -- handlers ----------------------------------------------------------------------------
    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "status.html", headers={"Cache-Control": "no-cache", **PAGE_HEADERS})

    async def script(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "status.js", headers={"Cache-Control": "no-cache", **PAGE_HEADERS})

    async def feed(self, request: web.Request) -> web.Response:
        if not self.samples or time.time() - self.samples[-1].t >= MIN_REFRESH_S:
            await self.refresh()
        return web.json_response(self.snapshot(), headers={"Cache-Control": "no-store"})

    # -- sampling ----------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read every store node and the front door's counters once; keep the sample."""
        async with self._lock:
            self.nodes = await self._read_nodes()
            m = self.door.metrics
            reg = m.registry
            tiers = [t for n in self.nodes for t in n["tiers"]]
            firsts = [n["tiers"][0] for n in self.nodes if n["tiers"]]   # each block asked counts once there
            now = time.time()
            self.samples.append(Sample(
                now, reg.get_sample_value("kvstore_scheduler_prompt_tokens_total") or 0.0,
                reg.get_sample_value("kvstore_scheduler_cached_prompt_tokens_total") or 0.0,
                sum(t["lookup_hits"] for t in tiers), sum(t["lookup_hits"] + t["lookup_misses"] for t in firsts),
                sum(t["hits"] for t in tiers), sum(t["hits"] + t["misses"] for t in firsts),
                reg.get_sample_value("kvstore_scheduler_requests_admitted_total") or 0.0,
                sum(_counter(m.rejected).values()), sum(_counter(m.handoff_tokens).values()),
                tuple(sorted(_counter(m.cached_by_source).items()))))
            while self.samples and now - self.samples[0].t > HISTORY_S:
                self.samples.popleft()

    async def _read_nodes(self) -> list[dict[str, Any]]:
        store = self.door.router.store
        if store is None:
            return []
        from kvstore.client import StoreClient
        from kvstore.cluster.client import ClusterClient
        if isinstance(store, ClusterClient):   # a cluster: every node registered
            try:
                listed = await asyncio.to_thread(store.nodes)
            except KVStoreError as exc:
                return [{"node_id": "?", "address": "", "state": f"registry unreachable: {exc}", "tiers": []}]
            addresses = [(n.node_id, n.address) for n in listed]
            listed_ids = {n.node_id for n in listed}
            lost = [{"node_id": p.node_id, "address": p.address, "state": f"down: {p.why}", "tiers": []}
                    for p in store.problems if p.node_id not in listed_ids]     # gone without a clean stop
            return [*(await asyncio.gather(*(self._read_node(i, a) for i, a in addresses))), *lost]
        elif isinstance(store, StoreClient):
            addresses = [("", store.address)]
        else:
            return []
        return list(await asyncio.gather(*(self._read_node(node_id, address) for node_id, address in addresses)))

    async def _read_node(self, node_id: str, address: str) -> dict[str, Any]:
        from kvstore.client import StoreClient
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = StoreClient(address, auth_token=self.door.config.store_auth_token,
                                                          timeout_s=2.0, data_path="grpc")
        try:
            found_id, stats = await asyncio.to_thread(client.stats)
        except KVStoreError as exc:
            return {"node_id": node_id or address, "address": address, "state": f"down: {exc}", "tiers": []}
        return {"node_id": found_id, "address": address, "state": "up", "tiers": [
            {"name": s.name, "capacity_bytes": s.capacity_bytes, "used_bytes": s.used_bytes, "blocks": s.blocks,
             "lookup_hits": s.lookup_hits, "lookup_misses": s.lookup_misses, "handoff_lookups": s.handoff_lookups,
             "hits": s.hits, "misses": s.misses, "evictions": s.evictions, "pinned_bytes": s.pinned_bytes}
            for s in stats]}

    # -- the feed ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The feed (JSON-ready): ``time``, ``sampled_at`` (when the nodes and counters were
        read), ``status``/``reasons`` (as ``/health``), ``model``,
        ``policy``, ``nodes``, ``hit_ratio`` over ``window_s`` (None without traffic):
        ``tokens`` (cached / prompt tokens), ``by_source`` (source -> its share of the prompt
        tokens), ``handoff`` (hand-off / prompt tokens: a transfer, not a hit), ``lookups``
        (the nodes' lookup hit ratio: reuse) and ``reads`` (their read success); ``series``:
        one point per sample interval), ``instances`` and ``admission``. Ratios are
        fractions in [0, 1]; times are seconds since the epoch."""
        door, router = self.door, self.door.router
        report = door.health_checks.report()
        last = self.samples[-1] if self.samples else None
        first = self._window_start()
        series = [{"t": b.t, **_ratios(a, b)} for a, b in zip(list(self.samples), list(self.samples)[1:])]
        window: dict[str, Any] = {"tokens": None, "lookups": None, "reads": None, "handoff": None, "by_source": {}}
        if first is not None and last is not None and last is not first:
            window = _ratios(first, last)
            before = dict(first.by_source)
            prompt = last.prompt_tokens - first.prompt_tokens
            window["by_source"] = {s: _ratio(n - before.get(s, 0.0), prompt) for s, n in last.by_source}
        rejected = _counter(door.metrics.rejected)
        return {
            "time": time.time(), "sampled_at": last.t if last else None,
            "status": report.status, "reasons": list(report.reasons),
            "model": door.info.model_id, "policy": router.policy.name,
            "nodes": self.nodes,
            "hit_ratio": {"window_s": WINDOW_S, **window, "series": series},
            "instances": self._instances(),
            "admission": {
                "inflight": router.inflight,
                "admitted": last.admitted if last else 0.0,
                "rejected": {reason: rejected[reason] for reason in sorted(rejected)},
                "finished": _counter(door.metrics.finished),
                "window_s": WINDOW_S,
                "admitted_in_window": last.admitted - first.admitted if first and last else 0.0,
                "rejected_in_window": last.rejected - first.rejected if first and last else 0.0,
            },
        }

    def _window_start(self) -> Sample | None:
        """The oldest sample within the window (the first one when all are older)."""
        if not self.samples:
            return None
        cutoff = self.samples[-1].t - WINDOW_S
        return next((s for s in self.samples if s.t >= cutoff), self.samples[0])

    def _instances(self) -> list[dict[str, Any]]:
        router = self.door.router
        down = router.down
        queued, running = router.queue_depths(), router.decode_running()
        out = []
        for role, pool in (("prefill", router.prefill), ("decode", router.decode)):
            for engine_id in pool:
                reason = down.get(engine_id) if isinstance(down, dict) else ("down" if engine_id in down else None)
                out.append({"id": engine_id, "role": role, "state": f"down: {reason}" if reason else "up",
                            "queued": queued.get(engine_id, 0) if role == "prefill" else 0,
                            "running": running.get(engine_id, 0) if role == "decode" else 0})
        return out


def install_status_page(app: web.Application, door: Frontdoor) -> StatusFeed:
    """Add ``/status``, ``/status.js`` and ``/status.json`` to the front door's ``app``."""
    feed = StatusFeed(door)
    feed.install(app)
    return feed
