"""The parts of a resumed stream that need no vLLM server (scheduler/vllm/resume.py): what
resumes, the continuation's body, its events shaped as the stream's, and the text replayed
with the tiny checkpoint's own tokenizer. tests/scheduler/vllm/test_vllm_resume.py resumes real streams."""
from __future__ import annotations

import os
import random

import pytest

from scheduler.vllm.resume import StreamResume, VLLMText, not_resumable


def test_what_resumes_and_what_does_not() -> None:
    assert not_resumable({"temperature": 0, "seed": 3, "min_tokens": 4, "repetition_penalty": 1.2,
                          "stop": [], "logprobs": 2}, 1, chat=False) is None
    assert not_resumable({"logprobs": False}, 1, chat=True) is None
    assert "n=2" in not_resumable({}, 2, chat=False)
    assert "stop" in not_resumable({"stop": "\n"}, 1, chat=False)
    assert "presence_penalty" in not_resumable({"presence_penalty": 0.5}, 1, chat=False)
    assert "frequency_penalty" in not_resumable({"frequency_penalty": -0.1}, 1, chat=True)
    assert "logprobs" in not_resumable({"logprobs": True, "top_logprobs": 2}, 1, chat=True)


def test_the_continuation_carries_the_generated_tokens_and_what_is_left() -> None:
    fields = {"temperature": 0.7, "seed": 9, "min_tokens": 10, "logprobs": False, "ignore_eos": True}
    resume = StreamResume(fields, [7, 8, 9], 20, chat=True, why_not=None)
    resume.seen({"created": 100, "prompt_token_ids": [1, 7, 8, 9, 5],
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    resume.seen({"created": 100, "choices": [{"index": 0, "delta": {"content": "ab"}, "token_ids": [40, 41]}]})
    resume.seen({"created": 100, "choices": [{"index": 0, "delta": {"content": "c"}, "token_ids": [42]}]})
    assert not resume.complete
    body = resume.continuation("served", "chatcmpl-x", "tenant-ns")
    assert body["prompt"] == [1, 7, 8, 9, 5, 40, 41, 42]     # vLLM's chat prompt, then what was generated
    assert (body["max_tokens"], body["min_tokens"], body["seed"], body["temperature"]) == (17, 7, 9, 0.7)
    assert body["cache_salt"] == "tenant-ns" and body["model"] == "served" and body["stream"] is True
    assert body["request_id"] == "chatcmpl-x-resume-1" and "logprobs" not in body
    assert resume.resumed and fields["min_tokens"] == 10           # the request's own fields untouched

    chunk = resume.shape({"id": "cmpl-y", "object": "text_completion", "created": 200, "model": "served",
                          "choices": [{"index": 0, "text": "d", "token_ids": [43], "finish_reason": None,
                                       "prompt_token_ids": body["prompt"]}]})
    assert chunk["object"] == "chat.completion.chunk" and chunk["created"] == 100
    assert chunk["choices"] == [{"index": 0, "delta": {"content": "d"}, "logprobs": None, "finish_reason": None,
                                 "token_ids": [43]}]
    usage = resume.shape({"created": 200, "choices": [], "usage": {
        "prompt_tokens": 8, "completion_tokens": 17, "total_tokens": 25,
        "prompt_tokens_details": {"cached_tokens": 8}}})["usage"]
    assert usage == {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25,
                     "prompt_tokens_details": {"cached_tokens": 5}}


def test_a_stream_that_had_finished_has_nothing_to_resume() -> None:
    resume = StreamResume({}, [7, 8], 4, chat=False, why_not=None)
    resume.seen({"choices": [{"index": 0, "text": "a", "token_ids": [40], "finish_reason": "stop"}]})
    assert resume.complete
    assert resume.usage_event("cmpl-z", "m")["usage"] == {"prompt_tokens": 2, "completion_tokens": 1,
                                                          "total_tokens": 3}


def test_the_replayed_text_is_what_an_uninterrupted_stream_sends(tmp_path) -> None:
    """Byte-level tokens cut anywhere, inside multi-byte characters too: the text replayed
    after the cut equals the uninterrupted stream's from there."""
    tokenizers = pytest.importorskip("tokenizers")
    from engines.vllm.checkpoint import write_tokenizer
    write_tokenizer(str(tmp_path), 4096)
    backend = tokenizers.Tokenizer.from_file(os.path.join(str(tmp_path), "tokenizer.json"))
    rng = random.Random(5)
    text = "kv cache — é ü 語 🙂 " * 3
    prompt = [b + 3 for b in b"prompt: "]
    for trial in range(20):
        generated = [b + 3 for b in text.encode()] if trial == 0 else [rng.randrange(3, 259) for _ in range(40)]
        whole = VLLMText(backend, prompt, [], True)
        pieces = [whole.of([t], False) for t in generated]
        if trial == 0:
            assert "".join(pieces) == text
        for cut in range(len(generated)):
            replayed = VLLMText(backend, prompt, generated[:cut], True)
            assert replayed.of(generated[cut:], False) == "".join(pieces[cut:]), (trial, cut)
    # a last token that stopped the request adds no text, as in vLLM
    assert VLLMText(backend, prompt, [], True).of([b + 3 for b in b"ab"] + [2], True) == "ab"
