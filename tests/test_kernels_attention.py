"""Paged decode attention (memra/kernels/attention_decode.py) against its torch reference,
and the reference against the model's attention (memra.layers.attention.attention).

CPU (CI): the Triton kernels run under the interpreter (TRITON_INTERPRET=1) at tiny shapes
with fp16/fp32 queries (the interpreter's tl.dot is wrong on bf16: shared/GPU.md). Unused
and released cache blocks hold NaN, so any read of them shows up in the output.
GPU (``-m gpu``): the flagship's and smollm2's shapes in bf16, and CUDA-graph capture/replay.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before memra.kernels._attention_triton is imported

from memra.kernels.attention_decode import (  # noqa: E402
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from memra.layers.attention import attention  # noqa: E402

triton = pytest.importorskip("triton")


def _make(lens: list[int], H: int, KV: int, D: int, window: int | None, bs: int = 16, dtype=torch.float32,
          device="cpu", seed: int = 0, extra_blocks: int = 3, gate: bool = False, cache_dtype=None):
    """Random q, a NaN-filled paged cache whose used slots are random, shuffled block tables
    (pages wholly outside the window released: -1), seq_lens; plus the per-sequence K/V."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    pages = [-(-L // bs) for L in lens]
    max_blocks = max(max(pages), 1) + 1
    n_blocks = sum(pages) + extra_blocks
    cdt = cache_dtype or dtype
    kc = torch.full((n_blocks, bs, KV, D), float("nan"), dtype=torch.float32)
    vc = torch.full_like(kc, float("nan"))
    perm = torch.randperm(n_blocks, generator=g)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    seqs = []
    o = 0
    for b, L in enumerate(lens):
        ks = torch.randn(L, KV, D, generator=g)
        vs = torch.randn(L, KV, D, generator=g)
        seqs.append((ks, vs))
        for p in range(pages[b]):
            blk = int(perm[o])
            o += 1
            table[b, p] = blk
            n = min(bs, L - p * bs)
            kc[blk, :n] = ks[p * bs:p * bs + n]
            vc[blk, :n] = vs[p * bs:p * bs + n]
        if window is not None and L > 0:
            lo = max(0, L - window)
            table[b, :lo // bs] = -1  # released
    q = torch.randn(B, H, D, generator=g)
    gt = torch.randn(B, H, generator=g) * 2 if gate else None
    to = lambda t: t.to(device)  # noqa: E731
    seqs = [(k.to(cdt).to(dtype), v.to(cdt).to(dtype)) for k, v in seqs]
    return (to(q.to(dtype)), to(kc.to(cdt)), to(vc.to(cdt)), to(table), to(torch.tensor(lens, dtype=torch.int32)),
            None if gt is None else to(gt.to(dtype)), seqs)


CASES = [
    # lens, H, KV, D, window
    ([1, 37, 16, 0, 70], 3, 1, 64, None),        # G=3 (non-power-of-two), padding row, length 1
    ([1, 37, 16, 0, 70], 9, 3, 64, 20),          # smollm2-like G=3, window < context
    ([5, 100, 33], 16, 2, 64, 300),              # G=8, window > context
    ([2, 64, 129], 8, 8, 64, 33),                # G=1, window crossing pages
    ([90, 17], 24, 3, 128, 16),                  # G=8, D=128, window == block size
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_ref(case, dtype):
    lens, H, KV, D, window = CASES[case]
    use_gate = case % 2 == 0
    q, kc, vc, table, sl, gate, _ = _make(lens, H, KV, D, window, dtype=dtype, seed=case, gate=use_gate)
    ref = paged_decode_attention_ref(q, kc, vc, table, sl, window, D ** -0.5, gate=gate)
    assert torch.isfinite(ref).all()
    tol = 2e-5 if dtype == torch.float32 else 3e-3
    for splits in (None, 1, 3):
        out = paged_decode_attention(q, kc, vc, table, sl, window, D ** -0.5, gate=gate, num_splits=splits)
        assert out.dtype == dtype and out.shape == q.shape
        assert torch.isfinite(out).all(), f"NaN/inf with splits={splits} (read of unused/released memory?)"
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=f"splits={splits}")
        assert (out[sl == 0] == 0).all()


def test_kernel_block_sizes_and_mixed_dtype():
    # block size 8 and 32; bf16 cache with fp32 queries (mixed path)
    for bs in (8, 32):
        q, kc, vc, table, sl, gate, _ = _make([3, 50, 41], 6, 2, 64, 25, bs=bs, dtype=torch.float32, seed=bs,
                                              cache_dtype=torch.bfloat16, gate=True)
        assert kc.dtype == torch.bfloat16
        ref = paged_decode_attention_ref(q, kc, vc, table, sl, 25, 0.125, gate=gate)
        for splits in (None, 2):
            out = paged_decode_attention(q, kc, vc, table, sl, 25, 0.125, gate=gate, num_splits=splits, block_n=16)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_out_argument_and_strided_q():
    q, kc, vc, table, sl, gate, _ = _make([7, 30], 8, 2, 64, None, dtype=torch.float32, seed=9)
    qbig = torch.randn(2, 8, 3 * 64)
    qbig[:, :, 64:128] = q
    qv = qbig[:, :, 64:128]
    out = torch.empty_like(q)
    res = paged_decode_attention(qv, kc, vc, table, sl, None, 0.1, out=out, num_splits=2)
    assert res is out
    ref = paged_decode_attention_ref(q, kc, vc, table, sl, None, 0.1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # more splits than pages (most partitions empty; the combine pads to 128)
    out = paged_decode_attention(q, kc, vc, table, sl, None, 0.1, num_splits=70, block_n=16)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_ref_matches_model_attention(case):
    lens, H, KV, D, window = CASES[case]
    q, kc, vc, table, sl, gate, seqs = _make(lens, H, KV, D, window, dtype=torch.float32, seed=case + 100,
                                             gate=True)
    ref = paged_decode_attention_ref(q, kc, vc, table, sl, window, D ** -0.5, gate=gate)
    for b, L in enumerate(lens):
        if L == 0:
            assert (ref[b] == 0).all()
            continue
        ks, vs = seqs[b]
        pos = torch.arange(L)
        o = attention(q[b:b + 1], ks, vs, pos[-1:], pos, window, D ** -0.5)[0]
        o = o * torch.sigmoid(gate[b])[:, None]
        torch.testing.assert_close(ref[b], o, atol=1e-5, rtol=1e-5)


def test_default_num_splits():
    assert default_num_splits(1, 8, 2048, 16, None) == 66
    assert default_num_splits(64, 8, 256, 16, None) == 1
    assert default_num_splits(64, 3, 256, 16, None) == 3
    assert default_num_splits(1, 8, 2048, 16, 512) == 9  # 33 pages of the window / 4 pages per step
    assert default_num_splits(1, 1, 1, 16, None) == 1
    assert default_num_splits(1, 3, 10_000, 16, None) == 128


def test_errors():
    q, kc, vc, table, sl, _, _ = _make([3], 4, 2, 64, None)
    with pytest.raises(ValueError, match="multiple of KV"):
        paged_decode_attention(q[:, :3], kc, vc, table, sl, None, 1.0)
    with pytest.raises(ValueError, match="block_table"):
        paged_decode_attention(q, kc, vc, table.long(), sl, None, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, kc, vc, table, sl.long(), None, 1.0)


# ---------------------------------------------------------------------------------------
# GPU: real shapes in bf16, CUDA graphs

GPU_SHAPES = [
    # name, H, KV, D, window
    ("step35-full", 64, 8, 128, None),
    ("step35-sliding", 96, 8, 128, 512),
    ("smollm2", 9, 3, 64, None),
]


def _gpu_case(B, ctx, H, KV, D, window, seed=0, bs=16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    max_blocks = -(-ctx // bs) + 1
    n_blocks = B * max_blocks + 8
    kc = torch.randn(n_blocks, bs, KV, D, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    table = torch.randperm(n_blocks, device=dev, generator=g)[:B * max_blocks].view(B, max_blocks).int()
    lens = torch.randint(max(1, ctx // 2), ctx + 1, (B,), device=dev, generator=g).int()
    lens[0] = ctx
    if window is not None:
        lo = (lens - window).clamp(min=0) // bs
        cols = torch.arange(max_blocks, device=dev)[None, :]
        table = torch.where(cols < lo[:, None], torch.full_like(table, -1), table)
    q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    gate = torch.randn(B, H, device=dev, dtype=torch.bfloat16, generator=g)
    return q, kc, vc, table, lens, gate


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
@pytest.mark.parametrize("B,ctx", [(1, 100), (4, 4096), (64, 4096), (1, 32768)])
def test_gpu_real_shapes(shape, B, ctx):
    _, H, KV, D, window = shape
    q, kc, vc, table, lens, gate = _gpu_case(B, ctx, H, KV, D, window)
    out = paged_decode_attention(q, kc, vc, table, lens, window, D ** -0.5, gate=gate)
    ref = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), table, lens, window, D ** -0.5,
                                     gate=gate.float())
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-2, err


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    H, KV, D, window = 64, 8, 128, None
    B, ctx = 4, 2048
    q, kc, vc, table, lens, gate = _gpu_case(B, ctx, H, KV, D, window, seed=1)
    sq, st, sl, sg = q.clone(), table.clone(), lens.clone(), gate.clone()
    out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        paged_decode_attention(sq, kc, vc, st, sl, window, D ** -0.5, gate=sg, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(sq, kc, vc, st, sl, window, D ** -0.5, gate=sg, out=out)
    for seed in (2, 3):
        q2, _, _, t2, l2, g2 = _gpu_case(B, ctx, H, KV, D, window, seed=seed)
        l2[1] = 0
        l2[2] = 1
        sq.copy_(q2), st.copy_(t2), sl.copy_(l2), sg.copy_(g2)
        graph.replay()
        ref = paged_decode_attention_ref(q2.float(), kc.float(), vc.float(), t2, l2, window, D ** -0.5,
                                         gate=g2.float())
        err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-2, err
        assert (out[1] == 0).all()
