"""Triton source of the MoE decode kernels (see :mod:`memra.kernels.moe_decode` for the math,
layouts, grouping and the host wrapper). The weight tile loads and inner products are the
decode GEMV's (:mod:`memra.kernels._gemv_triton`); this file adds the per-slot column loop,
the SwiGLU epilogue and the weighted combine (``_dot_cols`` is shared with the dense GEMV). Imported only when a kernel is launched."""

import triton
import triton.language as tl

from ._fused_triton import _swiglu_limit
from ._gemv_triton import _dot_cols, _put
from ._pdl_triton import pdl_enter


@triton.jit
def _act_store(ptr, y, ra, m, limit, BA: tl.constexpr, HAS_LIMIT: tl.constexpr):
    # y [2 BA]: BA gate sums then the BA matching up sums -> act = min(silu(g), limit) * clamp(u, +-limit)
    g, u = tl.split(tl.permute(tl.reshape(y, [2, BA]), (1, 0)))
    a = g * tl.sigmoid(g)
    if HAS_LIMIT:
        a, u = _swiglu_limit(a, u, limit)
    tl.store(ptr + ra, a * u, mask=m)


@triton.jit
def _gu_chunk(x_ptr, perm_ptr, act_ptr, w_ptr, s_ptr, rn, n_ok, ra, a_ok, start, c0, cnt, topk, I, k_lo, K,
              stride_x, stride_wn, stride_sn, limit,
              FMT: tl.constexpr, BA: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, NC: tl.constexpr,
              EVEN_K: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr, PREFETCH: tl.constexpr,
              HAS_LIMIT: tl.constexpr, XV: tl.constexpr = False):
    # tokens c0 .. c0 + NC - 1 of the slot (sorted positions start + c0 + i)
    p0 = tl.load(perm_ptr + start + c0, mask=c0 < cnt, other=0)
    xp0 = x_ptr + (p0 // topk).to(tl.int64) * stride_x
    xp1 = xp0
    xp2 = xp0
    xp3 = xp0
    if NC > 1:
        p1 = tl.load(perm_ptr + start + c0 + 1, mask=c0 + 1 < cnt, other=0)
        xp1 = x_ptr + (p1 // topk).to(tl.int64) * stride_x
    if NC > 2:
        p2 = tl.load(perm_ptr + start + c0 + 2, mask=c0 + 2 < cnt, other=0)
        xp2 = x_ptr + (p2 // topk).to(tl.int64) * stride_x
        p3 = tl.load(perm_ptr + start + c0 + 3, mask=c0 + 3 < cnt, other=0)
        xp3 = x_ptr + (p3 // topk).to(tl.int64) * stride_x
    y0, y1, y2, y3 = _dot_cols(w_ptr, s_ptr, rn, n_ok, 2 * I, xp0, xp1, xp2, xp3, c0, cnt, k_lo, K, stride_wn,
                               stride_sn, FMT, 2 * BA, G, GS, NC, EVEN_K, ASM, F16, PREFETCH, False, XV)
    row = act_ptr + (start + c0).to(tl.int64) * I
    _act_store(row, y0, ra, a_ok & (c0 < cnt), limit, BA, HAS_LIMIT)
    if NC > 1:
        _act_store(row + I, y1, ra, a_ok & (c0 + 1 < cnt), limit, BA, HAS_LIMIT)
    if NC > 2:
        _act_store(row + 2 * I, y2, ra, a_ok & (c0 + 2 < cnt), limit, BA, HAS_LIMIT)
        _act_store(row + 3 * I, y3, ra, a_ok & (c0 + 3 < cnt), limit, BA, HAS_LIMIT)


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, s_ptr, act_ptr, perm_ptr, se_ptr, ss_ptr, sc_ptr,
                        topk, I, K, stride_x, stride_we, stride_wn, stride_se, stride_sn, limit,
                        FMT: tl.constexpr, BA: tl.constexpr, U: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
                        NC: tl.constexpr, EVEN_K: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr,
                        PREFETCH: tl.constexpr, HAS_LIMIT: tl.constexpr, PREFETCH_TAIL: tl.constexpr = False,
                        PDL: tl.constexpr = False, XV: tl.constexpr = False):
    """act[start + c, j] = swiglu(gate_e x[tok_c], up_e x[tok_c])[j] for act columns
    j = pid0 * BA .. + BA and every token c of slot pid1 (expert e; -1: nothing to do).
    W: fused bank [E, 2I, K], rows interleaved in blocks of U (gate, up, gate, up, ...)."""
    pdl_enter(PDL)
    pid_a = tl.program_id(0)
    slot = tl.program_id(1)
    e = tl.load(se_ptr + slot)
    start = tl.load(ss_ptr + slot)
    cnt = tl.load(sc_ptr + slot)
    cnt = tl.where(e >= 0, cnt, 0)
    e64 = tl.maximum(e, 0).to(tl.int64)
    if (FMT == 2 or FMT == 1) and F16:
        wb = w_ptr.to(tl.pointer_type(tl.int64)) + e64 * stride_we  # strides in 8-byte words (host)
    else:
        wb = w_ptr + e64 * stride_we
    sb = s_ptr + e64 * stride_se
    rw = tl.arange(0, 2 * BA)
    j = pid_a * BA + rw % BA
    rn = (j // U) * (2 * U) + (rw // BA) * U + j % U  # first BA: gate rows of columns j, then their up rows
    n_ok = j < I
    ra = pid_a * BA + tl.arange(0, BA)
    a_ok = ra < I
    k_lo = pid_a * 0  # a tensor, not a constexpr 0 (_h2_load applies tl.multiple_of to it)
    for c0 in range(0, cnt - (NC - 1), NC):
        _gu_chunk(x_ptr, perm_ptr, act_ptr, wb, sb, rn, n_ok, ra, a_ok, start, c0, cnt, topk, I, k_lo, K,
                  stride_x, stride_wn, stride_sn, limit, FMT, BA, G, GS, NC, EVEN_K, ASM, F16, PREFETCH, HAS_LIMIT, XV)
    r0 = cnt - cnt % NC
    if NC >= 4:
        if cnt - r0 >= 2:
            _gu_chunk(x_ptr, perm_ptr, act_ptr, wb, sb, rn, n_ok, ra, a_ok, start, r0, cnt, topk, I, k_lo, K,
                      stride_x, stride_wn, stride_sn, limit, FMT, BA, G, GS, 2, EVEN_K, ASM, F16, PREFETCH_TAIL, HAS_LIMIT, XV)
        r0 = r0 + 2 * (cnt - r0 >= 2).to(tl.int32)
    if NC >= 2:
        if cnt - r0 >= 1:
            _gu_chunk(x_ptr, perm_ptr, act_ptr, wb, sb, rn, n_ok, ra, a_ok, start, r0, cnt, topk, I, k_lo, K,
                      stride_x, stride_wn, stride_sn, limit, FMT, BA, G, GS, 1, EVEN_K, ASM, F16, PREFETCH_TAIL, HAS_LIMIT, XV)


@triton.jit
def _combine(y_ptr, yv, perm_ptr, wt_ptr, pos, c, cnt, topk, N, rn, n_ok, ATOMIC: tl.constexpr = True):
    # ATOMIC: y[tok, rn] += weight[p] * yv (fp32 atomics) for pair p = perm[pos] of token tok = p // topk;
    # else y[p, rn] = weight[p] * yv (per-pair rows, each written once; summed by _moe_combine_kernel)
    p = tl.load(perm_ptr + pos, mask=c < cnt, other=0)
    wgt = tl.load(wt_ptr + p, mask=c < cnt, other=0.0)
    if ATOMIC:
        _put(y_ptr + (p // topk).to(tl.int64) * N, yv * wgt, c, cnt, rn, n_ok, 0, True)
    else:
        _put(y_ptr + p.to(tl.int64) * N, yv * wgt, c, cnt, rn, n_ok, 0, False)


@triton.jit
def _dn_chunk(act_ptr, perm_ptr, wt_ptr, y_ptr, w_ptr, s_ptr, rn, n_ok, start, c0, cnt, topk, N, K, k_lo, k_hi,
              stride_wn, stride_sn,
              FMT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, NC: tl.constexpr,
              EVEN_K: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr, PREFETCH: tl.constexpr,
              ATOMIC: tl.constexpr, XV: tl.constexpr = False):
    xp0 = act_ptr + (start + c0).to(tl.int64) * K
    y0, y1, y2, y3 = _dot_cols(w_ptr, s_ptr, rn, n_ok, N, xp0, xp0 + K, xp0 + 2 * K, xp0 + 3 * K, c0, cnt, k_lo,
                               k_hi, stride_wn, stride_sn, FMT, BN, G, GS, NC, EVEN_K, ASM, F16, PREFETCH, False, XV)
    _combine(y_ptr, y0, perm_ptr, wt_ptr, start + c0, c0, cnt, topk, N, rn, n_ok, ATOMIC)
    if NC > 1:
        _combine(y_ptr, y1, perm_ptr, wt_ptr, start + c0 + 1, c0 + 1, cnt, topk, N, rn, n_ok, ATOMIC)
    if NC > 2:
        _combine(y_ptr, y2, perm_ptr, wt_ptr, start + c0 + 2, c0 + 2, cnt, topk, N, rn, n_ok, ATOMIC)
        _combine(y_ptr, y3, perm_ptr, wt_ptr, start + c0 + 3, c0 + 3, cnt, topk, N, rn, n_ok, ATOMIC)


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, s_ptr, y_ptr, perm_ptr, wt_ptr, se_ptr, ss_ptr, sc_ptr,
                     topk, N, K, k_per_split, stride_we, stride_wn, stride_se, stride_sn,
                     FMT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, NC: tl.constexpr,
                     EVEN_K: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr, PREFETCH: tl.constexpr,
                     ATOMIC: tl.constexpr = True, PREFETCH_TAIL: tl.constexpr = False, PDL: tl.constexpr = False,
                     XV: tl.constexpr = False):
    """y[tok_c, n] += weight[p_c] * sum_k act[start + c, k] W_e[n, k] for rows n = pid0 * BN .. + BN,
    every token c of slot pid1 and the K range of pid2 (fp32 atomics; y zeroed by the host).
    ATOMIC=False (one K split): y[p_c, n] = the same term, per-pair rows [T * k, N]."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    pid_k = tl.program_id(2)
    e = tl.load(se_ptr + slot)
    start = tl.load(ss_ptr + slot)
    cnt = tl.load(sc_ptr + slot)
    cnt = tl.where(e >= 0, cnt, 0)
    e64 = tl.maximum(e, 0).to(tl.int64)
    if (FMT == 2 or FMT == 1) and F16:
        wb = w_ptr.to(tl.pointer_type(tl.int64)) + e64 * stride_we
    else:
        wb = w_ptr + e64 * stride_we
    sb = s_ptr + e64 * stride_se
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    for c0 in range(0, cnt - (NC - 1), NC):
        _dn_chunk(act_ptr, perm_ptr, wt_ptr, y_ptr, wb, sb, rn, n_ok, start, c0, cnt, topk, N, K, k_lo, k_hi,
                  stride_wn, stride_sn, FMT, BN, G, GS, NC, EVEN_K, ASM, F16, PREFETCH, ATOMIC, XV)
    r0 = cnt - cnt % NC
    if NC >= 4:
        if cnt - r0 >= 2:
            _dn_chunk(act_ptr, perm_ptr, wt_ptr, y_ptr, wb, sb, rn, n_ok, start, r0, cnt, topk, N, K, k_lo, k_hi,
                      stride_wn, stride_sn, FMT, BN, G, GS, 2, EVEN_K, ASM, F16, PREFETCH_TAIL, ATOMIC, XV)
        r0 = r0 + 2 * (cnt - r0 >= 2).to(tl.int32)
    if NC >= 2:
        if cnt - r0 >= 1:
            _dn_chunk(act_ptr, perm_ptr, wt_ptr, y_ptr, wb, sb, rn, n_ok, start, r0, cnt, topk, N, K, k_lo, k_hi,
                      stride_wn, stride_sn, FMT, BN, G, GS, 1, EVEN_K, ASM, F16, PREFETCH_TAIL, ATOMIC, XV)


@triton.jit
def _moe_group_kernel(idx_ptr, perm_ptr, se_ptr, ss_ptr, sc_ptr, n, S,
                      BI: tl.constexpr, BJ: tl.constexpr, EP: tl.constexpr, SP: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Grouping of the n (token, expert) pairs by expert (see moe_decode.moe_group): one launch.

    Every program counts the pairs per expert (cnt [EP]); program 0 writes the slots (distinct
    experts in increasing order: expert, first sorted position = pairs on smaller experts, count;
    then -1 / 0 / 0 up to S); program pid ranks pairs pid*BI.. : rank(i) = #{j: e_j < e_i} +
    #{j < i: e_j = e_i}, perm[rank(i)] = i. O(n * (E + BI)) work per program, no atomics."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    ev = tl.arange(0, EP)
    cnt = tl.zeros([EP], dtype=tl.int32)
    for j0 in range(0, n, BJ):
        rj = j0 + tl.arange(0, BJ)
        vj = tl.load(idx_ptr + rj, mask=rj < n, other=-1).to(tl.int32)
        cnt += tl.sum((vj[:, None] == ev[None, :]).to(tl.int32), axis=0)
    if pid == 0:
        present = cnt > 0
        slot = tl.cumsum(present.to(tl.int32), axis=0) - 1
        start = tl.cumsum(cnt, axis=0) - cnt
        nd = tl.sum(present.to(tl.int32), axis=0)
        tl.store(se_ptr + slot, ev, mask=present)
        tl.store(ss_ptr + slot, start, mask=present)
        tl.store(sc_ptr + slot, cnt, mask=present)
        rs = tl.arange(0, SP)
        unused = (rs >= nd) & (rs < S)
        tl.store(se_ptr + rs, tl.full([SP], -1, tl.int32), mask=unused)
        tl.store(ss_ptr + rs, tl.zeros([SP], dtype=tl.int32), mask=unused)
        tl.store(sc_ptr + rs, tl.zeros([SP], dtype=tl.int32), mask=unused)
    ri = pid * BI + tl.arange(0, BI)
    vi = tl.load(idx_ptr + ri, mask=ri < n, other=0).to(tl.int32)
    rank = tl.zeros([BI], dtype=tl.int32)
    for j0 in range(0, n, BJ):
        rj = j0 + tl.arange(0, BJ)
        vj = tl.load(idx_ptr + rj, mask=rj < n, other=-1).to(tl.int32)
        lt = (vj[None, :] < vi[:, None]) & (rj < n)[None, :]
        tie = (vj[None, :] == vi[:, None]) & (rj[None, :] < ri[:, None])
        rank += tl.sum((lt | tie).to(tl.int32), axis=1)
    tl.store(perm_ptr + rank, ri, mask=ri < n)
