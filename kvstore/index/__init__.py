"""Block keys (the key spec: docs/key-spec.md) and the prefix index."""
from kvstore.index.keys import (
    HASH_FUNCTIONS,
    KeyExtras,
    KVLayout,
    block_keys,
    encode_extras,
    usable_prefix_tokens,
)
from kvstore.index.prefix_index import BlockEntry, PrefixIndex, PrefixMatch

__all__ = ["HASH_FUNCTIONS", "KeyExtras", "KVLayout", "block_keys", "encode_extras",
           "usable_prefix_tokens", "BlockEntry", "PrefixIndex", "PrefixMatch"]
