"""A client of the whole pool: the live store nodes found in the membership registry.

Same calls as :class:`kvstore.client.StoreClient` (``lookup``, ``get_blocks``,
``put_blocks``), so engines and the router take either. A node that vanished, or does not
answer, makes its blocks misses — never an exception to the caller.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvstore.client import StoreClient
from kvstore.cluster.health import ClusterHealth, NodeProblem, raise_unless_serving
from kvstore.cluster.membership import NodeInfo, Registry, registry_for
from kvstore.cluster.placement import plan_chain
from kvstore.errors import KVStoreError, QuotaExceeded, Unavailable
from kvstore.pool.pool import PutResult
from kvstore.tiers.slab import page_footprint
from kvstore.transfer import BlockTransport, open_transport
from kvstore.wire.types import LookupResult

log = logging.getLogger(__name__)
# How long a client keeps using its last listing of the nodes while the registry cannot be
# read, seconds: a Redis blip changes nothing, but a node that stopped meanwhile must not stay
# listed for good (its port may be someone else's by then, and the client sends it the token).
STALE_LISTING_S = 30.0


class ClusterClient:
    """Places, finds and reads blocks across the live nodes; a
    :class:`~kvstore.block_store.BlockStore`, like one node's :class:`StoreClient`.

    Placement: a chain goes to the node holding its parent, else to the node with the most
    free bytes, spilling to the next only when full (:func:`plan_chain`); ``replicas`` > 1
    also copies each block to that many nodes in all, and :meth:`replicate` copies a hot
    chain already stored. Lookups ask every live node in parallel and follow the chain from
    node to node. Reads go to the node holding each run of blocks by ``transport`` (``auto``:
    the transfer engine where the node runs one, else the gRPC stream; see ``paths``).

    Args:
        redis_url: membership registry (None: this process's embedded registry).
        registry: a registry object instead of ``redis_url``.
        refresh_s: how long a listing of live nodes is reused (while the registry cannot be
            read, the last one is kept, for :data:`STALE_LISTING_S` at most).
        suspect_s: how long a node that failed a call is skipped.
        prefault: :class:`~kvstore.client.StoreClient`'s, for each node (False: lookups only).
    """

    def __init__(self, redis_url: str | None = None, *, registry: Registry | None = None,
                 auth_token: str | None = None, transport: str = "auto", replicas: int = 1,
                 refresh_s: float = 0.5, suspect_s: float = 5.0, timeout_s: float = 30.0,
                 prefault: bool = True) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self.registry = registry or registry_for(redis_url, auth_token)
        self.auth_token, self.transport, self.replicas = auth_token, transport, replicas
        self.refresh_s, self.suspect_s, self.timeout_s = refresh_s, suspect_s, timeout_s
        self.prefault = prefault
        self._lock = threading.Lock()
        self._listed: list[NodeInfo] = []
        self._listed_at = self._listed_ok_at = 0.0   # when last asked / last read (monotonic s)
        self._refreshing = False                      # a background listing is under way
        self._suspect: dict[str, float] = {}
        self._clients: dict[tuple[str, int], StoreClient] = {}
        self._transports: dict[tuple[str, int], BlockTransport] = {}
        self._placed: dict[str, tuple[int, int]] = {}   # node -> (free seen, bytes placed since)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvstore-cluster")
        self._health: ClusterHealth | None = None
        self._health_lock = threading.Lock()
        self.problems: list[NodeProblem] = []      # the nodes down at the last health()
        # what a node down means to a request (the front door's /health says it)
        self.down_effect = "its blocks are misses; the other nodes serve"

    # -- membership ------------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        """The live nodes (registry listing, minus nodes that just failed a call). The first
        listing, and one forced by zeroing ``_listed_at``, is read in the caller; a periodic
        one is read in the background while callers go on with the last listing, so a
        registry that stops answering (its host cut off) costs no request its timeout."""
        now = time.monotonic()
        with self._lock:
            if now - self._listed_at > self.refresh_s:
                if not self._listed_at or not self._listed_ok_at:
                    self._apply_listing(self._read_listing(), now)
                elif not self._refreshing:
                    self._refreshing = True
                    self._listed_at = now
                    self._pool.submit(self._refresh_in_background)
            return [n for n in self._listed if self._suspect.get(n.node_id, 0.0) < now]

    def _read_listing(self) -> list[NodeInfo] | Exception:
        try:
            return self.registry.nodes()
        except Exception as exc:  # noqa: BLE001 - redis-py raises its own error types
            return exc

    def _refresh_in_background(self) -> None:
        listing = self._read_listing()
        with self._lock:
            try:
                self._apply_listing(listing, time.monotonic())
            finally:        # never left set: the listing would then never be read again
                self._refreshing = False

    def _apply_listing(self, listing: list[NodeInfo] | Exception, now: float) -> None:
        """Under the lock: take a listing read, or keep the last one a while when the read failed."""
        if not isinstance(listing, Exception):
            self._listed, self._listed_ok_at = listing, now
        elif self._listed and now - self._listed_ok_at > STALE_LISTING_S:
            log.warning("membership registry unreadable for %.0f s: no node is listed until it "
                        "answers (their blocks are misses): %s", now - self._listed_ok_at, listing)
            self._listed = []
        else:
            log.warning("membership registry unavailable: %s", listing)
        self._listed_at = now

    def health(self) -> str:
        """``SERVING`` when every node the registry lists answers its health check and none
        left the registry without a clean stop in the last
        :data:`~kvstore.cluster.health.LOST_NODE_S` (kvstore/cluster/health.py). Raises
        Unavailable naming each node that is down and how, or saying that no node is
        registered or that the registry cannot be read; :attr:`problems` keeps the last
        check's nodes down."""
        with self._health_lock:
            if self._health is None:
                self._health = ClusterHealth(self.registry, self.auth_token)
            try:
                serving, problems = self._health.check()
            except Exception as exc:  # noqa: BLE001 - redis-py raises its own error types
                raise Unavailable(f"membership registry unreadable: {exc}") from None
            self.problems = problems
        raise_unless_serving(serving, problems, self.registry)
        return "SERVING"

    def wait_for_nodes(self, count: int, timeout_s: float = 30.0) -> list[NodeInfo]:
        """Block until ``count`` nodes are live; raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._listed_at = 0.0
            live = self.nodes()
            if len(live) >= count:
                return live
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(live)} of {count} store nodes live after {timeout_s} s")
            time.sleep(0.1)

    def _fail(self, node: NodeInfo, exc: Exception) -> None:
        log.warning("store node %s (%s) failed, its blocks are misses: %s", node.node_id, node.address, exc)
        with self._lock:
            self._suspect[node.node_id] = time.monotonic() + self.suspect_s

    def _client(self, node: NodeInfo) -> StoreClient:
        with self._lock:
            key = (node.node_id, node.epoch)
            if key not in self._clients:
                self._clients[key] = StoreClient(node.address, self.auth_token, self.timeout_s,
                                                 prefault=self.prefault)
            return self._clients[key]

    def attach(self, wait_s: float = 0.0) -> dict[str, tuple[str, bool]]:
        """:meth:`StoreClient.attach` of every live node, all mapped first, then ``wait_s`` in all for
        their page tables: node id -> (data path, page tables built); one not reached or failing is
        left out (it attaches on first use)."""
        deadline, reached = time.monotonic() + wait_s, {}
        for node in self.nodes():       # every slab mapped first, so that their page tables build at once
            client = self._client(node)
            try:
                if client.attach(0.0)[0]:
                    reached[node.node_id] = client
            except (KVStoreError, OSError) as exc:
                log.warning("store node %s: data path not attached at start (%s)", node.node_id, exc)
        return {node_id: client.attach(max(0.0, deadline - time.monotonic())) for node_id, client in reached.items()}

    def _transport(self, node: NodeInfo) -> BlockTransport:
        key = (node.node_id, node.epoch)
        with self._lock:
            t = self._transports.get(key)
        if t is None:
            t = open_transport(self.transport, node.address, self.auth_token, node.te_endpoint or None,
                               client=self._client(node), timeout_s=self.timeout_s)
            with self._lock:
                t = self._transports.setdefault(key, t)
        return t

    @property
    def paths(self) -> dict[str, str]:
        """node id -> the transport its reads use (``grpc_stream (fallback: why)`` when a
        transfer engine could not start)."""
        with self._lock:
            out = {}
            for (node_id, _), t in self._transports.items():
                reason = getattr(t, "fallback_reason", None)
                out[node_id] = f"{t.name} (fallback: {reason})" if reason else t.name
            return out

    # -- lookups ---------------------------------------------------------------------------
    def locate(self, keys: Sequence[bytes]) -> list[NodeInfo]:
        """The node holding each block of the longest prefix of ``keys`` held anywhere."""
        return self._walk(list(keys), "probe", None)[0]     # the reads that follow count

    def _walk(self, keys: list[bytes], purpose: str,
              namespace: str | None) -> tuple[list[NodeInfo], list[str]]:
        owners: list[NodeInfo] = []
        tiers: list[str] = []
        live = self.nodes()
        while len(owners) < len(keys) and live:
            rest = keys[len(owners):]
            answers = list(self._pool.map(self._lookup_one, live, [rest] * len(live), [purpose] * len(live),
                                          [namespace] * len(live)))
            best = max(range(len(live)), key=lambda i: answers[i].blocks)
            if answers[best].blocks == 0:
                break
            owners += [live[best]] * answers[best].blocks
            tiers += answers[best].tiers
        return owners, tiers

    def _lookup_one(self, node: NodeInfo, keys: list[bytes], purpose: str = "probe",
                    namespace: str | None = None) -> LookupResult:
        try:
            return self._client(node).lookup(keys, purpose, namespace)
        except (KVStoreError, OSError) as exc:
            self._fail(node, exc)
            return LookupResult(0, ())

    def lookup(self, keys: Sequence[bytes], purpose: str = "reuse", namespace: str | None = None) -> LookupResult:
        """Longest prefix of the chain ``keys`` held across the live nodes (renews nothing).
        ``purpose``: as :meth:`kvstore.client.StoreClient.lookup`; every live node is asked
        for the rest of the chain, so each node's lookup books count its own share of the
        chains (docs/metrics.md)."""
        owners, tiers = self._walk(list(keys), purpose, namespace)
        return LookupResult(len(owners), tuple(tiers))

    # -- reads -----------------------------------------------------------------------------
    def get_blocks(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        """Bytes of each key (None for a miss; with ``stop_at_miss`` the list ends at the
        first miss), each run of blocks read from the node holding it."""
        keys = list(keys)
        owners = self.locate(keys)
        out: list[bytes | None] = []
        start = 0
        while start < len(owners):
            end = start
            while end < len(owners) and owners[end].node_id == owners[start].node_id:
                end += 1
            got = self._read(owners[start], keys[start:end])
            out += got
            if len(got) < end - start or any(d is None for d in got):
                if stop_at_miss:
                    return out[:next((i for i, d in enumerate(out) if d is None), len(out)) + 1]
                out += [None] * (end - start - len(got))
            start = end
        if len(out) < len(keys):
            if stop_at_miss:
                return out + [None]
            out += self._scatter_get(keys[len(out):])
        return out

    def _read(self, node: NodeInfo, keys: list[bytes]) -> list[bytes | None]:
        try:
            return self._transport(node).get_blocks(keys, stop_at_miss=True)
        except (KVStoreError, OSError) as exc:
            self._fail(node, exc)
            return [None]

    def _scatter_get(self, keys: list[bytes]) -> list[bytes | None]:
        """Keys past the held prefix (not a chain): ask each live node for what is left."""
        out: list[bytes | None] = [None] * len(keys)
        for node in self.nodes():
            todo = [i for i, d in enumerate(out) if d is None]
            if not todo:
                break
            try:
                got = self._transport(node).get_blocks([keys[i] for i in todo])
            except (KVStoreError, OSError) as exc:
                self._fail(node, exc)
                continue
            for i, data in zip(todo, got):
                out[i] = data
        return out

    # -- writes ----------------------------------------------------------------------------
    def put_blocks(self, blocks: Sequence[tuple[bytes, bytes]], chain: bool = False,
                   parent: bytes | None = None, namespace: str | None = None) -> list[PutResult]:
        """Put blocks across the nodes (see the class docstring); one result per block, in
        order. A block no live node took is ``ok=False`` with the reason, not an exception.
        ``namespace``: the tenant the blocks belong to, sent to each node that takes some
        (kvstore/pool/tenants.py: its books and quota there). A node whose quota for the tenant
        refuses a part stays in use (the tenant is over, not the node): that part's blocks
        are ``ok=False`` naming the quota (the ones before the refused block may be stored;
        a put again finds them ``existed``)."""
        blocks = list(blocks)
        if not blocks:
            return []
        live = self.nodes()
        if not live:
            return [PutResult(k, False, False, "no live store node") for k, _ in blocks]
        held = self.locate([parent]) if chain and parent else []
        head = held[0].node_id if held else None
        free = self._free(live)
        # A slab tier takes whole pages: count a block as the pages it takes, or a node of
        # small blocks looks roomier than it is (and evicts what was just placed there).
        sizes = [page_footprint(len(d)) for _, d in blocks]
        plan = plan_chain(sizes, free, prefer=head, replicas=self.replicas)
        results: list[PutResult | None] = [None] * len(blocks)
        by_id = {n.node_id: n for n in live}
        for node_id, start, end in plan:
            link = (blocks[start - 1][0] if start else parent) if chain else None
            part = blocks[start:end]
            try:
                got = self._client(by_id[node_id]).put_blocks(part, chain=chain, parent=link, namespace=namespace)
            except QuotaExceeded as exc:
                got = [PutResult(k, False, False, f"QuotaExceeded: {exc}") for k, _ in part]
            except (KVStoreError, OSError) as exc:
                self._fail(by_id[node_id], exc)
                got = [PutResult(k, False, False, str(exc)) for k, _ in part]
            self._account(node_id, sum(sizes[start:end]))
            for i, r in enumerate(got, start):
                prev = results[i]
                if prev is None or (r.ok and not prev.ok):
                    results[i] = r
        return [r or PutResult(k, False, False, "not placed") for r, (k, _) in zip(results, blocks)]

    def replicate(self, keys: Sequence[bytes], copies: int = 2, namespace: str | None = None) -> int:
        """Make the held prefix of the chain ``keys`` (hot blocks, as the caller judges) live
        on ``copies`` nodes in all, each new copy on the node with the most free bytes that
        lacks it, as one chain. ``namespace``: the tenant the blocks belong to, so that each
        copy is on its books and held to its quota there (None: the copies are unattributed).
        Returns blocks copied; a node that fails is skipped."""
        keys = list(keys)
        owners = self.locate(keys)
        if not owners:
            return 0
        held = keys[:len(owners)]
        have = {n.node_id for n in self.nodes() if self._lookup_one(n, held).blocks == len(held)}
        need = copies - len(have)
        if need <= 0:
            return 0
        data = self.get_blocks(held, stop_at_miss=True)
        if len(data) < len(held) or any(d is None for d in data):
            return 0
        blocks = [(k, d) for k, d in zip(held, data) if d is not None]   # all of them: checked above
        free = self._free([n for n in self.nodes() if n.node_id not in have])
        copied = 0
        for node_id in sorted(free, key=lambda n: (-free[n], n))[:need]:
            node = next(n for n in self.nodes() if n.node_id == node_id)
            try:
                got = self._client(node).put_blocks(blocks, chain=True, namespace=namespace)
            except (KVStoreError, OSError) as exc:
                self._fail(node, exc)
                continue
            self._account(node_id, sum(len(d) for _, d in blocks))
            copied += sum(1 for r in got if r.ok and not r.existed)
        return copied

    def _free(self, live: list[NodeInfo]) -> dict[str, int]:
        """node id -> bytes placement may still put there; a draining node is left out."""
        with self._lock:
            out = {}
            for n in live:
                if n.draining:
                    continue
                seen, placed = self._placed.get(n.node_id, (n.free_bytes, 0))
                if seen != n.free_bytes:      # a fresh heartbeat counted our puts already
                    placed = 0
                self._placed[n.node_id] = (n.free_bytes, placed)
                out[n.node_id] = max(0, n.free_bytes - placed)
            return out

    def _account(self, node_id: str, nbytes: int) -> None:
        with self._lock:
            seen, placed = self._placed.get(node_id, (0, 0))
            self._placed[node_id] = (seen, placed + nbytes)

    def close(self) -> None:
        with self._lock:
            clients, transports = list(self._clients.values()), list(self._transports.values())
            self._clients.clear()
            self._transports.clear()
        for t in transports:
            t.close()
        for c in clients:
            c.close()
        if self._health is not None:
            self._health.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
