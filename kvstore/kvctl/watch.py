"""``kvctl watch``: a refreshing terminal view of the store's tiers — use, blocks, the
lookup hit ratio (reuse), the read success ratio and the rates of read hits, read misses,
evictions, demotions and promotions over the last refresh (docs/metrics.md) — like
``top`` for the cache (LMCache's ``lmcache`` CLI and ``redis-cli --stat`` are the anchors).

Each refresh reads every node's ``Stats`` once (gRPC, no bytes moved). Rates are counter
differences over the seconds between two refreshes, so the first refresh shows totals only.
On a terminal each refresh redraws the screen; otherwise (a pipe, a file) refreshes follow
one another, separated by a blank line. ``--json`` prints one JSON object per refresh, one
per line. ``--count N`` stops after N refreshes (default: until Ctrl-C).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from tabulate import tabulate

from kvstore.errors import KVStoreError
from kvstore.kvctl.common import whole_number
from kvstore.pool.types import TierStats

RATES = ("lookup_hits", "lookup_misses", "hits", "misses", "evictions", "demotions", "promotions")
SHOWN = ("hits", "misses", "evictions", "demotions", "promotions")   # rates in the table
CLEAR = "\x1b[H\x1b[2J"


@dataclass(frozen=True)
class NodeReading:
    """One node at one instant: ``tiers`` (None when it did not answer, ``error`` says why)."""

    address: str
    node_id: str
    tiers: tuple[TierStats, ...] | None
    error: str = ""


def read_nodes(addresses: Sequence[str], token: str | None | Callable[[str], str | None],
               timeout_s: float) -> list[NodeReading]:
    """Each node's tier figures (``Stats``); a node that does not answer is a reading with
    the error, never an exception. ``token``: the token, or the token to send an address."""
    from kvstore.client import StoreClient
    out = []
    for address in addresses:
        try:
            with StoreClient(address, auth_token=token(address) if callable(token) else token,
                             timeout_s=timeout_s, data_path="grpc") as client:
                node_id, stats = client.stats()
            out.append(NodeReading(address, node_id, tuple(stats)))
        except KVStoreError as exc:
            out.append(NodeReading(address, "?", None, str(exc)))
    return out


def frame(now: list[NodeReading], before: list[NodeReading] | None, elapsed_s: float) -> dict[str, Any]:
    """One refresh as a document: per node and tier the figures, the hit ratio (all time and,
    with ``before``, over the interval) and, with ``before``, counter ``delta`` and ``rate``
    (per second over ``elapsed_s``)."""
    prev = {(r.address, s.name): s for r in before or () for s in r.tiers or ()}
    nodes = []
    for r in now:
        tiers = []
        for s in r.tiers or ():
            reads, looked = s.hits + s.misses, s.lookup_hits + s.lookup_misses
            row: dict[str, Any] = {**asdict(s), "read_success_ratio": s.hits / reads if reads else None,
                                   "lookup_hit_ratio": s.lookup_hits / looked if looked else None}
            p = prev.get((r.address, s.name))
            if p is not None and elapsed_s > 0:
                delta = {k: getattr(s, k) - getattr(p, k) for k in RATES}
                row["delta"] = delta
                row["rate"] = {k: v / elapsed_s for k, v in delta.items()}
                d_reads, d_looked = delta["hits"] + delta["misses"], delta["lookup_hits"] + delta["lookup_misses"]
                row["interval_read_success_ratio"] = delta["hits"] / d_reads if d_reads else None
                row["interval_lookup_hit_ratio"] = delta["lookup_hits"] / d_looked if d_looked else None
            tiers.append(row)
        nodes.append({"address": r.address, "node_id": r.node_id, "up": r.tiers is not None,
                      "error": r.error, "tiers": tiers})
    return {"time": time.time(), "interval_s": elapsed_s if before is not None else None, "nodes": nodes}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def render(doc: dict[str, Any]) -> str:
    """The refresh as a table: one row per node and tier."""
    rows = []
    for n in doc["nodes"]:
        if not n["up"]:
            rows.append([n["node_id"], n["address"], "DOWN: " + n["error"]] + [""] * 12)
            continue
        for t in n["tiers"]:
            rate = t.get("rate")
            rows.append([n["node_id"], n["address"], t["name"], f"{t['used_bytes'] / 2**20:,.1f}",
                         f"{100 * t['used_bytes'] / t['capacity_bytes']:.1f}" if t["capacity_bytes"] else "-",
                         t["blocks"], _pct(t["lookup_hit_ratio"]), _pct(t.get("interval_lookup_hit_ratio")),
                         _pct(t["read_success_ratio"]), _pct(t.get("interval_read_success_ratio"))]
                        + [f"{rate[k]:,.1f}" if rate else "-" for k in SHOWN])
    interval = doc["interval_s"]
    when = time.strftime("%H:%M:%S", time.localtime(doc["time"]))
    head = f"kvstore watch  {when}  " + (f"rates per second over the last {interval:.1f} s" if interval
                                         else "totals (rates from the next refresh)")
    return head + "\n" + tabulate(rows, headers=["node", "address", "tier", "used MiB", "used %", "blocks",
                                                 "lookup hit % (all)", "lookup hit % (interval)",
                                                 "read ok % (all)", "read ok % (interval)", "read hits/s",
                                                 "read misses/s",
                                                 "evictions/s", "demotions/s", "promotions/s"])


def watch(read: Callable[[], list[NodeReading]], interval_s: float, count: int | None, as_json: bool,
          out: TextIO = sys.stdout, sleep: Callable[[float], None] = time.sleep) -> int:
    """Refresh ``count`` times (None: until interrupted), ``interval_s`` apart. Returns 0, or
    1 when no node answered the last refresh."""
    before: list[NodeReading] | None = None
    t_before = 0.0
    redraw = out.isatty() and not as_json
    done = 0
    now: list[NodeReading] = []
    try:
        while count is None or done < count:
            if done:
                sleep(interval_s)
            t = time.monotonic()
            now = read()
            doc = frame(now, before, t - t_before)
            if as_json:
                out.write(json.dumps(doc, separators=(",", ":")) + "\n")
            else:
                out.write((CLEAR if redraw else ("\n" if done else "")) + render(doc) + "\n")
            out.flush()
            before, t_before = now, t
            done += 1
    except KeyboardInterrupt:
        pass
    return 0 if any(r.tiers is not None for r in now) else 1


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``watch`` on kvctl's subcommands."""
    p = sub.add_parser("watch", help="a refreshing view of tiers, hit ratio and rates",
                       description=(__doc__ or "").replace("``", "`"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interval", type=_positive, default=2.0, metavar="S", help="seconds between refreshes (default 2)")
    p.add_argument("--count", type=whole_number(1), metavar="N", help="stop after N refreshes (default: until Ctrl-C)")
    p.add_argument("--json", action="store_true", help="one JSON object per refresh, one per line")
    p.add_argument("--node", action="append", metavar="HOST:PORT",
                   help="watch this node too (repeatable; default: --store)")
    return p


def run(addresses: Sequence[str], token: str | None | Callable[[str], str | None], timeout_s: float,
        args: argparse.Namespace,
        redis_url: str | None = None, seal_token: str | None = None) -> int:
    """``kvctl watch`` over ``addresses`` and the ``--node``s — with ``redis_url``, over every
    node registered in the cluster at each refresh instead of ``addresses`` (the records
    sealed with ``seal_token``, the store token: see :mod:`kvstore.cluster.membership`)."""
    extra = list(args.node or [])
    per_call = min(timeout_s, max(args.interval, 1.0))

    def read() -> list[NodeReading]:
        listed = _registered(redis_url, seal_token) if redis_url else list(addresses)
        return read_nodes(list(dict.fromkeys([*listed, *extra])), token, per_call)
    return watch(read, args.interval, args.count, args.json)


def _registered(redis_url: str, seal_token: str | None) -> list[str]:
    """The addresses of the nodes in the membership registry (records sealed with
    ``seal_token``). Raises KVStoreError when it cannot be read, Unauthenticated when none
    of its records is sealed under ``seal_token``."""
    from kvstore.kvctl.cluster import registry_nodes
    return sorted(n.address for n in registry_nodes(redis_url, seal_token))


def cmd_watch(target: Any, args: argparse.Namespace) -> int:
    """kvctl's ``watch`` on a target with ``store``, ``token``, ``timeout_s`` and
    ``redis_url`` (with a registry: every node in it)."""
    own = getattr(target, "own", None)
    if own is not None and args.node:   # a stack's node by its own address, not localhost's
        args.node = [own(a) for a in args.node]
    return run([target.store], getattr(target, "token_for", target.token), target.timeout_s, args,
               getattr(target, "redis_url", None), target.token)


def add_commands(sub: Any) -> None:
    """Register ``watch`` (its ``func`` takes kvctl's target and the arguments)."""
    add_parser(sub).set_defaults(func=cmd_watch)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
