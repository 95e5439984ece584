"""The offline API on the embedded default model (smollm2-135m)."""

from __future__ import annotations

import pytest
import torch

from memra import LLM, SamplingParams
from memra.engine.llm import PromptTooLongError


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m")


def test_generate_text_and_ids_agree(llm):
    p = SamplingParams(temperature=0, max_tokens=8)
    a = llm.generate("The capital of France is", p)[0]
    b = llm.generate([llm.tokenizer.encode("The capital of France is")], p)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert "Paris" in a.outputs[0].text
    assert a.outputs[0].text == llm.tokenizer.decode(a.outputs[0].token_ids, skip_special_tokens=True)
    ids = llm.tokenizer.encode("The capital of France is")
    c, d = llm.generate([{"prompt_token_ids": ids}, {"prompt": "The capital of France is"}], p)  # vLLM's dict forms
    assert c.outputs[0].token_ids == d.outputs[0].token_ids == a.outputs[0].token_ids
    assert d.prompt == "The capital of France is"
    import numpy as np

    e = llm.generate({"prompt_token_ids": np.array(ids)}, p)[0]  # numpy integer ids
    assert e.outputs[0].token_ids == a.outputs[0].token_ids


def test_seed_reproducible_and_n(llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=42, n=2, ignore_eos=True)
    r1 = llm.generate("Once upon a time", p)[0]
    r2 = llm.generate("Once upon a time", p)[0]
    assert [o.token_ids for o in r1.outputs] == [o.token_ids for o in r2.outputs]
    assert len(r1.outputs) == 2 and r1.outputs[0].token_ids != r1.outputs[1].token_ids
    r3 = llm.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=12, seed=43, ignore_eos=True))[0]
    assert r3.outputs[0].token_ids != r1.outputs[0].token_ids


def test_stream_equals_generate(llm):
    p = SamplingParams(temperature=0, max_tokens=24, stop=["\n\n"])
    text = "".join(llm.stream("Write a haiku about autumn:", p))
    assert text == llm.generate("Write a haiku about autumn:", p)[0].outputs[0].text


def test_decode_steps_do_not_recompute_the_prefix(llm, monkeypatch):
    """The prompt goes through the model once; each decode step feeds exactly one token."""
    seen = []
    orig = llm.model.forward

    def spy(ids, positions, kv):
        seen.append((ids.numel(), int(positions[0])))
        return orig(ids, positions, kv)

    monkeypatch.setattr(llm.model, "forward", spy)
    ids = llm.tokenizer.encode("The capital of France is")
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert seen == [(len(ids), 0)] + [(1, len(ids) + i) for i in range(5)]


def test_logprobs_are_log_softmax_of_the_model(llm):
    ids = llm.tokenizer.encode("The capital of France is")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0]
    from memra.engine.kv_cache import ContiguousKVCache

    with torch.no_grad():
        logits = llm.model.logits(llm.model(torch.tensor(ids), torch.arange(len(ids)),
                                            ContiguousKVCache(llm.config, len(ids)))[-1])
    lp = torch.log_softmax(logits, -1)
    tok, chosen, top = out.logprobs[0]
    assert tok == int(lp.argmax()) and abs(chosen - float(lp.max())) < 1e-5
    assert [i for i, _ in top] == torch.topk(lp, 3).indices.tolist()


def test_chat_uses_template_and_stops_at_end_of_turn(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                   SamplingParams(temperature=0, max_tokens=32)).outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.stop_reason in llm.eos_ids


def test_errors(llm):
    with pytest.raises(PromptTooLongError, match="context length"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=llm.max_model_len))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="exactly one of 'prompt'"):
        llm.generate([{"prompt_ids": [1, 2]}])
    with pytest.raises(ValueError, match="must be integers, got '5'"):
        llm.generate([[1, "5"]])
    with pytest.raises(ValueError, match="'prompt' must be text"):
        llm.generate({"prompt": [1, 2]})
    with pytest.raises(ValueError, match="'prompt_token_ids' must be a list"):
        llm.generate({"prompt_token_ids": "abc"})
    for bad in (None, 5, 2.5, b"abc"):
        with pytest.raises(ValueError, match="prompts?: expected|a prompt is text"):
            llm.generate(bad)
    with pytest.raises(ValueError, match="a prompt is text"):
        llm.generate([{"prompt_token_ids": 5}])
    assert llm.generate([]) == []  # nothing to run, as vLLM
    for bad in (torch.tensor([1.0, 2.0]), [torch.tensor(1.5)], torch.tensor(5), {1, 2, 3}):
        with pytest.raises(ValueError, match="token ids must be integers|a prompt is text|prompts: expected"):
            llm.generate(bad)
    p = SamplingParams(temperature=0, max_tokens=3)
    with pytest.raises(ValueError, match="params: expected a SamplingParams"):
        llm.generate("Hi", {"temperature": 0})
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["Hi"], [p, p])
    for kw in (dict(stop=5), dict(stop_token_ids=5)):
        with pytest.raises(ValueError, match="must be a list"):
            SamplingParams(**kw)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []  # as vLLM


def test_per_prompt_sampling_params(llm):
    """generate(prompts, [params, ...]): each prompt with its own parameters, as vLLM."""
    a = SamplingParams(temperature=0, max_tokens=3)
    b = SamplingParams(temperature=0, max_tokens=6)
    x, y = llm.generate(["The capital of France is", "Hello"], [a, b])
    assert len(x.outputs[0].token_ids) <= 3 and len(y.outputs[0].token_ids) <= 6
    assert x.outputs[0].token_ids == llm.generate("The capital of France is", a)[0].outputs[0].token_ids
    assert y.outputs[0].token_ids == llm.generate("Hello", b)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="dtype"):
        LLM("smollm2-135m", dtype="int3")
