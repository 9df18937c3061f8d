"""The same-host control channel's socket (kvstore/dataplane/control_server.py,
kvstore/config.py): an accept loop that survives accept errors, a path that replaces only a
dead node's socket, and a path too long for a socket put in a directory of this user's alone."""
from __future__ import annotations

import os
import time

import pytest

from kvstore.client import StoreClient
from kvstore.dataplane.control_client import UdsControl
from kvstore.node import StoreNode
from kvstore.pool.pool import KVPool, PoolSettings
from tests.helpers.dataplane_helpers import MIB, block_of, key_of, socket_path


def test_the_accept_loop_survives_accept_errors(slab_node) -> None:
    """EMFILE and the like are transient: the server logs, backs off and accepts again."""
    import errno
    pool, _, path = slab_node()
    server = slab_node.nodes[id(pool)].control

    class Flaky:
        def __init__(self, sock):
            self.sock, self.failures = sock, 3

        def accept(self):
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return self.sock.accept()

        def __getattr__(self, name):
            return getattr(self.sock, name)

    flaky = server._sock = Flaky(server._sock)
    UdsControl(path).close()           # wakes the accept already waiting; the next ones fail
    deadline = time.monotonic() + 5
    while flaky.failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert flaky.failures == 0
    ctl = UdsControl(path)             # served after the failures
    assert ctl.lookup([key_of(1)]) == (0, ())
    ctl.close()


def test_the_socket_path_replaces_only_a_dead_nodes_socket(make_dram, tmp_path) -> None:
    """A stale socket (its node died) is replaced; a regular file at the path is left as it
    was and the node refuses to start, saying why."""
    import socket as sockets
    pool = KVPool([make_dram(8 * MIB)], settings=PoolSettings(high_watermark=1.0, low_watermark=1.0))
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    with pytest.raises(OSError, match="not a Unix socket"):
        StoreNode.serve(pool, dataplane_socket=str(precious))
    assert precious.read_text() == "keep me"
    stale = socket_path()
    dead = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    dead.bind(stale)
    dead.close()                       # bound, never listening: what a killed node leaves
    served = StoreNode.serve(pool, dataplane_socket=stale)
    try:
        with StoreClient(served.address) as client:
            assert client.put(key_of(1), block_of(1, 4096)).ok
            assert client._local() is not None
    finally:
        served.stop(grace_s=None)


def test_a_socket_path_too_long_goes_to_a_directory_of_this_users_alone(make_dram, tmp_path, monkeypatch) -> None:
    """A data dir too deep for a socket's path put it at /tmp/kvstore-<node>-<pid>.sock, a
    name in the shared /tmp that another user could take first (the node then could not
    start). Now it is in $XDG_RUNTIME_DIR/kvstore, else <tmp>/kvstore-<uid>, mode 0700;
    one of another user's or open to others there stops the node, naming it."""
    import stat

    from kvstore.config import StoreConfig
    runtime = tmp_path / "run"
    runtime.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    deep = str(tmp_path / ("d" * 100))
    path = StoreConfig(data_dir=deep, node_id="n-1").dataplane_socket_path()
    assert path is not None and path.startswith(str(runtime / "kvstore") + "/") and len(path) < 108
    assert stat.S_IMODE(os.stat(runtime / "kvstore").st_mode) == 0o700
    pool = KVPool([make_dram(8 * MIB)])
    served = StoreNode.serve(pool, dataplane_socket=path)
    try:
        with StoreClient(served.address) as client:
            assert client.put(key_of(1), block_of(1, 4096)).ok and client._local() is not None
    finally:
        served.stop(grace_s=None)
    os.chmod(runtime / "kvstore", 0o755)             # open to others: refused, not used
    with pytest.raises(OSError, match="of this user's alone"):
        StoreConfig(data_dir=deep, node_id="n-1").dataplane_socket_path()
    monkeypatch.delenv("XDG_RUNTIME_DIR")             # none: a private directory under <tmp>
    path = StoreConfig(data_dir=deep, node_id="n-1").dataplane_socket_path()
    assert path is not None and os.path.basename(os.path.dirname(path)) == f"kvstore-{os.getuid()}"
