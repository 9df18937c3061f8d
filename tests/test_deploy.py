"""The deployment an operator applies (deploy/, docs/deploy.md) stays true offline:

* every manifest of deploy/k8s/ is valid Kubernetes, in strict mode (unknown fields are
  errors), at the oldest and the newest version named below — with kubernetes-validate's
  bundled schemas, no cluster — and the validator rejects a broken one;
* every ``kvstore ...`` command of a manifest and of the image parses with kvstore's own
  parser (``launcher.cli.build_parser``), the vLLM instances' with vLLM's, and the
  connector's ``kv_connector_extra_config`` with the connector's settings: a flag renamed in
  the code breaks this test, not a deployment;
* secrets are referenced (``secretKeyRef``), never written into a manifest or onto a command
  line, and each one referenced is one that deploy/k8s/make-secrets.sh creates;
* services bind the pod's or the host's address (the downward API), never every interface;
* every metrics port carries Prometheus' scrape annotations;
* the image definition copies paths that exist and pins torch as the Makefile does.
"""
from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate  # the dev extra (pyproject.toml); it bundles the schemas and PyYAML
import pytest
import yaml

from launcher.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))
CONTAINERFILE = ROOT / "deploy" / "Containerfile"
# The oldest Kubernetes the manifests are checked against, and the newest the schemas bundle.
K8S_VERSIONS = ("1.30.0", "1.37.0")
# What the downward API gives, as the kubelet would fill it in: addresses from 198.18.0.0/15.
DOWNWARD = {"status.podIP": "198.18.0.10", "status.hostIP": "198.18.0.2", "spec.nodeName": "gpu-host-1",
            "metadata.name": "pod-0", "metadata.namespace": "kvstore"}
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
SECRET_NAME = re.compile(r"TOKEN|KEY|PASSWORD|SECRET", re.I)


def resources() -> list[dict[str, Any]]:
    out = []
    for path in MANIFESTS:
        out += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def pod_templates() -> list[tuple[str, dict[str, Any]]]:
    """(workload name, pod template) of every workload."""
    return [(r["metadata"]["name"], r["spec"]["template"]) for r in resources()
            if "template" in r.get("spec", {})]


def containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def container_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: downward API fields filled in,
    a secret as ``<secret>/<key>``, ``$(VAR)`` in a value expanded from the variables before
    it. Fails when a value names a variable not defined before it."""
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "valueFrom" in e:
            src = e["valueFrom"]
            if "fieldRef" in src:
                env[e["name"]] = DOWNWARD[src["fieldRef"]["fieldPath"]]
            else:
                ref = src["secretKeyRef"]
                env[e["name"]] = f"{ref['name']}/{ref['key']}"
        else:
            env[e["name"]] = expand(e["value"], env, f"{c['name']}: env {e['name']}")
    return env


def expand(text: str, env: dict[str, str], where: str) -> str:
    missing = [v for v in VAR.findall(text) if v not in env]
    assert not missing, f"{where}: $({missing[0]}) is not defined before it (Kubernetes would leave it as is)"
    return VAR.sub(lambda m: env[m.group(1)], text)


def argv(c: dict[str, Any]) -> list[str]:
    """The container's command line after the kubelet's $(VAR) expansion, command then args."""
    env = container_env(c)
    return [expand(a, env, c["name"]) for a in c.get("command", []) + c.get("args", [])]


def kvstore_containers() -> list[tuple[str, dict[str, Any]]]:
    """(workload, container) of every container that runs the image's entrypoint, ``kvstore``."""
    return [(name, c) for name, t in pod_templates() for c in containers(t)
            if c["image"].startswith("kvstore:") and "command" not in c]


def parsed(c: dict[str, Any]) -> Any:
    try:
        return build_parser().parse_args(argv(c))
    except SystemExit:   # argparse's error went to stderr
        pytest.fail(f"container {c['name']}: `kvstore {shlex.join(argv(c))}` does not parse (see stderr)")


def the(workload: str, container: str) -> dict[str, Any]:
    return next(c for name, t in pod_templates() if name == workload for c in containers(t) if c["name"] == container)


# -- valid Kubernetes ------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_kubernetes_in_strict_mode(path: Path, version: str) -> None:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs, f"{path.name} holds no resource"
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
        assert doc["metadata"].get("namespace", "kvstore") == "kvstore" or doc["kind"] == "Namespace"


def test_the_manifests_hold_the_whole_deployment() -> None:
    kinds = {(r["kind"], r["metadata"]["name"]) for r in resources()}
    assert {("Namespace", "kvstore"), ("DaemonSet", "kvstore-store"), ("Deployment", "kvstore-redis"),
            ("Service", "kvstore-redis"), ("StatefulSet", "kvstore-vllm"), ("Service", "kvstore-vllm"),
            ("Deployment", "kvstore-frontdoor"), ("Service", "kvstore-frontdoor")} <= kinds
    store = next(r for r in resources() if r["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert store["hostNetwork"] is True and store["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_the_validator_rejects_a_broken_manifest() -> None:
    """Not vacuous: the same DaemonSet with an unknown field, a port that is no number, or no
    containers fails validation."""
    store = next(r for r in resources() if r["kind"] == "DaemonSet")
    kubernetes_validate.validate(store, K8S_VERSIONS[0], strict=True)
    unknown = copy.deepcopy(store)
    unknown["spec"]["template"]["spec"]["containers"][0]["argz"] = ["serve"]
    bad_port = copy.deepcopy(store)
    bad_port["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    no_containers = copy.deepcopy(store)
    del no_containers["spec"]["template"]["spec"]["containers"]
    for broken in (unknown, bad_port, no_containers):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


# -- commands parse with the code's own parsers ----------------------------------------------

def test_every_kvstore_command_parses_with_the_cli() -> None:
    commands = {name: parsed(c) for name, c in kvstore_containers()}
    assert {args.command for args in commands.values()} == {"serve", "scheduler"}
    store = commands["kvstore-store"]
    from kvstore.config import StoreConfig
    cfg = StoreConfig.load(None, node_id=store.node_id, host=store.host, port=store.port, tiers=store.tier,
                           data_dir=store.data_dir, transfer_engine=store.transfer_engine,
                           advertise_host=store.advertise_host, control_port=store.control_port,
                           metrics_port=store.metrics_port, dataplane_socket=store.dataplane_socket,
                           te_staging_bytes=store.te_staging)
    assert cfg.host == cfg.advertise_host == DOWNWARD["status.hostIP"]
    assert [t.kind for t in cfg.tiers] == ["dram", "ssd"] and cfg.transfer_engine == "tcp"
    assert store.redis is None, "the Redis URL (with its password) comes from KVSTORE_REDIS_URL, not argv"


def test_the_front_door_names_every_vllm_instance() -> None:
    """The StatefulSet's pods by their stable names through the headless Service, as many as
    its replicas, on the port they listen on, with the same checkpoint and block size."""
    door = parsed(the("kvstore-frontdoor", "frontdoor"))
    sts = next(r for r in resources() if r["kind"] == "StatefulSet")
    svc, ns, n = sts["spec"]["serviceName"], sts["metadata"]["namespace"], sts["spec"]["replicas"]
    vllm = vllm_flags()
    expected = [f"http://{sts['metadata']['name']}-{i}.{svc}.{ns}.svc.cluster.local:{vllm['--port']}"
                for i in range(n)]
    assert door.vllm_colocated == expected
    assert door.vllm_block_size == int(vllm["--block-size"]) and door.model == vllm["--model"]
    assert door.max_model_len == int(vllm["--max-model-len"])


def vllm_flags() -> dict[str, str]:
    c = the("kvstore-vllm", "vllm")
    line = argv(c)
    assert line[:3] == ["python", "-m", "engines.vllm.api_server"]
    return dict(a.split("=", 1) for a in line[3:] if "=" in a)


def test_the_connector_settings_are_the_connectors() -> None:
    from engines.vllm.launch import ROLES
    from engines.vllm.pool_link import ConnectorConfig
    kv = json.loads(vllm_flags()["--kv-transfer-config"])
    assert kv["kv_connector"] == "KVStoreConnector" and kv["kv_role"] in ROLES
    module = ROOT / (kv["kv_connector_module_path"].replace(".", "/") + ".py")   # importing it imports vLLM
    assert module.exists() and "class KVStoreConnector(" in module.read_text()
    assert "redis" not in json.dumps(kv), "the Redis URL (with its password) comes from KVSTORE_REDIS_URL, not argv"
    with pytest.MonkeyPatch.context() as env:     # the connector's settings in the pod's environment
        for name, value in container_env(the("kvstore-vllm", "vllm")).items():
            env.setenv(name, value)
        cfg = ConnectorConfig.from_extra(kv["kv_connector_extra_config"])
    assert cfg.redis and cfg.redis.startswith("redis://:kvstore-redis/password@kvstore-redis.")
    assert cfg.store == f"{DOWNWARD['status.hostIP']}:50051"


def test_the_vllm_command_parses_with_vllms_parser() -> None:
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    line = argv(the("kvstore-vllm", "vllm"))
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(line[3:])
    assert args.kv_transfer_config.kv_connector == "KVStoreConnector"
    assert args.kv_transfer_config.kv_connector_module_path == "engines.vllm.connector"
    assert args.host == DOWNWARD["status.podIP"] and args.block_size == 32
    from engines.vllm import connector
    assert hasattr(connector, "KVStoreConnector")
    for words in doc_commands("python -m engines.vllm.api_server"):     # docs/deploy.md's, by hand
        doc = make_arg_parser(FlexibleArgumentParser()).parse_args(words)
        assert doc.kv_transfer_config.kv_connector == "KVStoreConnector" and doc.block_size == 32


# -- secrets and binding ---------------------------------------------------------------------

def secrets_created() -> set[tuple[str, str]]:
    """(Secret, key) pairs deploy/k8s/make-secrets.sh creates."""
    script = (K8S / "make-secrets.sh").read_text().replace("\\\n", " ")
    out = set()
    for line in script.splitlines():
        if m := re.search(r"create secret generic (\S+)", line):
            out |= {(m.group(1), key) for key in re.findall(r"--from-file=([\w-]+)=", line)}
    return out


def test_secrets_are_referenced_never_inlined() -> None:
    assert not [r for r in resources() if r["kind"] in ("Secret", "ConfigMap")], \
        "secrets are made by deploy/k8s/make-secrets.sh, not kept in a manifest"
    created = secrets_created()
    assert {("kvstore-tokens", "store-token"), ("kvstore-redis", "password")} <= created
    refs = set()
    for name, t in pod_templates():
        refs |= {(v["secret"]["secretName"], it["key"]) for v in t["spec"].get("volumes", []) if "secret" in v
                 for it in v["secret"].get("items", [])}
        refs |= {(v["secret"]["secretName"], None) for v in t["spec"].get("volumes", []) if "secret" in v}
        for c in containers(t):
            for e in c.get("env", []):
                if SECRET_NAME.search(e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{name}/{c['name']}: {e['name']} is inlined"
                    refs.add((e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"]))
                elif "@" in e.get("value", ""):
                    assert VAR.search(e["value"].split("@")[0]), f"{name}/{c['name']}: {e['name']} holds credentials"
            words = c.get("command", []) + c.get("args", [])
            for flag in ("--auth-token", "--store-token", "--engine-token", "--api-key", "--requirepass"):
                assert not any(w.split("=")[0] == flag for w in words), f"{name}/{c['name']}: {flag} on argv"
            assert not any(re.search(r"[A-Za-z0-9_-]{40,}", w) for w in words), f"{name}/{c['name']}: a literal token"
    assert {r for r in refs if r[1] is not None} <= created
    assert {s for s, _ in refs} <= {s for s, _ in created}


def test_services_bind_the_pods_or_the_hosts_address() -> None:
    """No manifest binds 0.0.0.0: every kvstore and vLLM listener takes --host from the
    downward API (the pod's address; the host's for the host-network store node)."""
    for name, c in kvstore_containers():
        host = next(a for a in c["args"] if a.startswith("--host=")).split("=", 1)[1]
        assert host in ("$(POD_IP)", "$(HOST_IP)"), f"{name}: --host={host}"
    assert vllm_flags()["--host"] == DOWNWARD["status.podIP"]
    for path in MANIFESTS:
        body = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        assert "0.0.0.0" not in body and "'::'" not in body, path.name


# -- Prometheus ------------------------------------------------------------------------------

def metrics_ports(template: dict[str, Any]) -> set[int]:
    """The ports of a pod that serve GET /metrics: a store node's --metrics-port, the front
    door's and a vLLM instance's HTTP port."""
    ports = set()
    for c in containers(template):
        if c["image"].startswith("kvstore:") and "command" not in c:
            args = parsed(c)
            ports.add(args.metrics_port if args.command == "serve" else args.port)
        elif c.get("command", [])[:3] == ["python", "-m", "engines.vllm.api_server"]:
            ports.add(int(dict(a.split("=", 1) for a in argv(c)[3:] if "=" in a)["--port"]))
    return ports


def test_every_metrics_port_carries_prometheus_annotations() -> None:
    scraped = 0
    for name, t in pod_templates():
        ports, notes = metrics_ports(t), t["metadata"].get("annotations", {})
        declared = {p["containerPort"] for c in containers(t) for p in c.get("ports", [])}
        if not ports:
            assert "prometheus.io/scrape" not in notes, name
            continue
        assert len(ports) == 1 and ports <= declared, f"{name}: metrics on {ports}, declared {declared}"
        assert notes.get("prometheus.io/scrape") == "true", name
        assert notes.get("prometheus.io/port") == str(ports.pop()) and notes.get("prometheus.io/path") == "/metrics"
        # a scraper needs only the read-only metrics token: the service takes it
        assert any(container_env(c).get("KVSTORE_METRICS_TOKEN") == "kvstore-tokens/metrics-token"
                   for c in containers(t)), f"{name}: no KVSTORE_METRICS_TOKEN"
        scraped += 1
    assert scraped == 3   # store nodes, vLLM instances, the front door


# -- the image -------------------------------------------------------------------------------

def containerfile() -> list[tuple[str, str]]:
    """(instruction, rest) of deploy/Containerfile, continuation lines joined."""
    text = CONTAINERFILE.read_text().replace("\\\n", " ")
    return [tuple(line.split(None, 1)) for line in text.splitlines()  # type: ignore[misc]
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_image_copies_what_exists_and_runs_the_cli() -> None:
    steps = containerfile()
    copies = [shlex.split(rest)[:-1] for op, rest in steps if op == "COPY"]
    assert copies
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()}
    for src in (s for srcs in copies for s in srcs):
        assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"
        assert src.rstrip("/") not in ignored, f"COPY {src}: excluded by .dockerignore"
    entry = json.loads(next(rest for op, rest in steps if op == "ENTRYPOINT"))
    cmd = json.loads(next(rest for op, rest in steps if op == "CMD"))
    assert entry == ["kvstore"]
    assert build_parser().parse_args(cmd).command == "serve"
    # the packages the code imports are all copied (pyproject.toml's package list)
    assert {"kvstore/", "engines/", "scheduler/", "launcher/", "protos/"} <= {s for srcs in copies for s in srcs}


def test_the_image_installs_as_the_makefile_does() -> None:
    pin = re.compile(r"torch==[\d.]+")
    assert set(pin.findall(CONTAINERFILE.read_text())) == set(pin.findall((ROOT / "Makefile").read_text()))
    text = CONTAINERFILE.read_text()
    assert "libibverbs1" in text and "'.[vllm]'" in text and "grpc_tools.protoc" in text
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    images = {c["image"] for _, t in pod_templates() for c in containers(t) if not c["image"].startswith("redis:")}
    assert images == {f"kvstore:{version}"}


# -- docs/deploy.md's commands ---------------------------------------------------------------

def doc_commands(program: str) -> list[list[str]]:
    """The command lines of docs/deploy.md's shell blocks that run ``program`` (continuations
    joined; leading VAR=value assignments dropped)."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)
    out = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        words = shlex.split(line.split(" #")[0]) if line.strip() and not line.startswith("#") else []
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words.pop(0)
        if words[:len(program.split())] == program.split():
            out.append(words[len(program.split()):])
    return out


def test_the_docs_commands_parse() -> None:
    """Every ``kvstore`` line of docs/deploy.md parses with the CLI; every vLLM line's
    connector settings with the connector's."""
    from engines.vllm.pool_link import ConnectorConfig
    kvstore_lines = doc_commands("kvstore")
    assert {"serve", "scheduler"} <= {words[0] for words in kvstore_lines}
    for words in kvstore_lines:
        try:
            build_parser().parse_args(words)
        except SystemExit:
            pytest.fail(f"docs/deploy.md: `kvstore {shlex.join(words)}` does not parse (see stderr)")
    vllm_lines = doc_commands("python -m engines.vllm.api_server")
    assert len(vllm_lines) == 2
    for words in vllm_lines:
        kv = json.loads(words[words.index("--kv-transfer-config") + 1])
        assert kv["kv_connector_module_path"] == "engines.vllm.connector"
        ConnectorConfig.from_extra(kv.get("kv_connector_extra_config"))


def test_the_redis_container_serves_only_with_its_password(tmp_path: Path) -> None:
    """The Redis container's own script, run here (its config directory and port moved): the
    config it writes is one redis-server takes, bound to the pod's address, with the password."""
    import shutil
    import subprocess
    import time

    import redis

    from launcher.supervisor import free_port
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    c = the("kvstore-redis", "redis")
    assert c["command"] == ["sh", "-c"]
    port = free_port()
    script = c["args"][0].replace("/run/redis", str(tmp_path)).replace("port 6379", f"port {port}")
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "POD_IP": "127.0.0.2", "REDIS_PASSWORD": "pw-0123456789"}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    try:
        good = redis.Redis(host="127.0.0.2", port=port, password="pw-0123456789", socket_timeout=5)
        for _ in range(100):
            try:
                assert good.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "redis-server exited: the config it was given is not valid"
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.2", port=port, socket_timeout=5).set("k", "v")
        assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0     # the password file: owner only
    finally:
        proc.terminate()
        proc.wait(timeout=10)
