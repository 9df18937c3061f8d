"""vLLM's KV events into the router (scheduler/vllm/events.py): how fast the bridge turns
vLLM's published batches into the connector's block keys in the router's index replica,
against the floor — computing the same keys alone (``PagedLayout.keys``, what the bridge
must do per stored block) — in the same run.

Batches are vLLM's own (``vllm.distributed.kv_events.KVEventBatch`` of ``BlockStored`` /
``BlockRemoved``, msgpack-encoded as vLLM's publisher sends them), one request of 64 blocks
of 32 tokens (2,048 tokens, a tenant's ``cache_salt``) per batch, LLaMA3-70B's KV layout
(bf16, 80 layers, 8 KV heads of 128). Fed to :meth:`VLLMEventBridge.receive` directly, so the
figure is the bridge's work, not ZeroMQ's.

Writes benchmarks/results/vllm_events.json: ``stored_blocks_per_s``, ``stored_tokens_per_s``,
``removed_blocks_per_s``, ``keys_only_blocks_per_s`` and ``stored_vs_keys_only`` (the ratio;
1.0 would be translation at the cost of the hashing alone). Best of ``--repeats`` runs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.run_info import write_results  # noqa: E402

BLOCK = 32
BLOCKS_PER_REQUEST = 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="batches (one request each) per run")
    ap.add_argument("--repeats", type=int, default=5, help="runs; the best is reported")
    args = ap.parse_args()
    import msgspec
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    from engines.vllm.layout import PagedLayout
    from kvstore.events.channel import LocalEventChannel
    from kvstore.events.replica import IndexReplica
    from kvstore.index.keys import KVLayout
    from scheduler.vllm.events import VLLMEventBridge

    layout = PagedLayout("llama3-70b", "main", KVLayout(dtype="bfloat16", num_layers=80, num_kv_heads=8,
                                                         head_dim=128, block_size=BLOCK))
    enc = msgspec.msgpack.Encoder()
    n = args.requests
    prompts = [list(range(r * 100_000, r * 100_000 + BLOCKS_PER_REQUEST * BLOCK)) for r in range(n)]
    hashes = [[r * 1000 + i for i in range(BLOCKS_PER_REQUEST)] for r in range(n)]
    stored = [enc.encode(KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=hashes[r], parent_block_hash=None, token_ids=prompts[r], block_size=BLOCK, lora_id=None,
        medium="GPU", lora_name=None, extra_keys=[("tenant-a",)] + [None] * (BLOCKS_PER_REQUEST - 1))]))
        for r in range(n)]
    removed = [enc.encode(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=hashes[r], medium="GPU")]))
               for r in range(n)]
    blocks = n * BLOCKS_PER_REQUEST
    best = {"stored": float("inf"), "removed": float("inf"), "keys": float("inf")}
    for _ in range(args.repeats):
        bridge = VLLMEventBridge("vllm-prefill-0", "ipc:///nonexistent", layout, IndexReplica(LocalEventChannel()))
        t = time.perf_counter()
        for seq, body in enumerate(stored):
            bridge.receive(seq, body)
        best["stored"] = min(best["stored"], time.perf_counter() - t)
        assert bridge.stats.stored == blocks and bridge.stats.bad == 0, bridge.stats
        t = time.perf_counter()
        for seq, body in enumerate(removed, start=n):
            bridge.receive(seq, body)
        best["removed"] = min(best["removed"], time.perf_counter() - t)
        assert bridge.stats.removed == blocks, bridge.stats
        t = time.perf_counter()
        for p in prompts:
            layout.keys(p, "tenant-a")
        best["keys"] = min(best["keys"], time.perf_counter() - t)
    out = {"requests": n, "blocks_per_request": BLOCKS_PER_REQUEST, "block_tokens": BLOCK,
           "stored_blocks_per_s": blocks / best["stored"], "stored_tokens_per_s": blocks * BLOCK / best["stored"],
           "removed_blocks_per_s": blocks / best["removed"], "keys_only_blocks_per_s": blocks / best["keys"],
           "stored_vs_keys_only": best["keys"] / best["stored"]}
    print(f"stored   {out['stored_blocks_per_s']:>12,.0f} blocks/s ({out['stored_tokens_per_s'] / 1e6:.2f} M tokens/s)")
    print(f"removed  {out['removed_blocks_per_s']:>12,.0f} blocks/s")
    print(f"keys only{out['keys_only_blocks_per_s']:>12,.0f} blocks/s (the floor: PagedLayout.keys alone)")
    print(f"stored / keys only: x{out['stored_vs_keys_only']:.2f}")
    path = ROOT / "benchmarks" / "results" / "vllm_events.json"
    write_results(path, out)
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
