"""vLLM instances as the router sees them: the model they serve (keyed exactly as the kvstore
connector keys it), an HTTP client of one instance's OpenAI API, and its load as its
``/metrics`` reports it.

:class:`VLLMClient` answers what the router asks of an engine — ``info()``, ``prefill(...)``
(a one-token completion with ``cache_salt`` set from the tenant: the instance, a
``kv_producer``, has saved every full prompt block to the pool when it answers) — plus
``complete``/``stream`` (a request relayed to a decode instance, whose ``kv_consumer``
connector loads the prompt's blocks from the pool) and ``load()``.

Errors: an instance that cannot be reached, times out, breaks a stream or answers 5xx raises
:class:`~kvstore.errors.Unavailable`; a 4xx (vLLM rejected the request) raises
:class:`~kvstore.errors.InvalidArgument` with vLLM's message.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from engines.checkpoint_identity import WEIGHT_SUFFIXES, model_identity
from engines.types import EngineInfo, PrefillResult
from engines.vllm.launch import SERVED_MODEL_NAME
from engines.vllm.layout import PagedLayout, checkpoint_quantized, model_variant
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.index.keys import KVLayout
from scheduler.policy.costing import attention_ratio

KEEPALIVE_S = 4.0   # an idle connection to an instance: less than vLLM's 5-s keep-alive


def _attention_ratio(cfg: dict[str, Any], heads: int, head_dim: int) -> float:
    """:attr:`VLLMModel.attention_ratio` from a parsed ``config.json`` (0 without its dimensions)."""
    try:
        return attention_ratio(int(cfg["hidden_size"]), heads, int(cfg.get("num_key_value_heads") or heads),
                               head_dim, int(cfg["intermediate_size"]))
    except (ValueError, KeyError, TypeError, InvalidArgument):
        return 0.0


@dataclass(frozen=True)
class VLLMModel:
    """The checkpoint the instances serve: ``paged`` (the connector's key layout: model id,
    revision, KV layout), ``vocab_size`` (model), ``eos_token_id``, ``attention_ratio`` (the
    model's ``s_per_token_context / s_per_token`` by its FLOPs,
    :func:`scheduler.policy.costing.attention_ratio`; 0 when its ``config.json`` does not give
    the dimensions, and T_prefill beyond the prompts measured is then bounded by the longest
    one's speed alone). Built from the local checkpoint directory, as the connector builds it
    from vLLM's config."""

    model_dir: str
    paged: PagedLayout
    vocab_size: int
    eos_token_id: int
    attention_ratio: float = 0.0

    @classmethod
    def from_dir(cls, model_dir: str, block_size: int = 32, dtype: str | None = None,
                 quantization: str | None = None, hf_overrides: dict | None = None) -> VLLMModel:
        """``dtype``: the instances' ``--dtype`` (default: the checkpoint's);
        ``quantization`` and ``hf_overrides``: theirs (:func:`engines.vllm.layout.model_variant`:
        the connector keys them). Raises InvalidArgument when ``model_dir`` holds no
        ``config.json`` or no weight files (the connector's keys hash them:
        :func:`engines.checkpoint_identity.model_identity`), or for ``hf_overrides`` that
        cannot be keyed."""
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise InvalidArgument(f"{model_dir} is not a local checkpoint (no config.json): the front door "
                                  "keys prompts as the connector does and needs the model's directory")
        with open(path) as f:
            cfg = json.load(f)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        dtype = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
        layout = KVLayout(dtype=dtype, num_layers=int(cfg["num_hidden_layers"]),
                          num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
                          block_size=block_size)
        if not any(name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(model_dir)):
            raise InvalidArgument(
                f"{model_dir} holds no weight files ({', '.join(WEIGHT_SUFFIXES)}): the connector keys blocks by "
                "the checkpoint's config.json and weights, so the front door needs the same directory the vLLM "
                "instances serve, weights included (read once, at start), or its keys would match none of theirs")
        eos = cfg.get("eos_token_id", 0)
        eos = eos[0] if isinstance(eos, list) else eos
        variant = model_variant(quantization, hf_overrides, checkpoint_quantized(cfg, model_dir))
        return cls(model_dir, PagedLayout(*model_identity(model_dir, None), layout, variant=variant),
                   int(cfg["vocab_size"]), int(eos or 0), _attention_ratio(cfg, heads, head_dim))

    @property
    def block_size(self) -> int:
        return self.paged.block_size

    def keys(self, tokens: Sequence[int], namespace: str) -> list[bytes]:
        """The pool keys of ``tokens``' full blocks for tenant ``namespace`` (sent to vLLM as
        ``cache_salt``): the connector's own keys."""
        return self.paged.keys(tokens, namespace)

    def key_spec(self) -> dict[str, Any]:
        """The connector's key extras but the tenant, as JSON (``kvstore up`` records it for
        ``kvctl lookup``, which makes the same keys with :class:`kvstore.index.keys.KeyExtras`):
        model id, revision, KV layout, the extras' ``other`` values, block size."""
        extras = self.paged.extras(None)
        assert extras.layout is not None     # PagedLayout always has one
        return {"model_id": extras.model, "revision": extras.revision, "layout": extras.layout.to_json(),
                "other": extras.other, "block_size": self.block_size}

    def engine_info(self, engine_id: str, role: str, max_model_len: int) -> EngineInfo:
        p = self.paged
        return EngineInfo(engine_id, role, p.model_id, p.revision, p.layout, p.block_size, self.vocab_size,
                          self.eos_token_id, "cpu", max_model_len)


@dataclass(frozen=True, slots=True)
class VLLMLoad:
    """An instance's ``/metrics``: requests ``running`` and ``waiting`` in its scheduler,
    ``kv_usage`` (fraction of its paged KV cache in use, 0–1), ``kv_blocks`` (its cache's
    size in blocks; 0 when not reported), ``at_s`` (``time.monotonic()`` of the read)."""

    running: int
    waiting: int
    kv_usage: float
    kv_blocks: int
    at_s: float


# The sampling fields the prefill request carries (see VLLMInstance.prefill): those vLLM
# checks per value; not n, min_tokens, stop or logprobs, which would change or refuse a
# one-token completion (or differ between completions and chat).
PREFILL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias")
_SAMPLE = re.compile(r'^(vllm:[a-z_]+)(\{[^}]*\})?\s+([-+0-9.eEinfa]+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> VLLMLoad:
    """A :class:`VLLMLoad` from vLLM's Prometheus text (summed over its engines)."""
    running = waiting = 0.0
    usage, blocks = 0.0, 0
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "vllm:num_requests_running":
            running += value
        elif name == "vllm:num_requests_waiting":
            waiting += value
        elif name == "vllm:kv_cache_usage_perc":
            usage = max(usage, value)
        elif name == "vllm:cache_config_info":
            found = dict(_LABEL.findall(labels)).get("num_gpu_blocks")
            if found and found.isdigit():
                blocks = int(found)
    return VLLMLoad(int(running), int(waiting), usage, blocks, time.monotonic())


class VLLMClient:
    """One vLLM instance at ``url`` (``http://host:port``) in ``role`` ("prefill", "decode"
    or "colocated"). Must be used inside a running event loop. ``timeout_s``: the limit of
    one request (seconds)."""

    def __init__(self, url: str, role: str, model: VLLMModel, engine_id: str, timeout_s: float = 600.0,
                 api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.address = self.url
        self.role, self.model, self.engine_id, self.timeout_s = role, model, engine_id, timeout_s
        self.served_model = SERVED_MODEL_NAME
        self.max_model_len = 0
        self.last_load: VLLMLoad | None = None
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # An idle connection is dropped after 4 s, before vLLM's server closes it (uvicorn's
            # keep-alive, VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): at aiohttp's default of 15 s a request
            # could go out on a connection the server was closing, fail with "Server disconnected",
            # and mark a healthy instance down.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S), headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=5))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until ``/health`` answers 200 and ``/v1/models`` names the model. Raises Unavailable."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                async with self._http().get(self.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        data = (await r.json())["data"][0]
                        self.served_model = data["id"]
                        self.max_model_len = int(data.get("max_model_len") or 0)
                        return
            except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise Unavailable(f"vLLM instance at {self.url} not ready after {timeout_s} s")
            await asyncio.sleep(0.5)

    async def info(self) -> EngineInfo:
        return self.model.engine_info(self.engine_id, self.role, self.max_model_len or 4096)

    async def health(self) -> bool:
        try:
            async with self._http().get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def load(self) -> VLLMLoad:
        """The instance's ``/metrics``. Raises Unavailable."""
        try:
            async with self._http().get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    raise Unavailable(f"vLLM instance at {self.url}: /metrics answered {r.status}")
                self.last_load = parse_metrics(await r.text())
                return self.last_load
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise Unavailable(f"vLLM instance at {self.url}: {type(exc).__name__}: {exc}") from None

    async def prefill(self, request_id: str, prompt: Sequence[int], namespace: str,
                      max_load_blocks: int | None = None, sampling: dict[str, Any] | None = None) -> PrefillResult:
        """Prefill ``prompt`` on this instance: a one-token completion (greedy unless
        ``sampling`` says otherwise) with ``cache_salt=namespace``. ``sampling``: the request's
        fields of :data:`PREFILL_SAMPLING`, sent along so that vLLM refuses bad ones (a 400:
        InvalidArgument) before it computes anything, rather than the decode instance after
        the prefill was spent; the one token is not used. ``max_load_blocks`` is not honoured
        (the connector loads any pool hit). Returns the result with ``prefill_s`` the measured
        seconds of the call and ``cached_tokens`` as vLLM reports them: the prompt tokens it did
        not compute (its own prefix cache's and the pool's: vLLM's ``num_cached_tokens``)."""
        body = {"model": self.served_model, "prompt": list(prompt), "max_tokens": 1, "temperature": 0,
                **{k: v for k, v in (sampling or {}).items() if k in PREFILL_SAMPLING},
                "cache_salt": namespace, "request_id": f"{request_id}-prefill", "return_token_ids": True}
        t0 = time.perf_counter()
        out = await self.complete("/v1/completions", body)
        seconds = time.perf_counter() - t0
        choice = out["choices"][0]
        cached = int(((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        bs = self.model.block_size
        keys = tuple(self.model.keys(prompt, namespace))
        first = (choice.get("token_ids") or [0])[0]
        return PrefillResult(request_id, int(first), keys, cached, len(prompt) - cached, b"", len(prompt) % bs,
                             seconds, cached // bs, len(keys) - cached // bs)

    async def complete(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` (not streamed) to ``path``; the JSON answer."""
        try:
            async with self._http().post(self.url + path, json=body) as r:
                if r.status != 200:
                    raise await _error(r, self.url)
                return await r.json()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise Unavailable(f"vLLM instance at {self.url}: {type(exc).__name__}: {exc}") from None

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """POST ``body`` with ``stream: true`` to ``path``; yields each server-sent event's
        JSON until ``[DONE]``. A stream that ends without ``[DONE]`` raises Unavailable;
        closing the iteration closes the connection (vLLM aborts the request)."""
        try:
            async with self._http().post(self.url + path, json=body) as r:
                if r.status != 200:
                    raise await _error(r, self.url)
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise Unavailable(f"vLLM instance at {self.url}: {event['error'].get('message')}")
                    yield event
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise Unavailable(f"vLLM instance at {self.url}: {type(exc).__name__}: {exc}") from None
        raise Unavailable(f"vLLM instance at {self.url}: the stream ended before [DONE]")


async def _error(r: aiohttp.ClientResponse, url: str) -> Exception:
    try:
        message = str((await r.json(content_type=None)).get("error", {}).get("message"))
    except (ValueError, AttributeError, aiohttp.ClientError):
        message = (await r.text())[:500]
    if 400 <= r.status < 500:
        return InvalidArgument(f"vLLM: {message}")
    return Unavailable(f"vLLM instance at {url} answered {r.status}: {message}")
