"""Domain types the engines exchange with the scheduler (protobuf stops at the edge)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.index.keys import KeyExtras, KVLayout

ROLES = ("prefill", "decode")   # what an engine does: compute prompts and publish blocks, or generate


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: str
    role: str                 # one of ROLES
    model_id: str
    revision: str
    layout: KVLayout
    block_size: int           # tokens per block
    vocab_size: int
    eos_token_id: int
    device: str               # "cpu", "cuda:0", ...
    max_model_len: int        # tokens
    profile: tuple[ProfilePoint, ...] = ()   # measured at start (engines/profiling.py); () for none


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    """One measurement of an engine's profiling pass at start (engines/profiling.py). Prefill:
    ``batch`` 1, ``tokens`` the prompt's tokens (all computed, none cached), ``seconds`` its
    prefill. Decode: ``batch`` requests interleaved, ``tokens`` their resident KV tokens in
    all, ``seconds`` the mean seconds between one request's tokens (TBT)."""

    batch: int
    tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill hands to decode: the first token, the prompt's block keys and the KV
    (bytes, see engines/kv.py) of the last ``tail_tokens`` prompt tokens: the partial tail
    block, and before it any full blocks the pool could not take (the blocks before the
    tail are in the pool), so decode recomputes nothing prefill computed or reused.
    ``load_s``/``load_bytes``: seconds and bytes spent loading the prefix from the pool
    (0 when it came from the engine's own cache or was recomputed); ``load_tier``: the pool
    tier it came from (``"hbm"``, ``"dram"``, ``"ssd"``; ``""`` when unknown or nothing
    was loaded)."""

    request_id: str
    first_token: int
    block_keys: tuple[bytes, ...]
    cached_tokens: int        # prompt tokens whose KV was loaded, not computed
    computed_tokens: int
    tail_kv: bytes
    tail_tokens: int
    prefill_s: float          # seconds spent in the engine
    loaded_blocks: int
    stored_blocks: int
    load_s: float = 0.0
    load_bytes: int = 0
    load_tier: str = ""
    first_logprobs: TokenLogprobs | None = None   # when asked for (``top_logprobs``)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How each token is chosen from the model's logits (OpenAI's sampling fields, whose
    ranges the front door checks): ``temperature`` 0 is greedy (argmax), else the logits are
    divided by it; ``top_p`` keeps the smallest set of most likely tokens whose probability
    reaches it (nucleus sampling, Holtzman et al. 2020, https://arxiv.org/abs/1904.09751);
    ``seed`` fixes the draws: token ``index`` of a request is drawn from a generator seeded
    with (``seed``, ``index``) (engines/sampling.py), so the same seed gives the same tokens
    on any engine, and a decode resumed elsewhere repeats the tokens already sent."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0             # 0 <= seed < 2**64

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log probability under the model (natural log of the softmax of its
    logits, before temperature and top_p, as vLLM's default ``raw_logprobs``) and the ``top``
    alternatives as ``(token id, logprob)``, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class DecodeStep:
    token: int
    index: int                # 0 is the first token (from prefill)
    finished: bool
    finish_reason: str        # "" until finished, then "length" or "stop"
    logprobs: TokenLogprobs | None = None   # when asked for; None at index 0 (prefill's)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    queued: int               # requests waiting
    running: int              # requests being served
    queued_tokens: int        # tokens still to compute for queued requests


@runtime_checkable
class Engine(Protocol):
    """What every engine answers, real (:class:`engines.prefill.PrefillEngine`,
    :class:`engines.decode.DecodeEngine`) or simulated in virtual time
    (:class:`engines.cost_model.CostModelEngine`)."""

    engine_id: str
    role: str

    def load(self) -> EngineLoad: ...


@runtime_checkable
class PrefillBackend(Engine, Protocol):
    """A prefill engine: ``prefill`` loads at most ``max_load_blocks`` cached prefix blocks
    (None: as many as it finds; the scheduler's decision otherwise), computes the rest and
    returns the result (``prefill_s``: seconds the engine spent, wall or virtual)."""

    def prefill(self, request_id: str, prompt: Sequence[int], namespace: str,
                max_load_blocks: int | None = None) -> PrefillResult: ...


def extras_for(model_id: str, revision: str, layout: KVLayout, namespace: str) -> KeyExtras:
    """The key extras of a request: the one place engines and the scheduler build them, so
    both compute the same block keys for the same tokens and tenant."""
    return KeyExtras(model=model_id, revision=revision, layout=layout, namespace=namespace)
