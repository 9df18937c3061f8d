"""How block bytes move from a store node to a reader: a :class:`BlockTransport` strategy per
path — ``grpc_stream`` (portable, always there), ``transfer_engine`` (Mooncake Transfer
Engine between registered buffers, across hosts) and ``same_host`` (the slab mapping of
kvstore/dataplane, through StoreClient). :func:`pick_transport` is the one place that picks
a path for a node (StoreClient asks it too); :func:`open_transport` opens the one picked and
falls back to ``grpc_stream``, saying so, when the transfer engine is unavailable."""
from kvstore.transfer.base import TRANSPORTS, BlockTransport, Pick, open_transport, pick_transport
from kvstore.transfer.grpc_stream import GrpcStreamTransport, SameHostTransport
from kvstore.transfer.te_transport import TransferEngineTransport

__all__ = ["TRANSPORTS", "BlockTransport", "GrpcStreamTransport", "Pick", "SameHostTransport",
           "TransferEngineTransport", "open_transport", "pick_transport"]
