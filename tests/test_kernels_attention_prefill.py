"""Paged prefill attention (memra/kernels/attention_prefill.py) against its torch reference, and
both against the model's attention (memra.layers.attention.attention) on dense per-sequence K/V.

CPU (CI): the Triton kernel runs under the interpreter (TRITON_INTERPRET=1) at tiny shapes with
fp16/fp32 inputs (the interpreter's tl.dot is wrong on bf16: shared/GPU.md). Unused cache
slots, pages released before the window (-1 in the block table) and spare blocks hold NaN, so
any read of them shows up in the output.
GPU (``-m gpu``): the flagship's shapes in bf16 (full and sliding layers, chunked prefill, varlen).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before memra.kernels._attention_prefill_triton is imported

from memra.kernels.attention_prefill import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from memra.layers.attention import attention  # noqa: E402

triton = pytest.importorskip("triton")


def _make(specs: list[tuple[int, int]], H: int, KV: int, D: int, window: int | None, bs: int = 16,
          dtype=torch.float32, cache_dtype=None, seed: int = 0, gate: bool = False, extra_blocks: int = 3):
    """specs: (prefix P, new tokens n) per sequence. Returns q [T, H, D], NaN-filled paged caches
    whose used slots are random (shuffled physical blocks; pages wholly before the first query's
    window released: -1 and NaN), block_table, cu_seqlens_q, seq_lens, gate, and the dense
    per-sequence (K, V) [L, KV, D] in the dtype the kernel sees."""
    g = torch.Generator().manual_seed(seed)
    S = len(specs)
    lens = [p + n for p, n in specs]
    pages = [-(-L // bs) for L in lens]
    max_blocks = max(pages + [1]) + 1
    n_blocks = sum(pages) + extra_blocks
    cdt = cache_dtype or dtype
    kc = torch.full((n_blocks, bs, KV, D), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    perm = torch.randperm(n_blocks, generator=g)
    table = torch.full((S, max_blocks), -1, dtype=torch.int32)
    seqs = []
    o = 0
    for s, (P, n) in enumerate(specs):
        L = P + n
        ks = torch.randn(L, KV, D, generator=g)
        vs = torch.randn(L, KV, D, generator=g)
        seqs.append((ks.to(cdt).to(dtype), vs.to(cdt).to(dtype)))
        lo_page = 0 if window is None or n == 0 else max(0, P - window + 1) // bs
        for p in range(pages[s]):
            blk = int(perm[o])
            o += 1
            if p < lo_page:
                continue  # released: -1 in the table, NaN in the (reused) block
            table[s, p] = blk
            m = min(bs, L - p * bs)
            kc[blk, :m] = ks[p * bs:p * bs + m]
            vc[blk, :m] = vs[p * bs:p * bs + m]
    T = sum(n for _, n in specs)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    gt = (torch.randn(T, H, generator=g) * 2).to(dtype) if gate else None
    cu = torch.tensor([0] + [sum(n for _, n in specs[:s + 1]) for s in range(S)], dtype=torch.int32)
    sl = torch.tensor(lens, dtype=torch.int32)
    return q, kc.to(cdt), vc.to(cdt), table, cu, sl, gt, seqs


def _dense(q, seqs, specs, window, scale, gate):
    """Independent check: memra.layers.attention.attention per sequence on the dense K/V (fp32)."""
    outs = []
    t = 0
    for (P, n), (ks, vs) in zip(specs, seqs):
        if n == 0:
            continue
        qpos = torch.arange(P, P + n)
        o = attention(q[t:t + n].float(), ks.float(), vs.float(), qpos, torch.arange(P + n), window, scale)
        if gate is not None:
            o = o * torch.sigmoid(gate[t:t + n].float())[..., None]
        outs.append(o)
        t += n
    return torch.cat(outs)


CASES = [
    # specs [(prefix, new)], H, KV, D, window
    ([(0, 37), (30, 20), (50, 1), (7, 0), (0, 9)], 9, 3, 64, None),   # smollm2-like G=3, chunked, n=1, n=0
    ([(0, 37), (30, 20), (50, 1), (7, 0), (0, 9)], 9, 3, 64, 8),      # window < chunk, not page-aligned
    ([(40, 33), (0, 50), (100, 5)], 8, 2, 32, 60),                     # G=4, window > some prefixes
    ([(20, 40), (0, 1), (0, 0), (64, 17)], 2, 2, 32, 16),              # G=1, window == block size
    ([(16, 21), (3, 2)], 24, 2, 32, None),                             # G=12 > block_m rows per query
]
LAUNCH = [dict(block_m=16, block_n=16), dict(block_m=32, block_n=16), dict(block_m=16, block_n=32)]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_ref_and_dense(case, dtype):
    specs, H, KV, D, window = CASES[case]
    use_gate = case % 2 == 0
    scale = D ** -0.5
    q, kc, vc, table, cu, sl, gate, seqs = _make(specs, H, KV, D, window, dtype=dtype, seed=case, gate=use_gate)
    ref = paged_prefill_attention_ref(q, kc, vc, table, cu, sl, window, scale, gate=gate)
    assert torch.isfinite(ref).all()
    dense = _dense(q, seqs, specs, window, scale, gate)
    torch.testing.assert_close(ref.float(), dense, atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=1e-5)
    tol = 2e-5 if dtype == torch.float32 else 3e-3
    max_n = max(n for _, n in specs)
    launch = LAUNCH[case % len(LAUNCH)]
    for mq in (None, max_n):
        out = paged_prefill_attention(q, kc, vc, table, cu, sl, window, scale, gate=gate, max_q_len=mq, **launch)
        assert out.dtype == dtype and out.shape == q.shape
        assert torch.isfinite(out).all(), "NaN/inf: read of an unused or released cache slot?"
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=f"max_q_len={mq} {launch}")
        torch.testing.assert_close(out.float(), dense, atol=2 * tol, rtol=2 * tol)


def test_chunked_equals_one_shot():
    # prefill of 55 tokens in one call == chunks of 30 + 25 (second chunk: prefix 30), window 20
    H, KV, D, w = 8, 2, 32, 20
    q, kc, vc, table, cu, sl, gate, _ = _make([(0, 55)], H, KV, D, None, seed=11, gate=True)
    full = paged_prefill_attention(q, kc, vc, table, cu, sl, w, 0.15, gate=gate)
    c1 = paged_prefill_attention(q[:30], kc, vc, table, torch.tensor([0, 30], dtype=torch.int32),
                                 torch.tensor([30], dtype=torch.int32), w, 0.15, gate=gate[:30])
    c2 = paged_prefill_attention(q[30:], kc, vc, table, torch.tensor([0, 25], dtype=torch.int32),
                                 torch.tensor([55], dtype=torch.int32), w, 0.15, gate=gate[30:], max_q_len=25)
    torch.testing.assert_close(torch.cat([c1, c2]), full, atol=2e-6, rtol=2e-6)


def test_block_sizes_and_mixed_dtype():
    # block size 8 and 32; bf16 cache with fp32 queries (mixed path: fp32 IEEE dots)
    specs = [(13, 19), (0, 6), (41, 3)]
    for bs in (8, 32):
        q, kc, vc, table, cu, sl, gate, seqs = _make(specs, 6, 2, 32, 25, bs=bs, seed=bs, gate=True,
                                                     cache_dtype=torch.bfloat16)
        assert kc.dtype == torch.bfloat16 and q.dtype == torch.float32
        ref = paged_prefill_attention_ref(q, kc, vc, table, cu, sl, 25, 0.125, gate=gate)
        torch.testing.assert_close(ref, _dense(q, seqs, specs, 25, 0.125, gate), atol=1e-5, rtol=1e-5)
        out = paged_prefill_attention(q, kc, vc, table, cu, sl, 25, 0.125, gate=gate, block_m=16, block_n=16)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_out_argument_strided_q_and_empty():
    specs = [(5, 11), (0, 7)]
    q, kc, vc, table, cu, sl, gate, _ = _make(specs, 4, 2, 32, None, seed=9, gate=True)
    qbig = torch.randn(q.shape[0], 4, 3 * 32)
    qbig[:, :, 32:64] = q
    gbig = torch.randn(q.shape[0], 8)
    gbig[:, ::2] = gate
    out = torch.empty_like(q)
    res = paged_prefill_attention(qbig[:, :, 32:64], kc, vc, table, cu, sl, None, 0.2, gate=gbig[:, ::2], out=out)
    assert res is out
    ref = paged_prefill_attention_ref(q, kc, vc, table, cu, sl, None, 0.2, gate=gate)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # every sequence empty (n_s = 0) and T = 0: nothing launched, nothing read
    cu0 = torch.zeros(3, dtype=torch.int32)
    e = paged_prefill_attention(q[:0], kc, vc, table, cu0, sl, None, 0.2)
    assert e.shape == (0, 4, 32)
    e = paged_prefill_attention(q[:0], kc, vc, table, cu0, sl, None, 0.2, max_q_len=0)
    assert e.shape == (0, 4, 32)


def test_errors():
    q, kc, vc, table, cu, sl, gate, _ = _make([(2, 3)], 4, 2, 32, None, gate=True)
    f = paged_prefill_attention
    cases = [
        (dict(q=q[0]), "q must be"),
        (dict(q=q[:, :3]), "multiple of KV"),
        (dict(q=q.double()), "q dtype"),
        (dict(k_cache=kc[..., :16], v_cache=vc[..., :16]), "head dim"),
        (dict(v_cache=vc[:1]), "k_cache/v_cache"),
        (dict(k_cache=kc.half(), v_cache=vc.half()), "cache dtype"),
        (dict(block_table=table.long()), "block_table"),
        (dict(block_table=table[:0]), "block_table"),
        (dict(cu_seqlens_q=cu.long()), "cu_seqlens_q"),
        (dict(seq_lens=sl.long()), "seq_lens"),
        (dict(seq_lens=torch.cat([sl, sl])), "seq_lens"),
        (dict(window=0), "window"),
        (dict(gate=gate[:, :2]), "gate"),
        (dict(out=torch.empty(5, 4, 32, dtype=torch.float16)), "out must be"),
        (dict(max_q_len=-1), "max_q_len"),
        (dict(k_cache=torch.empty(kc.shape, device="meta"), v_cache=torch.empty(vc.shape, device="meta")),
         "k_cache is on meta"),
    ]
    base = dict(q=q, k_cache=kc, v_cache=vc, block_table=table, cu_seqlens_q=cu, seq_lens=sl, window=None,
                scale=1.0, gate=gate)
    for over, msg in cases:
        for fn in (f, paged_prefill_attention_ref):
            with pytest.raises(ValueError, match=msg):
                fn(**{**base, **over})
    q48 = torch.randn(5, 4, 48)
    kc48 = torch.randn(3, 16, 2, 48)
    with pytest.raises(ValueError, match="power of two"):
        f(q48, kc48, kc48, table, cu, sl, None, 1.0)
    with pytest.raises(ValueError, match="block_m"):
        f(q, kc, vc, table, cu, sl, None, 1.0, block_m=24)
    with pytest.raises(ValueError, match="new queries"):  # n_s > seq_lens (reference checks values)
        paged_prefill_attention_ref(q, kc, vc, table, cu, torch.tensor([2], dtype=torch.int32), None, 1.0)
    bad = table.clone()
    bad[0, 0] = -1
    with pytest.raises(RuntimeError, match="released"):
        paged_prefill_attention_ref(q, kc, vc, bad, cu, sl, None, 1.0)


# ---------------------------------------------------------------------------------------
# GPU: real shapes in bf16


def _gpu_case(specs, H, KV, D, window, seed=0, bs=16):
    """Random bf16 caches (every block random), shuffled tables, pages before the window -1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    S = len(specs)
    lens = [p + n for p, n in specs]
    max_blocks = max(-(-L // bs) for L in lens) + 1
    n_blocks = S * max_blocks + 8
    kc = torch.randn(n_blocks, bs, KV, D, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    table = torch.randperm(n_blocks, device=dev, generator=g)[:S * max_blocks].view(S, max_blocks).int()
    if window is not None:
        lo = torch.tensor([max(0, p - window + 1) // bs for p, _ in specs], device=dev)
        cols = torch.arange(max_blocks, device=dev)[None, :]
        table = torch.where(cols < lo[:, None], torch.full_like(table, -1), table)
    T = sum(n for _, n in specs)
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    gate = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0] + [sum(n for _, n in specs[:s + 1]) for s in range(S)], dtype=torch.int32, device=dev)
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, kc, vc, table, cu, sl, gate


GPU_CASES = [
    # name, specs [(prefix, new)], H, KV, D, window
    ("full-4096", [(0, 4096)], 64, 8, 128, None),
    ("full-chunk2", [(4096, 4096)], 64, 8, 128, None),
    ("sliding-512", [(1000, 4096)], 96, 8, 128, 512),
    ("varlen-full", [(0, 1500), (3000, 700), (100, 1)], 64, 8, 128, None),
    ("varlen-sliding", [(0, 1500), (3000, 700), (100, 1), (5, 0)], 96, 8, 128, 512),
    ("smollm2", [(0, 1000), (500, 300)], 9, 3, 64, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_real_shapes(case):
    _, specs, H, KV, D, window = case
    q, kc, vc, table, cu, sl, gate = _gpu_case(specs, H, KV, D, window)
    max_n = max(n for _, n in specs)
    out = paged_prefill_attention(q, kc, vc, table, cu, sl, window, D ** -0.5, gate=gate, max_q_len=max_n)
    ref = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), table, cu, sl, window, D ** -0.5,
                                      gate=gate.float())
    err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-2, err
    out2 = paged_prefill_attention(q, kc, vc, table, cu, sl, window, D ** -0.5, max_q_len=max_n)  # no gate
    ref2 = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), table, cu, sl, window, D ** -0.5)
    err = (out2.float() - ref2).abs().max().item() / ref2.abs().max().item()
    assert err < 1e-2, err


# ---------------------------------------------------------------------------------------
# aligned tiles (batch-invariant mode): a query's bits do not depend on the rest of its launch


def _alone_with_padding(q, table, specs, gate):
    """Every query of ``specs`` as a sequence of one (n = 1 on its own prefix, its sequence's block
    table) with a padding row (n = 1, seq_lens 0, table all -1) before each: the layout of the MTP
    drafting graphs. Returns (q, table, cu, seq_lens, gate, rows of the real queries)."""
    rows, tabs, lens, src, t = [], [], [], [], 0
    for s, (P, n) in enumerate(specs):
        for i in range(n):
            tabs += [torch.full_like(table[s], -1), table[s]]
            lens += [0, P + i + 1]
            src += [t + i, t + i]
            rows.append(len(src) - 1)
        t += n
    idx = torch.tensor(src, device=q.device)
    cu = torch.arange(len(src) + 1, dtype=torch.int32, device=q.device)
    return (q[idx].clone(), torch.stack(tabs), cu, torch.tensor(lens, dtype=torch.int32, device=q.device),
            gate[idx].clone(), rows)


def _check_aligned(q, kc, vc, table, cu, sl, gate, specs, window, scale, ref_tol, **launch):
    """Same bits on the GPU; under the interpreter within 1e-3 (numpy's elementwise exp2 is not
    the same bits at every position of an array: SIMD body vs scalar tail)."""
    exact = q.device.type == "cuda"

    def same_rows(a, b):
        if exact:
            return (a == b).flatten(1).all(1)
        return ((a.float() - b.float()).abs() <= 1e-3 * b.float().abs().max()).flatten(1).all(1)

    whole = paged_prefill_attention(q, kc, vc, table, cu, sl, window, scale, gate=gate, aligned=True, **launch)
    ref = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), table, cu, sl, window, scale,
                                      gate=gate.float())
    err = float((whole.float() - ref).abs().max() / ref.abs().max())
    assert err < ref_tol, err
    qa, ta, cua, sla, ga, rows = _alone_with_padding(q, table, specs, gate)
    alone = torch.full_like(qa, float("nan"))  # so a padding row the kernel skipped shows
    paged_prefill_attention(qa, kc, vc, ta, cua, sla, window, scale, gate=ga, out=alone, max_q_len=1, aligned=True,
                            **launch)
    pad = [r for r in range(qa.shape[0]) if r not in set(rows)]
    assert torch.equal(alone[pad], torch.zeros_like(alone[pad])), "padding rows must be zeros"
    ref_alone = paged_prefill_attention_ref(qa.float(), kc.float(), vc.float(), ta, cua, sla, window, scale,
                                            gate=ga.float(), aligned=True)
    assert torch.equal(ref_alone[pad], torch.zeros_like(ref_alone[pad]))
    same = same_rows(alone[rows], whole)
    assert bool(same.all()), f"rows that differ alone vs in their chunk: {(~same).nonzero().flatten().tolist()}"
    # a verify-like split: each sequence's queries in chunks of 3 on their prefixes
    for s, (P, n) in enumerate(specs):
        t0 = int(cu[s])
        for c0 in range(0, n, 3):
            c1 = min(n, c0 + 3)
            part = paged_prefill_attention(q[t0 + c0:t0 + c1], kc, vc, table[s:s + 1],
                                           torch.tensor([0, c1 - c0], dtype=torch.int32, device=q.device),
                                           torch.tensor([P + c1], dtype=torch.int32, device=q.device), window, scale,
                                           gate=gate[t0 + c0:t0 + c1], aligned=True, **launch)
            assert bool(same_rows(part, whole[t0 + c0:t0 + c1]).all()), (s, c0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real-shape twin below")
@pytest.mark.parametrize("window", [None, 5, 20])
def test_aligned_query_has_the_same_bits_alone_in_chunks_and_whole(window):
    """``aligned=True``: each query alone (n = 1, padding rows between), in chunks of 3, and in its
    whole chunk gives the same result (the same bits on the GPU: the twin below), close to the
    reference; padding rows give zeros. Caches are NaN outside what a query may read (released
    pages before the window included)."""
    specs = [(30, 14), (3, 9), (40, 1)]  # (30, 14): rows whose first visible tile is not their block's first
    H, KV, D = 4, 2, 16
    q, kc, vc, table, cu, sl, gate, _ = _make(specs, H, KV, D, window, bs=4, dtype=torch.float16, seed=5, gate=True)
    _check_aligned(q, kc, vc, table, cu, sl, gate, specs, window, D ** -0.5, 3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 512])
def test_gpu_aligned_query_has_the_same_bits_alone_in_chunks_and_whole(window):
    """The aligned tiles at the flagship's shapes (bf16, H 64 / 96, KV 8, D 128), prefixes across
    several key tiles and past the window."""
    specs = [(700, 40), (5, 17), (1300, 1)]
    H = 64 if window is None else 96
    q, kc, vc, table, cu, sl, gate = _gpu_case(specs, H, 8, 128, window, seed=2)
    _check_aligned(q, kc, vc, table, cu, sl, gate, specs, window, 128 ** -0.5, 1e-2)
