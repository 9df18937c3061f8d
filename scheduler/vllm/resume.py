"""A stream whose decode instance fails mid-stream, continued on another instance
(docs/resume.md).

The front door over vLLM (:mod:`scheduler.vllm.frontdoor`) records what a stream has carried
(:class:`StreamResume`): the prompt's token ids (a completion's as sent; a chat's as vLLM's
first chunk gives them, ``return_token_ids``), the token ids generated so far, ``created``.
When the instance fails after the stream began, the request goes on as a completion on
another instance that decodes (:meth:`StreamResume.continuation`): the prompt's ids and the
generated ids as its prompt, ``max_tokens`` less what was generated, ``min_tokens`` likewise,
the same sampling fields and ``cache_salt`` (the tenant's namespace). The prompt's full
blocks come from the pool through the kvstore connector (the prefill saved them); only the
generated tokens, and the prompt's last partial block, are computed again. Its events are
shaped as the stream's (:meth:`StreamResume.shape`): the same ``created``, chat chunks
(``delta``) for a chat stream, and a ``usage`` that describes the whole request.

What does not resume (:func:`not_resumable`) ends as before, with an error event: ``n`` > 1,
``stop`` strings, ``presence_penalty`` / ``frequency_penalty``, chat ``logprobs``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CONTINUATION_PATH = "/v1/completions"
_INVALID_PREFIX = "Invalid prefix encountered"     # tokenizers' DecodeStream, as vLLM matches it

# Fields a continuation drops: chat's logprobs (a bool; chat logprobs do not resume).
_CHAT_ONLY = ("logprobs", "top_logprobs")


def not_resumable(body: dict[str, Any], n: int, chat: bool) -> str | None:
    """Why a stream of this request cannot resume on another instance, or None when it can.

    * ``n`` > 1: each sequence would need a continuation of its own;
    * ``stop`` strings: vLLM holds back the text that may begin one, so the text sent lags
      the token ids, and a stop string across the break would be missed;
    * ``presence_penalty`` / ``frequency_penalty``: vLLM counts them over generated tokens
      only, and a continuation's generated tokens are its prompt (``repetition_penalty``
      counts prompt and output alike, so it resumes);
    * chat ``logprobs``: a completion's logprobs do not translate into chat's exactly.
    """
    if n > 1:
        return f"n={n} (each sequence would need its own continuation)"
    if body.get("stop"):
        return "stop strings (vLLM holds back the text that may begin one)"
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name):
            return f"{name} (vLLM counts it over generated tokens only)"
    if chat and body.get("logprobs"):
        return "chat logprobs (a completion's logprobs do not translate into chat's exactly)"
    return None


class StreamResume:
    """What one stream has carried, and the continuation of it. ``fields``: the sampling
    fields sent to the first instance (:data:`scheduler.vllm.frontdoor.PASSTHROUGH`);
    ``prompt``: the prompt's token ids as the front door tokenized it (a chat stream takes
    vLLM's from its first chunk); ``why_not``: :func:`not_resumable`'s answer."""

    def __init__(self, fields: dict[str, Any], prompt: Sequence[int], max_tokens: int, chat: bool,
                 why_not: str | None, backend: Any = None) -> None:
        self.fields = fields
        self.backend = backend     # the model's tokenizers.Tokenizer (None: vLLM's text as it comes)
        self._text: VLLMText | None = None
        self.prompt = list(prompt)
        self.max_tokens = max_tokens
        self.chat = chat
        self.why_not = why_not
        self.generated: list[int] = []
        self.before = 0             # tokens generated before the current continuation
        self.legs = 0               # continuations started
        self.created: int | None = None
        self.finished = False       # a finish_reason was relayed
        self.usage_seen = False

    @property
    def resumed(self) -> bool:
        return self.legs > 0

    @property
    def complete(self) -> bool:
        """Nothing more to generate: a finish reason was relayed, or every token was."""
        return self.finished or len(self.generated) >= self.max_tokens

    def seen(self, event: dict[str, Any]) -> None:
        """Record an event as vLLM sent it (before :meth:`shape`)."""
        if self.created is None and isinstance(event.get("created"), int):
            self.created = event["created"]
        if not self.resumed and self.chat and event.get("prompt_token_ids"):
            self.prompt = list(event["prompt_token_ids"])      # the chat template's, as vLLM applied it
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            self.generated.extend(choice.get("token_ids") or ())
            if choice.get("finish_reason"):
                self.finished = True
        if event.get("usage"):
            self.usage_seen = True

    def continuation(self, model: str, request_id: str, namespace: str) -> dict[str, Any]:
        """The next continuation's body for :data:`CONTINUATION_PATH` (``namespace``: the
        tenant's, vLLM's ``cache_salt``); counts it in ``legs``."""
        self.legs += 1
        self.before = len(self.generated)
        if self.backend is not None:
            self._text = VLLMText(self.backend, self.prompt, self.generated,
                                  self.fields.get("skip_special_tokens", True) is not False)
        out = {k: v for k, v in self.fields.items() if not (self.chat and k in _CHAT_ONLY)}
        if out.get("min_tokens"):
            out["min_tokens"] = max(0, int(out["min_tokens"]) - self.before)
        out.update(model=model, prompt=self.prompt + self.generated, max_tokens=self.max_tokens - self.before,
                   request_id=f"{request_id}-resume-{self.legs}", cache_salt=namespace, stream=True,
                   stream_options={"include_usage": True}, return_token_ids=True)
        return out

    def shape(self, event: dict[str, Any]) -> dict[str, Any]:
        """A continuation's event shaped as the stream's: its ``created``, no second
        ``prompt_token_ids``, chat chunks for a chat stream, the whole request's usage."""
        if self.created is not None:
            event["created"] = self.created
        event.pop("prompt_token_ids", None)
        for choice in event.get("choices") or ():
            choice.pop("prompt_token_ids", None)
            if self._text is not None and choice.get("index", 0) == 0:
                choice["text"] = self._text.of(choice.get("token_ids") or (), choice.get("finish_reason") == "stop"
                                               and not self.fields.get("include_stop_str_in_output"))
        if self.chat:
            event["object"] = "chat.completion.chunk"
            event["choices"] = [_chat_choice(c) for c in event.get("choices") or ()]
        usage = event.get("usage")
        if usage:
            prompt = len(self.prompt)
            completion = self.before + int(usage.get("completion_tokens") or 0)
            usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                details["cached_tokens"] = min(int(details["cached_tokens"]), prompt)
        return event

    def usage_event(self, request_id: str, model: str) -> dict[str, Any]:
        """The usage chunk of a stream whose generation was over when its instance failed
        (before vLLM's usage chunk): what the front door counted; no cached tokens known."""
        prompt, completion = len(self.prompt), len(self.generated)
        return {"id": request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created or 0, "model": model, "choices": [],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}


def _chat_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """A completion's stream choice as a chat one: its text as ``delta.content``."""
    text = choice.get("text") or ""
    out: dict[str, Any] = {"index": choice.get("index", 0), "delta": {"content": text},
                           "logprobs": None, "finish_reason": choice.get("finish_reason")}
    for key in ("stop_reason", "token_ids"):
        if key in choice:
            out[key] = choice[key]
    return out


class VLLMText:
    """The text vLLM would have streamed for the tokens of an uninterrupted request: its
    incremental detokenization (a ``tokenizers`` ``DecodeStream`` primed with the prompt, as
    vLLM's ``FastIncrementalDetokenizer``), replayed over the tokens already sent, then
    stepped over the continuation's. A continuation's own text starts from a stream primed
    with prompt and generated tokens alike, which differs where the break falls inside a
    character (and was seen to repeat earlier text)."""

    def __init__(self, backend: Any, prompt: Sequence[int], generated: Sequence[int],
                 skip_special_tokens: bool) -> None:
        from tokenizers.decoders import DecodeStream
        self._new = lambda: DecodeStream(skip_special_tokens=skip_special_tokens)
        self.backend = backend
        self.stream = DecodeStream(ids=list(prompt), skip_special_tokens=skip_special_tokens)
        for token in generated:
            self._step(token)

    def _step(self, token: int) -> str:
        try:
            return self.stream.step(self.backend, token) or ""
        except (OverflowError, TypeError):
            return ""
        except Exception as exc:    # tokenizers raises a plain Exception here
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            self.stream = self._new()       # vLLM starts a fresh stream (vllm-project/vllm#17448)
            return self.stream.step(self.backend, token) or ""

    def of(self, tokens: Sequence[int], stop_terminated: bool) -> str:
        """The text of a chunk's ``tokens``; a last token that stopped the request (EOS or a
        stop token id) adds none, as in vLLM."""
        if stop_terminated and tokens:
            tokens = tokens[:-1]
        return "".join(self._step(t) for t in tokens)
