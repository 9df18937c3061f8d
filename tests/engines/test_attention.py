"""engines/attention.py against transformers' own SDPA attention on the tiny model: the same
logits and greedy tokens on every path — a prefill from scratch, one over a short cached past
(padded queries), one over a long past (lower-right mask) and decode steps."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from engines.attention import NAME
from engines.model import ModelConfig, load_model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    lm = load_model(ModelConfig(device="cpu"))
    assert lm.model.config._attn_implementation == NAME
    return lm.model


def run(model: torch.nn.Module, impl: str, ids: torch.Tensor, past: int) -> tuple[torch.Tensor, list[int]]:
    """Logits of ``ids[past:]`` over a cache holding ``ids[:past]``, then 4 greedy decode steps."""
    model.set_attn_implementation(impl)
    try:
        with torch.inference_mode():
            cache = DynamicCache()
            if past:
                model(input_ids=ids[:, :past], past_key_values=cache, use_cache=True)
            logits = model(input_ids=ids[:, past:], past_key_values=cache, use_cache=True).logits
            token, tokens = logits[:, -1:].argmax(-1), []
            for _ in range(4):
                tokens.append(int(token))
                token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return logits, tokens
    finally:
        model.set_attn_implementation(NAME)


@pytest.mark.parametrize("length,past", [
    (200, 0),                     # from scratch: square and causal
    (200, 16),                    # a short past: padded queries
    (200, 150),                   # past = 3 q (PAD_RATIO): still padded
    (200, 184),                   # past = 11.5 q: the lower-right mask
    (17, 16),                     # one new token over a past (a prefill's last token)
])
def test_same_logits_and_tokens_as_transformers_sdpa(model, length, past):
    ids = torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(length + past))
    ours, our_tokens = run(model, NAME, ids, past)
    theirs, their_tokens = run(model, "sdpa", ids, past)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert our_tokens == their_tokens
    whole, _ = run(model, "sdpa", ids, 0)   # and what a prefill of the whole prompt gives
    torch.testing.assert_close(ours, whole[:, past:], atol=1e-4, rtol=1e-4)

