"""The across-host path: lease over gRPC (the store's ``LeaseBlocks``: slab offsets), read the
leased blocks out of the node's registered slab with the Mooncake Transfer Engine, verify
each against its checksum, release."""
from __future__ import annotations

import logging
import os
from typing import Sequence

import grpc
import numpy as np

from kvstore.client import _translate
from kvstore.integrity import checksum_of
from kvstore.service import GRPC_OPTIONS
from kvstore.transfer.base import BlockTransport, register_transport
from kvstore.transfer.engine import TransferEngineHandle, TransferEngineUnavailable, process_engine
from kvstore.transfer.grpc_stream import grpc_only_client
from protos import kvstore_pb2 as kv_pb
from protos import kvstore_pb2_grpc as kv_grpc
from protos import transfer_pb2 as pb
from protos import transfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MISS, MAPPED, ELSEWHERE = 0, 1, 2    # LeasedBlock.state (protos/kvstore.proto)
MIN_BUFFER_BYTES = 16 << 20
PIECE_BYTES = 4 << 20      # big blocks move in pieces the engine runs in parallel (te_probe.py)


@register_transport("transfer_engine")
class TransferEngineTransport(BlockTransport):
    """Reads one node's blocks with this process's transfer engine (``KVSTORE_TE_HOST``,
    default 127.0.0.1; ``KVSTORE_TE_METADATA``, default the node's metadata; the protocol is
    the node's). Blocks not in the node's slab (SSD, HBM) and transfers that fail are read over
    the gRPC stream instead (counted in ``grpc_reads``; ``te_reads`` counts the others).

    Raises TransferEngineUnavailable at construction when the engine cannot start here or
    the node runs none, so :func:`open_transport` can fall back.
    """

    def __init__(self, address: str, auth_token: str | None = None, timeout_s: float = 60.0,
                 engine: TransferEngineHandle | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._meta = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._info_stub = pb_grpc.BlockTransferStub(self._channel)
        self._kv = kv_grpc.KVStoreStub(self._channel)
        self.stream = grpc_only_client(address, auth_token, timeout_s)
        self.te_reads = self.grpc_reads = 0
        self._buf: np.ndarray | None = None
        self._buf_addr = 0
        try:
            info = self._info_stub.Info(pb.TransferInfoRequest(), timeout=timeout_s, metadata=self._meta)
            if not info.te_endpoint:
                raise TransferEngineUnavailable(f"store node at {address} runs no transfer engine")
            self.endpoint, self.protocol, self.slab_address = info.te_endpoint, info.protocol, info.slab_address
            self.engine = engine or process_engine(os.environ.get("KVSTORE_TE_HOST", "127.0.0.1"),
                                                   os.environ.get("KVSTORE_TE_METADATA",
                                                                  info.metadata or "P2PHANDSHAKE"),
                                                   info.protocol)
        except grpc.RpcError as exc:
            self.close()
            raise _translate(exc, address) from None
        except TransferEngineUnavailable:
            self.close()
            raise

    def _buffer(self, nbytes: int) -> tuple[np.ndarray, int]:
        if self._buf is None or self._buf.nbytes < nbytes:
            if self._buf is not None:
                self.engine.unregister(self._buf_addr)
            self._buf = np.empty(max(nbytes, MIN_BUFFER_BYTES), dtype=np.uint8)
            self._buf_addr = self.engine.register(self._buf)
        return self._buf, self._buf_addr

    def get_blocks(self, keys: Sequence[bytes], stop_at_miss: bool = False) -> list[bytes | None]:
        keys = list(keys)
        if not keys:
            return []
        try:
            lease = self._kv.LeaseBlocks(kv_pb.LeaseBlocksRequest(keys=keys, stop_at_miss=stop_at_miss),
                                         timeout=self.timeout_s, metadata=self._meta)
        except grpc.RpcError as exc:
            raise _translate(exc, self.address) from None
        blocks = list(lease.blocks)
        out: list[bytes | None] = [None] * len(blocks)
        mapped = [i for i, b in enumerate(blocks) if b.state == MAPPED]
        ok = True
        try:
            if mapped:
                ok = self._read(blocks, mapped, out)
        finally:
            # Not waited for: the checksum verified after the copy is what guards the bytes
            # (a slab range reused after an expired lease cannot match the block's checksum).
            if lease.lease_id:
                self._kv.ReleaseLease.future(kv_pb.ReleaseLeaseRequest(lease_id=lease.lease_id),
                                             timeout=self.timeout_s, metadata=self._meta)
        if not ok:
            log.warning("transfer engine read from %s failed; reading %d blocks over gRPC",
                        self.endpoint, len(mapped))
        self.te_reads += sum(1 for i in mapped if out[i] is not None)
        redo = [i for i, b in enumerate(blocks) if out[i] is None and b.state != MISS]
        if redo:
            self.grpc_reads += len(redo)
            for i, data in zip(redo, self.stream.get_blocks([keys[i] for i in redo])):
                out[i] = data
        if stop_at_miss:
            first = next((i for i, d in enumerate(out) if d is None), None)
            if first is not None:
                return out[:first + 1]
            return out + [None] if len(out) < len(keys) else out
        return out + [None] * (len(keys) - len(out))

    def _read(self, blocks: list, mapped: list[int], out: list[bytes | None]) -> bool:
        """One batched engine read of the ``mapped`` blocks; fills ``out`` with the ones whose
        checksum holds. Returns whether the engine reported success."""
        with self.engine.lock:
            buf, base = self._buffer(sum(blocks[i].size for i in mapped))
            local, remote, lengths, at = [], [], [], 0
            for i in mapped:
                src = self.slab_address + blocks[i].offset
                for off in range(0, blocks[i].size, PIECE_BYTES):
                    local.append(base + at + off)
                    remote.append(src + off)
                    lengths.append(min(PIECE_BYTES, blocks[i].size - off))
                at += blocks[i].size
            if not self.engine.read(self.endpoint, local, remote, lengths):
                return False
            at = 0
            for i in mapped:
                b = blocks[i]
                data = buf[at:at + b.size]
                at += b.size
                if checksum_of(data) == b.checksum:
                    out[i] = data.tobytes()
            return True

    def close(self) -> None:
        if self._buf is not None:
            self.engine.unregister(self._buf_addr)
            self._buf = None
        self.stream.close()
        self._channel.close()

