"""The node side of the transfer-engine path: the ``BlockTransfer`` gRPC service
(protos/transfer.proto) says where the node's transfer engine listens and where its
registered DRAM slab lies, and the port of the node's compact TCP control channel
(kvstore/dataplane/server.py ``TcpControlServer``), where readers lease slab offsets; without
one they use the store service's own ``LeaseBlocks`` / ``ReleaseLease``."""
from __future__ import annotations

from typing import Callable

import grpc

from kvstore.pool import KVPool
from kvstore.transfer.engine import NodeTransferEngine
from protos import transfer_pb2 as pb
from protos import transfer_pb2_grpc as pb_grpc


class TransferServicer(pb_grpc.BlockTransferServicer):
    def __init__(self, pool: KVPool, node_te: NodeTransferEngine | None, control_port: int = 0) -> None:
        self.pool = pool
        self.node_te = node_te
        self.control_port = control_port

    def Info(self, request: pb.TransferInfoRequest, context: grpc.ServicerContext) -> pb.TransferInfoResponse:
        te = self.node_te
        if te is None:
            return pb.TransferInfoResponse(node_id=self.pool.node_id)
        return pb.TransferInfoResponse(node_id=self.pool.node_id, te_endpoint=te.endpoint, protocol=te.protocol,
                                       slab_address=te.slab_address, slab_bytes=te.slab_bytes,
                                       metadata=te.handle.metadata, control_port=self.control_port,
                                       staged=te.staging is not None)


def transfer_service(pool: KVPool, node_te: NodeTransferEngine | None,
                     control_port: int = 0) -> Callable[[grpc.Server], None]:
    """An ``extra_services`` entry for :func:`kvstore.service.serve_store`."""
    servicer = TransferServicer(pool, node_te, control_port)
    return lambda server: pb_grpc.add_BlockTransferServicer_to_server(servicer, server)
