"""The model an engine runs: a tiny Llama-architecture causal LM built from a config with
seeded random weights (no download), or a local Hugging Face checkpoint (``model_dir``)."""
from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engines.checkpoint_identity import model_identity
from kvstore.index.keys import KVLayout

log = logging.getLogger(__name__)
TINY_MODEL_ID = "kvstore/tiny-llama"
DEFAULT_MAX_MODEL_LEN = 4096   # tokens, prompt + generation
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """``model_dir``: a local checkpoint, or None for the tiny seeded model. ``device``:
    ``"auto"`` (CUDA when present, else CPU), ``"cpu"`` or ``"cuda[:i]"``. ``block_size`` in
    tokens. ``max_model_len``: the longest prompt + generation served (tokens; the tiny
    model's rotary positions take any length, a checkpoint's ``max_position_embeddings``
    caps it)."""

    model_dir: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int = DEFAULT_MAX_MODEL_LEN

    def __post_init__(self) -> None:
        if not (isinstance(self.max_model_len, int) and self.max_model_len >= 1):
            raise ValueError(f"max_model_len must be an integer >= 1 (tokens), got {self.max_model_len!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not supported; valid: {sorted(DTYPES)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0 tokens, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: torch.nn.Module
    model_id: str
    revision: str
    layout: KVLayout
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    eos_token_id: int
    max_model_len: int
    keeps_last_logits: bool = False   # the model's forward takes ``logits_to_keep`` (:func:`run`)


def run(lm: LoadedModel, ids: Sequence[int], cache: object) -> torch.Tensor:
    """Run one sequence's ``ids`` (token ids, >= 1 of them) through ``lm`` over ``cache`` (a
    transformers ``DynamicCache``, extended in place by ``len(ids)`` tokens) and return the
    logits of the last position: shape ``(vocab_size,)``, on ``lm.device``. Only that
    position's logits are computed where the model's forward takes ``logits_to_keep``
    (transformers' causal LMs do): every caller needs the last position's alone, and a
    prompt's whole logits are ``len(ids) × vocab_size`` numbers — 2.5 GB in float32 for
    4096 tokens of a 152k-token vocabulary. Call under ``torch.inference_mode()``."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=lm.device)
    keep = {"logits_to_keep": 1} if lm.keeps_last_logits else {}
    return lm.model(input_ids=x, past_key_values=cache, use_cache=True, **keep).logits[0, -1]


def tiny_llama_config(max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> LlamaConfig:
    """2 layers, hidden 64, 4 attention heads, 2 KV heads (head dim 16), vocab 512."""
    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=max_model_len, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)


def resolve_device(device: str) -> torch.device:
    """The engine's ``--device`` (``auto``: CUDA when torch sees a GPU, else the CPU). Raises
    InvalidArgument for a name torch does not know or CUDA on a machine without it."""
    from kvstore.tiers.hbm import resolve_device as resolve
    return torch.device(resolve(device, "--device"))


def _use_prefix_attention(model: torch.nn.Module) -> None:
    """Run the model with engines/attention.py's attention (fast causal kernel on a prefill
    over a cached prefix); a model whose code cannot switch keeps its own, logged."""
    from engines.attention import NAME
    try:
        model.set_attn_implementation(NAME)  # type: ignore[operator]
    except (ValueError, AttributeError) as exc:
        log.warning("model keeps its own attention (%s): a prefill over a cached prefix may be slower", exc)


def check_checkpoint_dir(model_dir: str) -> None:
    """Raise ValueError unless ``model_dir`` is a local checkpoint (a directory holding a
    ``config.json``): nothing is downloaded, and a wrong path is named at once (rather than
    taken for a Hugging Face Hub id and retried against the network for 30 s)."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        what = "no such directory" if not os.path.isdir(model_dir) else "no config.json in it"
        raise ValueError(f"model {model_dir!r} is not a local checkpoint ({what}); give the directory of a "
                         "Hugging Face checkpoint on this machine (nothing is downloaded)")


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Build or load the model, in eval mode on the chosen device; logs which device."""
    device = resolve_device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    if cfg.model_dir:
        check_checkpoint_dir(cfg.model_dir)
        model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=dtype, local_files_only=True)
        # its name, and a digest of its config.json and weights (two fine-tunes saved under
        # one directory name with one config.json must not share keys)
        model_id, revision = model_identity(cfg.model_dir, None)
        max_len = min(cfg.max_model_len, getattr(model.config, "max_position_embeddings", cfg.max_model_len))
    else:
        torch.manual_seed(cfg.seed)
        # transformers wraps PreTrainedModel.to, and its wrapper's type takes the model first
        model = LlamaForCausalLM(tiny_llama_config(cfg.max_model_len)).to(dtype)  # type: ignore[arg-type]
        model_id, revision, max_len = TINY_MODEL_ID, f"seed-{cfg.seed}", cfg.max_model_len
    model = model.to(device).eval()  # type: ignore[arg-type]
    _use_prefix_attention(model)
    c = model.config
    num_heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_heads
    layout = KVLayout(dtype=cfg.dtype, num_layers=c.num_hidden_layers,
                      num_kv_heads=getattr(c, "num_key_value_heads", None) or num_heads,
                      head_dim=head_dim, block_size=cfg.block_size)
    eos = c.eos_token_id if isinstance(c.eos_token_id, int) else (c.eos_token_id or [0])[0]
    log.info("model %s (%s) on %s, dtype %s", model_id, revision, device, cfg.dtype)
    keeps_last = "logits_to_keep" in inspect.signature(model.forward).parameters
    return LoadedModel(model, model_id, revision, layout, device, dtype, c.vocab_size, eos, max_len, keeps_last)
