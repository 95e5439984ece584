"""The CPU decode path (issue 19): the one-query attention against torch SDPA, the fp32 KV cache
of the CPU, and a decode step through it against the same tokens in one prefill pass."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memra.engine.kv_cache import ContiguousKVCache, kv_storage_dtype
from memra.layers.attention import decode_attention


def _sdpa(q, k, v, valid, scale):
    """The reference: torch SDPA per row, over the row's visible keys only."""
    out = []
    for b in range(q.shape[0]):
        ks, vs = k[b][valid[b]], v[b][valid[b]]  # [l, KV, D]
        o = F.scaled_dot_product_attention(q[b][:, None].float(), ks.transpose(0, 1).float(),
                                           vs.transpose(0, 1).float(), scale=scale, enable_gqa=True)
        out.append(o[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H,KV", [(9, 3), (8, 8), (14, 2)])
def test_decode_attention_matches_sdpa(dtype, H, KV):
    g = torch.Generator().manual_seed(H * 10 + KV)
    B, L, D = 3, 37, 64
    q = torch.randn(B, H, D, generator=g).to(dtype)
    k = torch.randn(B, L, KV, D, generator=g)  # the CPU cache is fp32 whatever the compute dtype
    v = torch.randn(B, L, KV, D, generator=g)
    lens = [37, 1, 20]
    valid = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]
    got = decode_attention(q, k, v, valid, 0.125)
    assert got.dtype == dtype and got.shape == (B, H, D)
    ref = _sdpa(q, k, v, valid, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)
    # valid=None means every key: the first row's answer again
    torch.testing.assert_close(decode_attention(q[:1], k[:1], v[:1], None, 0.125), got[:1])


def test_cpu_kv_cache_is_fp32():
    assert kv_storage_dtype(torch.bfloat16, "cpu") == torch.float32
    assert kv_storage_dtype(torch.float32, torch.device("cpu")) == torch.float32
    assert kv_storage_dtype(torch.bfloat16, "cuda") == torch.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_match_one_prefill(dtype):
    """smollm2-135m: 24 tokens prefilled at once and 16 of them then decoded one by one through the
    CPU decode attention give the same final-normed hidden states (fp32: to rounding; bf16: the
    same greedy tokens)."""
    from memra import LLM

    llm = LLM("smollm2-135m", dtype=dtype)
    m = llm.model
    ids = torch.tensor(llm.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it runs "
                                            "into the forest to find")[:24])
    n = ids.numel()
    with torch.inference_mode():
        kv = ContiguousKVCache(llm.config, n, kv_storage_dtype(m.dtype, "cpu"))
        full = m(ids, torch.arange(n), kv)
        kv = ContiguousKVCache(llm.config, n, kv_storage_dtype(m.dtype, "cpu"))
        m(ids[:8], torch.arange(8), kv)
        kv.advance(8)
        steps = []
        for i in range(8, n):
            steps.append(m(ids[i:i + 1], torch.tensor([i]), kv))
            kv.advance(1)
        steps = torch.cat(steps)
    if dtype == "float32":
        torch.testing.assert_close(steps, full[8:], rtol=1e-4, atol=1e-4)
    else:
        agree = (m.logits(steps).argmax(-1) == m.logits(full[8:]).argmax(-1)).float().mean().item()
        assert agree >= 0.9, agree


def test_head_logits_rescores_the_top_candidates_exactly(torch_cpu_paths):
    """The int4 head's top-k logits are the fp32 dot products with the dequantized rows; the rest are
    the kernel's; the argmax is then the fp32 head's on the same hidden state."""
    from test_linear import random_q4

    from memra.layers.linear import RESCORE_TOP_K, Linear, head_logits
    from memra.quant.types import QType

    w = random_q4(QType.Q8_0, 512, 128, 7)
    head = Linear(w, None, torch.bfloat16)
    assert head.kernel == "int4"
    h = torch.randn(3, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    got = head_logits(head, h)
    plain = head(h).float()
    exact = h.float() @ w.dequantize().t()
    top = plain.topk(RESCORE_TOP_K, -1).indices
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(got[rest], plain[rest])
    assert torch.equal(got.argmax(-1), exact.argmax(-1))


def test_int4_needs_the_packers_row_granularity_and_builds_lazily(torch_cpu_paths):
    """The int4 packer takes a multiple of 16 rows (digits x out_features): other layers stay dense
    (a 32002-row Q8_0 head loads); a layer moved to its GPU form never builds the CPU forms."""
    from test_linear import random_q4

    from memra.layers.linear import Linear
    from memra.quant.types import QType

    x = torch.randn(2, 64)
    for qtype, n, kernel in ((QType.Q8_0, 36, "dense"), (QType.Q8_0, 40, "int4"), (QType.Q4_0, 24, "dense"),
                             (QType.Q4_0, 32, "int4")):
        w = random_q4(qtype, n, 64, n)
        lin = Linear(w, None, torch.bfloat16)
        assert lin.kernel == kernel, (qtype, n)
        ref = x @ w.dequantize().t()
        err = ((lin(x.to(torch.bfloat16)).float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, (qtype, n, err)
    lazy = Linear(random_q4(QType.Q8_0, 32, 64, 1), None, torch.bfloat16)
    assert "stored" not in lazy._buffers and "packed" not in lazy._buffers
    lazy.to_gpu("cpu")  # the GPU form (here under the Triton interpreter's device, the CPU)
    assert lazy.kernel == "gpu" and "stored" not in lazy._buffers and "packed" not in lazy._buffers


def test_head_logits_of_other_heads_is_their_output():
    """A head that is not memra's Linear (e.g. the vocab-parallel head of a TP shard) is taken as is."""
    from memra.layers.linear import head_logits

    head = torch.nn.Linear(8, 5, bias=False)
    h = torch.randn(3, 8)
    torch.testing.assert_close(head_logits(head, h), head(h).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [64, 32])
def test_cpu_rope_is_the_textbook_rotate_half_exactly(dtype, rot):
    """rope_torch on the CPU (roll and signed sin) equals x * cos + cat(-x2, x1) * sin bit for bit,
    full and partial rotary widths (the other dims passed through)."""
    from memra.kernels.norm_rope import rope_torch

    g = torch.Generator().manual_seed(rot)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    cos, sin = (torch.randn(3, rot, generator=g).to(dtype) for _ in range(2))
    xr = x[..., :rot]
    ref = xr * cos[:, None] + torch.cat([-xr[..., rot // 2:], xr[..., :rot // 2]], -1) * sin[:, None]
    ref = torch.cat([ref, x[..., rot:]], -1)
    assert torch.equal(rope_torch(x, cos, sin), ref)
