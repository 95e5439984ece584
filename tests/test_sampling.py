"""Sampler and stop-condition logic against plain restatements of their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from memra.engine.output import OutputProcessor
from memra.engine.sampling import Sampler, SampleResult, SamplingParams


def _logits(seed=0, v=50):
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = _logits()
    assert Sampler(SamplingParams(temperature=0), [], 50).sample(x).token == int(x.argmax())


def test_same_seed_same_tokens_and_different_seed_differs():
    x = _logits(1)
    def run(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed), [], 50)
        return [s.sample(x).token for _ in range(40)]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_only_samples_top_k():
    x = _logits(2)
    allowed = set(torch.topk(x, 3).indices.tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=0), [], 50)
    got = {s.sample(x).token for _ in range(300)}
    assert got <= allowed and len(got) == 3


def test_top_p_keeps_smallest_nucleus():
    x = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=0), [], 4)
    got = {s.sample(x).token for _ in range(300)}
    assert got == {0, 1}  # 0.5 < 0.75 so token 1 is needed; 0.8 >= 0.75 so token 2 is not


def test_min_p_drops_unlikely_tokens():
    x = torch.log(torch.tensor([0.6, 0.3, 0.07, 0.03]))
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.1, seed=0), [], 4)
    got = {s.sample(x).token for _ in range(400)}
    assert got == {0, 1, 2}  # 0.03 < 0.1 * 0.6


def test_sampling_distribution_matches_softmax_with_temperature():
    x = torch.tensor([1.0, 0.0, -1.0])
    s = Sampler(SamplingParams(temperature=2.0, seed=3), [], 3)
    n = 6000
    counts = torch.bincount(torch.tensor([s.sample(x).token for _ in range(n)]), minlength=3).float() / n
    want = torch.softmax(x / 2.0, 0)
    assert torch.allclose(counts, want, atol=0.03), (counts, want)


def test_repetition_penalty_matches_definition():
    x = torch.tensor([2.0, -2.0, 1.9, 0.5])
    # token 0 (positive logit) is divided, token 1 (negative) multiplied: greedy then picks token 2
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5), [0, 1], 4)
    assert s.sample(x).token == 2


def test_presence_and_frequency_penalties():
    x = torch.tensor([3.0, 2.5, 0.0])
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=0.4), [], 3)
    toks = [s.sample(x).token for _ in range(3)]
    # after one 0: 3.0-0.4=2.6 > 2.5 -> 0 again; after two: 2.2 < 2.5 -> 1
    assert toks == [0, 0, 1]
    s = Sampler(SamplingParams(temperature=0, presence_penalty=1.0), [], 3)
    assert [s.sample(x).token for _ in range(3)] == [0, 1, 0]


def test_logprobs_are_raw_log_softmax():
    x = _logits(4)
    r = Sampler(SamplingParams(temperature=0.7, logprobs=3, seed=1), [], 50).sample(x)
    lp = torch.log_softmax(x, 0)
    assert math.isclose(r.logprob, float(lp[r.token]), rel_tol=1e-6)
    assert [i for i, _ in r.top] == torch.topk(lp, 3).indices.tolist()


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                dict(min_p=1.0), dict(max_tokens=0), dict(n=0), dict(repetition_penalty=0),
                                dict(presence_penalty=3), dict(logprobs=21), dict(stop=[""]),
                                dict(temperature=float("nan")), dict(seed="x")])
def test_invalid_params_name_the_parameter(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


class FakeTok:
    """Byte-level toy tokenizer: token i < 256 is byte i."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def _run(text: str, params: SamplingParams, eos=(), extra=()):

    proc = OutputProcessor(0, FakeTok(), params, list(eos), [])
    chunks = []
    for b in list(text.encode()) + list(extra):
        if proc.finished:
            break
        chunks.append(proc.add(SampleResult(b)))
    return proc.out, chunks


def test_stop_string_across_tokens_is_cut_and_never_streamed():
    out, chunks = _run("Hello, wor" + "ld END more", SamplingParams(max_tokens=100, stop=["END", "ld E"]))
    assert out.text == "Hello, wor"
    assert out.finish_reason == "stop" and out.stop_reason == "ld E"
    assert "".join(chunks) == out.text


def test_eos_and_stop_token_ids_and_length():
    out, _ = _run("abc", SamplingParams(max_tokens=100), eos=[ord("b")])
    assert (out.text, out.finish_reason, out.stop_reason) == ("a", "stop", ord("b"))
    out, _ = _run("abc", SamplingParams(max_tokens=100, ignore_eos=True), eos=[ord("b")])
    assert out.text == "abc" and out.finish_reason is None
    out, _ = _run("abcdef", SamplingParams(max_tokens=4))
    assert (out.text, out.finish_reason) == ("abcd", "length")
    out, _ = _run("abcdef", SamplingParams(max_tokens=10, stop_token_ids=[ord("d")]))
    assert (out.text, out.finish_reason, out.token_ids[-1]) == ("abc", "stop", ord("d"))


def test_multibyte_characters_are_not_split():
    out, chunks = _run("héllo 世界 🙂!", SamplingParams(max_tokens=100, stop=["!"]))
    assert out.text == "héllo 世界 🙂"
    assert all("\ufffd" not in c for c in chunks)


def test_stop_strings_before_min_tokens_do_not_count():
    """vLLM's min_tokens: only a stop string completed at or after the min_tokens-th token ends it."""
    p = dict(max_tokens=8, stop=["\n\n"])
    out, _ = _run("Hi\n\nSure", SamplingParams(**p, min_tokens=4))  # "\n\n" completes at token 4
    assert (out.text, out.finish_reason) == ("Hi", "stop")
    out, chunks = _run("Hi\n\nSure", SamplingParams(**p, min_tokens=5))
    assert (out.text, out.finish_reason) == ("Hi\n\nSure", "length") and "".join(chunks) == out.text
    out, _ = _run("Hi\n\nSo\n\nX", SamplingParams(max_tokens=20, stop=["\n\n"], min_tokens=5))
    assert (out.text, out.finish_reason) == ("Hi\n\nSo", "stop")  # the later one counts


def test_logit_bias_and_min_tokens_in_the_sampler():
    torch.manual_seed(0)
    logits = torch.randn(50)
    top = int(logits.argmax())
    s = Sampler(SamplingParams(temperature=0, logit_bias={top: -100}), [], 50)
    assert s.sample(logits).token != top
    s = Sampler(SamplingParams(temperature=0, logit_bias={7: 100}), [], 50)
    assert s.sample(logits).token == 7
    s = Sampler(SamplingParams(temperature=0, max_tokens=5, min_tokens=2), [], 50, end_ids=[top])
    assert [s.sample(logits).token == top for _ in range(3)] == [False, False, True]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="logit_bias: token id 60"):
        Sampler(SamplingParams(logit_bias={60: 1.0}), [], 50)
