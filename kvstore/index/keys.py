"""The key spec: the one function that turns a token sequence into a chain of block keys.

Spec (version 1), docs/key-spec.md §1::

    root   = H("kvstore.root.v1" ‖ encode_extras(extras))
    key_i  = H("kvstore.block.v1" ‖ key_{i-1} ‖ u32le(n) ‖ u32le(token_0) … u32le(token_{n-1}))
    key_-1 = root

``H`` is SHA-256 by default (32-byte keys) or XXH3-128 as an explicit opt-in for trusted
single-tenant deployments (16-byte keys). The hash function's name and the spec version are
fields of the extras, so keys made under different configurations never match. The extras
encoding is tagged and length-prefixed (see :func:`encode_extras`), so two different field
tuples never encode to the same bytes. Nothing here depends on Python's ``hash()``: keys are
equal across processes, hosts and restarts whatever ``PYTHONHASHSEED`` is. docs/key-spec.md
documents the same bytes for other implementations.
"""
from __future__ import annotations

import array
import hashlib
import json
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument

SPEC_VERSION = 1
_ROOT_TAG = b"kvstore.root.v1"
_BLOCK_TAG = b"kvstore.block.v1"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS: dict[str, Callable[[bytes], bytes]] = {"sha256": _sha256, "xxh3_128": _xxh3_128}


# The chain loops: the same bytes as the spec, each in the fastest form measured for its hash
# (benchmarks/bench_index.py). SHA-256 copies a state that already absorbed the block tag and
# feeds the block from a memoryview (no copy of it); XXH3 is fast enough that one call on the
# joined bytes beats several updates.
_SHA256_BLOCK_TAG = hashlib.sha256(_BLOCK_TAG)


def _chain_sha256(parent: bytes, count: bytes, raw: memoryview, step: int) -> list[bytes]:
    fresh = _SHA256_BLOCK_TAG.copy
    keys: list[bytes] = []
    append = keys.append
    for off in range(0, len(raw) - step + 1, step):
        h = fresh()
        h.update(parent + count)
        h.update(raw[off:off + step])
        parent = h.digest()
        append(parent)
    return keys


def _chain_xxh3_128(parent: bytes, count: bytes, raw: memoryview, step: int) -> list[bytes]:
    digest, join, tag = xxhash.xxh3_128_digest, b"".join, _BLOCK_TAG
    keys: list[bytes] = []
    append = keys.append
    for off in range(0, len(raw) - step + 1, step):
        parent = digest(join((tag, parent, count, raw[off:off + step])))
        append(parent)
    return keys


# bytes of the keys each hash makes ({"sha256": 32, "xxh3_128": 16}); no other length is a block key
KEY_BYTES: dict[str, int] = {name: len(fn(b"")) for name, fn in HASH_FUNCTIONS.items()}
VALID_KEY_BYTES = frozenset(KEY_BYTES.values())
_CHAINS: dict[str, Callable[[bytes, bytes, memoryview, int], list[bytes]]] = {
    "sha256": _chain_sha256, "xxh3_128": _chain_xxh3_128}


def _as_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgument(f"KV layout {name} must be an int >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What the bytes of a KV block depend on besides the tokens.

    ``dtype`` is a torch dtype name (``"float32"``); ``block_size`` is in tokens. Raises
    InvalidArgument for a non-string dtype or a count that is not a positive int.
    """

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str) or not self.dtype:
            raise InvalidArgument(f"KV layout dtype must be a non-empty str, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            object.__setattr__(self, name, _as_count(name, getattr(self, name)))

    def to_json(self) -> str:
        return json.dumps({"dtype": self.dtype, "num_layers": self.num_layers,
                           "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                           "block_size": self.block_size}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVLayout:
        """The layout a JSON object gives (an engine's Info ``layout_json``). Raises
        InvalidArgument naming what is wrong: not JSON, not an object, a field missing or
        unknown, or a value :class:`KVLayout` refuses."""
        fields = ("dtype", "num_layers", "num_kv_heads", "head_dim", "block_size")
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise InvalidArgument(f"a KV layout is a JSON object, got text that is not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise InvalidArgument(f"a KV layout is a JSON object with {', '.join(fields)}; got {type(obj).__name__}")
        missing = [f for f in fields if f not in obj]
        unknown = sorted(set(obj) - set(fields))
        if missing or unknown:
            raise InvalidArgument(f"a KV layout has exactly the fields {', '.join(fields)}; "
                                  + "; ".join(p for p in (f"missing {', '.join(missing)}" if missing else "",
                                                          f"unknown {', '.join(unknown)}" if unknown else "") if p))
        return cls(**obj)


def block_bytes(layout: KVLayout, tokens: int, itemsize: int) -> int:
    """Bytes of a block of ``tokens`` tokens of ``layout`` at ``itemsize`` bytes an element:
    every layer's K and V."""
    return layout.num_layers * 2 * layout.num_kv_heads * tokens * layout.head_dim * itemsize


@dataclass(frozen=True, slots=True)
class KeyExtras:
    """Everything besides the tokens that changes the KV of a block (docs/key-spec.md §2).

    ``namespace`` is the tenant; servers set it from the caller's authenticated identity,
    never from a request body. ``mm_hashes`` are content hashes of multimodal inputs.
    ``salt`` is a free cache salt; ``other`` carries any further values (None, str, bytes,
    int, float, bool and nested tuples/lists of them).

    Invariant: the string fields hold ``str`` (the optional ones ``str`` or None) and
    ``mm_hashes`` holds ``str``/``bytes``, so equal extras always encode to equal bytes.
    Raises InvalidArgument otherwise, or for an unknown ``hash_name``.
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
        for name in ("model", "revision", "namespace"):
            if not isinstance(getattr(self, name), str):
                raise InvalidArgument(f"key extras {name} must be a str, got {getattr(self, name)!r}")
        for name in ("adapter", "adapter_version", "salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(f"key extras {name} must be a str or None, got {value!r}")
        if self.layout is not None and not isinstance(self.layout, KVLayout):
            raise InvalidArgument(f"key extras layout must be a KVLayout or None, got {self.layout!r}")
        if not isinstance(self.mm_hashes, tuple):
            object.__setattr__(self, "mm_hashes", tuple(self.mm_hashes))
        if not all(isinstance(h, (str, bytes)) for h in self.mm_hashes):
            raise InvalidArgument("key extras mm_hashes must hold str or bytes content hashes")
        if not isinstance(self.other, tuple):
            object.__setattr__(self, "other", tuple(self.other))


# Value type tags of the extras encoding.
_T_NONE, _T_STR, _T_BYTES, _T_INT = b"\x00", b"\x01", b"\x02", b"\x03"
_T_BOOL, _T_FLOAT, _T_SEQ = b"\x04", b"\x05", b"\x06"
_U32 = struct.Struct("<I").pack
_F64 = struct.Struct("<d").pack


def _encode_value(value: Any, out: bytearray) -> None:
    if value is None:
        out += _T_NONE
    elif isinstance(value, bool):
        out += _T_BOOL + (b"\x01" if value else b"\x00")
    elif isinstance(value, int):
        raw = str(int(value)).encode()
        out += _T_INT + _U32(len(raw)) + raw
    elif isinstance(value, float):
        out += _T_FLOAT + _F64(value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += _T_STR + _U32(len(raw)) + raw
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        out += _T_BYTES + _U32(len(raw)) + raw
    elif isinstance(value, (tuple, list)):
        out += _T_SEQ + _U32(len(value))
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

    Raises InvalidArgument for a value of another type in ``other``.
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
        (9, extras.mm_hashes),
        (10, extras.namespace),
        (11, extras.other),
    )
    out = bytearray(b"KVX" + bytes([SPEC_VERSION]))
    for tag, value in fields:
        out.append(tag)
        _encode_value(value, out)
    return bytes(out)


def _type_exact(value: Any) -> bool:
    """True when equality of ``value`` implies equality of its encoding (no int/float/bool,
    whose equal values 1 == 1.0 == True encode differently)."""
    if value is None or isinstance(value, (str, bytes)):
        return True
    return isinstance(value, tuple) and all(_type_exact(v) for v in value)


_ROOTS: dict[KeyExtras, bytes] = {}
_ROOTS_MAX = 1024


def _root(extras: KeyExtras) -> bytes:
    """``H(root tag ‖ encode_extras(extras))``, memoised for extras whose equality implies
    equal bytes (a cache only: the result is the same with or without it)."""
    cacheable = _type_exact(extras.other)
    if cacheable:
        root = _ROOTS.get(extras)
        if root is not None:
            return root
    root = HASH_FUNCTIONS[extras.hash_name](_ROOT_TAG + encode_extras(extras))
    if cacheable:
        if len(_ROOTS) >= _ROOTS_MAX:
            _ROOTS.clear()
        _ROOTS[extras] = root
    return root


# array("I") converts a list at C speed and range-checks it; usable where it is 4-byte u32le.
_ARRAY_U32LE = sys.byteorder == "little" and array.array("I").itemsize == 4


def _tokens_u32le(tokens: Sequence[int] | np.ndarray) -> memoryview:
    """The tokens as one contiguous buffer of u32le. Raises InvalidArgument for anything but
    a flat sequence of integers in ``[0, 2**32)``."""
    if not isinstance(tokens, np.ndarray):
        if _ARRAY_U32LE:
            try:
                return memoryview(array.array("I", tokens)).cast("B")
            except OverflowError:
                raise InvalidArgument("tokens must be integers in [0, 2**32)") from None
            except TypeError:
                pass  # not plain integers: numpy decides below (and names the problem)
        tokens = np.asarray(tokens)
    arr = tokens
    if arr.ndim != 1:
        raise InvalidArgument(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype != np.dtype("<u4"):
        if arr.dtype.kind not in "iu":
            raise InvalidArgument(f"tokens must be integers, got dtype {arr.dtype}")
        if int(arr.min()) < 0 or int(arr.max()) >= 2**32:
            raise InvalidArgument("tokens must be integers in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4").data.cast("B")


def block_keys(tokens: Sequence[int] | np.ndarray, block_size: int, extras: KeyExtras,
               parent: bytes | None = None) -> list[bytes]:
    """The chain of block keys for the full blocks of ``tokens``.

    Args:
        tokens: token ids, shape ``[n]``, integers in ``[0, 2**32)`` (a list, or a numpy
            array of any integer dtype; ``uint32`` is the fastest).
        block_size: tokens per block (> 0). A partial tail block gets no key.
        extras: model, layout, adapter, namespace, … (see :class:`KeyExtras`).
        parent: the key of the block before ``tokens`` (same ``block_size`` and extras):
            the chain goes on from it, so ``block_keys(b, bs, x, parent=block_keys(a, bs,
            x)[-1])`` equals the tail of ``block_keys(a + b, bs, x)`` when ``a`` is whole
            blocks. None: ``tokens`` start the prompt.

    Returns:
        ``n // block_size`` keys, head first; key ``i`` depends on every token up to the end
        of block ``i`` and on the extras. 32 bytes each with SHA-256, 16 with XXH3-128.

    Raises:
        InvalidArgument: bad block size, tokens, extras or parent.
    """
    if type(block_size) is not int or block_size <= 0:
        raise InvalidArgument(f"block_size must be an int > 0, got {block_size!r}")
    if parent is not None and (type(parent) is not bytes or len(parent) != KEY_BYTES[extras.hash_name]):
        raise InvalidArgument(f"parent must be a {KEY_BYTES[extras.hash_name]}-byte {extras.hash_name} block key, "
                              f"got {parent!r:.80}")
    raw = _tokens_u32le(tokens)
    return _CHAINS[extras.hash_name](_root(extras) if parent is None else parent, _U32(block_size), raw,
                                     block_size * 4)


def usable_prefix_tokens(hit_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens whose cached KV an engine may reuse: never the last prompt token, since
    the engine must compute at least one token to get logits (docs/key-spec.md §1, "What an
    engine may reuse")."""
    return max(0, min(hit_blocks * block_size, prompt_tokens - 1))
