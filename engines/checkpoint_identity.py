"""Who computed a block's KV, as its key names it: a local checkpoint's (model id, revision)
and a LoRA adapter's identity. The built-in engines (engines/model.py), the vLLM connector
(engines/vllm/) and the front door over vLLM (scheduler/vllm/instances.py) all name a
checkpoint through :func:`model_identity`, so their keys agree.

A local checkpoint's revision hashes its ``config.json`` and its weight files' names, sizes
and bytes (docs/key-spec.md, field ``revision``): two checkpoints with one directory name and
one ``config.json`` (two fine-tunes, each saved as ``checkpoint-1000``) never share a key.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

# Files whose bytes are a checkpoint's weights (Hugging Face, PyTorch, GGUF).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CHUNK = 16 << 20
_weights_digests: dict[tuple, str] = {}


def _weights_digest(model: str) -> str:
    """xxh3-128 of the names, sizes and bytes of the weight files in ``model`` (sorted; its
    subdirectories are not read, as loaders do not; its ``.safetensors`` files alone when
    it has any, as loaders then read no other); one read of the weights per process,
    remembered by path, size and mtime."""
    import xxhash
    files = []
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if name.endswith(WEIGHT_SUFFIXES) and os.path.isfile(path):
            st = os.stat(path)
            files.append((name, st.st_size, st.st_mtime_ns, path))
    if any(f[0].endswith(".safetensors") for f in files):
        # what vLLM and transformers load when there are any; a Trainer checkpoint's
        # optimizer.pt (several times the weights), scheduler.pt, rng_state*.pth and
        # training_args.bin are no weights and are not read
        files = [f for f in files if f[0].endswith(".safetensors")]
    memo = (os.path.realpath(model), tuple(f[:3] for f in files))
    if memo not in _weights_digests:
        h = xxhash.xxh3_128()
        for name, size, _, path in files:
            h.update(f"{name}\0{size}\0".encode())
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
        _weights_digests[memo] = h.hexdigest()
    return _weights_digests[memo]


def _directory_digest(directory: str, config: str) -> str | None:
    """The first 16 hex digits of the SHA-256 of ``directory``'s ``config`` file and of its
    weights (:func:`_weights_digest`); None when it has no such file."""
    path = os.path.join(directory, config)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read() + b"\0weights " + _weights_digest(directory).encode()).hexdigest()[:16]


def model_identity(model: str, revision: str | None) -> tuple[str, str]:
    """(model id, revision) of a model argument: for a local checkpoint directory its base
    name and :func:`_directory_digest` of its ``config.json`` and weights (one read of them
    per process), else the name and the configured revision (``""`` when none)."""
    digest = _directory_digest(model, "config.json")
    if digest is not None:
        return os.path.basename(os.path.normpath(model)), digest
    return model, revision or ""


def adapter_identity(lora_request: Any) -> str | None:
    """What a request's LoRA adapter adds to its keys (its KV is not the base model's): for a
    local adapter directory the digest of its ``adapter_config.json`` and weights (as
    :func:`model_identity`), else its name and path; None without an adapter."""
    if lora_request is None:
        return None
    path = getattr(lora_request, "lora_path", "") or ""
    digest = _directory_digest(path, "adapter_config.json")
    if digest is not None:
        return "lora " + digest
    return f"lora {lora_request.lora_name} {path}"
