"""Sampling in the built-in engines (engines/sampling.py) and text as it streams
(engines/tokenizer.py ByteStream, scheduler/frontdoor/text_stream.py): greedy is the argmax, a seed
fixes every draw whatever the device or the engine, the nucleus keeps exactly the tokens
its mass needs, draws follow the softmax of logits / temperature; the real decode engine
of the tiny model reproduces a seeded generation token for token; an engine refuses
sampling parameters and logprob counts out of range; decoding a stream piece by piece gives the whole text."""
from __future__ import annotations

import math
import random

import grpc
import pytest
import torch

from engines.decode import DecodeEngine
from engines.model import ModelConfig, load_model
from engines.prefill import PrefillEngine
from engines.sampling import Sampler, nucleus, step_seed
from engines.server import start_engine
from engines.tokenizer import ByteTokenizer
from engines.types import SamplingParams
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc as pb_grpc
from scheduler.frontdoor.text_stream import TextStream

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])


def test_greedy_is_the_argmax_and_a_seed_fixes_each_draw():
    assert Sampler(SamplingParams()).choose(LOGITS, 0) == 0
    s = SamplingParams(temperature=1.0, seed=42)
    draws = [Sampler(s).choose(LOGITS, i) for i in range(50)]
    assert draws == [Sampler(s).choose(LOGITS, i) for i in range(50)]          # same seed, same draws
    assert draws != [Sampler(SamplingParams(1.0, 1.0, 43)).choose(LOGITS, i) for i in range(50)]
    assert len(set(draws)) > 1
    assert step_seed(42, 0) != step_seed(42, 1) != step_seed(43, 0) and 0 <= step_seed(2**64 - 1, 9) < 2**63


def test_draws_follow_the_softmax_of_logits_over_temperature():
    for temperature in (0.5, 1.0, 2.0):
        n = 4000
        counts = [0] * len(LOGITS)
        for seed in range(n):
            counts[Sampler(SamplingParams(temperature, 1.0, seed)).choose(LOGITS, 0)] += 1
        want = torch.softmax(LOGITS / temperature, dim=-1).tolist()
        for got, p in zip(counts, want):   # within 4.5 standard deviations of the binomial
            assert abs(got / n - p) < 4.5 * math.sqrt(p * (1 - p) / n) + 1e-9, (temperature, counts, want)


def test_the_nucleus_keeps_the_most_likely_tokens_up_to_top_p():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    assert nucleus(probs, 0.8).tolist() == pytest.approx([0.0, 0.5, 0.0, 0.3])   # 0.5 + 0.3 reach 0.8
    assert nucleus(probs, 0.81).tolist() == pytest.approx([0.15, 0.5, 0.0, 0.3])
    assert nucleus(probs, 1e-9).tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0])  # the most likely stays
    s = SamplingParams(temperature=1.5, top_p=0.8, seed=0)
    assert {Sampler(SamplingParams(1.5, 0.6, seed)).choose(LOGITS, 0) for seed in range(300)} <= {0, 1}
    assert Sampler(s).choose(LOGITS, 3) in (0, 1, 2)


def test_a_huge_or_tiny_temperature_never_gives_nan():
    big = torch.tensor([1e30, -1e30, 0.0])
    assert Sampler(SamplingParams(1e-30, 1.0, 1)).choose(big, 0) == 0
    assert Sampler(SamplingParams(1e-300, 1.0, 1)).choose(LOGITS, 0) == 0   # 0 in float32: greedy
    assert Sampler(SamplingParams(2.0, 1.0, 1)).choose(big, 0) == 0


def test_the_decode_engine_reproduces_a_seeded_generation_and_resumes_the_same():
    """Prefill draws token 0, decode the rest, with the same seed: twice the same; a second
    decode engine (another process's model, same weights) gives the same tokens."""
    lm = load_model(ModelConfig(block_size=16))
    prompt = [random.Random(5).randrange(3, 512) for _ in range(37)]
    s = SamplingParams(temperature=1.0, top_p=0.95, seed=11)

    def generate(params: SamplingParams) -> list[int]:
        r = PrefillEngine(lm, None).prefill("r", prompt, "t", sampling=params)
        steps = DecodeEngine(lm, None).decode("r", prompt, r.first_token, r.block_keys, r.tail_kv, 16,
                                              sampling=params, namespace="t")
        return [step.token for step in steps]

    first = generate(s)
    assert generate(s) == first and len(first) == 16
    assert generate(SamplingParams(1.0, 0.95, 12)) != first
    greedy = generate(SamplingParams())
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert greedy == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("sampling,needle", [
    (pb.SamplingParams(temperature=float("nan"), top_p=1.0), "temperature"),
    (pb.SamplingParams(temperature=3.0, top_p=1.0), "temperature"),
    (pb.SamplingParams(temperature=-0.5), "temperature"),
    (pb.SamplingParams(temperature=1.0, top_p=1.5), "top_p"),
])
def test_an_engine_refuses_sampling_out_of_range(sampling, needle):
    server, port = start_engine("prefill", None, block_size=16)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as exc:
                pb_grpc.EngineStub(ch).Prefill(pb.PrefillRequest(request_id="r", prompt=[5, 6, 7], namespace="t",
                                                                 sampling=sampling), timeout=30)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in exc.value.details()
            ok = pb_grpc.EngineStub(ch).Prefill(pb.PrefillRequest(
                request_id="r", prompt=[5, 6, 7], namespace="t", sampling=pb.SamplingParams(temperature=1.0)),
                timeout=30)   # top_p 0 (unset) is 1
            assert 0 <= ok.first_token < 512
    finally:
        server.stop(None).wait()


def test_an_engine_refuses_more_than_20_logprob_alternatives():
    server, port = start_engine("prefill", None, block_size=16)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.EngineStub(ch)
            with pytest.raises(grpc.RpcError) as exc:
                stub.Prefill(pb.PrefillRequest(request_id="r", prompt=[5, 6], namespace="t", top_logprobs=21),
                             timeout=30)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in exc.value.details()
            ok = stub.Prefill(pb.PrefillRequest(request_id="r", prompt=[5, 6], namespace="t", top_logprobs=20),
                              timeout=30)
            top = ok.first_logprobs
            assert len(top.top_ids) == 20 and top.top_ids[0] == ok.first_token and top.logprob <= 0
            assert list(top.top_logprobs) == sorted(top.top_logprobs, reverse=True)
    finally:
        server.stop(None).wait()


class _CheckpointLike:
    """The byte tokenizer seen only through the Tokenizer protocol, as a checkpoint's
    tokenizer is: TextStream then takes its generic path (decode the whole, send the new)."""

    def __init__(self) -> None:
        self._tok = ByteTokenizer()
        self.eos_token_id, self.vocab_size = self._tok.eos_token_id, self._tok.vocab_size
        self.encode, self.decode = self._tok.encode, self._tok.decode
        self.apply_chat_template = self._tok.apply_chat_template


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), _CheckpointLike()], ids=["bytes", "generic"])
def test_a_stream_decoded_piece_by_piece_is_the_whole_text(tokenizer):
    rng = random.Random(1)
    text = "ascii, é, €, 😀 and more"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer)
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) + stream.flush() == text
    assert pieces[0] == "a" and pieces[ids.index("é".encode()[0] + 3)] == ""   # é's first byte waits
    for _ in range(200):
        ids = [rng.randrange(0, 512) for _ in range(rng.randrange(1, 20))]
        stream = TextStream(tokenizer)
        assert "".join(stream.push(t) for t in ids) + stream.flush() == tokenizer.decode(ids)
