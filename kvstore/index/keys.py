"""The key spec: the one function that turns a token sequence into a chain of block keys.

Spec (version 1), after DESIGN.md §3::

    root   = H("kvstore.root.v1" ‖ encode_extras(extras))
    key_i  = H("kvstore.block.v1" ‖ key_{i-1} ‖ u32le(n) ‖ u32le(token_0) … u32le(token_{n-1}))
    key_-1 = root

``H`` is SHA-256 by default (32-byte keys) or XXH3-128 as an explicit opt-in for trusted
single-tenant deployments (16-byte keys). The hash function's name and the spec version are
fields of the extras, so keys made under different configurations never match. The extras
encoding is tagged and length-prefixed (see :func:`encode_extras`), so two different field
tuples never encode to the same bytes. Nothing here depends on Python's ``hash()``: keys are
equal across processes, hosts and restarts whatever ``PYTHONHASHSEED`` is.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, NewType, Sequence

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument

BlockKey = NewType("BlockKey", bytes)
SPEC_VERSION = 1
_ROOT_TAG = b"kvstore.root.v1"
_BLOCK_TAG = b"kvstore.block.v1"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256, "xxh3_128": _xxh3_128}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What the bytes of a KV block depend on besides the tokens.

    ``dtype`` is a torch dtype name (``"float32"``); ``block_size`` is in tokens.
    """

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def to_json(self) -> str:
        return json.dumps({"dtype": self.dtype, "num_layers": self.num_layers,
                           "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                           "block_size": self.block_size}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "KVLayout":
        return cls(**json.loads(text))


@dataclass(frozen=True, slots=True)
class KeyExtras:
    """Everything besides the tokens that changes the KV of a block (DESIGN.md §3).

    ``namespace`` is the tenant; servers set it from the caller's authenticated identity,
    never from a request body. ``mm_hashes`` are content hashes of multimodal inputs.
    ``salt`` is a free cache salt; ``other`` carries any further values (None, str, bytes,
    int, float, bool and nested tuples/lists of them).
    """

    model: str = ""
    revision: str = ""
    layout: KVLayout | None = None
    adapter: str | None = None
    adapter_version: str | None = None
    salt: str | None = None
    mm_hashes: tuple[str | bytes, ...] = ()
    namespace: str = "default"
    hash_name: str = "sha256"
    other: tuple[Any, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.hash_name not in HASH_FUNCTIONS:
            raise InvalidArgument(f"unknown key hash {self.hash_name!r}; valid: {sorted(HASH_FUNCTIONS)}")


# Value type tags of the extras encoding.
_T_NONE, _T_STR, _T_BYTES, _T_INT, _T_BOOL, _T_FLOAT, _T_SEQ = b"\x00", b"\x01", b"\x02", b"\x03", b"\x04", b"\x05", b"\x06"


def _encode_value(value: Any, out: bytearray) -> None:
    if value is None:
        out += _T_NONE
    elif isinstance(value, bool):
        out += _T_BOOL + (b"\x01" if value else b"\x00")
    elif isinstance(value, int):
        raw = str(value).encode()
        out += _T_INT + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, float):
        out += _T_FLOAT + struct.pack("<d", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += _T_STR + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        out += _T_BYTES + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, (tuple, list)):
        out += _T_SEQ + struct.pack("<I", len(value))
        for item in value:
            _encode_value(item, out)
    else:
        raise InvalidArgument(f"key extras cannot hold a {type(value).__name__}; "
                              "use None, str, bytes, int, float, bool or tuples of them")


def encode_extras(extras: KeyExtras) -> bytes:
    """Encode ``extras`` as bytes: ``b"KVX"`` + u8 spec version, then for each field in a
    fixed order a u8 field tag followed by the typed value.

    A typed value is a one-byte type tag followed by: nothing (None); one byte (bool);
    u32le length + ASCII decimal (int); f64le (float); u32le length + UTF-8 (str); u32le
    length + raw bytes (bytes); u32le count + that many typed values (tuple/list). Every
    variable part is length-prefixed, so ("ab", "c") and ("a", "bc") differ, and every field
    has its own tag, so adapter "X" and salt "X" differ.
    """
    layout = extras.layout
    fields: tuple[tuple[int, Any], ...] = (
        (1, extras.hash_name),
        (2, SPEC_VERSION),
        (3, extras.model),
        (4, extras.revision),
        (5, None if layout is None else (layout.dtype, layout.num_layers, layout.num_kv_heads,
                                         layout.head_dim, layout.block_size)),
        (6, extras.adapter),
        (7, extras.adapter_version),
        (8, extras.salt),
        (9, tuple(extras.mm_hashes)),
        (10, extras.namespace),
        (11, tuple(extras.other)),
    )
    out = bytearray(b"KVX" + bytes([SPEC_VERSION]))
    for tag, value in fields:
        out.append(tag)
        _encode_value(value, out)
    return bytes(out)


def _tokens_bytes(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= 2**32):
        raise InvalidArgument("tokens must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False)


def block_keys(tokens: Sequence[int] | np.ndarray, block_size: int, extras: KeyExtras) -> list[BlockKey]:
    """The chain of block keys for the full blocks of ``tokens``.

    Args:
        tokens: token ids, shape ``[n]``, integers in ``[0, 2**32)``.
        block_size: tokens per block (> 0). A partial tail block gets no key.
        extras: model, layout, adapter, namespace, … (see :class:`KeyExtras`).

    Returns:
        ``n // block_size`` keys, head first; key ``i`` depends on every token up to the end
        of block ``i`` and on the extras. 32 bytes each with SHA-256, 16 with XXH3-128.

    Raises:
        InvalidArgument: bad block size or tokens.
    """
    if block_size <= 0:
        raise InvalidArgument(f"block_size must be > 0, got {block_size}")
    arr = _tokens_bytes(tokens)
    h = HASH_FUNCTIONS[extras.hash_name]
    parent = h(_ROOT_TAG + encode_extras(extras))
    header = _BLOCK_TAG
    count = struct.pack("<I", block_size)
    raw = arr.tobytes()
    step = block_size * 4
    keys: list[BlockKey] = []
    for i in range(arr.size // block_size):
        parent = h(header + parent + count + raw[i * step:(i + 1) * step])
        keys.append(BlockKey(parent))
    return keys


def usable_prefix_tokens(hit_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens whose cached KV an engine may reuse: never the last prompt token, since
    the engine must compute at least one token to get logits (DESIGN.md §3)."""
    return max(0, min(hit_blocks * block_size, prompt_tokens - 1))
