"""Choosing each generated token from the model's logits: greedy, or sampled with a
temperature and nucleus (top-p) filter from a per-request ``torch.Generator`` reseeded for
each token index, so that a request's tokens depend only on its prompt, its
:class:`~engines.types.SamplingParams` and its seed — the same on a prefill engine (token 0)
and on any decode engine (tokens 1..), which is what lets a decode resume elsewhere."""
from __future__ import annotations

import hashlib

import torch

from engines.types import SamplingParams, TokenLogprobs

MAX_TOP_LOGPROBS = 20     # OpenAI's bound on top_logprobs
# Draws are computed in float32: a temperature below float32's smallest normal number
# (about 1.2e-38; 1e-300 is 0 in float32) would divide the max logit's 0 by 0 (NaN), which
# torch.multinomial refuses. Sampling that cold is the argmax, so it is drawn as greedy.
MIN_SAMPLED_TEMPERATURE = float(torch.finfo(torch.float32).tiny)


def step_seed(seed: int, index: int) -> int:
    """The generator seed of token ``index`` (0 = the token prefill emits) of a request with
    ``seed``: 63 bits of BLAKE2b over both, so nearby seeds give unrelated draws."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Sampler:
    """One request's token chooser. :meth:`choose` takes the logits of the next token
    (shape ``(vocab,)``, any device and float dtype) and the token's index in the generated
    sequence; it returns the token id. Greedy requests take the argmax (the first on ties,
    as ``torch.argmax``); others are drawn on the CPU in float32, so the draw does not
    depend on the device. A temperature under :data:`MIN_SAMPLED_TEMPERATURE` (its limit
    is the argmax) is greedy too."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        cold = params.greedy or params.temperature < MIN_SAMPLED_TEMPERATURE
        self._gen = None if cold else torch.Generator(device="cpu")

    def choose(self, logits: torch.Tensor, index: int) -> int:
        if self._gen is None:
            return int(logits.argmax())
        p = self.params
        x = logits.detach().float().cpu()
        probs = torch.softmax((x - x.max()) / p.temperature, dim=-1)   # max first: no inf/inf
        if p.top_p < 1.0:
            probs = nucleus(probs, p.top_p)
        self._gen.manual_seed(step_seed(p.seed, index))
        return int(torch.multinomial(probs, 1, generator=self._gen))


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log probability under ``logits`` (shape ``(vocab,)``: log-softmax in
    float32 on the CPU) and the ``top`` most likely tokens' (ties: the lower id first)."""
    lp = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]))
        alternatives = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(float(lp[token]), alternatives)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` (shape ``(vocab,)``, summing to 1) restricted to the smallest set of most
    likely tokens whose total reaches ``top_p`` (the most likely token always stays), not
    renormalized (``torch.multinomial`` takes weights)."""
    sorted_p, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p      # mass of the tokens ranked above
    keep = before < top_p
    keep[0] = True
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out
