"""Byte views over what callers hand the pool (bytes-like objects, numpy arrays, torch tensors)
and the copies out of a tier's view into a caller's buffer. No per-byte Python loops: every
copy is one ``np.copyto`` or one ``Tensor.copy_``. torch is never imported here; a tensor is
recognised only when the caller has imported torch already."""
from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument

_U8 = np.dtype(np.uint8)


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(obj: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(obj, torch.Tensor)


class Segments:
    """One block held in several buffers, back to back: its bytes are the concatenation of
    ``parts`` (contiguous numpy arrays or tensors of any dtype) in order. A paged KV block is
    one: vLLM keeps each layer's KV in its own tensor, so a block of all layers is one slice
    per layer (engines/vllm/connector.py). The pool copies a Segments block into one slot
    (a gather) and out of it into its parts (a scatter), with no staging buffer.

    ``nbytes``: the block's size in bytes. Raises InvalidArgument for a non-contiguous part.
    """

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Any) -> None:
        self.parts = [as_u8(p) for p in parts]
        self.nbytes = sum(int(p.shape[0]) for p in self.parts)

    def scatter(self, view: Any) -> int:
        """Copy the first :attr:`nbytes` of ``view`` (a flat uint8 array or tensor) into the
        parts; returns the bytes copied. Raises InvalidArgument when ``view`` is shorter."""
        n = view.shape[0] if hasattr(view, "shape") else nbytes(view)
        if n < self.nbytes:
            raise InvalidArgument(f"a block of {n} bytes cannot fill segments of {self.nbytes}")
        at = 0
        for part in self.parts:
            size = int(part.shape[0])
            copy_into(part, view[at:at + size])
            at += size
        return at

    def gather(self, out: Any) -> int:
        """Copy the parts, in order, to the start of ``out`` (a flat uint8 array or tensor of
        at least :attr:`nbytes`); returns the bytes copied."""
        if out.shape[0] < self.nbytes:
            raise InvalidArgument(f"output buffer holds {out.shape[0]} bytes; the block has {self.nbytes}")
        at = 0
        for part in self.parts:
            size = int(part.shape[0])
            copy_into(out[at:at + size], part)
            at += size
        return at

    def checksum(self) -> int:
        """xxh3_64 of the concatenated parts (kvstore.integrity), read from the parts."""
        from kvstore.integrity import new_hasher
        hasher = new_hasher()
        for part in self.parts:
            hasher.update((part if isinstance(part, np.ndarray) else part.cpu().numpy()).data)
        return hasher.intdigest()

    def tobytes(self) -> bytes:
        return b"".join(to_bytes(p) for p in self.parts)


def nbytes(data: Any) -> int:
    """Size of ``data`` in bytes (bytes-like, array, tensor or :class:`Segments`)."""
    if isinstance(data, Segments):
        return data.nbytes
    if isinstance(data, (bytes, bytearray)):
        return len(data)
    if isinstance(data, memoryview):
        return data.nbytes
    if is_tensor(data):
        return data.numel() * data.element_size()
    return int(np.asarray(data).nbytes)


def as_u8(data: Any) -> np.ndarray | Any:
    """A flat uint8 view of ``data`` without a copy: a numpy array for host memory, a uint8
    tensor for a tensor on a device. Raises InvalidArgument for non-contiguous data."""
    if type(data) is np.ndarray and data.dtype == _U8 and data.ndim == 1 and data.flags.c_contiguous:
        return data  # already what is wanted (the pool's own views): the hot path
    if isinstance(data, Segments):
        return data
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise InvalidArgument("block data must be a contiguous array")
        return data.reshape(-1).view(np.uint8)
    if is_tensor(data):
        if not data.is_contiguous():
            raise InvalidArgument("block data must be a contiguous tensor")
        flat = data.detach().reshape(-1).view(_torch().uint8)
        return flat.numpy() if flat.device.type == "cpu" else flat
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except (BufferError, ValueError, TypeError) as exc:  # e.g. a non-contiguous memoryview
        raise InvalidArgument(f"block data must be contiguous bytes, an array or a tensor: {exc}") from None


def host_u8(data: Any) -> np.ndarray:
    """Like :func:`as_u8`, but always host memory (a tensor on a device is copied over)."""
    view = as_u8(data)
    return view if isinstance(view, np.ndarray) else view.cpu().numpy()


def to_bytes(view: Any) -> bytes:
    """A sink: the view's bytes as a new ``bytes`` object (one copy)."""
    if isinstance(view, Segments):
        return view.tobytes()
    if isinstance(view, np.ndarray):
        return view.tobytes()
    if is_tensor(view):
        return view.cpu().numpy().tobytes()
    return bytes(view)


def copy_into(out: Any, view: Any) -> int:
    """A sink: copy ``view`` to the start of ``out`` (a contiguous numpy array or tensor of
    any dtype, at least as many bytes as ``view``). Returns the bytes copied. Raises
    InvalidArgument when ``out`` is too small or not contiguous."""
    if type(view) is np.ndarray and type(out) is np.ndarray and out.ndim == 1 and (
            out.dtype is _U8 or out.dtype == _U8):
        n, m = view.shape[0], out.shape[0]
        if m < n:
            raise InvalidArgument(f"output buffer holds {m} bytes; the block has {n}")
        np.copyto(out if m == n else out[:n], view)  # the common case, without the checks below
        return n
    if isinstance(out, Segments):
        return out.scatter(view)
    dst = as_u8(out)
    if isinstance(view, Segments):
        return view.gather(dst)
    n = view.nbytes if isinstance(view, np.ndarray) else nbytes(view)
    if dst.shape[0] < n:
        raise InvalidArgument(f"output buffer holds {dst.shape[0]} bytes; the block has {n}")
    if isinstance(dst, np.ndarray) and isinstance(view, np.ndarray):
        np.copyto(dst[:n], view)
    else:
        torch = _torch()
        with warnings.catch_warnings():  # a read-only view is only ever read here
            warnings.simplefilter("ignore", UserWarning)
            d = torch.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
            v = torch.from_numpy(view) if isinstance(view, np.ndarray) else view
        d[:n].copy_(v)
    return n
