"""The front door's OpenAI surface on the wire, through a raw HTTP client (urllib) against a
real front door over real engines and a real store node on 127.0.0.1
(tests/helpers/frontdoor_cluster.py): status codes and JSON shapes of errors (404 for an unknown
path or model, 405 with Allow), the model card, the ids and objects of each answer, and
the 400s for what the built-in engines do not apply (never silently ignored)."""
from __future__ import annotations

import json
import logging

import pytest

from engines.model import TINY_MODEL_ID
from tests.helpers.frontdoor_cluster import call, cluster_fixture, complete, door_fixture, sse_events, url_fixture  # noqa: F401  (cluster_fixture, door_fixture, url_fixture: fixtures)


def error_of(status: int, data: bytes, want_status: int) -> dict:
    """The ``error`` object of an answer, checked to be OpenAI's shape."""
    assert status == want_status, data
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_an_unknown_path_is_a_json_404(url):
    status, headers, data = call(url, "/v1/embeddings", {"input": "x"})
    err = error_of(status, data, 404)
    assert headers["Content-Type"].startswith("application/json") and err["code"] == "not_found"
    assert "/v1/embeddings" in err["message"]


@pytest.mark.parametrize("method,path,allow", [("GET", "/v1/completions", "POST"),
                                               ("GET", "/v1/chat/completions", "POST"),
                                               ("POST", "/v1/models", "GET"),
                                               ("DELETE", "/health", "GET")])
def test_a_wrong_method_is_a_json_405_naming_the_allowed_one(url, method, path, allow):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url + path, method=method, data=b"{}" if method != "GET" else None)
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=30)
    err = error_of(exc.value.code, exc.value.read(), 405)
    assert err["code"] == "method_not_allowed" and allow in exc.value.headers["Allow"]


def test_the_model_card_and_model_not_found(url):
    status, _, data = call(url, f"/v1/models/{TINY_MODEL_ID}")
    card = json.loads(data)
    assert status == 200 and card["id"] == TINY_MODEL_ID and card["object"] == "model"
    err = error_of(*call(url, "/v1/models/llama-3-8b")[::2], 404)
    assert err["code"] == "model_not_found" and err["param"] == "model" and "llama-3-8b" in err["message"]
    status, _, data = call(url, "/v1/completions", {"model": "llama-3-8b", "prompt": "hi", "max_tokens": 2})
    assert error_of(status, data, 404)["code"] == "model_not_found"
    ok = complete(url, {"model": TINY_MODEL_ID, "prompt": "hi", "max_tokens": 2})   # the served one
    assert ok["model"] == TINY_MODEL_ID and ok["id"].startswith("cmpl-") and ok["object"] == "text_completion"


def test_chat_ids_and_objects_whole_and_streamed(url):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3,
            "ignore_eos": True}
    whole = json.loads(call(url, "/v1/chat/completions", body)[2])
    assert whole["id"].startswith("chatcmpl-") and whole["object"] == "chat.completion"
    events = sse_events(call(url, "/v1/chat/completions", {**body, "stream": True})[2])
    assert {e["id"] for e in events} == {events[0]["id"]} and events[0]["id"].startswith("chatcmpl-")
    assert {e["object"] for e in events} == {"chat.completion.chunk"} and all("usage" not in e for e in events)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),   # without stream
    ({"prompt": "hi", "stream": True, "stream_options": []}, "stream_options"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": "hi", "stop": [None]}, "stop"),          # a null in the list was a 500
    ({"prompt": "hi", "stop": ["end", None]}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": None, "max_tokens": 0},
     "max_tokens"),                                      # a null max_completion_tokens hid max_tokens
    ({"prompt": "hi", "seed": 1.5}, "seed"),
    ({"prompt": "hi", "seed": 2 ** 64}, "seed"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "best_of": 3}, "best_of"),
    ({"prompt": "hi", "best_of": True}, "best_of"),      # True == 1 and 0 == False passed as neutral
    ({"prompt": "hi", "echo": 0}, "echo"),
    ({"prompt": "hi", "repetition_penalty": True}, "repetition_penalty"),
    ({"prompt": "hi", "min_tokens": False}, "min_tokens"),
    ({"prompt": "hi", "suffix": "end"}, "suffix"),
    ({"prompt": "hi", "cache_salt": "key-0123456789abcdef"}, "cache_salt"),   # the namespace is the API key's
    ({"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"prompt": "hi", "logprobs": 9}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "hi", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"prompt": "hi", "top_k": 5}, "top_k"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": ""}, "prompt"),                          # these four said "param": null
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 2, 10 ** 6]}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
])
def test_what_is_not_applied_is_a_400_naming_the_field(url, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = error_of(*call(url, path, body)[::2], 400)
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


def test_a_chat_content_part_the_model_cannot_take_is_named(url):
    for part, said in (({"type": "image_url", "image_url": {"url": "x"}}, "is a 'image_url' part"),
                       ({"type": "text"}, "is a text part without a string 'text'"),
                       ("hello", "is not a content part")):
        body = {"messages": [{"role": "user", "content": "hi"},
                             {"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}
        err = error_of(*call(url, "/v1/chat/completions", body)[::2], 400)
        assert f"messages[1].content[1] {said}" in err["message"] and err["code"] == "unsupported_content"


def test_neutral_values_of_unapplied_fields_are_served(url):
    got = complete(url, {"prompt": "hi", "max_tokens": 2, "echo": False, "best_of": 1, "presence_penalty": 0,
                         "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": None, "seed": -5,
                         "top_k": -1, "repetition_penalty": 1.0, "min_tokens": 0,
                         "temperature": 0.7, "top_p": 0.9})
    assert len(got["choices"][0]["token_ids"]) == 2 and got["choices"][0]["logprobs"] is None


def test_a_temperature_too_small_for_float32_is_greedy_and_the_engine_stays_up(url):
    """1e-300 is 0 in float32: the engine's draw divided 0 by 0 (NaN), the prefill failed with
    an escaped UNKNOWN and the front door took the instance out of routing for every tenant.
    Sampling that cold is the argmax: the greedy tokens, and the engines stay up."""
    body = {"prompt": "The pool remembers every block.", "max_tokens": 4, "ignore_eos": True}
    greedy = complete(url, body)["choices"][0]["token_ids"]
    for temperature in (1e-300, 5e-324, 1e-39):
        got = complete(url, {**body, "temperature": temperature, "seed": 7})
        assert got["choices"][0]["token_ids"] == greedy, temperature
    status, _, data = call(url, "/health")
    assert status == 200 and json.loads(data)["status"] == "ok", data


def test_a_body_that_cannot_be_read_is_a_json_400_and_one_too_large_a_json_413(url):
    """aiohttp's own refusals in OpenAI's shape too: a body that is not the Content-Encoding
    it claims (it was a 500 with a traceback), and one over the size limit (a plain-text 413)."""
    for encoding in ("gzip", "deflate"):
        status, headers, data = call(url, "/v1/completions", raw=b"not compressed at all",
                                     headers={"Content-Encoding": encoding})
        err = error_of(status, data, 400)
        assert err["code"] == "invalid_body" and encoding in err["message"]
        assert headers["Content-Type"].startswith("application/json")
    status, _, data = call(url, "/v1/completions", raw=b" " * (2 << 20))     # the limit: 1 MiB at 4096 tokens
    err = error_of(status, data, 413)
    assert err["code"] == "request_too_large" and "1048576" in err["message"]
    # a Content-Length over the limit is refused at once, before any of the body is read (its
    # sender waited for the read timeout, then got a 408)
    import socket
    import urllib.parse
    u = urllib.parse.urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000000\r\n\r\n{")
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert complete(url, {"prompt": [1, 2, 3], "max_tokens": 1})["choices"]   # and it serves on


def test_a_compressed_body_is_decoded_and_a_bomb_stops_at_the_limit(url):
    import gzip
    import zlib
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    half = len(body) // 2
    for encoding, raw in [("gzip", gzip.compress(body)), ("x-gzip", gzip.compress(body)),
                          ("gzip", gzip.compress(body[:half]) + gzip.compress(body[half:])),   # two members
                          ("deflate", zlib.compress(body)), ("deflate", zlib.compress(body, wbits=-15)),
                          ("identity", body)]:
        status, _, data = call(url, "/v1/completions", raw=raw, headers={"Content-Encoding": encoding})
        assert status == 200 and json.loads(data)["choices"], (encoding, data)
    bomb = gzip.compress(b" " * (40 << 20))              # 40 KiB sent, 40 MiB decoded
    err = error_of(*call(url, "/v1/completions", raw=bomb, headers={"Content-Encoding": "gzip"})[::2], 413)
    assert err["code"] == "request_too_large" and str(1 << 20) in err["message"]
    cut = gzip.compress(body)[:-12]
    err = error_of(*call(url, "/v1/completions", raw=cut, headers={"Content-Encoding": "gzip"})[::2], 400)
    assert err["code"] == "invalid_body" and "ends before" in err["message"]


def test_many_gzip_members_are_refused_at_once_and_the_door_answers_meanwhile(url):
    """Review: each gzip member cost a copy of the rest of the body, on the event loop: 150,000
    empty members (3 MB) held both front doors 8 s, /health included."""
    import gzip
    import threading
    import time
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    step = -(-len(body) // 16)
    sixteen = b"".join(gzip.compress(body[i * step:(i + 1) * step]) for i in range(16))   # 16 members: served
    assert call(url, "/v1/completions", raw=sixteen, headers={"Content-Encoding": "gzip"})[0] == 200
    gz = {"Content-Encoding": "gzip"}
    assert call(url, "/v1/completions", raw=sixteen + gzip.compress(b""), headers=gz)[0] == 400
    many = gzip.compress(body) + gzip.compress(b"") * 45_000     # 0.9 MB: under the 1 MiB limit as sent
    answers: list[float] = []

    def health() -> None:
        t0 = time.perf_counter()
        assert call(url, "/health")[0] == 200
        answers.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    side = threading.Thread(target=health)
    side.start()
    status, _, data = call(url, "/v1/completions", raw=many, headers={"Content-Encoding": "gzip"})
    side.join(30)
    err = error_of(status, data, 400)
    assert err["code"] == "invalid_body" and "more than 16 gzip members" in err["message"]
    assert time.perf_counter() - t0 < 5 and answers and answers[0] < 5


def test_the_body_limit_follows_the_context_and_a_large_body_is_parsed_off_the_event_loop(url):
    """Attack review: a 74 kB gzip body of a million empty chat messages (29 MiB of JSON) held
    the event loop 2.2 s (json.loads, then the messages' checks) — every tenant's streams and
    the store's health check with it. The body limit is now 64 bytes a token of context (1
    MiB at least: this door's 4096 tokens), a large or compressed body is parsed in a worker
    thread, one per tenant at a time (scheduler/frontdoor/parse_slots.py), and more messages than the
    context has tokens are refused before any is looked at."""
    import gzip
    bomb = gzip.compress(b'{"messages": [' + b",".join([b'{"role":"user","content":""}'] * 1_000_000) + b"]}")
    err = error_of(*call(url, "/v1/chat/completions", raw=bomb, headers={"Content-Encoding": "gzip"})[::2], 413)
    assert err["code"] == "request_too_large" and "1048576" in err["message"], err
    # under the limit, a large body that is valid is served from the worker thread
    padded = b'{"prompt": [1, 2, 3], "max_tokens": 1' + b" " * (900 << 10) + b"}"
    status, _, data = call(url, "/v1/completions", raw=padded)
    assert status == 200 and json.loads(data)["usage"]["prompt_tokens"] == 3, data
    status, _, data = call(url, "/v1/completions", raw=gzip.compress(padded), headers={"Content-Encoding": "gzip"})
    assert status == 200 and json.loads(data)["usage"]["prompt_tokens"] == 3, data
    for messages, raw in ((5000, None),            # on the event loop (small), then the thread (compressed)
                          (30_000, gzip.compress(json.dumps({"messages": [{"role": "user", "content": ""}] * 30_000})
                                                 .encode()))):
        body = {"messages": [{"role": "user", "content": ""}] * messages, "max_tokens": 1}
        extra = {"headers": {"Content-Encoding": "gzip"}, "raw": raw} if raw else {}
        err = error_of(*call(url, "/v1/chat/completions", None if raw else body, **extra)[::2], 400)
        assert err["code"] == "context_length_exceeded" and f"{messages} messages" in err["message"], err
    assert call(url, "/health")[0] == 200


def test_content_encoding_on_several_lines_is_one_list(url):
    """RFC 9110 §5.3: "gzip" then "br" on two lines is "gzip, br": more than one coding, a
    415 (only the first line was read: a br body went through as gzip's)."""
    import gzip
    import http.client
    import urllib.parse
    body = gzip.compress(json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode())
    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        for name, value in [("Content-Type", "application/json"), ("Content-Encoding", "gzip"),
                            ("Content-Encoding", "br"), ("Content-Length", str(len(body)))]:
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        err = error_of(resp.status, resp.read(), 415)
        assert err["code"] == "unsupported_media_type" and "gzip, br" in err["message"]
    finally:
        conn.close()


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, gzip"])
def test_an_encoding_not_supported_is_a_json_415_and_no_traceback(url, encoding, caplog):
    """aiohttp's parser failed on codings it cannot decode before any handler ran: a
    plain-text 400 telling the client to install Brotli, and a traceback at ERROR per request
    (no key needed, any path); a body not the gzip it claimed logged one more when drained."""
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    with caplog.at_level(logging.INFO):
        status, headers, data = call(url, "/v1/completions", raw=body, headers={"Content-Encoding": encoding})
        err = error_of(status, data, 415)
        assert err["code"] == "unsupported_media_type" and encoding in err["message"]
        assert headers["Content-Type"].startswith("application/json")
        status, _, data = call(url, "/health", raw=b"x", headers={"Content-Encoding": encoding})
        assert error_of(status, data, 405)["code"] == "method_not_allowed"
        call(url, "/v1/completions", raw=b"not gzip", headers={"Content-Encoding": "gzip"})
        assert complete(url, {"prompt": [1, 2, 3], "max_tokens": 1})["choices"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml"])
def test_a_body_sent_as_another_type_than_json_is_a_415(url, content_type):
    """A browser sends text, form and multipart bodies to any origin without asking it
    (CORS simple requests): a web page must not spend a key-less front door's engines."""
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    status, _, data = call(url, "/v1/completions", raw=body, headers={"Content-Type": content_type})
    err = error_of(status, data, 415)
    assert err["code"] == "unsupported_media_type" and content_type in err["message"]


def test_json_with_parameters_a_json_suffix_or_no_content_type_is_served(url):
    import http.client
    import urllib.parse
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
        status, _, data = call(url, "/v1/completions", raw=body, headers={"Content-Type": content_type})
        assert status == 200 and json.loads(data)["choices"], (content_type, data)
    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=body)     # http.client adds no Content-Type
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["choices"]
    finally:
        conn.close()


@pytest.mark.parametrize("raw", [b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
                                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 b"zz\r\n"],
                         ids=["bad-header", "bad-content-length", "bad-chunk-size"])
def test_a_malformed_request_is_a_400_and_one_debug_line_not_a_traceback(url, raw, caplog):
    """aiohttp logged each request its parser refused at ERROR with a traceback: anyone who
    reaches the port, key or not, grew the log by one per connection."""
    import socket
    import urllib.parse
    where = urllib.parse.urlsplit(url)
    for level in (logging.INFO, logging.DEBUG):
        caplog.clear()
        with caplog.at_level(level):
            with socket.create_connection((where.hostname, where.port), timeout=30) as s:
                s.sendall(raw)
                status_line = s.recv(100).split(b"\r\n")[0]
                assert status_line.startswith(b"HTTP/1.") and b" 400 " in status_line, status_line
            assert complete(url, {"prompt": [1, 2, 3], "max_tokens": 1})["choices"]
        server = [r for r in caplog.records if r.name == "aiohttp.server"]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], caplog.text
        if level == logging.DEBUG:   # one line, naming what was wrong
            assert len(server) == 1 and "400" in server[0].getMessage(), caplog.text
        else:
            assert not server


def test_a_batch_of_one_that_is_not_a_prompt_names_the_token_ids():
    """``[["x"]]`` was "only one prompt per request is supported, got a batch of 1"."""
    from engines.tokenizer import load_tokenizer
    from scheduler.frontdoor.openai_api import APIError, ModelLimits, parse_completion
    limits = ModelLimits(vocab_size=256 + 16, max_model_len=512)
    with pytest.raises(APIError) as exc:
        parse_completion({"prompt": [["x"]]}, load_tokenizer(None, 256 + 16), limits, 16)
    assert exc.value.status == 400 and "integer token ids" in str(exc.value)
    assert parse_completion({"prompt": [[5, 6]]}, load_tokenizer(None, 256 + 16), limits, 16).prompt == (5, 6)


def test_tokenize_detokenize_version_and_ping_as_vllm_serves_them(url):
    """vLLM's /tokenize, /detokenize, /version and /ping (new-user review: each was a 404)."""
    status, _, data = call(url, "/tokenize", {"prompt": "hi there"})
    body = json.loads(data)
    assert status == 200 and body["count"] == len(body["tokens"]) == 8 and body["max_model_len"] == 4096, body
    status, _, data = call(url, "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and json.loads(data) == {"prompt": "hi there"}
    chat = json.loads(call(url, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[2])
    served = complete(url, {"prompt": chat["tokens"], "max_tokens": 1})     # the chat template's tokens
    assert served["usage"]["prompt_tokens"] == chat["count"] > 2
    for path, bad, code in (("/tokenize", {}, "missing_prompt"), ("/tokenize", {"prompt": 3}, "missing_prompt"),
                            ("/detokenize", {"tokens": [1, "a"]}, "invalid_type"),
                            ("/detokenize", {"tokens": [10 ** 9]}, "invalid_value"),
                            ("/tokenize", {"prompt": "x", "model": "nope"}, "model_not_found")):
        status, _, data = call(url, path, bad)
        assert status in (400, 404) and json.loads(data)["error"]["code"] == code, (path, bad, data)
    status, _, data = call(url, "/version")
    assert status == 200 and json.loads(data)["version"]
    assert call(url, "/ping")[0] == 200 and call(url, "/ping", {})[0] == 200


def test_the_messages_an_engine_renders_again_are_the_ones_the_front_door_rendered():
    """The front door over vLLM sends chat ``messages`` on to the decode instance, which
    renders them with its template: only each role (as the template names it) and its text go,
    so fields the front door neither checked nor counted (``name``, ``tool_calls``) cannot make
    that prompt differ from the one it prefilled."""
    from engines.tokenizer import ByteTokenizer
    from scheduler.frontdoor.openai_api import ModelLimits, parse_chat
    messages = [{"role": "developer", "content": "be brief", "name": "x" * 1000},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                 "tool_calls": [{"id": 1}]}]
    req = parse_chat({"messages": messages}, ByteTokenizer(), ModelLimits(vocab_size=512, max_model_len=8192), 8)
    assert list(req.messages) == [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "ab"}]
