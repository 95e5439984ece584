"""Triton source of the paged decode attention kernels (see :mod:`memra.kernels.attention_decode`
for the math, the layouts and the host wrapper). Imported only when a kernel is launched, so
the torch references work without Triton."""

import triton
import triton.language as tl

from ._pdl_triton import pdl_enter


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, gate_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
    sm_scale, window, num_kv, num_splits,
    s_qb, s_qh, s_kn, s_kt, s_kh, s_vn, s_vt, s_vh, s_btb, s_gb, s_ob, s_oh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_GATE: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
    CAST_F32: tl.constexpr, PDL: tl.constexpr = False,
):
    # program (b * KV + kv head, split): all G query heads of one kv head over one key partition
    pdl_enter(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // num_kv
    kvh = pid % num_kv
    L = tl.load(len_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(L - window, 0)
    # visible keys [lo, L); pages [lo // BS, ceil(L / BS)); split the pages evenly over the splits
    p0 = lo // BS
    npages = tl.maximum((L + BS - 1) // BS - p0, 0)
    per = (npages + num_splits - 1) // num_splits
    pstart = p0 + split * per
    k_lo = tl.maximum(pstart * BS, lo)
    k_hi = tl.minimum((pstart + per) * BS, L)

    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    if CAST_F32:
        q = q.to(tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 domain

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    for t0 in range(pstart * BS, k_hi, BLOCK_N):
        pos = t0 + offs_n
        ok = (pos >= k_lo) & (pos < k_hi)
        blk = tl.load(bt_row + pos // BS, mask=ok, other=0).to(tl.int64)
        tok = pos % BS
        kp = k_ptr + blk[:, None] * s_kn + tok[:, None] * s_kt + kvh * s_kh + offs_d[None, :]
        k = tl.load(kp, mask=ok[:, None], other=0.0)
        if CAST_F32:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vp = v_ptr + blk[:, None] * s_vn + tok[:, None] * s_vt + kvh * s_vh + offs_d[None, :]
        v = tl.load(vp, mask=ok[:, None], other=0.0)
        if CAST_F32:
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if DIRECT:
        # one split: normalise, gate and store the output here (padding rows: l = 0 -> zeros)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if HAS_GATE:
            gt = tl.load(gate_ptr + b * s_gb + heads, mask=g_ok, other=0.0).to(tl.float32)
            o = o * tl.sigmoid(gt)[:, None]
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None])
    else:
        # partials, layout m/l [B, H, S], acc [B, H, S, D] (fp32; m in the exp2 domain)
        row = (b * (num_kv * G) + heads) * num_splits + split
        tl.store(m_ptr + row, m_i, mask=g_ok)
        tl.store(l_ptr + row, l_i, mask=g_ok)
        tl.store(acc_ptr + row[:, None].to(tl.int64) * D + offs_d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _decode_combine_kernel(
    m_ptr, l_ptr, acc_ptr, gate_ptr, out_ptr, num_heads, num_splits, s_gb, s_ob, s_oh,
    D: tl.constexpr, SP: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr = False,
):
    # program (b * H + h): merge the splits' (m, l, acc) into the output row
    pdl_enter(PDL)
    pid = tl.program_id(0)
    b = pid // num_heads
    h = pid % num_heads
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, D)
    s_ok = offs_s < num_splits
    row = pid * num_splits + offs_s
    m = tl.load(m_ptr + row, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + row, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok & (l > 0), tl.exp2(m - m_safe), 0.0)
    acc = tl.load(acc_ptr + row[:, None].to(tl.int64) * D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    o = num / tl.where(den > 0, den, 1.0)
    if HAS_GATE:
        gt = tl.load(gate_ptr + b * s_gb + h).to(tl.float32)
        o = o * tl.sigmoid(gt)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d, o.to(out_ptr.dtype.element_ty))
