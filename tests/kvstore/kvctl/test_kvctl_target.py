"""Where kvctl goes when no stack is running: the default address, and an error that says so."""
from __future__ import annotations

import json
import socket
import subprocess

import pytest

from tests.helpers.kvctl_helpers import kvctl, kvctl_env


def test_with_no_stack_running_a_refused_default_address_is_explained(tmp_path) -> None:
    """After a ``kill -9`` of ``kvstore up`` its record stays; kvctl skips it, asks the default
    address, and when nothing answers there says why it asked it, naming the stale record."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 50051)) == 0:
            pytest.skip("something listens on 127.0.0.1:50051, kvctl's default address")
    exited = subprocess.Popen(["true"])
    exited.wait()
    records = tmp_path / "run" / "kvstore"
    records.mkdir(parents=True)
    (records / f"up-{exited.pid}.json").write_text(json.dumps({"pid": exited.pid, "stores": ["127.0.0.1:1"]}))
    env = kvctl_env(tmp_path, token=None)
    del env["KVSTORE_UP_FILE"]
    env["XDG_RUNTIME_DIR"] = str(tmp_path / "run")
    rc, out, err = kvctl(env, "--timeout", "5", "tiers")
    assert rc == 1 and out["success"] is False, (out, err)
    assert "store node at 127.0.0.1:50051: UNAVAILABLE" in err, err
    assert "no kvstore up of this user is running" in err and "127.0.0.1:50051 is only the default" in err, err
    assert f"up-{exited.pid}.json names a stack that has exited" in err, err
