"""Triton source of memra/kernels/fused.py (see there for the math)."""

import triton
import triton.language as tl

from ._pdl_triton import pdl_enter


@triton.jit
def _clamp_keep_nan(x, lo, hi):
    # min(max(x, lo), hi) with NaN kept (as torch.clamp): PTX min.NaN / max.NaN, not min / max.f32,
    # which return the other operand of a NaN
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _swiglu_limit(a, u, limit):
    """The SwiGLU clamp of Step-3.5 (``swiglu_limits``): ``(min(a, limit), clamp(u, -limit, limit))``
    for ``a = silu(gate)``, a NaN kept NaN; the product ``a * u`` is the caller's."""
    return tl.minimum(a, limit, propagate_nan=tl.PropagateNan.ALL), _clamp_keep_nan(u, -limit, limit)


@triton.jit
def _swiglu_kernel(gu_ptr, y_ptr, n, stride_g, stride_y, limit, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n
    g = tl.load(gu_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + n + cols, mask=m, other=0.0).to(tl.float32)
    a = g / (1.0 + tl.exp(-g))
    if HAS_LIMIT:
        a, u = _swiglu_limit(a, u, limit)
    tl.store(y_ptr + row * stride_y + cols, (a * u).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _router_logits_kernel(h_ptr, w_ptr, out_ptr, E, D, stride_h, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr = False):
    # logits[t, e] = sum_d fp32(h[t, d]) * w[e, d]: program (pid_e, t) sums BLOCK_E experts' rows for
    # token t in BLOCK_D-wide fp32 partial sums, then across them (a fixed order: the result does not
    # depend on how many tokens the launch has)
    pdl_enter(PDL)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    t = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    em = e < E
    acc = tl.zeros([BLOCK_E, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dm = d0 + d < D
        x = tl.load(h_ptr + t * stride_h + d0 + d, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * D + d0 + d[None, :], mask=em[:, None] & dm[None, :], other=0.0)
        acc += w * x[None, :]
    tl.store(out_ptr + t * E + e, tl.sum(acc, axis=1), mask=em)


@triton.jit
def _router_topk_kernel(l_ptr, b_ptr, idx_ptr, w_ptr, E, scaling, K: tl.constexpr, KP: tl.constexpr,
                        BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    m = e < E
    x = tl.load(l_ptr + row * E + e, mask=m, other=0.0)
    s = 1.0 / (1.0 + tl.exp(-x))
    c = s
    if HAS_BIAS:
        c = s + tl.load(b_ptr + e, mask=m, other=0.0)
    c = tl.where(m, c, float("-inf"))
    kk = tl.arange(0, KP)
    sel_i = tl.zeros([KP], dtype=tl.int32)
    sel_s = tl.zeros([KP], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(c, axis=0)
        i = tl.min(tl.where(c == best, e, BLOCK_E), axis=0)  # lowest index among equal maxima
        sv = tl.sum(tl.where(e == i, s, 0.0), axis=0)
        sel_i = tl.where(kk == j, i, sel_i)
        sel_s = tl.where(kk == j, sv, sel_s)
        c = tl.where(e == i, float("-inf"), c)
    total = tl.sum(tl.where(kk < K, sel_s, 0.0), axis=0)
    tl.store(idx_ptr + row * K + kk, sel_i.to(tl.int64), mask=kk < K)
    tl.store(w_ptr + row * K + kk, sel_s / total * scaling, mask=kk < K)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_k, stride_v, W, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < W
    kk = tl.load(k_ptr + row * stride_k + c, mask=m)
    vv = tl.load(v_ptr + row * stride_v + c, mask=m)
    tl.store(kc_ptr + slot * W + c, kk.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + slot * W + c, vv.to(vc_ptr.dtype.element_ty), mask=m)
