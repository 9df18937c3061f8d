"""The front door's OpenAI surface through the official ``openai`` SDK (``openai.OpenAI``
pointed at a real front door over real engines of the tiny model and a real store node on
127.0.0.1, tests/frontdoor_cluster.py): the model card and ``model_not_found``, seeded
sampling that reproduces, stop strings, usage in a stream only when asked, chat with content
parts and chat ids, and a stream whose chunks carry each token's text as it decodes."""
from __future__ import annotations

import codecs
from typing import Any, Iterator

import openai
import pytest

from engines.model import TINY_MODEL_ID
from tests.frontdoor_cluster import (  # noqa: F401  (cluster_fixture, door_fixture, url_fixture: fixtures)
    BS, cluster_fixture, door_fixture, prompt_of, url_fixture)

MODEL = TINY_MODEL_ID
OFFSET = 3           # the byte tokenizer's id of byte 0 (engines/tokenizer.py)


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=url + "/v1", api_key="sk-sdk-tenant", max_retries=0, timeout=60)
    yield c
    c.close()


def ids_of(choice: Any) -> list[int]:
    """Our extension field: the generated token ids of a choice (or of a stream chunk's)."""
    return list(choice.model_extra["token_ids"])


def test_models_list_and_retrieve_and_an_unknown_model_is_model_not_found(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4o")
    assert exc.value.code == "model_not_found"
    for call in (lambda: client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2),
                 lambda: client.chat.completions.create(model="gpt-4o", max_tokens=2,
                                                        messages=[{"role": "user", "content": "hi"}])):
        with pytest.raises(openai.NotFoundError) as exc:
            call()
        assert exc.value.code == "model_not_found" and "gpt-4o" in exc.value.message


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(client):
    prompt = prompt_of(90, 2 * BS + 5)

    def sample(seed: int | None, temperature: float = 1.0, top_p: float = 1.0) -> list[int]:
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=temperature,
                                        top_p=top_p, seed=seed, extra_body={"ignore_eos": True})
        return ids_of(got.choices[0])

    greedy = sample(None, temperature=0.0)
    first, again = sample(7), sample(7)
    assert first == again and len(first) == 12
    assert sample(8) != first                 # another seed, other draws
    assert first != greedy                    # sampled, not the argmax: 12 draws over 512 ids
    assert sample(7, top_p=1e-6) == greedy    # a nucleus of one token is the argmax
    # streamed with the same seed: the same tokens, and each chunk carries one
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7,
                                       stream=True, extra_body={"ignore_eos": True})
    assert [t for chunk in stream for t in ids_of(chunk.choices[0])] == first


def test_a_stop_string_cuts_the_text_and_finishes_with_stop(client):
    prompt = prompt_of(91, BS + 7)
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == text[:text.index(stop)] and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens < 24
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("include_usage", [None, False, True])
def test_a_stream_carries_usage_only_when_asked(client, include_usage):
    opts = None if include_usage is None else {"include_usage": include_usage}
    chunks = list(client.completions.create(model=MODEL, prompt="usage please", max_tokens=5, stream=True,
                                            stream_options=opts, extra_body={"ignore_eos": True}))
    if include_usage:
        *chunks, last = chunks
        assert last.choices == [] and last.usage.completion_tokens == 5
        assert last.usage.prompt_tokens == len("usage please".encode())
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_takes_content_parts_and_answers_with_chat_ids_and_objects(client):
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "kvstore."}]
    as_parts = client.chat.completions.create(model=MODEL, max_tokens=6, extra_body={"ignore_eos": True},
                                              messages=[{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": parts}])
    as_text = client.chat.completions.create(model=MODEL, max_tokens=6, extra_body={"ignore_eos": True},
                                             messages=[{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hello, kvstore."}])
    assert as_parts.id.startswith("chatcmpl-") and as_parts.object == "chat.completion"
    assert as_parts.choices[0].message.role == "assistant" and as_parts.choices[0].finish_reason == "length"
    assert ids_of(as_parts.choices[0]) == ids_of(as_text.choices[0])   # the parts joined are the prompt
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True},
                                                 messages=[{"role": "user", "content": parts}]))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == \
        client.chat.completions.create(model=MODEL, max_tokens=6, extra_body={"ignore_eos": True},
                                       messages=[{"role": "user", "content": parts}]).choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_logprobs_are_refused_with_a_400_that_says_so(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=2)
    assert "logprobs" in exc.value.message and exc.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, max_tokens=2, logprobs=True, top_logprobs=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert "logprobs" in exc.value.message


def test_each_chunk_carries_its_tokens_text_as_soon_as_it_decodes(client):
    """The first chunk's text is the first token's; each chunk carries exactly the characters
    its token completes (the stdlib's UTF-8 decoder is the oracle), so a chunk is empty only
    while its byte begins a character not yet complete. Before the fix, ids past the byte
    range decoded to nothing and most of the tiny model's chunks were empty."""
    prompt = prompt_of(92, 3 * BS + 1)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=1.0, seed=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    tokens = [c for c in chunks if ids_of(c.choices[0])]
    assert len(tokens) == 48 and tokens[0].choices[0].text
    raw, sent = b"", ""          # bytes since the last token of no byte; the text they decoded to
    for chunk in tokens:
        (token,) = ids_of(chunk.choices[0])
        if token < OFFSET:          # pad, bos, eos: no text, nothing flushed
            want = ""
        elif token < 256 + OFFSET:  # one more byte: whatever characters it completes
            raw += bytes((token - OFFSET,))
            text, _ = codecs.utf_8_decode(raw, "replace", False)
            want, sent = text[len(sent):], text
        else:                       # no byte: what was held (U+FFFD), then U+FFFD
            want = codecs.utf_8_decode(raw, "replace", True)[0][len(sent):] + "\ufffd"
            raw, sent = b"", ""
        assert chunk.choices[0].text == want, (token, raw[-4:])
