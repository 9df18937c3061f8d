"""The ports ``kvstore up`` holds for its services (kvstore/port_hold.py): a process of another
user cannot bind one — on its address or the wildcard, however it sets SO_REUSEADDR and
SO_REUSEPORT — while the service is starting, serving, or gone between a crash and its restart,
so it never receives the bearer tokens the service's clients send. The service itself, told
its port is held, binds beside the hold and serves; without a hold a port in use stays an
error. Real sockets, a real metrics server and gRPC server, a real process as ``nobody``."""
from __future__ import annotations

import urllib.request
from concurrent import futures

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvstore.metrics_http import MetricsServer
from kvstore.port_hold import HELD_ENV, hold
from kvstore.wire.channel import listen, server_options
from launcher.supervisor import Stack, port_taker
from tests.helpers.other_user import binds_as_nobody, need_other_user

REFUSED = ["EADDRINUSE"] * 8


def test_a_free_port_without_a_hold_is_the_squatters():
    """The attack the hold stops: nothing listens on the port yet, so another user binds it."""
    need_other_user()
    sock = hold("127.0.0.1")
    port = sock.getsockname()[1]
    sock.close()
    assert "bound" in binds_as_nobody("127.0.0.1", port)


def test_a_held_port_refuses_another_user_before_during_and_after_its_service(monkeypatch, tmp_path):
    stack = Stack(log_dir=str(tmp_path / "logs"))
    port = port_taker("127.0.0.1", stack.holds)()
    assert binds_as_nobody("127.0.0.1", port) == REFUSED              # before the service starts
    with pytest.raises(OSError, match="cannot listen"):                 # no hold told: in use stays an error
        MetricsServer(CollectorRegistry(), port=port, token="t")
    monkeypatch.setenv(HELD_ENV, "1")
    server = MetricsServer(CollectorRegistry(), port=port, token="t")   # beside the hold
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer t"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        assert binds_as_nobody("127.0.0.1", port) == REFUSED          # while it serves
    finally:
        server.close()
    assert binds_as_nobody("127.0.0.1", port) == REFUSED              # between a crash and its restart
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)   # refused: no one listens
    stack.stop()                                                        # the stack's end frees it
    assert "bound" in binds_as_nobody("127.0.0.1", port)


def test_a_grpc_service_binds_beside_its_hold_only_when_told(monkeypatch):
    holds: list = []
    port = port_taker("127.0.0.1", holds)()
    try:
        refused = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=server_options())
        with pytest.raises(RuntimeError, match="port in use"):
            listen(refused, f"127.0.0.1:{port}", "store node")
        monkeypatch.setenv(HELD_ENV, "1")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=server_options())
        assert listen(server, f"127.0.0.1:{port}", "store node") == port
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=10)
        channel.close()
        server.stop(0)
    finally:
        for sock in holds:
            sock.close()


def test_the_front_doors_port_is_held_from_the_preflight_to_the_end_of_kvstore_up(tmp_path, capsys):
    """``kvstore up --port 0`` picks the front door's port by holding it, in its preflight, and
    holds it until it ends, across the stacks it starts one after another (a comparison's
    set-ups): there is no moment between the pick and the front door's start, or between two
    set-ups, when another user could bind it. A second kvstore up is refused the port."""
    import argparse

    from launcher.supervisor import port_is_free, release_front_door
    from launcher.up import preflight
    args = argparse.Namespace(host="127.0.0.1", port=0, data_dir=str(tmp_path / "up"), keep_data=False, replay=None)
    port = preflight(args)
    assert port
    try:
        assert binds_as_nobody("127.0.0.1", port) == ["EADDRINUSE"] * 8
        for _ in range(2):            # two set-ups, one after the other
            stack = Stack(log_dir=str(tmp_path / "logs"))
            stack.hold_port("127.0.0.1", port)
            assert stack.front_door_held and stack.holds == []     # the run's hold, not the stack's
            stack.stop()
            assert binds_as_nobody("127.0.0.1", port) == ["EADDRINUSE"] * 8
        again = argparse.Namespace(**{**vars(args), "port": port, "data_dir": str(tmp_path / "up2")})
        assert preflight(again) is None
        assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err
        assert binds_as_nobody("127.0.0.1", port) == ["EADDRINUSE"] * 8    # still the first one's
    finally:
        release_front_door()
    assert port_is_free("127.0.0.1", port)
