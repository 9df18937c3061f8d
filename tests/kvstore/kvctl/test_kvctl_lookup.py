"""kvctl lookup keys a prompt exactly as the engines do: a real prefill engine (tiny model)
stores a tenant's prompt in a real store node, and ``kvctl lookup --prompt TEXT --tenant
KEY --engine ADDR`` gives the keys the engine returned and finds every stored block; the
same keys as the front door's (``scheduler.routing.tenancy``)."""
from __future__ import annotations

import grpc
import pytest

from engines.tokenizer import ByteTokenizer
from kvstore.auth import bearer_metadata
from kvstore.kvctl.lookup import namespace_of
from protos import engine_pb2, engine_pb2_grpc
from scheduler.routing.tenancy import namespace_from_authorization, prompt_keys
from tests.helpers.kvctl_helpers import TOKEN, kvctl, kvctl_env

ENGINE_TOKEN = "test-engine-token-0123456789"
PROMPT = "The operator asks which blocks hold this prompt, and where they are." * 2


@pytest.fixture
def engine(spawn_store_node):
    from engines.server import start_engine
    _, store = spawn_store_node("lk-node", "--dram", "16MiB", "--ssd", "0", "--auth-token", TOKEN,
                                "--transfer-engine", "off")
    server, port = start_engine("prefill", store, store_token=TOKEN, auth_token=ENGINE_TOKEN, device="cpu")
    yield store, f"127.0.0.1:{port}"
    server.stop(grace=None).wait()


def test_lookup_gives_the_engines_keys_and_finds_the_blocks(engine, tmp_path):
    store, address = engine
    assert namespace_of("sk-alice") == namespace_from_authorization("Bearer sk-alice")
    assert namespace_of(None) == namespace_from_authorization(None)
    tokens = ByteTokenizer().encode(PROMPT)
    ns = namespace_of("sk-alice")
    with grpc.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        meta = bearer_metadata(ENGINE_TOKEN)
        info = stub.Info(engine_pb2.InfoRequest(), timeout=30, metadata=meta)
        done = stub.Prefill(engine_pb2.PrefillRequest(request_id="r1", prompt=tokens, namespace=ns),
                            timeout=120, metadata=meta)
    assert done.stored_blocks == len(tokens) // info.block_size > 0
    env = kvctl_env(tmp_path)
    rc, doc, err = kvctl(env, "--store", store, "lookup", "--prompt", PROMPT, "--tenant", "sk-alice",
                         "--engine", address, "--engine-token", ENGINE_TOKEN)
    assert rc == 0, err
    assert doc["namespace"] == ns and doc["tokens"] == len(tokens) and doc["key_spec_from"] == f"engine {address}"
    assert [b["key"] for b in doc["blocks"]] == [k.hex() for k in done.block_keys]
    from engines.types import EngineInfo
    from kvstore.index.keys import KVLayout
    engine = EngineInfo(info.engine_id, info.role, info.model_id, info.revision, KVLayout.from_json(info.layout_json),
                        info.block_size, info.vocab_size, info.eos_token_id, info.device, info.max_model_len)
    front_door = prompt_keys(tokens, engine, ns)
    assert [b["key"] for b in doc["blocks"]] == [k.hex() for k in front_door]
    assert doc["held_prefix_blocks"] == done.stored_blocks
    assert all(b["copies"][0]["node"] == "lk-node" and b["copies"][0]["tiers"] == ["dram"] for b in doc["blocks"])
    rc, doc, _ = kvctl(env, "--store", store, "lookup", "--prompt", PROMPT, "--tenant", "sk-bob",
                       "--engine", address, "--engine-token", ENGINE_TOKEN)
    assert rc == 0 and doc["held_prefix_blocks"] == 0             # another tenant's keys differ
    rc, text, _ = kvctl(env, "--store", store, "lookup", "--prompt", PROMPT, "--engine", address,
                        "--engine-token", ENGINE_TOKEN, json_out=False)
    assert rc == 0 and "prefix of 0 blocks" in text and "give --tenant KEY" in text   # no key: a hint
    rc, _, err = kvctl(env, "--store", store, "lookup", "--prompt", PROMPT, "--engine", address,
                       "--engine-token", "wrong", json_out=False)
    assert rc == 1 and "UNAUTHENTICATED" in err



def test_lookup_after_kvstore_up_over_vllm_makes_the_connectors_keys_from_its_record(spawn_store_node, tmp_path):
    """After ``kvstore up`` over vLLM, kvctl lookup makes the connector's keys from the key spec
    the stack's record holds (the front door's, scheduler/vllm/instances.py): the same keys,
    and a record without one is refused, naming what to do."""
    import json
    import os

    from kvstore.index.keys import KeyExtras, KVLayout, block_keys
    _, store = spawn_store_node("lk-vllm", "--dram", "16MiB", "--ssd", "0", "--auth-token", TOKEN,
                                "--transfer-engine", "off")
    env = kvctl_env(tmp_path)
    layout = KVLayout("float32", 2, 2, 16, 4)
    spec = {"model_id": "bench-llama", "revision": "0123abcd", "layout": layout.to_json(),
            "other": ["vllm-paged-v2", ["tp", 1, 2]], "block_size": 4}
    record = {"version": 1, "pid": os.getpid(), "stores": [store], "engines": [], "frontdoor": "http://127.0.0.1:1",
              "auth_env": "", "data_dir": str(tmp_path), "cluster": False,
              "vllm": {"model": str(tmp_path / "ckpt"), "block_size": 4, "key_spec": spec}}
    os.makedirs(os.path.dirname(env["KVSTORE_UP_FILE"]), exist_ok=True)
    with open(env["KVSTORE_UP_FILE"], "w") as f:
        json.dump(record, f)
    rc, doc, err = kvctl(env, "lookup", "--tokens", "1,2,3,4,5,6,7,8,9", "--tenant", "sk-alice")
    assert rc == 0, err
    extras = KeyExtras(model="bench-llama", revision="0123abcd", layout=layout, namespace=namespace_of("sk-alice"),
                       other=("vllm-paged-v2", ("tp", 1, 2)))
    assert [b["key"] for b in doc["blocks"]] == [k.hex() for k in block_keys(list(range(1, 10)), 4, extras)]
    assert doc["held_prefix_blocks"] == 0 and doc["key_spec_from"].startswith("kvstore up's vLLM connector")
    del record["vllm"]["key_spec"]
    with open(env["KVSTORE_UP_FILE"], "w") as f:
        json.dump(record, f)
    rc, _, err = kvctl(env, "lookup", "--tokens", "1,2,3")
    assert rc != 0 and "holds no key spec" in err and "restart it" in err, err
