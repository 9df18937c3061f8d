"""The across-host path: lease the blocks (slab offsets) over the node's compact TCP control
channel (kvstore/dataplane/control_client.py ``TcpControl``; the store's gRPC ``LeaseBlocks``
where the node runs none; both decoded to the same LeaseGrant by kvstore/wire's codecs), read
them out of the node's registered slab with the Mooncake Transfer Engine, verify each against
its checksum, release."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from kvstore.auth import bearer_metadata
from kvstore.dataplane.control_client import TcpControl
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.integrity import new_hasher
from kvstore.tiers.buffers import copy_into
from kvstore.transfer.base import BlockTransport, register_transport
from kvstore.transfer.engine import (
    DONE,
    FAILED,
    IN_FLIGHT,
    TransferEngineHandle,
    TransferEngineUnavailable,
    local_address_toward,
    process_engine,
)
from kvstore.transfer.grpc_stream import grpc_only_client
from kvstore.wire import proto_codec, transfer_codec
from kvstore.wire.channel import GRPC_OPTIONS
from kvstore.wire.errors import from_rpc_error
from kvstore.wire.types import ELSEWHERE, MAPPED, MISS, BlockLocation, LeaseRequest
from protos import kvstore_pb2 as kv_pb
from protos import kvstore_pb2_grpc as kv_grpc
from protos import transfer_pb2 as pb
from protos import transfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MIN_BUFFER_BYTES = 16 << 20
# Blocks move in pieces of at most PIECE_BYTES, each its own async transfer, all started at
# once; each block is hashed as its pieces land, while later blocks still move. One transfer
# per block: the engine's TCP transport pays for every transfer (0.3.13), and a 16 MiB block
# between two network namespaces (benchmarks/bench_multihost.py's reads, 2-core Xeon VM)
# took 11.2-12.7 ms as one transfer against 17-26 ms as 16 of 1 MiB (best of 5, three runs).
PIECE_BYTES = 1 << 30
# A read the engine failed at once (that try took at most RETRY_WITHIN_S: a dropped session) is
# started again this many times before its blocks go over gRPC; one that ran out of time, or
# failed only after a while (a host that does not answer: an ARP or connect timeout), is not.
# The engine may hold a new transfer to a peer whose session just failed for up to a second
# (0.3.13: after a refused read, the next to that peer took 1.0 s here), so once at most.
TE_RETRIES = 1
RETRY_WITHIN_S = 0.5
CONTROL_RETRY_S = 2.0   # a failed control channel is dialled again after this long
_STALLED: list = []  # buffers of closed readers whose transfers never ended: kept, never freed


def _direct_target(out: Any, size: int, engine: TransferEngineHandle) -> np.ndarray | None:
    """``out[:size]`` when the engine can write the block into it directly: a contiguous
    uint8 numpy array of at least ``size`` bytes inside a registered region."""
    if (isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1 and out.shape[0] >= size
            and out.flags.c_contiguous and out.flags.writeable and engine.registered(int(out.ctypes.data), size)):
        return out[:size]
    return None


@register_transport("transfer_engine")
class TransferEngineTransport(BlockTransport):
    """Reads one node's blocks with this process's transfer engine (on ``KVSTORE_TE_HOST``,
    default this host's address on the route to the node's engine: :func:`local_address_toward`;
    ``KVSTORE_TE_METADATA``, default the node's metadata; the protocol is
    the node's). Blocks not in the node's slab (SSD, HBM) and transfers that fail are read over
    the gRPC stream instead (counted in ``grpc_reads``; ``te_reads`` counts the others); a
    transfer the engine fails at once is first started again, up to :data:`TE_RETRIES`
    times (counted in ``te_retries``).
    Leases go over the node's TCP control channel when it announces one (``control`` is
    then a :class:`~kvstore.dataplane.control_client.TcpControl`; for nodes without one, and
    after that connection fails until a new one is made, over gRPC: ``control`` is None).

    Raises TransferEngineUnavailable at construction when the engine cannot start here or
    the node runs none, so :func:`open_transport` can fall back.
    """

    def __init__(self, address: str, auth_token: str | None = None, timeout_s: float = 60.0,
                 engine: TransferEngineHandle | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._meta = bearer_metadata(auth_token)
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._info_stub = pb_grpc.BlockTransferStub(self._channel)
        self._kv = kv_grpc.KVStoreStub(self._channel)
        self.stream = grpc_only_client(address, auth_token, timeout_s)
        self.te_reads = self.grpc_reads = self.te_retries = 0
        self._registered: list[int] = []  # callers' buffers given to register()
        self._releases: list[Any] = []    # ReleaseLease calls in flight
        self._buf: np.ndarray | None = None
        self._buf_addr = 0
        self._lock = threading.Lock()  # one read through the transport's buffer at a time
        self._retired: list[tuple[list[int], np.ndarray, int]] = []  # (stalled transfers, buffer, address)
        self.control: TcpControl | None = None
        self._control_at = ""   # host:port of the node's control channel ("" none, or closed)
        self.staged = False
        try:
            info = transfer_codec.info_of(self._info_stub.Info(pb.TransferInfoRequest(), timeout=timeout_s,
                                                               metadata=self._meta))
            if not info.te_endpoint:
                raise TransferEngineUnavailable(f"store node at {address} runs no transfer engine")
            self.endpoint, self.protocol, self.slab_address = info.te_endpoint, info.protocol, info.slab_address
            # A staging node registers a staging area, not its slab: only the control
            # channel's leases point into it (kvstore/transfer/staging.py).
            self.staged = info.staged
            self.engine = engine or process_engine(os.environ.get("KVSTORE_TE_HOST")
                                                   or local_address_toward(info.te_endpoint.rpartition(":")[0]),
                                                   os.environ.get("KVSTORE_TE_METADATA",
                                                                  info.metadata or "P2PHANDSHAKE"),
                                                   info.protocol)
        except grpc.RpcError as exc:
            self.close()
            raise from_rpc_error(exc, address) from None
        except TransferEngineUnavailable:
            self.close()
            raise
        self._control_at = f"{address.rpartition(':')[0]}:{info.control_port}" if info.control_port else ""
        self._token, self._control_retry_at = auth_token, 0.0
        if self._control_at:
            try:
                self.control = TcpControl(self._control_at, auth_token, timeout_s)
            except Unavailable as exc:  # leases then go over gRPC, as for an older node
                log.warning("no control channel to %s (%s); leasing over gRPC", address, exc)
                self._control_retry_at = time.monotonic() + CONTROL_RETRY_S

    def _control(self) -> TcpControl | None:
        """The control channel; one that failed is dialled again every :data:`CONTROL_RETRY_S`
        (a link that was cut and came back), gRPC leases standing in meanwhile."""
        if self.control is None and self._control_at and time.monotonic() >= self._control_retry_at:
            try:
                self.control = TcpControl(self._control_at, self._token, self.timeout_s)
                log.info("control channel to %s is back", self.address)
            except Unavailable:
                self._control_retry_at = time.monotonic() + CONTROL_RETRY_S
        return self.control

    def _reap(self) -> None:
        """Unregister and drop the retired buffers whose stalled transfers have all ended."""
        keep = []
        for ids, buf, addr in self._retired:
            ids = [t for t in ids if not self.engine.ended(t)]
            if ids:
                keep.append((ids, buf, addr))
            else:
                self.engine.unregister(addr)
        self._retired = keep

    def _buffer(self, nbytes: int) -> tuple[np.ndarray, int]:
        """The transport's own registered buffer, at least ``nbytes`` (no transfer is in
        flight into it: one that stalled retired it)."""
        if self._buf is None or self._buf.nbytes < nbytes:
            if self._buf is not None:
                self.engine.unregister(self._buf_addr)
            self._buf = np.empty(max(nbytes, MIN_BUFFER_BYTES), dtype=np.uint8)
            self._buf_addr = self.engine.register(self._buf)
        return self._buf, self._buf_addr

    def register(self, array: np.ndarray) -> None:
        """Register a caller's host buffer (a contiguous numpy array kept alive by the
        caller until :meth:`close`) with this process's engine, so :meth:`get_into` reads
        blocks straight into it, as Mooncake Store's ``register_buffer`` does. Raises
        TransferEngineUnavailable when the engine refuses it."""
        self._registered.append(self.engine.register(array))

    def get_blocks(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        return self._get(list(keys), None, stop_at_miss)

    def get_into(self, keys: Sequence[bytes], outs: Sequence[Any], stop_at_miss: bool = False) -> list[int | None]:
        """Copy block i into ``outs[i]`` (a numpy array or tensor, at least the block's
        size); per key the bytes written or None for a miss (with ``stop_at_miss`` the list
        ends at the first miss). A contiguous uint8 array inside a buffer given to
        :meth:`register` is written by the engine directly; anything else through the
        transport's own registered buffer. A read into a caller's buffer never returns
        while the engine may still write into it: from a node that stalls without dying it
        waits on (a warning every ``timeout_s``). Raises InvalidArgument for too few buffers."""
        if len(outs) < len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(outs)} output buffers")
        return self._get(list(keys), outs, stop_at_miss)

    def _get(self, keys: list[bytes], outs: Sequence[Any] | None, stop_at_miss: bool) -> list[Any]:
        """get_blocks (``outs`` None: bytes per block) or get_into (bytes written per block).
        A staging node answers the blocks its staging area has no room for ELSEWHERE with
        their size (kvstore/transfer/staging.py): they are leased again, batch after batch,
        each once the one before is read and released, for as long as each batch moves some
        block; the rest (other tiers, blocks larger than the area) come over the gRPC stream."""
        if not keys:
            return []
        lease_id, got = self._lease(keys, stop_at_miss)
        blocks = list(got)
        out: list[Any] = [None] * len(blocks)
        todo = list(range(len(blocks)))
        while True:
            mapped = [i for i in todo if blocks[i].state == MAPPED]
            ok = True
            try:
                if mapped:
                    ok = self._read(blocks, mapped, out, outs)
            finally:
                # Not waited for: the checksum verified after the copy is what guards the bytes
                # (a slab range reused after an expired lease cannot match the block's checksum).
                self._release(lease_id)
            if not ok:
                log.warning("transfer engine read from %s failed; reading %d blocks over gRPC",
                            self.endpoint, len(mapped))
            self.te_reads += sum(1 for i in mapped if out[i] is not None)
            todo = [i for i in todo if blocks[i].state == ELSEWHERE and blocks[i].size] if self.staged else []
            if not (ok and mapped and todo):
                break
            lease_id, again = self._lease([keys[i] for i in todo], False)
            for i, b in zip(todo, again):
                blocks[i] = b
        redo = [i for i, b in enumerate(blocks) if out[i] is None and b.state != MISS]
        if redo:
            self.grpc_reads += len(redo)
            for i, data in zip(redo, self.stream.get_blocks([keys[i] for i in redo])):
                if data is not None and outs is not None:
                    out[i] = copy_into(outs[i], np.frombuffer(data, dtype=np.uint8))
                else:
                    out[i] = data
        if stop_at_miss:
            first = next((i for i, d in enumerate(out) if d is None), None)
            if first is not None:
                return out[:first + 1]
            return out + [None] if len(out) < len(keys) else out
        return out + [None] * (len(keys) - len(out))

    def _lease(self, keys: list[bytes], stop_at_miss: bool) -> tuple[int, list[BlockLocation]]:
        """(lease id, per key a block with state, offset, size, checksum): over the TCP
        control channel, or gRPC where there is none (or it just failed). Raises
        Unavailable when the node cannot be reached, and the node's refusal as its class.
        A staging node without a control channel: every block ELSEWHERE (the gRPC stream)."""
        ctl = self._control()
        if ctl is not None:
            try:
                grant = ctl.lease(keys, None, stop_at_miss, stop_at_miss)
                return grant.lease_id, grant.blocks
            except Unavailable as exc:
                log.warning("control channel to %s failed (%s); leasing over gRPC until it answers again",
                            self.address, exc)
                self.control = None
                self._control_retry_at = time.monotonic() + CONTROL_RETRY_S
                ctl.close()
        if self.staged:   # gRPC leases give slab offsets, which lie outside what the engine may read
            return 0, [BlockLocation(ELSEWHERE)] * len(keys)
        try:
            grant = proto_codec.lease_grant_of(self._kv.LeaseBlocks(
                proto_codec.lease_request(LeaseRequest(keys, None, stop_at_miss, stop_at_miss)),
                timeout=self.timeout_s, metadata=self._meta))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.address) from None
        return grant.lease_id, grant.blocks

    def _release(self, lease_id: int) -> None:
        """End a lease without waiting for the node. Over gRPC the call's future is kept
        until done: gRPC cancels a call whose future is dropped."""
        if not lease_id:
            return
        ctl = self.control
        if ctl is not None:
            try:
                ctl.release(lease_id)
                return
            except Unavailable:  # the connection is gone, and its leases with it
                return
        self._releases = [f for f in self._releases if not f.done()]
        self._releases.append(self._kv.ReleaseLease.future(
            kv_pb.ReleaseLeaseRequest(lease_id=lease_id), timeout=self.timeout_s, metadata=self._meta))

    def _read(self, blocks: list[BlockLocation], mapped: list[int], out: list[Any],
              outs: Sequence[Any] | None) -> bool:
        """Read the ``mapped`` blocks with the engine: each into its caller's registered
        buffer, or else into the transport's buffer (then copied out, or to bytes when
        ``outs`` is None). The pieces (at most :data:`PIECE_BYTES`) are all started at
        once; each is hashed (streaming xxh3_64 per block) as it lands, while later ones
        are still moving. Fills ``out`` with the blocks whose checksum holds. Returns
        whether the engine reported success for every piece."""
        with self._lock:
            self._reap()
            direct = {i: _direct_target(outs[i], blocks[i].size, self.engine) for i in mapped} if outs else {}
            buf, base = self._buffer(max(1, sum(blocks[i].size for i in mapped if direct.get(i) is None)))
            at, pieces = 0, []  # (block, local address, local view, remote address, length)
            staged: dict[int, np.ndarray] = {}  # block -> its bytes in the transport's buffer
            for i in mapped:
                size, src = blocks[i].size, self.slab_address + blocks[i].offset
                view = direct.get(i)
                if view is None:
                    view = staged[i] = buf[at:at + size]
                    at += size
                local = int(view.ctypes.data)
                for off in range(0, size, PIECE_BYTES):
                    n = min(PIECE_BYTES, size - off)
                    pieces.append((i, local + off, view[off:off + n], src + off, n))
            hashers, failed, stalled, slow = self._move(pieces, direct)
            for _ in range(TE_RETRIES):   # the failed blocks again, when that try failed at once
                if slow or not failed:
                    break
                self.te_retries += 1
                log.info("transfer engine read of %d blocks from %s failed; starting them again",
                         len(failed), self.endpoint)
                again, failed, stalled, slow = self._move([p for p in pieces if p[0] in failed], direct)
                hashers.update(again)
            ok = not failed
            if stalled:
                # The transport's buffer may still be written: retire it (registered and alive)
                # until those transfers end; the next read gets a fresh one.
                log.warning("transfer engine read from %s still in flight after %.0f s (%d pieces); "
                            "retiring its buffer", self.endpoint, self.timeout_s, len(stalled))
                self._retired.append((stalled, buf, base))
                self._buf = None
            if not ok:
                return False
            for i in mapped:
                b = blocks[i]
                if (hashers[i] if i in hashers else new_hasher()).intdigest() != b.checksum:  # 0 bytes: no piece
                    continue
                data = staged.get(i)
                if data is None:  # the engine wrote it into the caller's buffer
                    out[i] = b.size
                else:
                    out[i] = data.tobytes() if outs is None else copy_into(outs[i], data)
            return True

    def _move(self, pieces: list[tuple[int, int, np.ndarray, int, int]], direct: dict[int, Any]
              ) -> tuple[dict[int, Any], set[int], list[int], bool]:
        """Start every piece, then wait for each in order, hashing it as it lands. Returns
        (per block whose every piece landed its hasher, the blocks with a piece that did not,
        the ids of pieces still in flight at the deadline, whether the try was slow: a piece
        ran out of time — still in flight, or ended by the engine's own timeout — or the try
        took longer than :data:`RETRY_WITHIN_S`)."""
        start, endpoint, wait = self.engine.read_piece, self.endpoint, self.engine.wait_piece
        t0 = time.monotonic()
        ids = [start(endpoint, p[1], p[3], p[4]) for p in pieces]
        deadline = t0 + self.timeout_s
        hashers: dict[int, Any] = {}
        failed: set[int] = set()
        stalled: list[int] = []
        timed_out = False
        for tid, (i, _, view, _, _) in zip(ids, pieces):
            status = wait(tid, deadline)
            while status == IN_FLIGHT and direct.get(i) is not None:
                # the caller's buffer: never handed back while the engine may write into it
                log.warning("transfer engine read from %s into a caller's buffer still in flight after "
                            "%.0f s; waiting on", self.endpoint, self.timeout_s)
                status = wait(tid, time.monotonic() + self.timeout_s)
            if status == IN_FLIGHT:
                stalled.append(tid)
            if status != DONE:
                failed.add(i)
                timed_out = timed_out or status != FAILED
                continue  # the later pieces are still waited for
            if i not in failed:
                hashers.setdefault(i, new_hasher()).update(view)
        slow = timed_out or time.monotonic() - t0 > min(RETRY_WITHIN_S, self.timeout_s / 4)
        return {i: h for i, h in hashers.items() if i not in failed}, failed, stalled, slow

    def close(self) -> None:
        for call in getattr(self, "_releases", ()):  # let the last releases land
            try:
                call.result(timeout=self.timeout_s)
            except grpc.RpcError:
                pass
        self._releases = []
        self._control_at = ""    # closed: never dialled again
        if getattr(self, "control", None) is not None:
            self.control.close()  # type: ignore[union-attr]
            self.control = None
        for addr in getattr(self, "_registered", ()):
            self.engine.unregister(addr)
        self._registered = []
        if getattr(self, "_buf", None) is not None:
            self.engine.unregister(self._buf_addr)
            self._buf = None
        deadline = time.monotonic() + self.timeout_s
        while getattr(self, "_retired", None) and time.monotonic() < deadline:
            self._reap()
            if self._retired:
                time.sleep(0.01)
        if getattr(self, "_retired", None):  # never freed while the engine may write there
            log.warning("closing the transfer-engine reader of %s with %d stalled transfers; their buffers "
                        "stay allocated", self.address, sum(len(ids) for ids, _, _ in self._retired))
            _STALLED.extend(self._retired)
            self._retired = []
        self.stream.close()
        self._channel.close()

