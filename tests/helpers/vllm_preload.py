"""Imported once by the fork server the test engines are forked from
(tests/helpers/vllm_driver.py): vLLM, its offline LLM class and the kvstore connector, with
the driver's environment set first (vLLM reads most of it when an engine is built, some of
it at import)."""
from __future__ import annotations

import os

from tests.helpers.vllm_driver import ENV

for _name, _value in ENV.items():
    os.environ.setdefault(_name, _value)

import vllm  # noqa: E402,F401
import vllm.entrypoints.llm  # noqa: E402,F401

import engines.vllm.connector  # noqa: E402,F401
