"""The front door's OpenAI surface through the official ``openai`` SDK (``openai.OpenAI``
pointed at a real front door over real engines of the tiny model and a real store node on
127.0.0.1, tests/helpers/frontdoor_cluster.py): the model card and ``model_not_found``, seeded
sampling that reproduces, stop strings, usage in a stream only when asked, chat with content
parts and chat ids, logprobs (the model's log-softmax), and a stream whose chunks carry each
token's text as it decodes."""
from __future__ import annotations

import codecs
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

import openai
import pytest
import torch

from engines.model import TINY_MODEL_ID, ModelConfig, load_model
from tests.helpers.frontdoor_cluster import BS, cluster_fixture, door_fixture, prompt_of, url_fixture  # noqa: F401  (cluster_fixture, door_fixture, url_fixture: fixtures)

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
        assert last.usage.prompt_tokens == len(b"usage please")
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


def test_a_developer_message_is_a_system_message(client):
    """OpenAI renamed the system role ``developer``; the SDK sends it and vLLM takes it (it
    was a 400 here). The chat template knows ``system``: the two give one prompt."""
    def ask(role: str) -> Any:
        return client.chat.completions.create(model=MODEL, max_tokens=4, extra_body={"ignore_eos": True},
                                              messages=[{"role": role, "content": "Be brief."},
                                                        {"role": "user", "content": "Hello."}])
    developer, system = ask("developer"), ask("system")
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens
    assert ids_of(developer.choices[0]) == ids_of(system.choices[0])


def test_a_batch_of_one_prompt_is_that_prompt_and_a_batch_of_two_a_400(client):
    """``prompt=["..."]`` is how the SDK's type hints lead a caller to write one prompt (it
    was a 400 here); a real batch stays a 400 naming its size."""
    one = client.completions.create(model=MODEL, prompt=["Hello, kvstore."], max_tokens=4,
                                    extra_body={"ignore_eos": True})
    plain = client.completions.create(model=MODEL, prompt="Hello, kvstore.", max_tokens=4,
                                      extra_body={"ignore_eos": True})
    assert one.usage.prompt_tokens == plain.usage.prompt_tokens and one.choices[0].text == plain.choices[0].text
    tokens = client.completions.create(model=MODEL, prompt=[[5, 6, 7, 8]], max_tokens=2)
    assert tokens.usage.prompt_tokens == 4
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=["Hello", "kvstore"], max_tokens=4)
    assert "batch of 2" in str(exc.value) and exc.value.body["param"] == "prompt"


def test_logprobs_are_the_models_log_softmax_whole_and_streamed(client):
    """Completions ``logprobs=3``: each generated token's log probability equals the model's
    log-softmax at its position (one uncached forward over prompt + output is the oracle);
    greedy picks the most likely, so it tops its alternatives; text_offset runs over the
    tokens' texts. The stream carries the same, one token per chunk."""
    prompt = prompt_of(93, BS + 3)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp, ids = got.choices[0].logprobs, ids_of(got.choices[0])
    lm = load_model(ModelConfig(block_size=BS))
    with torch.inference_mode():
        logits = lm.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    want = torch.log_softmax(logits.float(), dim=-1)
    assert lp.token_logprobs == pytest.approx([float(want[i, t]) for i, t in enumerate(ids)], abs=1e-4)
    assert [max(d.values()) for d in lp.top_logprobs] == pytest.approx(want.max(dim=-1).values.tolist(), abs=1e-4)
    assert lp.token_logprobs == pytest.approx([max(d.values()) for d in lp.top_logprobs], abs=1e-6)
    assert lp.text_offset == list(accumulate([0] + [len(t) for t in lp.tokens[:-1]]))
    chunks = [c for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logprobs=3, stream=True,
                                                   extra_body={"ignore_eos": True}) if ids_of(c.choices[0])]
    assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and ids_of(plain.choices[0]) == ids


def test_chat_logprobs_with_top_alternatives(client):
    messages = [{"role": "user", "content": "logprobs, please"}]
    got = client.chat.completions.create(model=MODEL, max_tokens=4, logprobs=True, top_logprobs=2,
                                         messages=messages, extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2 and all(0 <= b < 256 for b in entry.bytes)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)      # greedy: the most likely
    chunks = client.chat.completions.create(model=MODEL, max_tokens=4, logprobs=True, top_logprobs=2, stream=True,
                                            messages=messages, extra_body={"ignore_eos": True})
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    with pytest.raises(openai.BadRequestError) as exc:      # out of OpenAI's range
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=6)
    assert exc.value.param == "logprobs"


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
