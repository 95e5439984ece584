"""Real models against transformers loading the same GGUF file (the oracle for model math).

For each model: teacher-forced logits over a fixed text of >= 256 tokens (memra's one-shot
prefill vs transformers' forward, both fp32) must agree on the argmax for >= 99% of
positions, and the max |difference| is reported; greedy 32-token continuations of 5
prompts through memra's KV-cached generation loop must equal transformers' greedy output.
"""

from __future__ import annotations

import pytest
import torch

from memra import LLM, SamplingParams
from memra.engine.kv_cache import ContiguousKVCache
from memra.hub import resolve_model

TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels; then came stored programs, assemblers, and compilers that let people express algorithms "
    "in terms closer to mathematics. Each layer hid the details of the one below it.\n\n"
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(12)])  # 0 1 1 2 3 5 8 13 21 34 55 89\n\n"
    "In 1936, Alan Turing described an abstract machine that could simulate any algorithm. Ten years "
    "later, ENIAC performed about 5,000 additions per second. Today a phone performs billions. "
    "Rivers carve canyons over millions of years; the Colorado River cut the Grand Canyon to a depth of "
    "about 1,857 metres. Paris is the capital of France, Berlin of Germany, and Madrid of Spain. "
    "Photosynthesis converts light energy into chemical energy stored in glucose, releasing oxygen. "
    "The quick brown fox jumps over the lazy dog, and the five boxing wizards jump quickly. "
    "A well-tested program is one whose behaviour has been compared against an independent reference "
    "on inputs its authors did not choose, so that agreement means something."
)

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:\n1.",
    "The theory of relativity was developed by",
]

MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(request.param)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    llm = LLM(request.param)
    yield request.param, llm, hf, tok
    del hf, llm


def test_teacher_forced_logits(pair):
    key, llm, hf, tok = pair
    ids = tok(TEXT)["input_ids"]
    assert len(ids) >= 256, len(ids)
    with torch.no_grad():
        kv = ContiguousKVCache(llm.config, len(ids))
        ours = llm.model.logits(llm.model(torch.tensor(ids), torch.arange(len(ids)), kv))
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    diff = (ours - ref).abs().max().item()
    print(f"\n{key}: {len(ids)} tokens, top-1 agreement {top1:.4f}, max|diff| {diff:.3e} "
          f"(max|ref| {ref.abs().max().item():.2f})")
    assert top1 >= 0.99
    assert diff < 1e-2 * ref.abs().max().item()


def test_teacher_forced_decode_matches_prefill(pair):
    """Token-by-token decode through the KV cache gives the logits of the one-shot prefill."""
    key, llm, hf, tok = pair
    ids = tok(TEXT)["input_ids"][:40]
    with torch.no_grad():
        kv = ContiguousKVCache(llm.config, len(ids))
        full = llm.model.logits(llm.model(torch.tensor(ids), torch.arange(len(ids)), kv))
        kv2 = ContiguousKVCache(llm.config, len(ids))
        steps = []
        for i, t in enumerate(ids):
            steps.append(llm.model.logits(llm.model(torch.tensor([t]), torch.tensor([i]), kv2)))
            kv2.advance(1)
    step = torch.cat(steps)
    rel = ((step - full).abs().max() / full.abs().max()).item()
    print(f"\n{key}: decode vs prefill max rel diff {rel:.2e}")
    assert rel < 1e-4


def test_greedy_matches_transformers(pair):
    key, llm, hf, tok = pair
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
        ours = llm.generate([ids], params)[0].outputs[0].token_ids
        assert len(ours) == 32
        if len(ref) < 32:  # transformers stopped at an end-of-generation token
            assert ref[-1] in llm.eos_ids, (prompt, ref)
        assert ours[: len(ref)] == ref, (key, prompt, tok.decode(ours), tok.decode(ref))


def test_bfloat16_mode_tracks_transformers(pair):
    """The speed mode (bf16; int4 kernel for Q4_0/Q4_1 weights) stays close to the fp32 oracle."""
    key, _, hf, tok = pair
    llm = LLM(key, dtype="bfloat16")
    ids = tok(TEXT)["input_ids"]
    with torch.no_grad():
        kv = ContiguousKVCache(llm.config, len(ids), torch.bfloat16)
        ours = llm.model.logits(llm.model(torch.tensor(ids), torch.arange(len(ids)), kv))
        ref = hf(torch.tensor([ids])).logits[0].float()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kernels = sorted({m.kernel for m in llm.model.modules() if hasattr(m, "kernel")})
    print(f"\n{key} bf16 ({kernels}): top-1 agreement with transformers fp32 {top1:.4f}, "
          f"max|diff| {(ours - ref).abs().max().item():.3f}")
    assert top1 >= 0.95
