"""Triton source of the paged prefill attention kernel (see :mod:`memra.kernels.attention_prefill`
for the math, the layouts, the tiling and the host wrapper). Imported only when the kernel is
launched, so the torch reference works without Triton."""

import triton
import triton.language as tl


@triton.jit
def _prefill_tiles(
    acc, l_i, m_i, q, qpos, k_base, v_base, bt_row, start, end, guard_lo, window, qk_scale,
    s_kn, s_kt, s_vn, s_vt,
    D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, CAST_F32: tl.constexpr, ALIGNED: tl.constexpr,
):
    # keys [start, end), BLOCK_N at a time, gathered through the block table. MASKED=False only
    # for ranges of whole tiles that every row of the block sees entirely (no mask, no guards).
    # ALIGNED: start may lie below the keys any row sees (rounded down to a tile edge); keys
    # below guard_lo are then not loaded (their pages may be released).
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for k0 in range(start, end, BLOCK_N):
        kpos = k0 + offs_n
        if MASKED:
            kin = kpos < end
            if ALIGNED:
                kin = kin & (kpos >= guard_lo)
            blk = tl.load(bt_row + kpos // BS, mask=kin, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + kpos // BS).to(tl.int64)
        tok = kpos % BS
        kp = k_base + blk[:, None] * s_kn + tok[:, None] * s_kt + offs_d[None, :]
        vp = v_base + blk[:, None] * s_vn + tok[:, None] * s_vt + offs_d[None, :]
        if MASKED:
            k = tl.load(kp, mask=kin[:, None], other=0.0)
        else:
            k = tl.load(kp)
        if CAST_F32:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if MASKED:
            ok = kin[None, :] & (kpos[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                ok = ok & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(vp, mask=kin[:, None], other=0.0)
        else:
            v = tl.load(vp)
        if CAST_F32:
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, len_ptr, gate_ptr, out_ptr,
    sm_scale, window, num_m,
    s_qt, s_qh, s_kn, s_kt, s_kh, s_vn, s_vt, s_vh, s_btb, s_gt, s_ot, s_oh,
    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_GATE: tl.constexpr, IEEE: tl.constexpr, CAST_F32: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    # program (query block, kv head, sequence). The block's BLOCK_M rows are the flattened
    # (query, head-of-group) rows f = i * G + g, f in [mb * BLOCK_M, (mb + 1) * BLOCK_M), so the
    # G query heads of one kv head share every K/V tile; the last (heaviest) blocks run first.
    mb = num_m - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2)
    t0 = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - t0
    rows = n * G
    f0 = mb * BLOCK_M
    if f0 >= rows:
        return
    L = tl.load(len_ptr + seq)
    P = L - n  # cached prefix: query i sits at position P + i

    offs_m = f0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < rows
    f = tl.minimum(offs_m, rows - 1)  # rows past the end repeat the last one (never stored)
    qi = f // G
    head = kvh * G + f % G
    qpos = P + qi
    tq = (t0 + qi).to(tl.int64)
    q = tl.load(q_ptr + tq[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :])
    if CAST_F32:
        q = q.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain

    # key ranges: the block's queries sit at p_first..p_last and together see [lo, hi);
    # [b, c) (whole BLOCK_N tiles) is seen by every row: no mask there. [lo, b) is the window's
    # lower edge, [c, hi) the causal diagonal (plus the tail of a partial tile). ALIGNED instead
    # walks [lo rounded down to a tile edge, hi), all masked (see below).
    p_first = P + f0 // G
    p_last = P + (tl.minimum(f0 + BLOCK_M, rows) - 1) // G
    hi = p_last + 1
    if HAS_WINDOW:
        lo = tl.maximum(p_first - window + 1, 0)
        b = tl.maximum(lo, tl.minimum(p_last - window + 1, hi))
    else:
        lo = 0
        b = 0
    c = b + (tl.maximum(p_first + 1 - b, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * s_btb
    k_base = k_ptr + kvh * s_kh
    v_base = v_ptr + kvh * s_vh
    if ALIGNED:
        # batch-invariant mode: key tiles at multiples of BLOCK_N and one (masked) code path for
        # all of them, whichever queries share the block, so a query's online softmax takes the
        # same steps at any q_len (one query of a decode step, a verify step's drafts, a chunk)
        acc, l_i, m_i = _prefill_tiles(acc, l_i, m_i, q, qpos, k_base, v_base, bt_row, (lo // BLOCK_N) * BLOCK_N, hi,
                                       lo, window, qk_scale, s_kn, s_kt, s_vn, s_vt, D=D, BS=BS, BLOCK_N=BLOCK_N,
                                       MASKED=True, HAS_WINDOW=HAS_WINDOW, IEEE=IEEE, CAST_F32=CAST_F32,
                                       ALIGNED=True)
    else:
        if HAS_WINDOW:
            acc, l_i, m_i = _prefill_tiles(acc, l_i, m_i, q, qpos, k_base, v_base, bt_row, lo, b, lo, window,
                                           qk_scale, s_kn, s_kt, s_vn, s_vt, D=D, BS=BS, BLOCK_N=BLOCK_N, MASKED=True,
                                           HAS_WINDOW=HAS_WINDOW, IEEE=IEEE, CAST_F32=CAST_F32, ALIGNED=False)
        acc, l_i, m_i = _prefill_tiles(acc, l_i, m_i, q, qpos, k_base, v_base, bt_row, b, c, lo, window, qk_scale,
                                       s_kn, s_kt, s_vn, s_vt, D=D, BS=BS, BLOCK_N=BLOCK_N, MASKED=False,
                                       HAS_WINDOW=HAS_WINDOW, IEEE=IEEE, CAST_F32=CAST_F32, ALIGNED=False)
        acc, l_i, m_i = _prefill_tiles(acc, l_i, m_i, q, qpos, k_base, v_base, bt_row, c, hi, lo, window, qk_scale,
                                       s_kn, s_kt, s_vn, s_vt, D=D, BS=BS, BLOCK_N=BLOCK_N, MASKED=True,
                                       HAS_WINDOW=HAS_WINDOW, IEEE=IEEE, CAST_F32=CAST_F32, ALIGNED=False)

    # every query sees at least itself, so l > 0; but ALIGNED also admits rows with a context
    # of 0 (n_s = 1, seq_lens 0: padding rows of a decode step), which get zeros
    if ALIGNED:
        l_i = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_i[:, None]
    if HAS_GATE:
        gt = tl.load(gate_ptr + tq * s_gt + head).to(tl.float32)
        o = o * tl.sigmoid(gt)[:, None]
    tl.store(out_ptr + tq[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])
