"""The node side of the transfer-engine path: the ``BlockTransfer`` gRPC service
(protos/transfer.proto) says where the node's transfer engine listens and where its
registered DRAM slab lies, and the port of the node's compact TCP control channel
(kvstore/dataplane/control_server.py ``TcpControlServer``), where readers lease slab offsets; without
one they use the store service's own ``LeaseBlocks`` / ``ReleaseLease``."""
from __future__ import annotations

from collections.abc import Callable

import grpc

from kvstore.pool.pool import KVPool
from kvstore.transfer.engine import NodeTransferEngine
from kvstore.wire.transfer_codec import info_response
from kvstore.wire.types import TransferInfo
from protos import transfer_pb2 as pb
from protos import transfer_pb2_grpc as pb_grpc


class TransferServicer(pb_grpc.BlockTransferServicer):
    def __init__(self, pool: KVPool, node_te: NodeTransferEngine | None, control_port: int = 0) -> None:
        self.pool = pool
        self.node_te = node_te
        self.control_port = control_port

    def Info(self, request: pb.TransferInfoRequest, context: grpc.ServicerContext) -> pb.TransferInfoResponse:
        return info_response(self.info())

    def info(self) -> TransferInfo:
        te = self.node_te
        if te is None:
            return TransferInfo(self.pool.node_id)
        return TransferInfo(self.pool.node_id, te.endpoint, te.protocol, te.slab_address, te.slab_bytes,
                            te.handle.metadata, self.control_port, te.staging is not None)


def transfer_service(pool: KVPool, node_te: NodeTransferEngine | None,
                     control_port: int = 0) -> Callable[[grpc.Server], None]:
    """An ``extra_services`` entry for :func:`kvstore.service.serve_store`."""
    servicer = TransferServicer(pool, node_te, control_port)
    return lambda server: pb_grpc.add_BlockTransferServicer_to_server(servicer, server)
