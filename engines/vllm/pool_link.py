"""The connector's way to the pool: settings read from vLLM's ``kv_connector_extra_config``,
and a :class:`PoolLink` that turns every pool failure into a miss.

A link talks to one store node (:class:`~kvstore.client.StoreClient`: the node's mapped DRAM
slab when it runs on this host, its gRPC stream otherwise) or, given a Redis URL, to the
cluster (:class:`~kvstore.cluster.client.ClusterClient`: chain placement across nodes, the
transfer engine or gRPC between hosts). A pool that fails a call is skipped for a back-off
(1 s, doubling to 30 s), so a store that is down costs at most one timeout per back-off,
never a failed request.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from kvstore.auth import REDIS_URL_ENV, STORE_TOKEN_ENV
from kvstore.errors import InvalidArgument, KVStoreError, LeaseExpired, QuotaExceeded, Unauthenticated
from kvstore.pool.types import LookupResult
from kvstore.tiers.buffers import Segments

log = logging.getLogger(__name__)

NO_BLOCKS = LookupResult(0, ())    # a lookup that could not ask the pool
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
QUOTA_LOG_EVERY_S = 60.0   # a tenant's refused saves: one log line a minute at most
ATTACH_WAIT_S = 30.0   # at most this long at start for the slab's page tables (2 GiB: about 0.3 s)
LOAD_ERROR_POLICIES = ("recompute", "fail")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's settings: ``kv_connector_extra_config`` keys of the form
    ``kvstore.<field>``; ``store_token`` falls back to the ``KVSTORE_STORE_TOKEN`` environment
    variable and ``redis`` to ``KVSTORE_REDIS_URL`` (so a token or a Redis password stays off
    command lines, as for every kvstore service).

    ``store``: a store node's host:port. ``redis``: a Redis URL; when set, the cluster
    registered there is the pool and ``store`` is unused. ``timeout_s``: seconds per pool
    call. ``on_load_error``: ``recompute`` (default: a block that fails to load is recomputed
    by vLLM) or ``fail`` (the request fails), set as vLLM's ``kv_load_failure_policy``.
    ``async_save``: a ``kv_both`` instance saves on a background thread (default True; a
    ``kv_producer`` always saves before vLLM answers). ``save_wait_s``: how long a ``kv_both``
    step waits for its background saves (default 0.05: they take milliseconds, and a step that
    waits leaves them the CPU vLLM's threads would take; a pool that hangs costs a step no
    more, the save goes on with its blocks pinned). ``max_pinned_fraction``: the share of
    vLLM's KV blocks that saves in flight may pin (default 0.25; past it a save is dropped).
    """

    store: str = "127.0.0.1:50051"
    redis: str | None = None
    store_token: str | None = None
    timeout_s: float = 5.0
    on_load_error: Literal["recompute", "fail"] = "recompute"
    async_save: bool = True
    save_wait_s: float = 0.05
    max_pinned_fraction: float = 0.25

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_s, (int, float)) or not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise InvalidArgument(f"kvstore.timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")
        if self.on_load_error not in LOAD_ERROR_POLICIES:
            raise InvalidArgument(f"kvstore.on_load_error must be one of {LOAD_ERROR_POLICIES}, "
                                  f"got {self.on_load_error!r}")
        if not isinstance(self.async_save, bool):
            raise InvalidArgument(f"kvstore.async_save must be true or false, got {self.async_save!r}")
        w = self.save_wait_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise InvalidArgument(f"kvstore.save_wait_s must be a number of seconds >= 0, got {w!r}")
        f = self.max_pinned_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise InvalidArgument(f"kvstore.max_pinned_fraction must be a number in (0, 1], got {f!r}")
        if not self.redis and (not isinstance(self.store, str) or ":" not in self.store):
            raise InvalidArgument(f"kvstore.store must be host:port, got {self.store!r}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """From ``kv_connector_extra_config``. Raises InvalidArgument for an unknown
        ``kvstore.`` key (the message lists the valid ones) or a bad value."""
        fields = {f: v for f, v in cls.__dataclass_fields__.items()}
        kw: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            if not key.startswith("kvstore."):
                if key in fields:   # "store" for "kvstore.store": ignored, the pool would be the default one
                    raise InvalidArgument(f"connector setting {key!r} has no 'kvstore.' prefix (did you mean "
                                          f"'kvstore.{key}'?); valid: {sorted('kvstore.' + f for f in fields)}")
                continue
            name = key.removeprefix("kvstore.")
            if name not in fields:
                raise InvalidArgument(f"unknown connector setting {key!r}; valid: "
                                      f"{sorted('kvstore.' + f for f in fields)}")
            if name == "timeout_s" and isinstance(value, (int, str)) and not isinstance(value, bool):
                try:
                    value = float(value)
                except ValueError:
                    raise InvalidArgument(f"kvstore.timeout_s must be a number of seconds > 0, "
                                          f"got {value!r}") from None
            kw[name] = value
        kw.setdefault("store_token", os.environ.get(STORE_TOKEN_ENV) or None)
        kw.setdefault("redis", os.environ.get(REDIS_URL_ENV) or None)
        return cls(**kw)


class PoolLink:
    """Lookups, loads and saves against the pool; every failure is a miss, counted and
    logged, and opens a back-off during which the pool is not asked. Thread-safe."""

    def __init__(self, cfg: ConnectorConfig, moves_bytes: bool = True) -> None:
        self.cfg = cfg
        self.moves_bytes = moves_bytes   # False: lookups only (the scheduler side), no slab page tables
        self._client: Any = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = BACKOFF_FIRST_S
        self.failures = 0
        # for the connector's metrics and events (connector_metrics.py, connector_events.py)
        self.put_tier = "dram"          # where the store node puts blocks: its first tier (probe)
        self.last_tiers: tuple[str, ...] = ()   # the last lookup's found blocks' tiers (its caller's thread)
        self.last_load_error = ""       # why the last load fell short: "" (it did not), or a cause
        self._down_since: float | None = None
        self._unavailable_s = 0.0
        self._quota_log: dict[str | None, tuple[float, int]] = {}   # namespace -> (last line, blocks since)

    @property
    def target(self) -> str:
        if self.cfg.redis:    # the URL may hold the Redis password: never in a log line
            from kvstore.cluster.redis_server import redact_url
            return f"cluster at {redact_url(self.cfg.redis)}"
        return f"store node {self.cfg.store}"

    def _get_client(self) -> Any:
        """The client, made on first use; None while backing off after a failure."""
        if time.monotonic() < self._down_until:
            return None
        with self._lock:
            if self._client is None:
                if self.cfg.redis:
                    from kvstore.cluster.client import ClusterClient
                    self._client = ClusterClient(self.cfg.redis, auth_token=self.cfg.store_token,
                                                 timeout_s=self.cfg.timeout_s, prefault=self.moves_bytes)
                else:
                    from kvstore.client import StoreClient
                    self._client = StoreClient(self.cfg.store, auth_token=self.cfg.store_token,
                                               timeout_s=self.cfg.timeout_s, prefault=self.moves_bytes)
            return self._client

    def attach(self, wait_s: float = ATTACH_WAIT_S) -> None:
        """Attach the store nodes' data paths at start (a cluster's: each live node's) and wait
        up to ``wait_s`` for this process's page tables of a same-host slab, so that building
        them (about 4 MiB per GiB of slab, on the cores vLLM's threads are bound to) does not
        slow the first requests. Never raises: a node that cannot be reached yet attaches on
        first use instead."""
        t0 = time.monotonic()
        try:
            client = self._get_client()
            if client is None:
                attached = {}
            elif self.cfg.redis:
                attached = client.attach(wait_s)
            else:
                path, built = client.attach(wait_s)
                attached = {self.target: (path, built)} if path else {}
        except Exception as exc:   # a warm-up: whatever fails here fails again, and is handled, on first use
            log.warning("kvstore connector: data path to %s not attached at start (%s: %s)", self.target,
                        type(exc).__name__, exc)
            return
        seconds = time.monotonic() - t0
        if not attached:
            log.info("kvstore connector: %s not reached at start; its data path attaches on first use", self.target)
        for node, (path, built) in attached.items():
            if path == "grpc":
                log.info("kvstore connector: blocks to and from %s go over %s", node,
                         "its transfer engine or the gRPC stream" if self.cfg.redis else "the gRPC stream")
            elif built:
                log.info("kvstore connector: %s's slab mapped (%s), its page tables built in %.2f s%s", node,
                         path, seconds, " (every node's)" if self.cfg.redis else "")
            else:
                log.info("kvstore connector: %s's slab mapped (%s); its page tables still building after "
                         "%.2f s, on a background thread", node, path, seconds)

    def probe(self, block_bytes: int) -> None:
        """One call to a store node at start, so that a misconfiguration stops vLLM there with
        its cause named rather than making every request a miss: raises InvalidArgument when
        the node refuses the token, or when a block of ``block_bytes`` fits none of its tiers.
        A node that cannot be reached is logged (vLLM recomputes until it answers). A cluster
        (``redis``) is not probed."""
        if self.cfg.redis:
            return
        client = self._get_client()
        try:
            node, tiers = client.stats()
        except Unauthenticated as exc:
            given = "none was given" if not self.cfg.store_token else "kvstore.store_token / KVSTORE_STORE_TOKEN"
            raise InvalidArgument(f"kvstore connector: the store node at {self.cfg.store} refused the store token "
                                  f"({given}): {exc}") from None
        except (KVStoreError, OSError) as exc:
            log.warning("kvstore connector: the store node at %s cannot be reached at start (%s: %s); vLLM "
                        "serves, recomputing every prefix, until it answers", self.cfg.store,
                        type(exc).__name__, exc)
            return
        largest = max((t.capacity_bytes for t in tiers), default=0)
        self.put_tier = tiers[0].name if tiers else self.put_tier
        if block_bytes > largest:
            raise InvalidArgument(f"kvstore connector: a KV block of this vLLM instance is {block_bytes} bytes "
                                  f"(--block-size and the model's KV layout), more than the largest tier of store "
                                  f"node {node} at {self.cfg.store} holds ({largest} bytes): no block could be "
                                  "stored; give the node a larger tier or vLLM a smaller --block-size")
        log.info("kvstore connector: store node %s at %s answers (tiers %s)", node, self.cfg.store,
                 ", ".join(f"{t.name} {t.capacity_bytes >> 20} MiB" for t in tiers))

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
            self._down_until = time.monotonic() + self._backoff
            effect = "its blocks are not stored" if what.startswith("save") else "recomputing"
            log.warning("kvstore connector: %s failed (%s: %s); %s, pool skipped for %.0f s",
                        what, type(exc).__name__, exc, effect, self._backoff)
            self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)

    def _ok(self) -> None:
        self._backoff = BACKOFF_FIRST_S
        if self._down_since is not None:
            with self._lock:
                if self._down_since is not None:
                    self._unavailable_s += time.monotonic() - self._down_since
                    self._down_since = None

    def take_unavailable_s(self) -> float:
        """Seconds the pool was unavailable since the last call: from a failed call to the
        next one that succeeded (still down: up to now)."""
        with self._lock:
            now = time.monotonic()
            if self._down_since is not None:
                self._unavailable_s += now - self._down_since
                self._down_since = now
            out, self._unavailable_s = self._unavailable_s, 0.0
        return out

    def lookup(self, keys: Sequence[bytes], purpose: str = "reuse", namespace: str | None = None) -> LookupResult:
        """The longest prefix of ``keys`` the pool holds and its tiers (none on any failure);
        ``purpose``: ``reuse`` or ``handoff`` (a decode instance's: the pool's lookup books
        count it apart, kvstore/pool/reads.py); ``namespace``: the tenant looking."""
        self.last_tiers = ()
        client = self._get_client() if keys else None
        if client is None:
            return NO_BLOCKS
        try:
            result = client.lookup(list(keys), purpose, namespace)
        except (KVStoreError, OSError) as exc:
            self._failed(f"lookup of {len(keys)} blocks in the {self.target}", exc)
            return NO_BLOCKS
        self._ok()
        self.last_tiers = tuple(result.tiers[:result.blocks])
        return result

    def load(self, keys: Sequence[bytes], outs: Sequence[Segments]) -> int:
        """Copy the blocks of ``keys`` into ``outs`` (vLLM's paged blocks) and return how many
        leading blocks were loaded whole and verified against their put-time checksums; the
        rest hold undefined bytes and must be recomputed. Never raises for a pool failure."""
        client = self._get_client() if keys else None
        self.last_load_error = "pool_unavailable" if keys and client is None else ""
        if client is None:
            return 0
        try:
            if hasattr(client, "get_into"):
                got = client.get_into(list(keys), list(outs), stop_at_miss=True)
            else:  # the cluster client: bytes from whichever node holds each block
                got = [None if d is None else o.scatter(np.frombuffer(d, dtype=np.uint8))
                       for d, o in zip(client.get_blocks(list(keys), stop_at_miss=True), outs)]
        except LeaseExpired as exc:
            log.warning("kvstore connector: a load of %d blocks outlived its lease (%s); recomputing them",
                        len(keys), exc)
            self.last_load_error = "lease_expired"
            return 0
        except (KVStoreError, OSError) as exc:
            self._failed(f"load of {len(keys)} blocks from the {self.target}", exc)
            self.last_load_error = "pool_unavailable"
            return 0
        self._ok()
        n = 0
        for size, out in zip(got, outs):
            if size is None or size != out.nbytes:
                break
            n += 1
        self.last_load_error = "miss" if n < len(keys) else ""
        return n

    def _quota_refused(self, namespace: str | None, blocks: int, exc: Exception) -> None:
        """Log a tenant's refused saves at most once a minute per namespace (a tenant over its
        quota is refused on every save), with the blocks refused since the last line."""
        now = time.monotonic()
        last, refused = self._quota_log.get(namespace, (-math.inf, 0))
        refused += blocks
        if now - last < QUOTA_LOG_EVERY_S:
            self._quota_log[namespace] = (last, refused)
            return
        self._quota_log[namespace] = (now, 0)
        log.info("kvstore connector: namespace %r over its pool quota, %d blocks not saved since the last such "
                 "line: %s", namespace, refused, exc)

    def save(self, blocks: Sequence[tuple[bytes, Segments]], parent: bytes | None,
             namespace: str | None = None) -> int:
        """Put ``blocks`` (one prefix chain, head first, extending ``parent``) for tenant
        ``namespace`` (the pool's per-tenant books and quota); returns how many the pool now
        holds (new or already there). Never raises for a pool failure; a tenant over its
        quota is logged and holds none of them."""
        client = self._get_client() if blocks else None
        if client is None:
            return 0
        try:
            if self.cfg.redis:  # the cluster client sends bytes
                results = client.put_blocks([(k, s.tobytes()) for k, s in blocks], chain=True, parent=parent,
                                            namespace=namespace)
            else:
                results = client.put_blocks(list(blocks), chain=True, parent=parent, namespace=namespace)
        except QuotaExceeded as exc:   # the tenant is over, not the pool: no back-off
            self._quota_refused(namespace, len(blocks), exc)
            return 0
        except (KVStoreError, OSError) as exc:
            self._failed(f"save of {len(blocks)} blocks to the {self.target}", exc)
            return 0
        self._ok()
        return sum(1 for r in results if r.ok)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
