"""Offline Hugging Face checkpoints for vLLM on the CPU: a Llama-architecture model with
seeded random weights saved with ``save_pretrained``, beside a byte-level BPE tokenizer built
with the ``tokenizers`` library (no merges: one token per UTF-8 byte), so ``vllm serve DIR``
and ``LLM(model=DIR)`` run with ``HF_HUB_OFFLINE=1`` and nothing downloaded.

Sizes (:data:`SIZES`): ``tiny`` (2 layers, hidden 128, 2 KV heads of 64 — vLLM's CPU
attention takes no head size under 32; tests) and ``bench`` (8 layers, hidden 512, 8 KV
heads of 64; recomputing a 2k-token prefix costs about a second on 2 CPU cores, loading its
64 MiB of KV a few milliseconds — what ``benchmarks/bench_vllm.py`` needs to show the
pool's worth). :func:`write_gemma2_checkpoint`: a hybrid model (sliding-window and full
attention layers: two KV-cache groups in vLLM)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

# Token ids of the byte-level tokenizer: 0 pad, 1 bos, 2 eos, then the 256 bytes.
SPECIALS = ("<pad>", "<s>", "</s>")


@dataclass(frozen=True, slots=True)
class CheckpointSize:
    """Llama dimensions: layers, hidden size, attention heads, KV heads, MLP width; vocab in
    tokens (at least 259: the specials and the 256 bytes)."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 512


SIZES = {
    "tiny": CheckpointSize(num_layers=2, hidden=128, heads=2, kv_heads=2, intermediate=256),
    "bench": CheckpointSize(num_layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1408),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map, which a ByteLevel pre-tokenizer applies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_vocab() -> dict[str, int]:
    """The specials, then byte ``b`` as id ``b + 3`` (as engines/tokenizer.py's ByteTokenizer)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b, ch in sorted(_bytes_to_unicode().items()):
        vocab[ch] = b + len(SPECIALS)
    return vocab


def write_tokenizer(model_dir: str, max_len: int) -> None:
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) saved in ``model_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=_byte_vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=max_len)
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(model_dir)


STAMP = "kvstore_checkpoint.json"   # the settings a checkpoint directory was written with


def _written(model_dir: str, stamp: dict) -> bool:
    """Whether ``model_dir`` holds a complete checkpoint written with the settings ``stamp``."""
    path = os.path.join(model_dir, STAMP)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return bool(json.load(f) == stamp)


def write_checkpoint(model_dir: str, size: str | CheckpointSize = "tiny", seed: int = 0,
                     max_model_len: int = 4096, dtype: str = "float32") -> str:
    """Write a seeded random Llama checkpoint and its tokenizer to ``model_dir`` (created);
    returns ``model_dir``. The same ``size`` and ``seed`` give the same weights. An existing
    complete checkpoint with the same settings is kept as it is.

    Raises ValueError for an unknown size name."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = SIZES[size] if isinstance(size, str) else size
    if isinstance(size, str) and size not in SIZES:
        raise ValueError(f"unknown checkpoint size {size!r}; valid: {sorted(SIZES)}")
    stamp = {"dims": [dims.num_layers, dims.hidden, dims.heads, dims.kv_heads, dims.intermediate, dims.vocab],
             "seed": seed, "max_model_len": max_model_len, "dtype": dtype}
    if _written(model_dir, stamp):
        return model_dir
    os.makedirs(model_dir, exist_ok=True)
    cfg = LlamaConfig(vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.intermediate,
                      num_hidden_layers=dims.num_layers, num_attention_heads=dims.heads,
                      num_key_value_heads=dims.kv_heads, max_position_embeddings=max_model_len,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(model_dir)
    write_tokenizer(model_dir, max_model_len)
    with open(os.path.join(model_dir, STAMP), "w") as f:
        json.dump(stamp, f)
    return model_dir


def write_gemma2_checkpoint(model_dir: str, seed: int = 0, max_model_len: int = 1024) -> str:
    """Write a seeded random Gemma-2 checkpoint (a hybrid model: 4 layers alternating
    sliding-window attention over 64 tokens and full attention, hidden 128, 2 KV heads of
    64) and its tokenizer to ``model_dir``; returns ``model_dir``. vLLM serves it with two
    KV-cache groups (``SlidingWindowSpec``, ``FullAttentionSpec``). Kept as it is when
    already written with the same settings."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    stamp = {"model": "gemma2", "seed": seed, "max_model_len": max_model_len}
    if _written(model_dir, stamp):
        return model_dir
    os.makedirs(model_dir, exist_ok=True)
    cfg = Gemma2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=64, sliding_window=64,
                       layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=max_model_len,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    Gemma2ForCausalLM(cfg).save_pretrained(model_dir)   # float32, torch's default
    write_tokenizer(model_dir, max_model_len)
    with open(os.path.join(model_dir, STAMP), "w") as f:
        json.dump(stamp, f)
    return model_dir


def main(argv: list[str] | None = None) -> None:
    """``python -m engines.vllm.checkpoint DIR [--size tiny|bench] [--seed N]``."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m engines.vllm.checkpoint",
                                     description="Write an offline random-weight Llama checkpoint and its "
                                                 "byte-level tokenizer, for vLLM (no download).")
    parser.add_argument("model_dir", help="directory to write (created)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny",
                        help="tiny: 2 layers, hidden 128 (default); bench: 8 layers, hidden 512")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="context length in tokens (default 4096)")
    args = parser.parse_args(argv)
    path = write_checkpoint(args.model_dir, args.size, args.seed, args.max_model_len)
    print(f"wrote {args.size} checkpoint to {path}")


if __name__ == "__main__":
    main()
