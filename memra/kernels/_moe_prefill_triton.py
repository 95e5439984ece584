"""Triton source of the grouped MoE prefill GEMMs (see :mod:`memra.kernels.moe_prefill` for the
math, layouts, the pair alignment and the host wrapper). Imported only when a kernel is
launched, so the torch references work without Triton.

Three kernels:
- ``_act_quant_kernel``: x [T, D] -> FP8 E4M3 codes [T, D] + fp32 scales [T, D/128], one
  scale per 1x128 group (the FP8 block recipe's activation quantization);
- ``_moe_gate_up_kernel`` (kernel A): act[pos] = swiglu(gate_e x[tok], up_e x[tok]) for a
  row block of BM sorted pairs of one expert and BA act columns (BA gate rows + BA up rows);
- ``_moe_down_kernel`` (kernel B): y[tok] += w[pair] * act[pos] @ W_down_e^T (fp32 atomics),
  or out[pair] = w[pair] * act[pos] @ W_down_e^T (per-pair rows, summed over k by the host).
"""

import triton
import triton.language as tl

from ._fused_triton import _clamp_keep_nan, _swiglu_limit
from ._gemv_triton import _e2m1_scaled, _nvfp4_pairs, _ue4m3_raw
from ._pdl_triton import pdl_enter


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP_M: tl.constexpr):
    # program id -> (row block, column tile), GROUP_M row blocks per column sweep (L2 reuse of
    # the weight tiles: consecutive row blocks mostly belong to one expert)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    # a [M, K] @ b [K, N] in fp32; IEEE: fp32 operands without TF32 rounding
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    # acc + a [M, K] @ b [K, N] (fp32 accumulator chained through the MMA)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _to_e4m3(v, EXACT: tl.constexpr):
    """fp32 values with |v| <= 448 (or NaN) -> float8e4nv, round to nearest even, NaN to NaN.
    EXACT: round on the E4M3 grid in fp32 arithmetic first (the Triton 3.6 interpreter's fp32 ->
    fp8 cast is wrong when the rounding carries into the next binade, e.g. -126.5 -> -64, and
    turns NaN into 384); else the native cast (cvt.rn.satfinite on sm_90, NaN to NaN)."""
    if EXACT:
        ex = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        ex = tl.maximum(ex, -6)  # E4M3 subnormals: spacing 2^-9
        ulp = ((ex - 3 + 127) << 23).to(tl.float32, bitcast=True)
        y = v / ulp  # exact (power of two), |y| < 16
        y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to an integer, ties to even
        r = (y * ulp).to(tl.float8e4nv)
        nan8 = tl.full(v.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True)
        return tl.where(v != v, nan8, r)  # (the interpreter's cast turns NaN into 384)
    return v.to(tl.float8e4nv)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quant_groups(v, R: tl.constexpr, C: tl.constexpr, EXACT: tl.constexpr):
    """fp32 v [R, C] (C a multiple of 128) -> (E4M3 codes [R, C], fp32 scales [R, C // 128]):
    s = max(amax of the 1x128 group, 1e-10) / 448, code = e4m3(clamp(v / s, +-448)). Non-finite
    values as in the torch twin (``quantize_act_fp8_ref``): a NaN in a group makes its scale NaN
    (``tl.max`` alone drops it) and its code NaN; an inf makes the scale inf and the group's codes
    NaN (inf / inf) or 0."""
    v3 = tl.reshape(v, [R, C // 128, 128])
    if EXACT:  # the interpreter: tl.max is numpy's; a custom combine would run element by element
        amax = tl.max(tl.abs(v3), axis=2)
        amax = tl.where(tl.sum((v3 != v3).to(tl.int32), axis=2) > 0, float("nan"), amax)
    else:
        amax = tl.reduce(tl.abs(v3), 2, _nan_max)
    amax = _nan_max(amax, 1e-10)
    s = amax / 448.0
    q = tl.math.div_rn(v3, s[:, :, None])
    q = _clamp_keep_nan(q, -448.0, 448.0)
    return tl.reshape(_to_e4m3(q, EXACT), [R, C]), s


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, T, stride_x, stride_q, stride_s,
                      BT: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr = False):
    """Rows pid0 * BT .. + BT, columns pid1 * 128 .. + 128 of x -> codes q and one scale per row."""
    pdl_enter(PDL)
    pid_t = tl.program_id(0)
    g = tl.program_id(1)
    rt = pid_t * BT + tl.arange(0, BT)
    rk = g * 128 + tl.arange(0, 128)
    t_ok = rt < T
    rt64 = rt.to(tl.int64)
    x = tl.load(x_ptr + rt64[:, None] * stride_x + rk[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
    q, s = _quant_groups(x, BT, 128, EXACT)
    tl.store(q_ptr + rt64[:, None] * stride_q + rk[None, :], q, mask=t_ok[:, None])
    tl.store(s_ptr + rt64 * stride_s + g, tl.reshape(s, [BT]), mask=t_ok)


@triton.jit
def _w_tile(w_ptr, s_ptr, rn, k0, K, stride_wn, stride_sn,
            FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, CDT: tl.constexpr,
            F8: tl.constexpr, SCALAR_S: tl.constexpr = False, ASM: tl.constexpr = False):
    """Weight rows rn [BN] (in range), columns k0 .. k0 + BK of one expert -> (tile [BN, BK], s [BN]).

    bf16 / nvfp4 / q8_0: the dequantized values in CDT, s = 1 (nvfp4 values E2M1 * UE4M3 are exact
    in fp16 and bf16; q8_0 code * d is rounded to CDT). fp8: the codes (E4M3 as they are with F8,
    else converted to CDT, exact) and s = the 128x128 block scale of each row at k0 (BK divides
    128, so one scale per row and loop step): the caller scales the product. SCALAR_S (fp8):
    the rows rn lie in one 128-row scale block; s is not loaded (ones): the caller loads that
    block's scale with :func:`_block_scale`."""
    s = tl.full([BN], 1.0, tl.float32)
    if FMT == 2:  # nvfp4: byte i of a row = elements 2i (low nibble), 2i + 1; UE4M3 byte per 16
        rb = k0 // 2 + tl.arange(0, BK // 2)
        if EVEN_K:
            b = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :])
        else:
            b = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :], mask=(rb * 2 < K)[None, :], other=0)
        rs = k0 // 16 + tl.arange(0, BK // 16)
        if EVEN_K:
            sbyte = tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :]).to(tl.int32)
        else:
            sbyte = tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :], mask=(rs * 16 < K)[None, :],
                            other=0).to(tl.int32)
        if ASM:  # packed decode (4 bytes -> 8 fp16 per asm block) and fp16 products, all exact:
            # lo, hi = E2M1 * 2^-14; (v * 2^8) * (raw * 2^14) = v * raw * 2^22 (as below), every
            # intermediate a normal or exact subnormal fp16 (raw * 2^14 in [2^-3, 30720], products
            # in [2^-10, 2880], at most 6 significant bits)
            lo, hi = _nvfp4_pairs(b, True)
            w3 = tl.reshape(tl.join(lo, hi), [BN, BK // 16, 16]) * 256.0
            sc = (_ue4m3_raw(sbyte) * 16384.0).to(tl.float16)
            w = tl.reshape(w3 * sc[:, :, None], [BN, BK]).to(CDT)
        else:
            b = b.to(tl.int32)
            lo = _e2m1_scaled(b & 15).to(tl.float32)  # E2M1 * 2^-14, exact
            hi = _e2m1_scaled(b >> 4).to(tl.float32)
            w3 = tl.reshape(tl.join(lo, hi), [BN, BK // 16, 16])
            sc = _ue4m3_raw(sbyte) * 4194304.0  # 2^22: as gemv's _tile (E2M1 * 2^-14 -> E2M1 * UE4M3)
            w = tl.reshape(w3 * sc[:, :, None], [BN, BK]).to(CDT)
    else:
        rk = k0 + tl.arange(0, BK)
        if EVEN_K:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :])
        else:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=(rk < K)[None, :], other=0)
        if FMT == 0:
            w = w.to(CDT)
        elif FMT == 1:
            if not SCALAR_S:  # else the caller loads the tile's one scale (_block_scale)
                s = tl.load(s_ptr + (rn // 128) * stride_sn + k0 // 128)
            if not F8:
                w = w.to(CDT)
        else:  # q8_0: fp16 d per 32 weights of a row
            rs = k0 // 32 + tl.arange(0, BK // 32)
            if EVEN_K:
                d = tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :]).to(tl.float32)
            else:
                d = tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :], mask=(rs * 32 < K)[None, :],
                            other=0.0).to(tl.float32)
            w = tl.reshape(tl.reshape(w.to(tl.float32), [BN, BK // 32, 32]) * d[:, :, None], [BN, BK]).to(CDT)
    return w, s


# 4 NVFP4 code bytes ($4; elements 2i: low nibbles, 2i + 1: high nibbles) and their 4 scales (one
# per byte, two packed pairs: $5 bytes 0, 1; $6 bytes 2, 3) -> 4 even elements ($0, $1) and 4 odd
# elements ($2, $3), each
# E2M1 * scale, exact: _NVFP4_SPLIT_F16 decodes E2M1 * 2^-14 (fp16 bits: sign to 15, magnitude to
# 9..11; code 1 is the subnormal 2^-15), _NVFP4_SPLIT_BF16 E2M1 * 2^-126 (bf16 bits: sign to 15,
# magnitude to 6..8: the nibble n, alone in its 16-bit half, times 2^6 + 2^12 puts n << 6 at bits
# 6..9 and n << 12 at 12..15 without overlap, and one mask keeps bits 6..8 and 15; the odd nibble,
# already at bits 4..7, times 2^2 + 2^8); one packed multiply by the scales per pair of elements.
_NVFP4_SPLIT_F16 = tl.constexpr("""
{
.reg .b32 t01, t23, a, b, w;
prmt.b32 t01, $4, 0, 0x4140;
prmt.b32 t23, $4, 0, 0x4342;
shl.b32 a, t01, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t01, 12;
and.b32 b, b, 0x80008000;
or.b32 w, a, b;
mul.rn.f16x2 $0, w, $5;
shl.b32 a, t23, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t23, 12;
and.b32 b, b, 0x80008000;
or.b32 w, a, b;
mul.rn.f16x2 $1, w, $6;
shl.b32 a, t01, 5;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t01, 8;
and.b32 b, b, 0x80008000;
or.b32 w, a, b;
mul.rn.f16x2 $2, w, $5;
shl.b32 a, t23, 5;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t23, 8;
and.b32 b, b, 0x80008000;
or.b32 w, a, b;
mul.rn.f16x2 $3, w, $6;
}
""")
_NVFP4_SPLIT_BF16 = tl.constexpr("""
{
.reg .b32 t01, t23, a, w;
prmt.b32 t01, $4, 0, 0x4140;
prmt.b32 t23, $4, 0, 0x4342;
and.b32 a, t01, 0x000F000F;
mul.lo.u32 a, a, 0x1040;
and.b32 w, a, 0x81C081C0;
mul.rn.bf16x2 $0, w, $5;
and.b32 a, t23, 0x000F000F;
mul.lo.u32 a, a, 0x1040;
and.b32 w, a, 0x81C081C0;
mul.rn.bf16x2 $1, w, $6;
and.b32 a, t01, 0x00F000F0;
mul.lo.u32 a, a, 0x0104;
and.b32 w, a, 0x81C081C0;
mul.rn.bf16x2 $2, w, $5;
and.b32 a, t23, 0x00F000F0;
mul.lo.u32 a, a, 0x0104;
and.b32 w, a, 0x81C081C0;
mul.rn.bf16x2 $3, w, $6;
}
""")


@triton.jit
def _nvfp4_split_tile(w_ptr, s_ptr, rn, k0, K, stride_wn, stride_sn, BN: tl.constexpr, BK: tl.constexpr,
                      EVEN_K: tl.constexpr, CDT: tl.constexpr, ASM: tl.constexpr):
    """NVFP4 weight rows rn [BN] (in range), columns k0 .. k0 + BK of one expert, split by parity:
    (even [BN, BK // 2], odd [BN, BK // 2]) = (W[rn, k0 + 2i], W[rn, k0 + 2i + 1]) * 2^-8 in CDT.

    Each code byte holds one even and one odd element, so the two halves come straight out of the
    byte tile: no interleaving of the decoded values (the tl.join + reshape of _w_tile cost ~5
    byte permutes per pair of weights in SASS). The caller multiplies x's even and odd columns
    with them (two dots) and the accumulator by 2^8. Values E2M1 * UE4M3 * 2^-8 are exact in
    fp16, bf16 and fp32 (at most 6 significant bits, e.g. 6 * 416 = 0b100111 * 2^6; magnitudes 2^-18 ..
    11.25, scale bytes read with bit 7 ignored as ggml does). ASM (CDT fp16 or
    bf16): decode and scale in one packed asm per 4 bytes (_NVFP4_SPLIT_F16 / _BF16); else fp32
    arithmetic (the interpreter's form)."""
    rb = k0 // 2 + tl.arange(0, BK // 2)
    if EVEN_K:
        b = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :])
    else:
        b = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :], mask=(rb * 2 < K)[None, :], other=0)
    rs = k0 // 16 + tl.arange(0, BK // 16)
    if EVEN_K:
        sbyte = tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :]).to(tl.int32)
    else:
        sbyte = tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :], mask=(rs * 16 < K)[None, :],
                        other=0).to(tl.int32)
    raw = _ue4m3_raw(sbyte)  # UE4M3 * 2^-8
    if ASM and CDT != tl.float32:
        # bf16: decoded E2M1 * 2^-126 (codes +-0.5: the bf16 subnormal 2^-127, kept by mul.rn.bf16x2,
        # which has no flush-to-zero form; checked by the flagship-shape GPU tests); raw * 2^126 in
        # [2^109, 1.875 * 2^126]
        if CDT == tl.bfloat16:
            s8 = tl.reshape(tl.broadcast_to((raw * 8.507059173023462e37).to(tl.bfloat16)[:, :, None],
                                            [BN, BK // 16, 8]), [BN, BK // 2])
            ev, od = tl.inline_asm_elementwise(_NVFP4_SPLIT_BF16, "=r,=r,=r,=r,r,r,r", [b, s8],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:  # decoded E2M1 * 2^-14; raw * 2^14 in [2^-3, 30720]
            s8 = tl.reshape(tl.broadcast_to((raw * 16384.0).to(tl.float16)[:, :, None], [BN, BK // 16, 8]),
                            [BN, BK // 2])
            ev, od = tl.inline_asm_elementwise(_NVFP4_SPLIT_F16, "=r,=r,=r,=r,r,r,r", [b, s8],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        bi = b.to(tl.int32)
        r8 = tl.reshape(tl.broadcast_to((raw * 16384.0)[:, :, None], [BN, BK // 16, 8]), [BN, BK // 2])
        ev = (_e2m1_scaled(bi & 15).to(tl.float32) * r8).to(CDT)  # E2M1 * 2^-14 * raw * 2^14, exact
        od = (_e2m1_scaled(bi >> 4).to(tl.float32) * r8).to(CDT)
    return ev, od


@triton.jit
def _parity(x, R: tl.constexpr, C: tl.constexpr):
    # x [R, C] -> (x[:, 0::2], x[:, 1::2])
    return tl.split(tl.reshape(x, [R, C // 2, 2]))


@triton.jit
def _block_scale(s_ptr, row, k0, stride_sn):
    # fp8: the 128x128 block scale of weight row ``row`` (scalar) at K offset k0
    return tl.load(s_ptr + (row // 128) * stride_sn + k0 // 128)


@triton.jit
def _moe_gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, act_ptr, as_ptr, ids_ptr, bexp_ptr,
                        n_pairs, topk, I, K, num_m,
                        stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_a, stride_as,
                        limit,
                        FMT: tl.constexpr, BM: tl.constexpr, BA: tl.constexpr, BK: tl.constexpr, U: tl.constexpr,
                        GROUP_M: tl.constexpr, CDT: tl.constexpr, F8IN: tl.constexpr, F8OUT: tl.constexpr,
                        HAS_LIMIT: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, EXACT: tl.constexpr,
                        SCALAR_S: tl.constexpr = False, SWAP: tl.constexpr = False):
    """act[pos, j] = min(silu(g), limit) * clamp(u, +-limit) for the BM sorted positions pos of
    row block pid_m (one expert e, or -1: nothing to do) and act columns j = pid_a * BA .. + BA,
    g / u = x[pair // topk] . W_e[gate / up row of j]. W: fused bank [E, 2I, K], rows interleaved
    in blocks of U (gate row of j: (j // U) * 2U + j % U, up row: that + U).
    F8IN: x is E4M3 codes with fp32 scales per 1x128 group (xs), W fp8: FP8 x FP8 dots, both
    scales applied per 128-K step. F8OUT: act written as E4M3 codes + one scale per 1x128 group
    (BA a multiple of 128); else act in CDT.
    SWAP (not with F8IN / F8OUT): the transposed products W x^T, [BA, BM] accumulators: the
    dequantized weight tile is the MMA's first operand, which Hopper's wgmma reads from registers
    (no round trip of the dequantized tile through shared memory), and the BM pair rows are the
    MMA's N (16..256) instead of its M (>= 64 per warp group)."""
    pid = tl.program_id(0)
    num_a = tl.cdiv(I, BA)
    pid_m, pid_a = _swizzle(pid, num_m, num_a, GROUP_M)
    e = tl.load(bexp_ptr + pid_m)
    if e >= 0:
        rm = pid_m * BM + tl.arange(0, BM)
        pair = tl.load(ids_ptr + rm)
        valid = pair < n_pairs
        tok = tl.where(valid, pair // topk, 0).to(tl.int64)
        j = pid_a * BA + tl.arange(0, BA)
        jc = tl.minimum(j, I - 1)  # columns past I: rows of column I - 1 (in range, never stored)
        rg = (jc // U) * (2 * U) + jc % U
        ru = rg + U
        j0 = pid_a * BA  # SCALAR_S: all of the tile's gate rows in one 128-row block (up rows: + U)
        rg0 = (j0 // U) * (2 * U) + j0 % U
        e64 = e.to(tl.int64)
        wb = w_ptr + e64 * stride_we
        sb = ws_ptr + e64 * stride_se
        if SWAP:
            acc_g = tl.zeros([BA, BM], dtype=tl.float32)
            acc_u = tl.zeros([BA, BM], dtype=tl.float32)
        else:
            acc_g = tl.zeros([BM, BA], dtype=tl.float32)
            acc_u = tl.zeros([BM, BA], dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            if EVEN_K:
                xm = valid[:, None]
            else:
                xm = valid[:, None] & (rk < K)[None, :]
            xa = tl.load(x_ptr + tok[:, None] * stride_x + rk[None, :], mask=xm, other=0.0)
            if not F8IN:
                xa = xa.to(CDT)
            if FMT == 2 and not SWAP:  # nvfp4: even and odd columns, two dots per weight tile
                xe, xo = _parity(xa, BM, BK)
                ge, go = _nvfp4_split_tile(wb, sb, rg, k0, K, stride_wn, stride_sn, BA, BK, EVEN_K, CDT, not EXACT)
                acc_g = _mma(xo, tl.trans(go), _mma(xe, tl.trans(ge), acc_g, IEEE), IEEE)
                ue, uo = _nvfp4_split_tile(wb, sb, ru, k0, K, stride_wn, stride_sn, BA, BK, EVEN_K, CDT, not EXACT)
                acc_u = _mma(xo, tl.trans(uo), _mma(xe, tl.trans(ue), acc_u, IEEE), IEEE)
            else:
                wg, sg = _w_tile(wb, sb, rg, k0, K, stride_wn, stride_sn, FMT, BA, BK, EVEN_K, CDT, F8IN, SCALAR_S,
                                 not EXACT)
                wu, su = _w_tile(wb, sb, ru, k0, K, stride_wn, stride_sn, FMT, BA, BK, EVEN_K, CDT, F8IN, SCALAR_S,
                                 not EXACT)
                if SWAP:
                    acc_g = _mma(wg, tl.trans(xa), acc_g, IEEE)
                    acc_u = _mma(wu, tl.trans(xa), acc_u, IEEE)
                elif FMT == 1 and SCALAR_S:  # one FMA per accumulator element: row scale x block scale
                    pg = _mm(xa, tl.trans(wg), IEEE)
                    pu = _mm(xa, tl.trans(wu), IEEE)
                    bg = _block_scale(sb, rg0, k0, stride_sn)
                    bu = _block_scale(sb, rg0 + U, k0, stride_sn)
                    if F8IN:
                        xs = tl.load(xs_ptr + tok * stride_xs + k0 // 128, mask=valid, other=0.0)
                        acc_g += pg * (xs * bg)[:, None]
                        acc_u += pu * (xs * bu)[:, None]
                    else:
                        acc_g += pg * bg
                        acc_u += pu * bu
                elif FMT == 1:
                    pg = _mm(xa, tl.trans(wg), IEEE)
                    pu = _mm(xa, tl.trans(wu), IEEE)
                    if F8IN:
                        xs = tl.load(xs_ptr + tok * stride_xs + k0 // 128, mask=valid, other=0.0)
                        acc_g += pg * xs[:, None] * sg[None, :]
                        acc_u += pu * xs[:, None] * su[None, :]
                    else:
                        acc_g += pg * sg[None, :]
                        acc_u += pu * su[None, :]
                else:
                    acc_g = _mma(xa, tl.trans(wg), acc_g, IEEE)
                    acc_u = _mma(xa, tl.trans(wu), acc_u, IEEE)
        if FMT == 2 and not SWAP:  # the split tiles hold W * 2^-8
            acc_g = acc_g * 256.0
            acc_u = acc_u * 256.0
        a = acc_g * tl.sigmoid(acc_g)
        if HAS_LIMIT:
            a, acc_u = _swiglu_limit(a, acc_u, limit)
        a = a * acc_u
        rm64 = rm.to(tl.int64)
        sm = valid[:, None] & (j < I)[None, :]
        if SWAP:  # a is [BA, BM]
            tl.store(act_ptr + rm64[None, :] * stride_a + j[:, None], a.to(act_ptr.dtype.element_ty),
                     mask=(j < I)[:, None] & valid[None, :])
        elif F8OUT:
            q, s = _quant_groups(a, BM, BA, EXACT)
            tl.store(act_ptr + rm64[:, None] * stride_a + j[None, :], q, mask=sm)
            rg2 = pid_a * (BA // 128) + tl.arange(0, BA // 128)
            tl.store(as_ptr + rm64[:, None] * stride_as + rg2[None, :], s,
                     mask=valid[:, None] & (rg2 * 128 < I)[None, :])
        else:
            tl.store(act_ptr + rm64[:, None] * stride_a + j[None, :], a.to(act_ptr.dtype.element_ty), mask=sm)


@triton.jit
def _moe_down_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, ids_ptr, bexp_ptr, wt_ptr,
                     n_pairs, topk, N, K, num_m,
                     stride_a, stride_as, stride_we, stride_wn, stride_se, stride_sn, stride_y,
                     FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     CDT: tl.constexpr, F8: tl.constexpr, ATOMIC: tl.constexpr, EVEN_K: tl.constexpr,
                     IEEE: tl.constexpr, SCALAR_S: tl.constexpr = False, SWAP: tl.constexpr = False,
                     ASM: tl.constexpr = False):
    """For the BM sorted positions pos of row block pid_m (expert e; -1: nothing to do) and
    output columns n = pid_n * BN .. + BN: v = weight[pair] * act[pos] . W_e[n]; ATOMIC: fp32
    atomic add into y[pair // topk, n]; else stored to y[pair, n] (per-pair rows).
    F8: act is E4M3 codes with per-1x128 scales (as_ptr), W fp8: FP8 x FP8 dots.
    SWAP (not with fp8 weights): the transposed product W act^T, a [BN, BM] accumulator (as
    kernel A's SWAP)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    pid_m, pid_n = _swizzle(pid, num_m, num_n, GROUP_M)
    e = tl.load(bexp_ptr + pid_m)
    if e >= 0:
        rm = pid_m * BM + tl.arange(0, BM)
        pair = tl.load(ids_ptr + rm)
        valid = pair < n_pairs
        rm64 = rm.to(tl.int64)
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        rnc = tl.minimum(rn, N - 1)
        e64 = e.to(tl.int64)
        wb = w_ptr + e64 * stride_we
        sb = ws_ptr + e64 * stride_se
        if SWAP:
            acc = tl.zeros([BN, BM], dtype=tl.float32)
        else:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            if EVEN_K:
                am = valid[:, None]
            else:
                am = valid[:, None] & (rk < K)[None, :]
            a = tl.load(a_ptr + rm64[:, None] * stride_a + rk[None, :], mask=am, other=0.0)
            if not F8:
                a = a.to(CDT)
            if FMT == 2 and not SWAP:  # nvfp4: even and odd columns, two dots
                ae, ao = _parity(a, BM, BK)
                we, wo = _nvfp4_split_tile(wb, sb, rnc, k0, K, stride_wn, stride_sn, BN, BK, EVEN_K, CDT, ASM)
                acc = _mma(ao, tl.trans(wo), _mma(ae, tl.trans(we), acc, IEEE), IEEE)
            else:
                w, s = _w_tile(wb, sb, rnc, k0, K, stride_wn, stride_sn, FMT, BN, BK, EVEN_K, CDT, F8, SCALAR_S, ASM)
                if SWAP:
                    acc = _mma(w, tl.trans(a), acc, IEEE)
                elif FMT == 1 and SCALAR_S:  # one FMA per accumulator element
                    p = _mm(a, tl.trans(w), IEEE)
                    bs = _block_scale(sb, pid_n * BN, k0, stride_sn)
                    if F8:
                        asc = tl.load(as_ptr + rm64 * stride_as + k0 // 128, mask=valid, other=0.0)
                        acc += p * (asc * bs)[:, None]
                    else:
                        acc += p * bs
                elif FMT == 1:
                    p = _mm(a, tl.trans(w), IEEE)
                    if F8:
                        asc = tl.load(as_ptr + rm64 * stride_as + k0 // 128, mask=valid, other=0.0)
                        acc += p * asc[:, None] * s[None, :]
                    else:
                        acc += p * s[None, :]
                else:
                    acc = _mma(a, tl.trans(w), acc, IEEE)
        wt = tl.load(wt_ptr + pair, mask=valid, other=0.0)
        if FMT == 2 and not SWAP:  # the split tiles hold W * 2^-8
            wt = wt * 256.0
        if SWAP:  # acc is [BN, BM]
            acc = acc * wt[None, :]
            om = n_ok[:, None] & valid[None, :]
            if ATOMIC:
                tok = tl.where(valid, pair // topk, 0).to(tl.int64)
                tl.atomic_add(y_ptr + tok[None, :] * stride_y + rn[:, None], acc, mask=om, sem="relaxed")
            else:
                p64 = tl.where(valid, pair, 0).to(tl.int64)
                tl.store(y_ptr + p64[None, :] * stride_y + rn[:, None], acc, mask=om)
        else:
            acc = acc * wt[:, None]
            om = valid[:, None] & n_ok[None, :]
            if ATOMIC:
                tok = tl.where(valid, pair // topk, 0).to(tl.int64)
                tl.atomic_add(y_ptr + tok[:, None] * stride_y + rn[None, :], acc, mask=om, sem="relaxed")
            else:
                p64 = tl.where(valid, pair, 0).to(tl.int64)
                tl.store(y_ptr + p64[:, None] * stride_y + rn[None, :], acc, mask=om)


@triton.jit
def _moe_align_kernel(idx_ptr, ids_ptr, bexp_ptr, used_ptr, n, num_blocks, E,
                      BM: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, EP: tl.constexpr, NBC: tl.constexpr):
    """:func:`memra.kernels.moe_prefill.moe_align` in one launch (method "triton"), same outputs.

    Every program counts the pairs per expert (cnt [EP]) and derives the padded runs
    (pad = ceil(cnt / BM) * BM, pad_start = exclusive cumsum). Program pid places pairs
    pid * BI .. + BI: dest(i) = pad_start[e_i] + #{j < i: e_j = e_i} (the stable sort by expert);
    and it writes row blocks pid * NBC, + nprog * NBC, ...: block_expert[b] = #{e: pad_end[e] <=
    b * BM} (the expert whose padded run holds the block; E -> -1), and the block's padding rows
    (row r >= cnt[e] - (b * BM - pad_start[e]), and every row past the used blocks) = n.
    Gathers from the per-expert vectors are one-hot sums ([rows, EP]); no atomics, so no two
    programs write the same element."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ev = tl.arange(0, EP)
    cnt = tl.zeros([EP], dtype=tl.int32)
    for j0 in range(0, n, BJ):
        rj = j0 + tl.arange(0, BJ)
        vj = tl.load(idx_ptr + rj, mask=rj < n, other=-1).to(tl.int32)
        cnt += tl.sum((vj[:, None] == ev[None, :]).to(tl.int32), axis=0)
    pad = (cnt + BM - 1) // BM * BM
    pad_end = tl.cumsum(pad, axis=0)
    pad_start = pad_end - pad
    total = tl.sum(pad, axis=0)
    if pid == 0:
        tl.store(used_ptr, total // BM)
    # pairs
    ri = pid * BI + tl.arange(0, BI)
    vi = tl.load(idx_ptr + ri, mask=ri < n, other=-1).to(tl.int32)
    rank = tl.zeros([BI], dtype=tl.int32)
    for j0 in range(0, n, BJ):
        rj = j0 + tl.arange(0, BJ)
        vj = tl.load(idx_ptr + rj, mask=rj < n, other=-2).to(tl.int32)
        tie = (vj[None, :] == vi[:, None]) & (rj[None, :] < ri[:, None])
        rank += tl.sum(tie.to(tl.int32), axis=1)
    base = tl.sum(tl.where(vi[:, None] == ev[None, :], pad_start[None, :], 0), axis=1)
    tl.store(ids_ptr + base + rank, ri, mask=ri < n)
    # row blocks: expert and padding rows
    for b0 in range(pid * NBC, num_blocks, nprog * NBC):
        rb = b0 + tl.arange(0, NBC)
        start = rb * BM
        be = tl.sum(((pad_end[None, :] <= start[:, None]) & (ev[None, :] < E)).to(tl.int32), axis=1)
        live = be < E
        tl.store(bexp_ptr + rb, tl.where(live, be, -1), mask=rb < num_blocks)
        oh = be[:, None] == ev[None, :]
        c = tl.sum(tl.where(oh, cnt[None, :], 0), axis=1)
        s0 = tl.sum(tl.where(oh, pad_start[None, :], 0), axis=1)
        filled = tl.where(live, c - (start - s0), 0)  # real pairs in this block (may exceed BM)
        r = tl.arange(0, BM)
        padrow = r[None, :] >= filled[:, None]
        tl.store(ids_ptr + start[:, None] + r[None, :], tl.full([NBC, BM], 0, tl.int32) + n,
                 mask=padrow & (rb < num_blocks)[:, None])


@triton.jit
def _moe_combine_kernel(acc_ptr, add_ptr, y_ptr, D, stride_acc, stride_add, stride_y,
                        TOPK: tl.constexpr, BD: tl.constexpr, HAS_ADD: tl.constexpr, PDL: tl.constexpr = False):
    """y[t, cols] = (sum over j = 0..TOPK-1, in this order, of acc[t * TOPK + j, cols]) + add[t, cols],
    in fp32, cast to y's dtype: the deterministic combine of the per-pair rows (the same token's
    result never depends on the other tokens of the call, nor on the run)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    m = rd < D
    t64 = t.to(tl.int64)
    s = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        s += tl.load(acc_ptr + (t64 * TOPK + j) * stride_acc + rd, mask=m, other=0.0)
    if HAS_ADD:
        s += tl.load(add_ptr + t64 * stride_add + rd, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + t64 * stride_y + rd, s.to(y_ptr.dtype.element_ty), mask=m)
