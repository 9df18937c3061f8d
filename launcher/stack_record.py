"""The record ``kvstore up`` keeps of its running stack, where ``kvctl`` finds it (its
addresses, the path of its tokens, over vLLM what its keys are made of), and its removal."""
from __future__ import annotations

import contextlib
import os

from kvstore.auth import REDIS_URL_ENV


def record_stack(stores: list[str], engines: list[str], url: str, data_dir: str,
                 redis_url: str | None, vllm: dict | None = None) -> str:
    """Record the running stack where kvctl looks (kvstore/kvctl/common.py ``up_file``:
    ``$XDG_RUNTIME_DIR/kvstore/up-<pid>.json``, mode 0600, one per running ``kvstore up``):
    this process's pid, the store nodes', engines' and front door's addresses, the path of its
    ``auth.env`` (which gets the Redis URL too, since a private Redis's holds its password)
    and over vLLM what its keys are made of (``vllm``: model, block_size, ...). Records of a
    ``kvstore up`` that died without removing its own are removed. Returns the file's path."""
    import json

    from kvstore.kvctl.common import stale_records, up_file
    for stale in stale_records(os.path.dirname(up_file())):
        with contextlib.suppress(OSError):
            os.remove(stale)
    auth_env = os.path.abspath(os.path.join(data_dir, "auth.env"))
    if redis_url:
        with open(auth_env, "a") as f:
            f.write(f"{REDIS_URL_ENV}={redis_url}\n")
    path = up_file()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    doc = {"version": 1, "pid": os.getpid(), "stores": stores, "engines": engines, "frontdoor": url,
           "auth_env": auth_env, "data_dir": os.path.abspath(data_dir), "cluster": bool(redis_url), "vllm": vllm}
    fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(f"{path}.tmp", path)
    print(f"kvctl          finds this stack through {path} (kvctl tiers, kvctl nodes, ...; "
          f"kvctl --stack {os.getpid()} ... when several run)", flush=True)
    return path


def forget_stack(path: str | None) -> None:
    """Remove the record :func:`record_stack` wrote, if it is still this process's."""
    if not path:
        return
    import json
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            mine = json.load(f).get("pid") == os.getpid()
        if mine:
            os.remove(path)
