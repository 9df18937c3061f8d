"""``kvctl lookup``: the block keys of a prompt, made exactly as the engines make them, and
where each block is (node, tier, size, pins).

The key spec's inputs come from an engine's ``Info`` (``--engine``; after ``kvstore up``
the stack's first engine): model id, revision and KV layout, which with the tenant's
namespace form the key extras (``engines.types.extras_for``: ``KeyExtras(model, revision,
layout, namespace)``), and the block size. ``--model``/``--revision``/``--layout``/
``--block-size`` give them by hand instead. The keys of vLLM's connector (made from the
checkpoint's identity, engines/vllm/layout.py) come from the record ``kvstore up`` over vLLM
keeps of its stack, which holds their extras (``key_spec``) and the checkpoint, whose
tokenizer then tokenizes ``--prompt``. The namespace is the front door's
(``scheduler.routing.tenancy.namespace_from_authorization``): ``key-`` + the first 16 hex digits of
SHA-256 of the tenant's API key (``--tenant KEY``), or ``public`` without one.
``--prompt TEXT`` is tokenized as the tiny model's byte tokenizer does (UTF-8 bytes + 3,
engines/tokenizer.py) or, with ``--tokenizer DIR``, by that checkpoint's tokenizer
(``AutoTokenizer``, no special tokens, as the front door).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
from typing import Any

import grpc
from tabulate import tabulate

from kvstore.auth import bearer_metadata
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.index.keys import KeyExtras, KVLayout, block_keys
from kvstore.kvctl.cluster import cluster_nodes
from kvstore.kvctl.common import EXIT_OK, Target, add_json, emit, namespace_arg, plural

PUBLIC_NAMESPACE = "public"
BYTE_TOKEN_OFFSET = 3       # the byte tokenizer: id = byte + 3 (0 pad, 1 bos, 2 eos)


def namespace_of(api_key: str | None) -> str:
    """The tenant namespace the front door gives a caller with this API key."""
    if not api_key:
        return PUBLIC_NAMESPACE
    return "key-" + hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:16]


def tokens_of(args: argparse.Namespace, tokenizer: str | None = None) -> list[int]:
    """The tokens of ``--tokens``, or of ``--prompt`` by ``--tokenizer`` (else ``tokenizer``, else
    the byte tokenizer)."""
    tokenizer = args.tokenizer or tokenizer
    if args.tokens is not None:
        try:
            return [int(x) for x in args.tokens.replace(",", " ").split()]
        except ValueError:
            raise InvalidArgument(f"--tokens takes integers separated by commas or spaces, "
                                  f"got {args.tokens!r}") from None
    if tokenizer:
        from transformers import AutoTokenizer
        return list(AutoTokenizer.from_pretrained(tokenizer).encode(args.prompt, add_special_tokens=False))
    try:
        return [b + BYTE_TOKEN_OFFSET for b in args.prompt.encode("utf-8")]
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"the prompt is not valid Unicode: {exc.reason}") from None


def key_spec(t: Target, args: argparse.Namespace) -> tuple[KeyExtras, int, str]:
    """The key extras but the tenant's namespace, the block size and where they came from: an
    engine's Info, or the flags."""
    engine = t.own(args.engine) if args.engine else (None if args.model is not None else
                                                     (t.engines[0] if t.engines else None))
    if engine:
        from protos import engine_pb2, engine_pb2_grpc
        with grpc.insecure_channel(engine) as channel:
            try:
                info = engine_pb2_grpc.EngineStub(channel).Info(
                    engine_pb2.InfoRequest(), timeout=t.timeout_s, metadata=bearer_metadata(t.engine_token_for(engine)))
            except grpc.RpcError as exc:
                raise Unavailable(f"engine at {engine}: {exc.code().name}: {exc.details()}") from None
        extras = KeyExtras(model=info.model_id, revision=info.revision, layout=KVLayout.from_json(info.layout_json))
        return extras, info.block_size, f"engine {engine}"
    if args.model is None or args.block_size is None:
        raise InvalidArgument("no engine to take the key spec from (no kvstore up found, or --stack names none): "
                              "give --engine ADDR (its Info has the key spec), or --model, --block-size (and "
                              "--revision, --layout) by hand")
    if args.block_size < 1:
        raise InvalidArgument(f"--block-size is tokens per block, >= 1; got {args.block_size}")
    layout = KVLayout.from_json(args.layout) if args.layout else None
    return KeyExtras(model=args.model, revision=args.revision, layout=layout), args.block_size, "flags"


def vllm_key_spec(record: dict[str, Any]) -> tuple[KeyExtras, int, str]:
    """The vLLM connector's key spec from ``kvstore up``'s record of its stack (launcher/up_vllm.py
    ``_key_spec``), as :func:`key_spec` gives one. Raises InvalidArgument when the record has
    none (a ``kvstore up`` of another version)."""
    spec = record.get("key_spec")
    if not isinstance(spec, dict):
        raise InvalidArgument("this kvstore up serves vLLM and its record holds no key spec (a kvstore up of "
                              "another version): restart it with this version; the connector's keys hold its block "
                              "format, which no flag of kvctl lookup gives")
    extras = KeyExtras(model=spec["model_id"], revision=spec["revision"], layout=KVLayout.from_json(spec["layout"]),
                       other=tuple(spec["other"]))
    return extras, int(spec["block_size"]), f"kvstore up's vLLM connector, checkpoint {record.get('model')}"


def cmd_lookup(t: Target, args: argparse.Namespace) -> int:
    namespace = args.namespace if args.namespace is not None else namespace_of(args.tenant)
    record = t.vllm if t.vllm and not (args.engine or args.model) else None   # kvstore up over vLLM
    # there the front door tokenizes with the checkpoint's tokenizer
    tokens = tokens_of(args, record.get("model") if record else None)
    spec, block_size, source = vllm_key_spec(record) if record else key_spec(t, args)
    extras = dataclasses.replace(spec, namespace=namespace)
    model, revision = extras.model, extras.revision
    keys = block_keys(tokens, block_size, extras)
    where: list[list[dict[str, Any]]] = [[] for _ in keys]
    nodes = cluster_nodes(t)
    for node in nodes:
        with t.admin_client(node.address) as admin:
            for i, key in enumerate(keys):
                r = admin.inspect(key)
                if r["found"]:
                    b = r["block"]
                    where[i].append({"node": node.node_id, "tiers": b["tiers"], "size": b["size"], "pin": b["pin"],
                                     "namespace": b["namespace"]})
    blocks: list[dict[str, Any]] = [
        {"index": i, "key": k.hex(), "tokens": [i * block_size, (i + 1) * block_size], "copies": w}
        for i, (k, w) in enumerate(zip(keys, where))]
    held = next((i for i, w in enumerate(where) if not w), len(keys))
    rows = [[b["index"], b["key"][:16], ",".join(c["node"] for c in b["copies"]) or "-",
             ";".join(",".join(c["tiers"]) for c in b["copies"]) or "miss",
             ";".join(str(c["size"]) for c in b["copies"]), ";".join(c["pin"] for c in b["copies"] if c["pin"])]
            for b in blocks]
    text = (f"{plural(len(tokens), 'token')}, {plural(len(keys), 'full block')} of {block_size} (key spec from "
            f"{source}; model {model!r}, namespace {namespace!r}); the pool holds a prefix of "
            f"{plural(held, 'block')}\n"
            + tabulate(rows, headers=["block", "key", "node", "tier", "bytes", "pin"]))
    if held == 0 and args.namespace is None and not args.tenant:
        text += (f"\n(namespace {PUBLIC_NAMESPACE!r}: the front door's tenant for a caller that sends no "
                 "'Authorization: Bearer' token. One that sends one is keyed by it, with API keys or without "
                 "(the OpenAI SDK always sends its api_key, 'none' or 'EMPTY' included): give --tenant KEY or "
                 "--namespace key-<16 hex>; kvctl namespaces lists those the node holds)")
    emit(args, {"namespace": namespace, "model": model, "revision": revision, "block_size": block_size,
                "tokens": len(tokens), "key_spec_from": source, "held_prefix_blocks": held, "blocks": blocks}, text)
    return EXIT_OK


def add_commands(sub: Any) -> None:
    p = sub.add_parser("lookup", help="key a prompt as the engines do; per block: key, node, tier, size, pins",
                       description="Make a prompt's block keys as the engines make them and say where each block "
                                   "is held (node, tiers, size, pin) and how long a prefix the pool holds. The key "
                                   "spec comes from kvstore up's record (over vLLM: the connector's keys, the "
                                   "prompt tokenized by the checkpoint's tokenizer), --engine's Info, or --model "
                                   "and the flags after it; the tenant from --tenant or --namespace (default: "
                                   "the front door's 'public').")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (tokenized as the front door does)")
    g.add_argument("--tokens", help="token ids, comma- or space-separated")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--tenant", metavar="API_KEY",
                     help="the tenant's API key (default: the public namespace; --namespace key-<16 hex> "
                          "names it without the key showing in ps)")
    who.add_argument("--namespace", type=namespace_arg, help="the namespace itself (key-<16 hex>, public, ...)")
    p.add_argument("--engine", metavar="ADDR", help="a built-in engine whose Info gives the key spec (default: "
                   "kvstore up's first engine; over vLLM, the stack's record)")
    p.add_argument("--engine-token", help="the engines' token (default: KVSTORE_ENGINE_TOKEN)")
    p.add_argument("--tokenizer", metavar="DIR", help="a Hugging Face checkpoint's tokenizer for --prompt "
                   "(default: after kvstore up over vLLM, its checkpoint's; else the tiny model's byte tokenizer)")
    p.add_argument("--model", help="model id (instead of --engine)")
    p.add_argument("--revision", default="", help="model revision (with --model)")
    p.add_argument("--layout", metavar="JSON", help="KV layout JSON (with --model), as an engine's Info gives "
                   'it: {"dtype": "float32", "num_layers": N, "num_kv_heads": N, "head_dim": N, "block_size": N}')
    p.add_argument("--block-size", type=int, help="tokens per block (with --model)")
    add_json(p)
    p.set_defaults(func=cmd_lookup)
