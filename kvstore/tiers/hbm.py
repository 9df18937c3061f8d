"""The HBM tier: a pre-allocated slab of device memory (a uint8 torch tensor) with a page
allocator. ``device="auto"`` takes CUDA when present and the CPU otherwise; ``device``
reports which one it runs on, so a CPU-only machine runs the same code and says so."""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.tiers import registry
from kvstore.tiers.base import register_tier
from kvstore.tiers.buffers import as_u8
from kvstore.tiers.slab import PAGE_BYTES, SlabTier


def resolve_device(device: str, what: str = "hbm device") -> str:
    """``auto`` → ``cuda`` when torch sees a GPU, else ``cpu``; other names pass through.
    Raises InvalidArgument (naming ``what``) for a name torch does not know or a CUDA device
    on a machine without one. The HBM tier and the engines' model share it."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(device)
    except RuntimeError:
        raise InvalidArgument(f"{what} {device!r}: not a torch device; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidArgument(f"{what} {device!r}: torch sees no CUDA device here; use 'cpu' or 'auto'")
    return device


@register_tier(registry.HBM.name)
class HbmTier(SlabTier):
    """Blocks in one ``torch.uint8`` tensor of ``capacity_bytes`` (rounded up to pages) on
    ``device``. Reads hand the sink a read-only numpy view when the slab is in host memory
    and a uint8 tensor slice when it is on a device."""

    def __init__(self, capacity_bytes: int, device: str = "auto") -> None:
        import torch

        super().__init__(capacity_bytes)
        self._torch = torch
        self._slab = torch.zeros(self.pages * PAGE_BYTES, dtype=torch.uint8, device=resolve_device(device))
        self.device = str(self._slab.device)
        self._host: np.ndarray | None = None
        if self._slab.device.type == "cpu":
            self._host = self._slab.numpy()
            self._ro = self._host.view()
            self._ro.flags.writeable = False

    def _copy_in(self, offset: int, data: Any) -> None:
        src = as_u8(data)
        n = src.shape[0]
        if self._host is not None and isinstance(src, np.ndarray):
            np.copyto(self._host[offset:offset + n], src)
            return
        if isinstance(src, np.ndarray):
            with warnings.catch_warnings():  # the source is only read
                warnings.simplefilter("ignore", UserWarning)
                src = self._torch.from_numpy(src)
        self._slab[offset:offset + n].copy_(src)

    def _view(self, offset: int, size: int) -> Any:
        if self._host is not None:
            return self._ro[offset:offset + size]
        return self._slab[offset:offset + size]

    def close(self) -> None:
        self._slab = self._host = self._ro = None  # type: ignore[assignment]
