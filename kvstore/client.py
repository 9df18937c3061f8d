"""A Python client of a store node's gRPC API (batched, streamed block transfers). On the
node's own host it moves block bytes through the node's mapped DRAM slab instead
(kvstore/dataplane), with the same methods."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from kvstore.auth import bearer_metadata
from kvstore.errors import InvalidArgument, KVStoreError, LeaseExpired, Unavailable
from kvstore.events.event import NodeSnapshot
from kvstore.limits import MAX_KEYS_PER_CALL
from kvstore.pool.quotas import check_namespace
from kvstore.pool.tenants import NAMESPACE_METADATA
from kvstore.tiers.buffers import Segments, to_bytes
from kvstore.wire import proto_codec as codec
from kvstore.wire.channel import GRPC_OPTIONS
from kvstore.wire.errors import from_rpc_error
from kvstore.wire.types import DataPlaneInfo, LookupResult, PutResult, TierStats
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
DATA_PATHS = ("auto", "grpc")
__all__ = ["DATA_PATHS", "LookupResult", "StoreClient"]


class StoreClient:
    """Talks to one store node at ``address`` (host:port); a :class:`~kvstore.block_store.BlockStore`.

    Every method raises :class:`Unavailable` when the node cannot be reached,
    :class:`~kvstore.errors.Unauthenticated` (an Unavailable) when it refuses the token, and
    :class:`InvalidArgument` when it rejects the request as malformed (the node's error
    class, as kvstore/wire/errors.py carries it).

    ``data_path``: ``auto`` (default) moves block bytes through the node's shared-memory
    slab when the node runs on this host, its top tier is that DRAM slab and the slab can be
    mapped here (control over the node's Unix socket, else gRPC), and through the gRPC
    stream otherwise; ``grpc`` always uses the stream. :attr:`data_path_in_use` says which was picked (logged once).
    ``prefault``: once the slab is mapped, build this process's page tables for all of it
    on a background thread (kvstore/tiers/prefault.py), so the first get or put touching a
    page does not fault (about 4 MiB of page tables per GiB of slab).
    """

    def __init__(self, address: str, auth_token: str | None = None, timeout_s: float = 60.0,
                 data_path: str = "auto", prefault: bool = True) -> None:
        if data_path not in DATA_PATHS:
            raise InvalidArgument(f"data_path must be one of {DATA_PATHS}, got {data_path!r}")
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._meta = bearer_metadata(auth_token)
        self._token = auth_token
        self._plane: Any = None          # a kvstore.dataplane.local.LocalDataPlane once attached
        self._info: DataPlaneInfo | None = None   # what the node announced of its slab
        self._plane_decided = data_path == "grpc"
        self._plane_lock = threading.Lock()
        self._prefault = prefault

    def close(self) -> None:
        if self._plane is not None:
            self._plane.close()
            self._plane = None
        self._channel.close()

    # -- the data path -----------------------------------------------------------------------
    @property
    def data_path_in_use(self) -> str:
        """``same-host/uds``, ``same-host/grpc`` (slab mapped; control over the node's Unix
        socket or gRPC) or ``grpc`` (bytes in the gRPC stream). Asks the node once."""
        plane = self._local()
        return "grpc" if plane is None else f"same-host/{plane.channel}"

    def attach(self, wait_s: float = 0.0) -> tuple[str, bool]:
        """Attach the data path now rather than on the first get or put, and wait up to
        ``wait_s`` for this process's page tables of a mapped slab (``prefault``), so that
        neither falls on the first requests. Returns :attr:`data_path_in_use` ("" when the
        node could not be reached: it is asked again on first use) and whether the page
        tables are built (True when there are none to build)."""
        plane = self._local()
        if not self._plane_decided:
            return "", False
        return self.data_path_in_use, plane is None or plane.wait_prefaulted(max(0.0, wait_s))

    def dataplane_info(self) -> DataPlaneInfo | None:
        """What the node announced of its DRAM slab (None: no slab, a ``grpc`` data path, or
        not reached yet), asked once: the input of :func:`kvstore.transfer.pick_transport`."""
        self._local()
        return self._info

    def _local(self) -> Any:
        """The same-host data plane, attached on first use when the transfer registry picks
        ``same_host`` for the node (:func:`kvstore.transfer.pick_transport`); None otherwise.
        A node that cannot be reached yet is asked again."""
        if self._plane_decided:
            return self._plane
        with self._plane_lock:
            if self._plane_decided:
                return self._plane
            from kvstore.dataplane.local import LocalDataPlane
            from kvstore.transfer.base import pick_transport
            try:
                resp = self._stub.DataPlaneInfo(pb.DataPlaneInfoRequest(), timeout=self.timeout_s,
                                                metadata=self._meta)
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return None  # not up yet: decide on a later call
                self._plane_decided = True
                log.info("store client -> %s: gRPC stream data path (%s)", self.address, exc.code().name)
                return None
            self._plane_decided = True
            info = self._info = codec.dataplane_info_of(resp)
            pick = pick_transport("auto", info)     # this client moves bytes itself: same_host or grpc_stream
            if pick.name != "same_host" or info is None:
                log.info("store client -> %s: gRPC stream data path (%s)", self.address, pick.why)
                return None
            try:
                self._plane = LocalDataPlane(info, self._control(info), fetch=self._grpc_get_blocks,
                                             prefault=self._prefault, report=self._report_bad)
            except Unavailable as exc:
                log.info("store client -> %s: gRPC stream data path (%s)", self.address, exc)
                return None
            log.info("store client -> %s: same-host data path (slab %s mapped, control over %s)",
                     self.address, info.slab_name, self._plane.channel)
            return self._plane

    def _drop_plane(self, exc: Exception) -> None:
        """The same-host path broke (the node stopped or restarted): forget it, so this call
        goes over gRPC and a later one attaches afresh."""
        with self._plane_lock:
            plane, self._plane, self._plane_decided = self._plane, None, False
        if plane is not None:
            log.info("store client -> %s: same-host path lost (%s); over gRPC until it is back", self.address, exc)
            plane.close()

    def _control(self, info: Any) -> Any:
        from kvstore.dataplane.grpc_control import GrpcControl
        if info.socket_path:
            from kvstore.dataplane.control_client import UdsControl
            try:
                return UdsControl(info.socket_path, self._token, self.timeout_s)
            except Unavailable as exc:
                log.info("store client -> %s: no Unix control socket (%s); control over gRPC", self.address, exc)
        return GrpcControl(self._stub, self._call)

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, timeout=self.timeout_s, metadata=self._meta, **kw)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from None

    def health(self) -> str:
        return self._call(self._stub.Health, pb.HealthRequest()).status

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the node answers; raises Unavailable after ``timeout_s``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"store node at {self.address} not ready after {timeout_s} s") from None

    def lookup(self, keys: Sequence[bytes], purpose: str = "reuse", namespace: str | None = None) -> LookupResult:
        """Longest prefix of the key chain the node holds (renews nothing). A chain longer
        than the node takes in one call (MAX_KEYS_PER_CALL) is looked up in parts.
        ``purpose``: what for — ``reuse`` (an engine about to compute the prompt), ``handoff``
        (a decode instance after its prefill's blocks) or ``probe`` (planning, looking): the
        node's lookup books count the first as reuse, the second apart, the third nowhere
        (kvstore/pool/reads.py, docs/metrics.md); ``namespace``: the tenant looking, whose
        books count the lookup (None: the node attributes it by the blocks it holds)."""
        if len(keys) > MAX_KEYS_PER_CALL:
            n = 0
            tiers: tuple[str, ...] = ()
            for start in range(0, len(keys), MAX_KEYS_PER_CALL):
                part = self.lookup(keys[start:start + MAX_KEYS_PER_CALL], purpose, namespace)
                n, tiers = n + part.blocks, tiers + part.tiers
                if part.blocks < min(MAX_KEYS_PER_CALL, len(keys) - start):
                    break
            return LookupResult(n, tiers)
        plane = self._local()
        if plane is not None:
            try:
                return plane.lookup(keys, purpose, namespace)
            except Unavailable as exc:
                self._drop_plane(exc)
        return codec.lookup_of(self._call(self._stub.Lookup, codec.lookup_request(keys, purpose, namespace)))

    def put_blocks(self, blocks: Sequence[tuple[bytes, bytes]], chain: bool = False,
                   parent: bytes | None = None, namespace: str | None = None) -> list[PutResult]:
        """Put several blocks in one streamed call; one result per block, in order.
        ``chain``: the blocks form one prefix chain (head first; ``parent``: the key the
        head extends), so the node evicts its tail before its head. ``namespace``: the
        tenant the blocks belong to (kvstore/pool/tenants.py: per-tenant accounting and quotas),
        carried by every wire (the same-host frames and the gRPC stream). Raises
        QuotaExceeded when the tenant is over its quota and its own blocks cannot make room
        (the blocks before the refused one are stored)."""
        if not blocks:
            return []
        if namespace:
            try:
                check_namespace(namespace)
            except InvalidArgument as exc:
                raise InvalidArgument(f"the put's namespace ({NAMESPACE_METADATA}): {exc}") from None
        started, why = time.monotonic(), ""
        plane = self._local()
        if plane is not None:
            try:
                return plane.put_blocks(blocks, chain, parent, namespace)
            except Unavailable as exc:  # puts are idempotent: the stream redoes the whole batch
                self._drop_plane(exc)
                why = str(exc)
        timeout_s = self._time_left(started, why)
        blocks = [(k, to_bytes(d) if isinstance(d, Segments) else d) for k, d in blocks]
        meta = self._meta + codec.namespace_metadata(namespace)
        try:
            resp = self._stub.Put(codec.put_chunks(blocks, chain, parent), timeout=timeout_s, metadata=meta)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from None
        return codec.put_results_of(resp.results)

    def put(self, key: bytes, data: bytes) -> PutResult:
        return self.put_blocks([(key, data)])[0]

    def get_blocks(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        """Bytes of each key (None for a miss; with ``stop_at_miss`` the list ends at the
        first miss). Each block's checksum is verified after it crosses the process
        boundary (socket or mapped slab); a block that fails it is returned as a miss. More
        keys than the node takes in one call (MAX_KEYS_PER_CALL) are read in parts."""
        if not keys:
            return []
        if len(keys) > MAX_KEYS_PER_CALL:
            return self._in_parts(lambda lo, hi: self.get_blocks(keys[lo:hi], stop_at_miss), len(keys),
                                  stop_at_miss)
        started, why = time.monotonic(), ""
        plane = self._local()
        if plane is not None:
            try:
                return plane.get_blocks(keys, stop_at_miss)
            except Unavailable as exc:
                self._drop_plane(exc)
                why = str(exc)
            except LeaseExpired:
                log.info("store client -> %s: a slab copy outlived its lease; reading over gRPC", self.address)
        return self._grpc_get_blocks(keys, stop_at_miss, self._time_left(started, why))

    def get_into(self, keys: Sequence[bytes], outs: Sequence[Any], stop_at_miss: bool = False) -> list[int | None]:
        """Copy block i into ``outs[i]`` (a contiguous numpy array or torch tensor on any
        device, at least the block's size): per key the bytes copied or None for a miss
        (with ``stop_at_miss`` the list ends at the first miss). Same host: one copy out of
        the mapped slab per block; otherwise over the gRPC stream. Raises LeaseExpired when
        a slab copy outlived its lease, InvalidArgument for a too-small buffer."""
        if len(keys) > MAX_KEYS_PER_CALL:
            return self._in_parts(lambda lo, hi: self.get_into(keys[lo:hi], outs[lo:hi], stop_at_miss), len(keys),
                                  stop_at_miss)
        started, why = time.monotonic(), ""
        plane = self._local()
        if plane is not None:
            try:
                return plane.get_into(keys, outs, stop_at_miss)
            except Unavailable as exc:
                self._drop_plane(exc)
                why = str(exc)
        timeout_s = self._time_left(started, why)
        from kvstore.tiers.buffers import copy_into
        return [None if d is None else copy_into(o, np.frombuffer(d, dtype=np.uint8))
                for d, o in zip(self._grpc_get_blocks(keys, stop_at_miss, timeout_s), outs)]

    def _time_left(self, started: float, why: str = "") -> float:
        """What is left of a call's ``timeout_s`` (begun at ``started``) for its gRPC part,
        after the same-host path was tried (and failed: ``why``) or asked for (the node's
        ``DataPlaneInfo``). Raises Unavailable when nothing is: on a node that hangs (stopped,
        not dead) the same-host attempt waits out the whole timeout, and a gRPC retry with the
        whole timeout again made a call take twice its timeout."""
        left = self.timeout_s - (time.monotonic() - started)
        if left <= 0.05:
            raise Unavailable(f"store node at {self.address}: no answer within {self.timeout_s:g} s"
                              + (f" ({why})" if why else ""))
        return left

    @staticmethod
    def _in_parts(read: Callable[[int, int], list[Any]], n: int, stop_at_miss: bool) -> list[Any]:
        """``read(lo, hi)`` over ``[0, n)`` in parts of MAX_KEYS_PER_CALL keys, joined; with
        ``stop_at_miss`` it stops after the first part that ended at a miss."""
        out: list[Any] = []
        for lo in range(0, n, MAX_KEYS_PER_CALL):
            hi = min(n, lo + MAX_KEYS_PER_CALL)
            part = read(lo, hi)
            out += part
            if stop_at_miss and (len(part) < hi - lo or (part and part[-1] is None)):
                break
        return out

    def _grpc_get_blocks(self, keys: Sequence[bytes], stop_at_miss: bool = False,
                         timeout_s: float | None = None) -> list[bytes | None]:
        """:meth:`get_blocks` over the gRPC stream (within ``timeout_s``, default the client's)."""
        if not keys:
            return []
        bad: list[bytes] = []
        try:
            out = codec.blocks_of(self._stub.Get(pb.GetRequest(keys=list(keys), stop_at_miss=stop_at_miss),
                                                 timeout=timeout_s or self.timeout_s, metadata=self._meta), bad)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from None
        if bad:
            self._report_bad(bad)
        return out

    def _report_bad(self, keys: list[bytes]) -> None:
        """Blocks that failed their checksum here, told to the node (:meth:`scrub`); a read
        already counts them as misses, so a failure to report is only logged."""
        log.warning("store client -> %s: %d blocks failed their checksum; the node is asked to verify them",
                    self.address, len(keys))
        try:
            checked, dropped = self.scrub(keys)
        except KVStoreError as exc:
            log.warning("store client -> %s: could not report them: %s", self.address, exc)
            return
        log.info("store client -> %s: the node verified %d copies and dropped %d", self.address, checked, dropped)

    def get(self, key: bytes) -> bytes | None:
        return self.get_blocks([key])[0]

    def stats(self) -> tuple[str, list[TierStats]]:
        resp = self._call(self._stub.Stats, pb.StatsRequest())
        return resp.node_id, [codec.tier_stats_of(t) for t in resp.tiers]

    def evict(self, tier: str, nbytes: int) -> tuple[int, int]:
        resp = self._call(self._stub.Evict, pb.EvictRequest(tier=tier, bytes=nbytes))
        return resp.evicted_bytes, resp.evicted_blocks

    def scrub(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """Report blocks that failed their checksum here: the node verifies every copy it
        holds of ``keys`` and drops those that fail (kvstore/pool/reads.py ``scrub``), so the
        next reader misses at once instead of copying damaged bytes again. Returns (copies
        checked, copies dropped). Raises as every call (InvalidArgument for bad keys)."""
        resp = self._call(self._stub.Scrub, pb.ScrubRequest(keys=list(keys)))
        return resp.checked, resp.dropped

    def pin(self, keys: Sequence[bytes], hard: bool = False, ttl_s: float | None = None,
            prefix: bool = False) -> int:
        """Pin blocks (``prefix``: the longest held prefix of the chain ``keys``): hard pins
        are never evicted, soft ones (``ttl_s``; default the node's) only as a last resort.
        Returns blocks pinned."""
        req = pb.PinRequest(keys=list(keys), prefix=prefix, hard=hard, ttl_s=ttl_s or 0.0)
        return self._call(self._stub.Pin, req).blocks

    def unpin(self, keys: Sequence[bytes], prefix: bool = False) -> int:
        """Drop pins (``prefix``: along the chain ``keys``); returns pins dropped."""
        return self._call(self._stub.Unpin, pb.UnpinRequest(keys=list(keys), prefix=prefix)).blocks

    def set_policy(self, policy: str, tier: str | None = None) -> dict[str, str]:
        """Switch the eviction policy of ``tier`` (default every tier); returns tier →
        previous policy. Raises InvalidArgument for an unknown policy or tier."""
        resp = self._call(self._stub.SetPolicy, pb.SetPolicyRequest(tier=tier or "", policy=policy))
        return dict(resp.previous)

    def snapshot(self) -> NodeSnapshot:
        """The node's index (every copy it holds) as of its KV event seq: what an index
        replica resynchronises from after a gap (kvstore/events)."""
        entries: list[tuple[bytes, str, int]] = []
        node, epoch, seq = "", 0, 0
        try:
            for i, chunk in enumerate(self._stub.Snapshot(pb.SnapshotRequest(), timeout=self.timeout_s,
                                                          metadata=self._meta)):
                if i == 0:
                    node, epoch, seq = chunk.node_id, chunk.epoch, chunk.seq
                entries.extend(zip(chunk.keys, chunk.tiers, chunk.sizes))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from None
        return NodeSnapshot(node, epoch, seq, tuple(entries))
