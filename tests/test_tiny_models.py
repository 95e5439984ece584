"""Tiny random checkpoints of every architecture against transformers (fp32).

Sequences are longer than Gemma 3's sliding window here (window 5, 24 tokens) so the
window boundary is exercised, which the real-model tests (window 512) cannot do.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, tiny_gguf

from memra.engine.kv_cache import ContiguousKVCache
from memra.models import load_gguf_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tiny_model_matches_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_gguf(tmp_path / f"{arch}.gguf", arch)
    # GGUF carries no query_pre_attn_scalar; llama.cpp (and memra) use head_dim, transformers defaults
    # to 256 (equal to head_dim in the released Gemma 3 sizes): tell it the tiny model's head_dim.
    extra = {"query_pre_attn_scalar": 16} if arch == "gemma3" else {}
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32,
                                              **extra).eval()
    model, _ = load_gguf_model(path)
    ids = torch.randint(2, VOCAB, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        kv = ContiguousKVCache(model.config, 24)
        ours = model.logits(model(ids, torch.arange(24), kv))
        kv.advance(24)
        kv2 = ContiguousKVCache(model.config, 24)
        steps = []
        for i in range(24):
            steps.append(model.logits(model(ids[i:i + 1], torch.tensor([i]), kv2)))
            kv2.advance(1)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    rel_dec = ((torch.cat(steps) - ref).abs().max() / ref.abs().max()).item()
    print(f"\n{arch}: prefill rel {rel:.2e}, decode rel {rel_dec:.2e}")
    assert ref.abs().max() > 0.1  # non-degenerate
    assert rel < 1e-5
    assert rel_dec < 1e-5
