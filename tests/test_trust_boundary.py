"""The transfer engine inside its trust boundary, on real store node processes: off on a
single node unless asked for, on (with a warning that it listens on every interface) when
the node joins a cluster through Redis."""
from __future__ import annotations

import grpc
import pytest

from protos import transfer_pb2 as pb
from protos import transfer_pb2_grpc as pb_grpc

pytest.importorskip("mooncake.engine")
WARNING = "listens on every interface"


def _info(address: str) -> pb.TransferInfoResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.BlockTransferStub(channel).Info(pb.TransferInfoRequest(), timeout=10)


def test_a_single_node_runs_no_transfer_engine_by_default(spawn_store_node, tmp_path):
    _, address = spawn_store_node("solo", "--dram", "8MiB", "--ssd", "0")
    info = _info(address)
    assert info.te_endpoint == "" and info.control_port == 0
    assert WARNING not in (tmp_path / "solo.log").read_text(errors="replace")


def test_a_cluster_node_runs_it_and_warns(spawn_store_node, redis_url, tmp_path):
    _, address = spawn_store_node("member", "--dram", "8MiB", "--ssd", "0", "--redis", redis_url)
    info = _info(address)
    assert info.te_endpoint and info.control_port
    log = (tmp_path / "member.log").read_text(errors="replace")
    assert WARNING in log and "private fabric" in log


def test_asked_for_on_a_single_node_it_runs_and_warns(spawn_store_node, tmp_path):
    _, address = spawn_store_node("asked", "--dram", "8MiB", "--ssd", "0", "--transfer-engine", "tcp")
    assert _info(address).te_endpoint
    assert WARNING in (tmp_path / "asked.log").read_text(errors="replace")
