"""What crosses a store node's wires, in one place (one contract per wire):

- :mod:`kvstore.wire.types`: the write-and-lease contract, the domain types every wire carries;
- :mod:`kvstore.wire.proto_codec`: the gRPC API's messages (protos/kvstore.proto) ↔ those types;
- :mod:`kvstore.wire.frame_codec`: the same-host / TCP control frames ↔ those types;
- :mod:`kvstore.wire.transfer_codec`: the transfer-engine endpoint (protos/transfer.proto) ↔ those types;
- :mod:`kvstore.wire.errors`: kvstore's errors ↔ gRPC status codes and frame status bytes;
- :mod:`kvstore.wire.channel`: chunk size and gRPC options both ends use.

tests/kvstore/wire/test_wire_conformance.py checks each option and each error over every wire.

Adding an option to a put or a lease: a field of the request type in ``types.py``; the
proto field (protos/kvstore.proto, then regenerate) and its line in ``proto_codec.py``; its
place in the frame (``frame_codec.py``: the module docstring, the encoder and the decoder);
what takes it (kvstore/dataplane/host.py, the pool); a case in the conformance test. A new
error class: its row in ``errors.py`` (a gRPC code, a frame status byte never used before).
"""
