"""The Admin API is the store token's only: every Admin RPC refuses a missing or wrong token
(UNAUTHENTICATED, before any method runs), kvctl says so; a malformed tenant name on a
Put is INVALID_ARGUMENT; Admin errors go through the wire error table (kvstore/wire/errors.py).
And kvctl finds the stack ``kvstore up`` recorded (up-<pid>.json, its auth.env) with no flags,
flags still winning, and asks which when several run."""
from __future__ import annotations

import os

import grpc
import pytest

from kvstore.admin.client import AdminClient
from kvstore.client import StoreClient
from kvstore.errors import InvalidArgument, Unauthenticated
from protos import admin_pb2 as apb
from protos import admin_pb2_grpc as apb_grpc
from tests.helpers.kvctl_helpers import TOKEN, block, kvctl, kvctl_env


@pytest.fixture
def node(spawn_store_node):
    _, address = spawn_store_node("auth-node", "--dram", "2MiB", "--ssd", "0", "--auth-token", TOKEN,
                                  "--transfer-engine", "off")
    return address


def _requests():
    service = apb.DESCRIPTOR.services_by_name["Admin"]
    for method in service.methods:
        cls = getattr(apb, method.input_type.name)
        yield method.name, cls()


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer not-the-token"),),
                                      (("authorization", TOKEN),)], ids=["missing", "wrong", "no-bearer"])
def test_every_admin_rpc_refuses_a_missing_or_wrong_token(node, metadata):
    names = []
    with grpc.insecure_channel(node) as channel:
        stub = apb_grpc.AdminStub(channel)
        for name, request in _requests():
            with pytest.raises(grpc.RpcError) as info:
                getattr(stub, name)(request, timeout=10, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            names.append(name)
        assert len(names) == 13
        reply = stub.Stats(apb.StatsRequest(), timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert reply.node_id == "auth-node"


def test_a_node_without_a_token_warns_that_any_caller_reaches_every_tenant(spawn_store_node, node, tmp_path):
    """Engines and the front door warned when they served without a token; a store node, whose
    Admin API then lists and removes every tenant's blocks for anyone, said nothing."""
    import time
    spawn_store_node("open-node", "--dram", "2MiB", "--ssd", "0", "--transfer-engine", "off")
    logs = {name: tmp_path / f"{name}.log" for name in ("open-node", "auth-node")}
    deadline = time.monotonic() + 20
    while "takes calls without a token" not in logs["open-node"].read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "store node open-node takes calls without a token" in logs["open-node"].read_text()
    assert "KVSTORE_STORE_TOKEN" in logs["open-node"].read_text()
    assert "without a token" not in logs["auth-node"].read_text()      # `node` has one


def test_kvctl_with_a_wrong_token_says_unauthenticated(node, tmp_path):
    rc, _, err = kvctl(kvctl_env(tmp_path, token="wrong"), "--store", node, "ls", json_out=False)
    assert rc == 1 and "UNAUTHENTICATED" in err
    with AdminClient(node, None) as admin, pytest.raises(Unauthenticated, match="UNAUTHENTICATED"):
        admin.list_blocks()


def test_a_bad_namespace_on_a_put_is_refused(node):
    with StoreClient(node, auth_token=TOKEN, data_path="grpc") as c:
        with pytest.raises(InvalidArgument, match="kvstore-namespace"):
            c.put_blocks([(block(1), b"x")], namespace="n" * 300)
        assert not c.lookup([block(1)]).blocks


def test_kvctl_finds_the_stack_kvstore_up_recorded(node, tmp_path, monkeypatch):
    from launcher.stack_record import forget_stack, record_stack
    env = kvctl_env(tmp_path, token=None)
    monkeypatch.setenv("KVSTORE_UP_FILE", env["KVSTORE_UP_FILE"])
    data = tmp_path / "up"
    data.mkdir()
    (data / "auth.env").write_text(f"KVSTORE_STORE_TOKEN={TOKEN}\nKVSTORE_ENGINE_TOKEN=e\n")
    path = record_stack([node], ["127.0.0.1:1"], "http://127.0.0.1:2", str(data), None)
    assert oct((tmp_path / "no-stack" / "up.json").stat().st_mode & 0o777) == "0o600"
    rc, doc, err = kvctl(env, "tiers")                           # no --store, no --token
    assert rc == 0, err
    assert doc["node_id"] == "auth-node" and doc["address"] == node
    rc, doc, err = kvctl(env, "ls")                              # an admin call: the token came from auth.env
    assert rc == 0, err
    rc, _, err = kvctl(env, "--token", "wrong", "ls", json_out=False)   # flags win
    assert rc == 1 and "UNAUTHENTICATED" in err
    forget_stack(path)
    rc, _, err = kvctl(env, "--timeout", "2", "tiers", json_out=False)  # record gone: the default address
    assert rc == 1 and "127.0.0.1:50051" in err


class _Listener(grpc.GenericRpcHandler):
    """Stands in for another local user listening on a port the stack does not hold: keeps
    the metadata of every call (and answers none)."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    def service(self, handler_call_details):  # type: ignore[no-untyped-def]
        self.metadata.append(dict(handler_call_details.invocation_metadata))
        return None


def test_kvctl_sends_a_stacks_token_to_its_own_nodes_only(node, tmp_path, monkeypatch):
    """``kvctl --store ADDR`` with a stack running sent that stack's store token (the admin
    of every tenant's blocks) to ADDR even when the stack holds no node there."""
    from concurrent import futures

    from launcher.stack_record import forget_stack, record_stack
    env = kvctl_env(tmp_path, token=None)
    monkeypatch.setenv("KVSTORE_UP_FILE", env["KVSTORE_UP_FILE"])
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "auth.env").write_text(f"KVSTORE_STORE_TOKEN={TOKEN}\nKVSTORE_ENGINE_TOKEN=engine-secret\n")
    path = record_stack([node], [], "http://127.0.0.1:2", str(tmp_path / "up"), None)
    listener = _Listener()
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[listener])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        rc, _, err = kvctl(env, "--store", f"127.0.0.1:{port}", "tiers", json_out=False)
        assert rc == 1 and listener.metadata, err
        assert all("authorization" not in md for md in listener.metadata), listener.metadata
        rc, _, err = kvctl(env, "--stack", str(os.getpid()), "--store", f"127.0.0.1:{port}", "ls", json_out=False)
        assert rc == 1 and "its tokens go to its own nodes only" in err, err
        assert all("authorization" not in md for md in listener.metadata)
        rc, doc, err = kvctl(env, "--store", node.replace("127.0.0.1", "localhost"), "ls")   # one host, two names
        assert rc == 0, err
        calls = len(listener.metadata)
        kvctl(env, "lookup", "--engine", f"127.0.0.1:{port}", "--prompt", "hi", json_out=False)
        kvctl(env, "watch", "--count", "1", "--node", f"127.0.0.1:{port}", json_out=False)
        assert len(listener.metadata) >= calls + 2
        assert all("authorization" not in md for md in listener.metadata), listener.metadata
    finally:
        server.stop(None).wait()
        forget_stack(path)


def _ipv6_loopback() -> bool:
    import socket
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback to listen on")
def test_kvctl_never_sends_a_stacks_token_to_whoever_holds_its_ports_on_ipv6_loopback(node, tmp_path, monkeypatch):
    """The stack listens on 127.0.0.1; any local user may bind [::1] on the same ports, and
    ``localhost`` resolves to ::1 first. kvctl took ``localhost:P`` and ``[::1]:P`` for the
    stack's node or engine and sent its tokens there; it now connects to the stack's own
    address instead."""
    from concurrent import futures

    from launcher.stack_record import forget_stack, record_stack
    from launcher.supervisor import free_port
    env = kvctl_env(tmp_path, token=None)
    monkeypatch.setenv("KVSTORE_UP_FILE", env["KVSTORE_UP_FILE"])
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "auth.env").write_text(f"KVSTORE_STORE_TOKEN={TOKEN}\nKVSTORE_ENGINE_TOKEN=engine-secret\n")
    node_port = node.rpartition(":")[2]
    engine_port = free_port()                  # the stack's engine: nothing listens on 127.0.0.1 there
    path = record_stack([node], [f"127.0.0.1:{engine_port}"], "http://127.0.0.1:2", str(tmp_path / "up"), None)
    listener = _Listener()
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[listener])
    server.add_insecure_port(f"[::1]:{node_port}")
    server.add_insecure_port(f"[::1]:{engine_port}")
    server.start()
    try:
        for name in ("localhost", "[::1]"):
            rc, doc, err = kvctl(env, "--store", f"{name}:{node_port}", "tiers")
            assert rc == 0 and doc["address"] == node, (name, err)     # the stack's node, by its own address
            kvctl(env, "lookup", "--engine", f"{name}:{engine_port}", "--prompt", "hi", json_out=False)
            kvctl(env, "watch", "--count", "1", "--node", f"{name}:{node_port}", json_out=False)
        assert not listener.metadata, listener.metadata           # the [::1] listener was never called
    finally:
        server.stop(None).wait()
        forget_stack(path)


def test_admin_errors_go_through_the_wire_error_table(node):
    """The Admin service answers as the store API does (kvstore/wire/errors.py): the code of
    the class and the class named in the ``kvstore-error`` trailer, which AdminClient raises."""
    with grpc.insecure_channel(node) as channel, pytest.raises(grpc.RpcError) as info:
        apb_grpc.AdminStub(channel).Inspect(apb.InspectRequest(key=b"short"), timeout=10,
                                            metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("kvstore-error", "InvalidArgument") in [(m.key, m.value) for m in info.value.trailing_metadata()]
    with AdminClient(node, TOKEN) as admin:
        with pytest.raises(InvalidArgument, match="namespace"):
            admin.quota("SetQuota", "bad\tname", 1)
        for call in (admin.list_blocks, admin.flush):   # a filter no tenant can have: refused, not "no match"
            with pytest.raises(InvalidArgument, match="namespace is 1-"):
                call(namespace="\x01")
        assert admin.list_blocks(namespace="")["matched"] == 0 and "blocks" in admin.list_blocks(namespace="t")



def test_draining_a_pool_with_no_membership_is_failed_precondition(make_dram):
    from kvstore.admin.service import NodeControl, admin_service
    from kvstore.errors import FailedPrecondition
    from kvstore.pool.pool import KVPool
    from kvstore.service import serve_store
    pool = KVPool([make_dram(1 << 20)])
    server, port = serve_store(pool, extra_services=(admin_service(pool, NodeControl("lone")),))
    try:
        with AdminClient(f"127.0.0.1:{port}", None) as admin:
            with pytest.raises(FailedPrecondition, match="no cluster membership"):
                admin.set_draining(True)
    finally:
        server.stop(None).wait()


def test_kvctl_with_several_stacks_running_asks_which(spawn_store_node, tmp_path, monkeypatch):
    """Two ``kvstore up`` of one user each keep their own record (up-<pid>.json): kvctl
    names both and asks for ``--stack``, or takes the one holding the ``--store`` node; a
    stack whose ``kvstore up`` exited is passed over."""
    import json
    import subprocess

    from launcher.stack_record import record_stack
    other_token = "other-store-token-0123456789"
    nodes = {}
    for name, token in (("stack-a-node", TOKEN), ("stack-b-node", other_token)):
        _, nodes[name] = spawn_store_node(name, "--dram", "2MiB", "--ssd", "0", "--auth-token", token,
                                          "--transfer-engine", "off")
    env = kvctl_env(tmp_path, token=None)
    del env["KVSTORE_UP_FILE"]
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
    monkeypatch.delenv("KVSTORE_UP_FILE", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])
    for name, token in (("a", TOKEN), ("b", other_token)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "auth.env").write_text(f"KVSTORE_STORE_TOKEN={token}\n")
    record_stack([nodes["stack-a-node"]], [], "http://127.0.0.1:1", str(tmp_path / "a"), None)   # this pid's
    other = subprocess.Popen(["sleep", "300"])            # stands in for a second kvstore up
    try:
        doc = {"version": 1, "pid": other.pid, "stores": [nodes["stack-b-node"]], "engines": [],
               "frontdoor": "http://127.0.0.1:2", "auth_env": str(tmp_path / "b" / "auth.env")}
        (tmp_path / "run" / "kvstore" / f"up-{other.pid}.json").write_text(json.dumps(doc))
        rc, _, err = kvctl(env, "ls", json_out=False)
        assert rc == 1 and "2 kvstore up stacks are running" in err and f"pid {other.pid}" in err, err
        assert "--stack PID" in err
        rc, doc, err = kvctl(env, "--stack", str(other.pid), "tiers")
        assert rc == 0 and doc["node_id"] == "stack-b-node", err
        assert kvctl(env, "--stack", str(other.pid), "ls")[0] == 0            # stack b's token, from its auth.env
        # --stack names the stack acted on, whatever the environment holds (a shell that had
        # sourced stack a's auth.env sent `--stack B` commands with a's settings: to a's cluster)
        sourced_a = {**env, "KVSTORE_STORE_TOKEN": TOKEN}
        rc, doc, err = kvctl(sourced_a, "--stack", str(other.pid), "tiers")
        assert rc == 0 and doc["node_id"] == "stack-b-node", err
        assert "using that stack's auth.env, not KVSTORE_STORE_TOKEN from the environment" in err, err
        rc, _, err = kvctl(env, "--store", nodes["stack-a-node"], "ls")       # the stack holding the node
        assert rc == 0, err
        rc, _, err = kvctl(env, "--stack", "999999999", "tiers", json_out=False)
        assert rc == 1 and "no kvstore up with pid 999999999" in err, err
    finally:
        other.kill()
        other.wait()
    rc, doc, err = kvctl(env, "tiers")                   # b has exited: a is the only one
    assert rc == 0 and doc["node_id"] == "stack-a-node", err
    record_stack([nodes["stack-a-node"]], [], "http://127.0.0.1:1", str(tmp_path / "a"), None)
    assert sorted(p.name for p in (tmp_path / "run" / "kvstore").iterdir()) == [f"up-{os.getpid()}.json"]
