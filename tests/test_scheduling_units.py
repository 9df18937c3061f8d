"""How ``make test`` hands tests to its two workers (tests/conftest.py): a module at a time,
every module that starts vLLM in one unit."""
from __future__ import annotations

from tests.conftest import _unit_of


def test_every_module_that_starts_vllm_is_one_unit_and_any_other_module_is_its_own() -> None:
    assert _unit_of("tests/launcher/test_demo_vllm.py::test_x") == "vllm"
    assert _unit_of("tests/scheduler/vllm/test_vllm_frontdoor.py::test_y[colocated]") == "vllm"
    assert _unit_of("tests/engines/vllm/test_vllm_connector.py::test_z") == "vllm"
    assert _unit_of("tests/test_sizes.py::test_a") == "tests/test_sizes.py"
    assert _unit_of("tests/kvstore/test_kill9.py::test_b") == "tests/kvstore/test_kill9.py"

