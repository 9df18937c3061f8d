"""What crosses a store node's wires, in one place (issue 15, "one contract per wire"):

- :mod:`kvstore.wire.types`: the write-and-lease contract, the domain types every wire carries;
- :mod:`kvstore.wire.proto_codec`: the gRPC API's messages (protos/kvstore.proto) ↔ those types;
- :mod:`kvstore.wire.frame_codec`: the same-host / TCP control frames ↔ those types;
- :mod:`kvstore.wire.transfer_codec`: the transfer-engine endpoint (protos/transfer.proto) ↔ those types;
- :mod:`kvstore.wire.errors`: kvstore's errors ↔ gRPC status codes and frame status bytes;
- :mod:`kvstore.wire.channel`: chunk size and gRPC options both ends use.

tests/test_wire_conformance.py checks each option and each error over every wire.
"""
