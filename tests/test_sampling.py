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


_BATCH_PARAMS = [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
                 dict(temperature=0.5, min_p=0.1), dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02),
                 dict(temperature=1e-3), dict(temperature=2.0, top_k=1), dict(temperature=1.0, top_p=0.05)]


def _twins(v: int, device: str = "cpu"):
    """Pairs of identically seeded samplers, one per parameter set (and a second seed each)."""
    out = []
    for i, kw in enumerate(_BATCH_PARAMS * 2):
        p = SamplingParams(seed=100 + i, max_tokens=50, **kw)
        out.append((Sampler(p, [1, 2], v), Sampler(p, [1, 2], v)))
    return out


def test_batched_device_sampler_draws_what_the_host_sampler_draws(monkeypatch):
    """sample_rows (the GPU runner's batched draw, here on the CPU, in chunks of 5 rows) gives each
    row the token its own Sampler.sample gives from the same logits and seed, step after step; a
    row's token does not depend on the other rows of the batch (each consumes one uniform of its
    own generator)."""
    from memra.engine import sampling
    from memra.engine.sampling import sample_rows

    monkeypatch.setattr(sampling, "SAMPLE_CHUNK", 5)

    v = 300
    pairs = _twins(v)
    g = torch.Generator().manual_seed(7)
    for _ in range(6):
        logits = torch.randn(len(pairs), v, generator=g) * 3
        batched = sample_rows(logits, [a for a, _ in pairs])
        host = [b.sample(logits[r]).token for r, (_, b) in enumerate(pairs)]
        assert [t for t, _ in batched] == host
        for r, ((a, _), (t, lg)) in enumerate(zip(pairs, batched)):
            assert lg == float(logits[r, t])  # the chosen token's own logit, for take()
            a.take(t, lg)
        assert len(set(host)) > 4  # not a degenerate draw
    # batch invariance: the same rows alone give the same tokens
    solo = _twins(v)
    logits = torch.randn(len(solo), v, generator=g)
    together = sample_rows(logits, [a for a, _ in solo])
    alone = [sample_rows(logits[r:r + 1], [b])[0] for r, (_, b) in enumerate(solo)]
    assert together == alone


def test_batched_sampler_respects_the_filters_and_the_distribution():
    """top-k / top-p / min-p never let a filtered token through, and draws follow the filtered
    distribution: 20000 draws over 6 tokens agree with the probabilities to within 5 sigma."""
    from memra.engine.sampling import filtered_probs, inverse_cdf

    x = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    one = lambda t: torch.tensor([t], dtype=torch.float64)  # noqa: E731
    probs = filtered_probs(x, one(1.0), torch.tensor([4]), one(0.9), one(0.0))[0]
    assert probs[4] == 0 and probs[5] == 0  # top-k = 4
    ref = torch.softmax(x[0, :4].double(), 0)
    keep = (torch.cumsum(ref, 0) - ref) < 0.9
    assert torch.equal(probs[:4] > 0, keep)  # top-p over the top 4
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    toks = inverse_cdf(probs.expand(n, -1), u)
    freq = torch.bincount(toks, minlength=6).double() / n
    p = probs / probs.sum()
    assert torch.all((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / n) + 1e-12)
    assert torch.all(freq[probs == 0] == 0)
    mp = filtered_probs(x, one(1.0), torch.tensor([0]), one(1.0), one(0.3))[0]
    assert torch.equal(mp > 0, torch.softmax(x[0].double(), 0) >= 0.3 * torch.softmax(x[0].double(), 0).max())


def test_batched_sampler_refuses_rows_without_a_finite_maximum():
    """A row with NaN or +inf logits reports that maximum, so Sampler.take raises as the host sampler
    does (instead of recording the token a NaN cumulative sum happens to point at)."""
    from memra.engine.sampling import sample_rows

    for bad in (float("nan"), float("inf")):
        logits = torch.tensor([[1.0, bad, 0.5, 2.0], [1.0, 3.0, 0.5, 2.0]])
        pairs = [Sampler(SamplingParams(temperature=1.0, seed=i), [], 4) for i in range(2)]
        (t0, l0), (t1, l1) = sample_rows(logits, pairs)
        with pytest.raises(ValueError, match="no finite logit"):
            pairs[0].take(t0, l0)
        with pytest.raises(ValueError, match="no finite logit"):
            Sampler(SamplingParams(temperature=1.0, seed=0), [], 4).sample(logits[0])
        pairs[1].take(t1, l1)  # the healthy row of the same batch is fine


def test_batchable_excludes_what_only_the_host_sampler_does():
    v = 50
    ok = Sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=1), [], v)
    assert ok.batchable()
    for kw in (dict(temperature=0.0), dict(repetition_penalty=1.2), dict(presence_penalty=0.5),
               dict(frequency_penalty=0.5), dict(logprobs=2), dict(logit_bias={3: 5.0})):
        assert not Sampler(SamplingParams(**({"temperature": 0.8} | kw), seed=1), [], v).batchable(), kw
    banned = Sampler(SamplingParams(temperature=0.8, min_tokens=2, max_tokens=4), [], v, end_ids=[1])
    assert not banned.batchable()
    banned.take(5, 0.0)
    banned.take(6, 0.0)
    assert banned.batchable()  # min_tokens reached: the end ids are no longer banned


@pytest.mark.gpu
def test_batched_sampler_on_the_gpu_draws_what_the_host_draws():
    """The batched draw on the H200 (64 rows, vocabulary 128k, mixed parameters) equals the host
    sampler's tokens from the same fp32 logits and seeds."""
    from memra.engine.sampling import sample_rows

    v = 128_896
    pairs = [(a, b) for a, b in _twins(v)] * 4
    pairs = [(Sampler(a.params, [], v, seed_offset=i), Sampler(a.params, [], v, seed_offset=i))
             for i, (a, _) in enumerate(pairs)]
    g = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        logits = torch.randn(len(pairs), v, generator=g, device="cuda") * 4
        dev = sample_rows(logits, [a for a, _ in pairs])
        host = [b.sample(logits[r].cpu()).token for r, (_, b) in enumerate(pairs)]
        assert [t for t, _ in dev] == host
        for (a, _), (t, lg) in zip(pairs, dev):
            a.take(t, lg)
