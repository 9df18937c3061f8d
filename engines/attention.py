"""The engines' attention: PyTorch's scaled-dot-product attention, with causality applied here
so that a prefill over a cached prefix keeps the fast causal kernel.

A prefill that reuses ``past`` cached tokens computes ``q`` new queries against ``past + q``
keys. Causal masking is then "lower right" (new token ``i`` sees keys ``0 .. past + i``),
which ``is_causal`` cannot express (its alignment is upper left) and transformers' default
path passes as an explicit mask: on the CPU that falls to the kernel that materialises every
score, 3-4 times slower per score than the causal one (measured here: 7508 new tokens over
a 32-token past, 3.3 s masked against 1.0 s causal for the square of 7540 — a whole prefill
of that prompt 2-3 times slower with the 32-token hit than without it) and
``q · (past + q)`` floats of memory per head. So with a short past the queries are padded in
front with ``past`` zero rows and run square and causal — row ``past + i`` of a square
causal attention sees exactly keys ``0 .. past + i`` — and the padding rows are dropped;
with a long past (few new tokens, where the masked kernel is cheap) the lower-right mask is
passed. Either way the result is the attention transformers' default computes, up to float
rounding.

Every engine call is one sequence (batch 1, no padding: engines/prefill.py, engines/decode.py),
so no padding mask is ever needed: the mask function registered with this attention makes
none, and this module alone decides causality. Registered with transformers' attention
interfaces (https://huggingface.co/docs/transformers/attention_interface) as :data:`NAME`.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

NAME = "kvstore_sdpa"
# Pad the queries (square causal kernel) while past <= PAD_RATIO * new tokens: the square
# costs (past + q)^2 / 2 scores at the causal kernel's speed, the mask q * (past + q) at about
# half of it. Measured here (2 threads, 4 heads of 16): masked / padded time 2.0 at
# past = q / 4, 1.7 at past = 2 q, 0.86 at past = 4 q, 0.48 at past = 6 q.
PAD_RATIO = 3


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """One unpadded sequence per call: no mask (causality is :func:`prefix_attention`'s)."""


def prefix_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention of ``query`` (batch, heads, q, head dim) over ``key``/``value``
    (batch, kv heads, past + q, head dim), the ``q`` queries being the last positions.
    Returns (batch, q, heads, head dim), as transformers' attention functions do."""
    kwargs.pop("is_causal", None)
    q_len, kv_len = query.shape[2], key.shape[2]
    past = kv_len - q_len
    if q_len == 1 or past == 0:   # a decode step sees every key; a prefill from scratch is square
        return sdpa_attention_forward(module, query, key, value, None, dropout, scaling, is_causal=True, **kwargs)
    if past <= PAD_RATIO * q_len:
        pad = query.new_zeros(query.shape[0], query.shape[1], past, query.shape[3])
        out, _ = sdpa_attention_forward(module, torch.cat([pad, query], dim=2), key, value, None, dropout, scaling,
                                        is_causal=True, **kwargs)
        return out[:, past:], None
    rows = torch.arange(q_len, device=query.device).unsqueeze(1) + past
    mask = torch.arange(kv_len, device=query.device).unsqueeze(0) <= rows
    return sdpa_attention_forward(module, query, key, value, mask[None, None], dropout, scaling,
                                  is_causal=False, **kwargs)


AttentionInterface.register(NAME, prefix_attention)
AttentionMaskInterface.register(NAME, _no_mask)
