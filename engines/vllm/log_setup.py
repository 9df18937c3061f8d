"""The connector's log lines inside vLLM: :func:`log_through_vllm`. Importing this module does
not import vLLM."""
from __future__ import annotations

import logging


def log_through_vllm() -> None:
    """vLLM gives handlers to its own ``vllm`` logger only, so the connector's INFO lines (the
    pool it reached, its data path) would be dropped. In a process whose root logger has no
    handler (vLLM's), give the ``engines`` and ``kvstore`` loggers vLLM's handlers and level,
    not passing their records on to the root (as vLLM does with its own); elsewhere (a test
    run, an application that configured logging or either logger) leave logging alone."""
    ours, theirs = [logging.getLogger(n) for n in ("engines", "kvstore")], logging.getLogger("vllm")
    if logging.getLogger().handlers or not theirs.handlers or any(o.handlers or o.level for o in ours):
        return
    for logger in ours:
        for handler in theirs.handlers:
            logger.addHandler(handler)
        logger.setLevel(theirs.getEffectiveLevel())
        logger.propagate = False
