"""Speculative decoding: the ngram proposer, greedy exactness through the engine (smollm2-135m,
CPU), stop conditions inside an accepted run, n = 2, prefix-cache hits and preemption with
speculation on, and losslessness of the acceptance rule at temperature > 0 (a chi-square test
that a deliberately wrong rule fails)."""

from __future__ import annotations

import pytest
import torch

from memra.engine.llm import LLM
from memra.engine.sampling import Sampler, SamplingParams
from memra.engine.speculative import NgramProposer

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "Monday, Tuesday, Wednesday,",
    "<ul>\n  <li>one</li>\n  <li>two</li>\n  <li>",
    "Once upon a time",
    "import os\nimport sys\nimport",
    "a b c d e f g h a b c d",
    "Q: What is 2+2?\nA: 4\nQ: What is 3+3?\nA: 6\nQ: What is 4+4?\nA:",
    "red green blue red green blue red",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "SELECT name FROM users; SELECT age FROM users; SELECT",
    "The capital of France is",
    "x = [1, 1, 2, 3, 5, 8, 13,",
    "Hello! Hello! Hello!",
    "{\"a\": 1, \"b\": 2, \"c\":",
    "To be or not to be, that is",
    "aaaa bbbb aaaa bbbb aaaa",
    "January February March April",
    "print('hi')\nprint('hi')\nprint(",
]


def test_ngram_proposer_finds_the_latest_earlier_match():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]
    assert p.propose([5, 1, 2, 7, 1, 2], 3) == [7, 1, 2]
    assert p.propose([1, 2, 3], 2) == []
    assert p.propose([4, 4, 4], 5) == [4]  # "4 4" last seen at 0: followed by one 4
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


@pytest.fixture(scope="module")
def engines():
    plain = LLM("smollm2-135m", max_model_len=512, max_num_seqs=8)
    spec = LLM("smollm2-135m", max_model_len=512, max_num_seqs=8, speculative_method="ngram",
               num_speculative_tokens=3)
    return plain, spec


def _texts(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]


def test_greedy_is_identical_with_ngram_speculation(engines):
    plain, spec = engines
    params = SamplingParams(max_tokens=64, temperature=0.0)
    a, b = _texts(plain, PROMPTS, params), _texts(spec, PROMPTS, params)
    assert a == b
    e = spec.engine
    assert sum(e.spec_drafted) > 100 and sum(e.spec_accepted) > 20, (e.spec_drafted, e.spec_accepted)


def test_stop_eos_max_tokens_and_n2_inside_accepted_runs(engines):
    plain, spec = engines
    for params in (SamplingParams(max_tokens=5, temperature=0.0),  # max_tokens lands inside a run
                   SamplingParams(max_tokens=64, temperature=0.0, stop=["mul"]),
                   SamplingParams(max_tokens=64, temperature=0.0, stop=["8,"], logprobs=2),
                   SamplingParams(max_tokens=40, temperature=0.0, n=2)):
        a = plain.generate(PROMPTS[:4], params)
        b = spec.generate(PROMPTS[:4], params)
        for x, y in zip(a, b):
            assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in x.outputs] == \
                   [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in y.outputs], params
            if params.logprobs:
                for cx, cy in zip(x.outputs, y.outputs):
                    for (t1, l1, top1), (t2, l2, top2) in zip(cx.logprobs, cy.logprobs):
                        assert t1 == t2 and abs(l1 - l2) < 1e-3 and [t for t, _ in top1] == [t for t, _ in top2]


def test_prefix_cache_hit_and_preemption_with_speculation():
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = LLM("smollm2-135m", max_model_len=256, max_num_seqs=8)
    want = _texts(plain, PROMPTS[:8], params)
    # 20 blocks of 16 tokens for 8 sequences: preemption is certain; the prompts repeat: cache hits
    spec = LLM("smollm2-135m", max_model_len=256, max_num_seqs=8, kv_cache_blocks=20, speculative_method="ngram",
               num_speculative_tokens=4)
    assert _texts(spec, PROMPTS[:8], params) == want
    assert spec.engine.scheduler.num_preemptions > 0
    assert _texts(spec, PROMPTS[:8], params) == want  # again, from the prefix cache
    assert spec.engine.kv.prefix_hits > 0


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 5
    stat = float((((counts - expected) ** 2) / expected)[keep].sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _joint(rule, params, L0, L1, drafts, q, samples, seed):
    """Joint counts [V, V] of the first two tokens: row 0 verifies draft 0, row 1 (given the first
    token) verifies draft 1 if the first was accepted, else is sampled plainly. With a draft
    distribution q the drafts are drawn from it; without, they are the fixed ``drafts`` (q one-hot)."""
    V = L0.shape[0]
    counts = torch.zeros(V, V, dtype=torch.float64)
    dg = torch.Generator().manual_seed(seed)
    for i in range(samples):
        s = Sampler(SamplingParams(**params, seed=seed * 100000 + i), [], V)
        if q[0] is not None:  # a draft model's tokens are drawn from its q (the theorem's premise)
            drafts = [int(torch.multinomial(qj, 1, generator=dg)) for qj in q]
        if rule is None:  # plain sampling
            t1 = s.sample(L0).token
            t2 = s.sample(L1[t1]).token
        else:
            r, ok = rule(s, L0, drafts[0], q[0])
            t1 = r.token
            t2 = (rule(s, L1[t1], drafts[1], q[1])[0] if ok else s.sample(L1[t1])).token
        counts[t1, t2] += 1
    return counts


def _wrong_rule(s, logits, draft, q):
    """A plausible-looking bug: on rejection, sample from p instead of the residual max(0, p - q)."""
    greedy, probs = s._distribution(logits.float())
    qd = 1.0 if q is None else float(q[draft])
    if float(torch.rand((), generator=s.generator, dtype=torch.float64)) * qd < float(probs[draft]):
        return s._record(draft, logits), True
    return s._record(int(torch.multinomial(probs, 1, generator=s.generator)), logits), False


@pytest.mark.parametrize("params,use_q", [({"temperature": 1.0}, False), ({"temperature": 0.8, "top_k": 5}, True),
                                          ({"temperature": 1.3, "top_p": 0.9, "repetition_penalty": 1.2}, False)])
def test_speculative_sampling_is_lossless(params, use_q):
    """20,000 two-token samples per arm on a 6-token vocabulary: speculation (with a one-hot or a
    random draft distribution q) gives the same joint distribution as plain sampling (chi-square
    p > 0.01 against the exact distribution); the wrong rejection rule fails the same test."""
    g = torch.Generator().manual_seed(7)
    V = 6
    L0 = torch.randn(V, generator=g) * 1.5
    L1 = torch.randn(V, V, generator=g) * 1.5
    q = [None, None]
    drafts = [2, 4]
    if use_q:
        q = [torch.softmax(torch.randn(V, generator=g), -1), torch.softmax(torch.randn(V, generator=g), -1)]
    # the exact joint distribution, from the plain sampler's own distribution function
    s = Sampler(SamplingParams(**params), [], V)
    _, p0 = s._distribution(L0)
    p0 = p0 / p0.sum()
    exact = torch.zeros(V, V, dtype=torch.float64)
    for t1 in range(V):
        s1 = Sampler(SamplingParams(**params), [], V)
        s1._record(t1, L0)
        _, p1 = s1._distribution(L1[t1])
        exact[t1] = p0[t1] * p1 / p1.sum()
    n = 20000
    spec = _joint(Sampler.speculate, params, L0, L1, drafts, q, n, 1)
    assert _chi2_pvalue(spec.flatten(), exact.flatten()) > 0.01
    if params == {"temperature": 1.0}:  # the test has the power to see a wrong rule
        wrong = _joint(_wrong_rule, params, L0, L1, drafts, q, 5000, 2)
        assert _chi2_pvalue(wrong.flatten(), exact.flatten()) < 1e-6


def test_spec_bench_runs(tmp_path):
    """``memra bench spec`` compares both modes in one run and says whether greedy stayed exact."""
    import json

    from memra.cli import main

    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--tokens", "8", "--rounds", "1", "--json-out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["greedy_identical"] and res["tok_s_plain"] > 0 and res["tok_s_spec"] > 0
    assert len(res["acceptance_per_position"]) == 3 and res["drafted"][0] > 0


def test_metrics_expose_draft_and_accepted_counts(engines):
    from memra.server.metrics import ServerMetrics

    _, spec = engines
    spec.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0))
    text = ServerMetrics(spec.engine.stats, "smol").render().decode()
    drafted = sum(spec.engine.spec_drafted)
    assert f'memra:spec_decode_num_draft_tokens_total{{model_name="smol"}} {float(drafted)}' in text
    assert 'memra:spec_decode_num_accepted_tokens_per_pos_total{model_name="smol",position="0"}' in text


def test_structured_output_with_speculation_is_exact_and_valid(engines):
    """Drafts of a constrained request are verified under the grammar: greedy output equals the
    constrained output without speculation, and it parses."""
    import json

    from memra.engine.structured import GrammarBackend

    plain, spec = engines
    schema = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 6, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["id"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}
    g = GrammarBackend(spec.tokenizer, spec.config.vocab_size, spec.eos_ids)
    params = SamplingParams(max_tokens=80, temperature=0.0, structured=g.json_schema(schema))
    prompts = ['A JSON list of ids: {"items": [{"id": 1}, {"id": 2}, {"id": 3}]}. Another one:', "JSON:"]
    drafted = sum(spec.engine.spec_drafted)
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        if y.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(y.outputs[0].text)["items"], list)
    assert sum(spec.engine.spec_drafted) > drafted  # it did speculate
