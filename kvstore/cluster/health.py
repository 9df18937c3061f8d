"""The health of a cluster's store nodes as one reader sees it: every node the registry lists
must answer its health check, and a node that left the listing without a clean stop is down
— not forgotten — for :data:`LOST_NODE_S`.

A node that stops heartbeating (killed, stopped with SIGSTOP, cut off) drops out of the
registry when its record's TTL lapses; to a reader that only lists the registry it simply
vanished, and the front door said ``ok`` while its blocks were misses. A node that stops
cleanly notes it in the registry, for that life (epoch) alone
(:meth:`~kvstore.cluster.membership.Registry.left_cleanly`): the reader asks about the life it
last listed, so another life's clean stop (an earlier life's, a twin's of the same id) neither
excuses its crash nor makes its clean stop look like one."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from kvstore.client import StoreClient
from kvstore.cluster.membership import NodeInfo, Registry
from kvstore.errors import KVStoreError, Unavailable

LOST_NODE_S = 600.0      # a node gone without a clean stop is reported down this long (or until it is back)
PROBE_TIMEOUT_S = 0.5    # a node's health check (the front door gives the whole check 1 s)
PROBE_THREADS = 32       # nodes probed at once: a cluster of up to 32 is checked in one 0.5 s round


@dataclass(frozen=True)
class NodeProblem:
    """A store node that is down: ``why`` says how (no answer, an error, gone)."""

    node_id: str
    address: str
    why: str

    def __str__(self) -> str:
        return f"store node {self.node_id} ({self.address}): {self.why}"


class ClusterHealth:
    """Checks the nodes of ``registry`` (``token``: the store token, sent to the nodes it
    lists). Not thread-safe: one checker calls :meth:`check`."""

    def __init__(self, registry: Registry, token: str | None) -> None:
        self.registry, self.token = registry, token
        self._known: dict[str, tuple[NodeInfo, float]] = {}   # node id -> (its record, last listed, monotonic s)
        self._clients: dict[tuple[str, int], StoreClient] = {}
        self._pool = ThreadPoolExecutor(max_workers=PROBE_THREADS, thread_name_prefix="kvstore-cluster-health")

    def check(self) -> tuple[int, list[NodeProblem]]:
        """(nodes that answered, the problems): each listed node that does not answer ``SERVING``
        within :data:`PROBE_TIMEOUT_S`, and each node listed before that is gone without a
        clean stop (for :data:`LOST_NODE_S`). Raises whatever reading the registry raises."""
        listed = self.registry.nodes()
        now = time.monotonic()
        for n in listed:
            self._known[n.node_id] = (n, now)
        probes = {n.node_id: (n, self._pool.submit(self._client(n).health)) for n in listed}
        problems = []
        for node, future in probes.values():
            try:
                status = future.result(timeout=PROBE_TIMEOUT_S + 0.1)
            except FutureTimeout:
                problems.append(NodeProblem(node.node_id, node.address,
                                            f"no answer to a health check within {PROBE_TIMEOUT_S:g} s"))
                continue
            except KVStoreError as exc:
                problems.append(NodeProblem(node.node_id, node.address, f"health check failed: {exc}"))
                continue
            if str(status).upper() not in ("SERVING", "OK"):
                problems.append(NodeProblem(node.node_id, node.address, f"health {status}"))
        for node_id, (info, seen) in list(self._known.items()):
            if node_id in probes:
                continue
            if self.registry.left_cleanly(node_id, info.epoch) or now - seen > LOST_NODE_S:
                del self._known[node_id]
                continue
            problems.append(NodeProblem(node_id, info.address, f"gone from the registry {now - seen:.0f} s ago "
                                        "without a clean stop (crashed, stopped or cut off)"))
        live = {(node_id, info.epoch) for node_id, (info, _) in self._known.items()}
        for key in [k for k in self._clients if k not in live]:
            self._clients.pop(key).close()
        return len(listed) - sum(p.node_id in probes for p in problems), problems

    def _client(self, node: NodeInfo) -> StoreClient:
        key = (node.node_id, node.epoch)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = StoreClient(node.address, self.token, PROBE_TIMEOUT_S, data_path="grpc")
        return client

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._pool.shutdown(wait=False)



def raise_unless_serving(serving: int, problems: list[NodeProblem], registry: Registry) -> None:
    """After :meth:`ClusterHealth.check`: raises Unavailable naming each node that is down and
    how, or saying that no node is registered (under this token, where the registry tells)."""
    if problems:
        raise Unavailable("; ".join(map(str, problems)) + f" ({serving} {'node' if serving == 1 else 'nodes'} "
                          "serving)")
    if not serving:
        unverified = getattr(registry, "unverified", 0)
        raise Unavailable(f"no store node is registered under this store token ({unverified} records are "
                          "sealed under another: a wrong token?)" if unverified else "no store node is registered")
