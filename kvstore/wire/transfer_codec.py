"""The codec of the transfer-engine endpoint (protos/transfer.proto ``BlockTransfer.Info``)
↔ :class:`~kvstore.wire.types.TransferInfo`, both directions. A reader then leases blocks
over the node's TCP control channel (kvstore/wire/frame_codec.py) or, without one, over
``KVStore.LeaseBlocks`` (kvstore/wire/proto_codec.py)."""
from __future__ import annotations

from dataclasses import asdict

from kvstore.wire.types import TransferInfo
from protos import transfer_pb2 as pb


def info_response(info: TransferInfo) -> pb.TransferInfoResponse:
    return pb.TransferInfoResponse(**asdict(info))


def info_of(resp: pb.TransferInfoResponse) -> TransferInfo:
    return TransferInfo(resp.node_id, resp.te_endpoint, resp.protocol, resp.slab_address, resp.slab_bytes,
                        resp.metadata, resp.control_port, resp.staged)
