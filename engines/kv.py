"""KV block bytes: how a slice of a ``DynamicCache`` becomes a stored block and back.

A block of ``T`` tokens is one C-contiguous tensor of shape
``[num_layers, 2, num_kv_heads, T, head_dim]`` (index 0 = keys, 1 = values) in the model's
dtype, as raw bytes: ``num_layers * 2 * num_kv_heads * T * head_dim * itemsize`` bytes.
Restoring blocks gives bit-identical tensors, hence bit-identical logits (docs/architecture.md §4).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import DynamicCache

from kvstore.errors import InvalidArgument
from kvstore.index.keys import KVLayout, block_bytes


def slice_bytes(cache: DynamicCache, start: int, end: int) -> bytes:
    """KV of token positions ``[start, end)`` of a batch-1 cache, as block bytes."""
    # Every layer of a full-attention model's cache is a filled DynamicLayer (keys and values
    # set); transformers types the layers as a union with linear-attention ones.
    parts = [torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end]))  # type: ignore[union-attr,index]
             for layer in cache.layers]
    t = torch.stack(parts).contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes()


def to_tensor(data: bytes, layout: KVLayout, dtype: torch.dtype) -> torch.Tensor:
    """Block bytes → tensor ``[num_layers, 2, num_kv_heads, T, head_dim]``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_token = block_bytes(layout, 1, itemsize)
    if len(data) % per_token:
        raise InvalidArgument(f"KV bytes ({len(data)}) are not a whole number of tokens "
                              f"({per_token} bytes each) for layout {layout}")
    tokens = len(data) // per_token
    raw = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    return raw.view(dtype).view(layout.num_layers, 2, layout.num_kv_heads, tokens, layout.head_dim)


def build_cache(blocks: Sequence[bytes], layout: KVLayout, dtype: torch.dtype,
                device: torch.device) -> DynamicCache:
    """A batch-1 ``DynamicCache`` holding the given blocks in order."""
    cache = DynamicCache()
    if blocks:
        append(cache, [to_tensor(b, layout, dtype) for b in blocks], device)
    return cache


def append(cache: DynamicCache, tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    """Append block tensors (``[L, 2, H, T, D]`` each) to a batch-1 cache, per layer."""
    kv = torch.cat(list(tensors), dim=3).to(device)
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0].unsqueeze(0).contiguous(), kv[layer, 1].unsqueeze(0).contiguous(), layer)
