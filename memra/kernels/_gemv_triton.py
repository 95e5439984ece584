"""Triton source of the decode GEMV kernel (see :mod:`memra.kernels.gemv` for the math,
layouts and the host wrapper). Imported only when a kernel is launched, so the torch
references work without Triton."""

import triton
import triton.language as tl

from ._pdl_triton import pdl_enter

# 4 NVFP4 code bytes (natural pair order: low nibble = element 2i, high = 2i + 1) -> 8 fp16
# values E2M1 * 2^-14, exact (sign to bit 15, the 3 magnitude bits to bits 9..11, i.e. the
# two exponent bits and the top mantissa bit; code 1 is the fp16 subnormal 2^-15).
# $0, $1: low nibbles of bytes (0, 1), (2, 3); $2, $3: high nibbles; $4: the 4 bytes.
_NVFP4_ASM = tl.constexpr("""
{
.reg .b32 t01, t23, a, b;
prmt.b32 t01, $4, 0, 0x4140;
prmt.b32 t23, $4, 0, 0x4342;
shl.b32 a, t01, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t01, 12;
and.b32 b, b, 0x80008000;
or.b32 $0, a, b;
shl.b32 a, t23, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t23, 12;
and.b32 b, b, 0x80008000;
or.b32 $1, a, b;
shl.b32 a, t01, 5;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t01, 8;
and.b32 b, b, 0x80008000;
or.b32 $2, a, b;
shl.b32 a, t23, 5;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t23, 8;
and.b32 b, b, 0x80008000;
or.b32 $3, a, b;
}
""")


@triton.jit
def _e2m1_scaled(c):
    # 4-bit code (int32) -> E2M1 value * 2^-14 as fp16 bits, exactly (as _NVFP4_ASM does).
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _nvfp4_pairs(b3, ASM: tl.constexpr):
    # uint8 code bytes [...] -> (low-nibble values, high-nibble values), fp16 E2M1 * 2^-14
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_NVFP4_ASM, "=r,=r,=r,=r,r", [b3],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        b = b3.to(tl.int32)
        lo = _e2m1_scaled(b & 15)
        hi = _e2m1_scaled(b >> 4)
    return lo, hi


# fp16x2 path (nvfp4, FMA path with F16): one 64-bit word = one 16-element sub-block, element e
# in nibble e. Each 32-bit half gives 4 fp16x2 registers (element k, element k + 4), decoded
# as E2M1 * 2^-14 (as _NVFP4_ASM), multiplied with the matching fp16x2 pairs of the scaled
# activations (HMUL2/HFMA2, fp16 partial sum of the 16 products), the two halves summed in fp32.
# $0: fp32 result bits; $1: the 64-bit code word; $2..$9: x pairs (x_k, x_k+4), k = 0..3, then
# (x_8+k, x_12+k).
_NVFP4_H2_ASM = tl.constexpr("""
{
.reg .b32 lo, hi, a, b, w, acc;
.reg .b16 h0, h1;
.reg .f32 f0, f1;
mov.b64 {lo, hi}, $1;
shl.b32 a, lo, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 b, lo, 12;
and.b32 b, b, 0x80008000;
or.b32 w, a, b;
mul.rn.f16x2 acc, w, $2;
shl.b32 a, lo, 5;
and.b32 a, a, 0x0E000E00;
shl.b32 b, lo, 8;
and.b32 b, b, 0x80008000;
or.b32 w, a, b;
fma.rn.f16x2 acc, w, $3, acc;
shl.b32 a, lo, 1;
and.b32 a, a, 0x0E000E00;
shl.b32 b, lo, 4;
and.b32 b, b, 0x80008000;
or.b32 w, a, b;
fma.rn.f16x2 acc, w, $4, acc;
shr.b32 a, lo, 3;
and.b32 a, a, 0x0E000E00;
and.b32 b, lo, 0x80008000;
or.b32 w, a, b;
fma.rn.f16x2 acc, w, $5, acc;
shl.b32 a, hi, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 b, hi, 12;
and.b32 b, b, 0x80008000;
or.b32 w, a, b;
fma.rn.f16x2 acc, w, $6, acc;
shl.b32 a, hi, 5;
and.b32 a, a, 0x0E000E00;
shl.b32 b, hi, 8;
and.b32 b, b, 0x80008000;
or.b32 w, a, b;
fma.rn.f16x2 acc, w, $7, acc;
shl.b32 a, hi, 1;
and.b32 a, a, 0x0E000E00;
shl.b32 b, hi, 4;
and.b32 b, b, 0x80008000;
or.b32 w, a, b;
fma.rn.f16x2 acc, w, $8, acc;
shr.b32 a, hi, 3;
and.b32 a, a, 0x0E000E00;
and.b32 b, hi, 0x80008000;
or.b32 w, a, b;
fma.rn.f16x2 acc, w, $9, acc;
mov.b32 {h0, h1}, acc;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 f0, f0, f1;
mov.b32 $0, f0;
}
""")


@triton.jit
def _h2_pair(x_ptr, t, T, kk, k_hi, xs, ASM: tl.constexpr, EVEN_K: tl.constexpr, STEP: tl.constexpr = 4):
    # fp16x2 bits (int32) of (x[t, kk] * xs, x[t, kk + STEP] * xs): low half = x[t, kk]
    if EVEN_K:
        a = tl.load(x_ptr + kk, mask=t < T, other=0.0).to(tl.float32) * xs
        b = tl.load(x_ptr + kk + STEP, mask=t < T, other=0.0).to(tl.float32) * xs
    else:
        a = tl.load(x_ptr + kk, mask=(kk < k_hi) & (t < T), other=0.0).to(tl.float32) * xs
        b = tl.load(x_ptr + kk + STEP, mask=(kk < k_hi) & (t < T), other=0.0).to(tl.float32) * xs
    if ASM:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        ha = a.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hb = b.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        return ha | (hb << 16)


def _x16_ptx(xbytes: int) -> str:
    """PTX that loads one 16-element sub-block of activations x[k .. k + 15] (bf16: xbytes = 2,
    two ld.global.v4.b32; fp32: xbytes = 4, four) and returns the 8 fp16x2 pairs of _h2_col in
    $0..$7: pair j < 4 is (x_j, x_j+4) * xs, pair 4 + j is (x_8+j, x_12+j) * xs, low half first,
    each product rounded as _h2_pair does (fp32 mul.rn, then cvt.rn.f16x2.f32).
    $8: the 16-byte aligned address of x[k] (int64); $9: xs (fp32); $10: nonzero to load (else the
    pairs are 0, as the masked loads' other=0). Plain ld.global, not .nc: under PDL the down kernel
    reads act, which the kernel before it wrote."""
    nw = 8 if xbytes == 2 else 16  # 32-bit words per sub-block
    lines = ["{", ".reg .pred p;", ".reg .b32 " + ", ".join(f"w{i}" for i in range(nw)) + ";",
             ".reg .b32 a, b;", "setp.ne.b32 p, $10, 0;"]
    lines += [f"mov.b32 w{i}, 0;" for i in range(nw)]
    for v in range(nw // 4):
        off = f"+{16 * v}" if v else ""
        lines.append(f"@p ld.global.v4.b32 {{w{4 * v}, w{4 * v + 1}, w{4 * v + 2}, w{4 * v + 3}}}, [$8{off}];")

    def elem(e: int, reg: str) -> list[str]:
        if xbytes == 4:
            return [f"mul.rn.f32 {reg}, w{e}, $9;"]
        w = f"w{e // 2}"
        fix = f"shl.b32 {reg}, {w}, 16;" if e % 2 == 0 else f"and.b32 {reg}, {w}, 0xFFFF0000;"
        return [fix, f"mul.rn.f32 {reg}, {reg}, $9;"]

    for j in range(8):
        lo = j if j < 4 else 4 + j  # x_j or x_8+(j-4)
        lines += elem(lo, "a") + elem(lo + 4, "b") + [f"cvt.rn.f16x2.f32 ${j}, b, a;"]
    lines.append("}")
    return "\n".join(lines)


_X16_BF16_ASM = tl.constexpr(_x16_ptx(2))
_X16_F32_ASM = tl.constexpr(_x16_ptx(4))


@triton.jit
def _h2_x16(x_ptr, t, T, kk, k_hi, xs, EVEN_K: tl.constexpr):
    # the 8 fp16x2 pairs of sub-blocks kk (as 8 _h2_pair calls) from 16-byte vector loads (_x16_ptx);
    # x rows 16-byte aligned, bf16 or fp32 (the host checks: moe_decode's xvec)
    if EVEN_K:
        ok = (t < T).to(tl.int32) + kk * 0
    else:
        ok = ((kk < k_hi) & (t < T)).to(tl.int32)
    a = (x_ptr + kk).to(tl.int64)
    xv = xs + tl.zeros(kk.shape, dtype=tl.float32)
    if x_ptr.dtype.element_ty == tl.float32:
        return tl.inline_asm_elementwise(_X16_F32_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,l,f,r", [a, xv, ok],
                                         dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_X16_BF16_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,l,f,r", [a, xv, ok],
                                         dtype=(tl.int32,) * 8, is_pure=True, pack=1)


@triton.jit
def _h2_half(c):
    # 4-bit code (int32) -> fp32 value of the fp16 E2M1 * 2^-14 (interpreter form)
    return _e2m1_scaled(c).to(tl.float32)


@triton.jit
def _h2_x(p, hi: tl.constexpr):
    # fp32 value of the low (hi=0) or high half of fp16x2 bits p (interpreter form)
    if hi:
        v = (p >> 16) & 0xFFFF
    else:
        v = p & 0xFFFF
    return v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _h2_dot(q, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """Sum of the 16 products of a sub-block's code word q (int64) with its x pairs."""
    if ASM:
        return tl.inline_asm_elementwise(_NVFP4_H2_ASM, "=r,l,r,r,r,r,r,r,r,r", [q, x0, x1, x2, x3, x4, x5, x6, x7],
                                         dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
    else:  # same products (exact in fp32), summed in fp32 instead of fp16
        lo = (q & 0xFFFFFFFF).to(tl.int32)
        hi = ((q >> 32) & 0xFFFFFFFF).to(tl.int32)
        p = _h2_half(lo & 15) * _h2_x(x0, 0) + _h2_half((lo >> 16) & 15) * _h2_x(x0, 1)
        p += _h2_half((lo >> 4) & 15) * _h2_x(x1, 0) + _h2_half((lo >> 20) & 15) * _h2_x(x1, 1)
        p += _h2_half((lo >> 8) & 15) * _h2_x(x2, 0) + _h2_half((lo >> 24) & 15) * _h2_x(x2, 1)
        p += _h2_half((lo >> 12) & 15) * _h2_x(x3, 0) + _h2_half((lo >> 28) & 15) * _h2_x(x3, 1)
        p += _h2_half(hi & 15) * _h2_x(x4, 0) + _h2_half((hi >> 16) & 15) * _h2_x(x4, 1)
        p += _h2_half((hi >> 4) & 15) * _h2_x(x5, 0) + _h2_half((hi >> 20) & 15) * _h2_x(x5, 1)
        p += _h2_half((hi >> 8) & 15) * _h2_x(x6, 0) + _h2_half((hi >> 24) & 15) * _h2_x(x6, 1)
        p += _h2_half((hi >> 12) & 15) * _h2_x(x7, 0) + _h2_half((hi >> 28) & 15) * _h2_x(x7, 1)
        return p


@triton.jit
def _pow2_xscale(x_ptr, t, T, k_lo, k_hi, BK: tl.constexpr, TOP: tl.constexpr):
    """Power of two xs with max |x[t, k_lo:k_hi]| * xs in [2^(TOP-1), 2^TOP) (x = 0: xs = 2^(TOP-1)
    * 2^(127-TOP)), and 1 / xs; both exact powers of two (fp32 bits built from max |x|'s exponent e,
    clamped to [TOP, 254] so that both stay normal)."""
    m = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        m = tl.maximum(m, tl.abs(tl.load(x_ptr + kk, mask=(kk < k_hi) & (t < T), other=0.0).to(tl.float32)))
    e = (tl.max(m, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, TOP), 254)
    xs = ((253 - e + TOP) << 23).to(tl.float32, bitcast=True)
    xinv = ((e + (1 - TOP)) << 23).to(tl.float32, bitcast=True)
    return xs, xinv


@triton.jit
def _h2_xscale(x_ptr, t, T, k_lo, k_hi, BK: tl.constexpr):
    """Power of two xs with max |x[t, k_lo:k_hi]| * xs in [2^14, 2^15) (fp16 range with room for
    16 products of |E2M1 * 2^-14| <= 6 * 2^-14), and 2^22 / xs (2^22: the UE4M3 scale factor of _tile)."""
    xs, xinv = _pow2_xscale(x_ptr, t, T, k_lo, k_hi, BK, 15)
    return xs, xinv * 4194304.0  # 2^22: see s2 in _tile


@triton.jit
def _h2_load(q_ptr, s_ptr, n3, n_ok, k0, k_hi, stride_wn, stride_sn, rg, G: tl.constexpr, EVEN_K: tl.constexpr):
    # codes (int64, one per sub-block) and UE4M3 bytes (int32) of tile [G // 2, BN, 2] at column k0
    sg = tl.multiple_of(k0 // 16, G) + rg  # k0 is a multiple of BK = 16 G
    if EVEN_K:
        g_ok = n_ok[None, :, None]
    else:
        g_ok = n_ok[None, :, None] & (sg * 16 < k_hi)
    if EVEN_K:  # n3: rows clamped to N - 1 (their sums are not stored): no mask
        q = tl.load(q_ptr + n3 * stride_wn + sg)
        sb = tl.load(s_ptr + n3 * stride_sn + sg).to(tl.int32)
    else:
        q = tl.load(q_ptr + n3 * stride_wn + sg, mask=g_ok, other=0)
        sb = tl.load(s_ptr + n3 * stride_sn + sg, mask=g_ok, other=0).to(tl.int32)
    return q, sb


@triton.jit
def _h2_col(acc, q, s2, x_ptr, t, T, k0, k_hi, xs, G: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
            XV: tl.constexpr = False):
    # acc [G // 2, BN, 2] += (sub-block sums of column t) * scale; XV: x pairs from _h2_x16
    kk = k0 + (tl.arange(0, G // 2)[:, None, None] * 2 + tl.arange(0, 2)[None, None, :]) * 16
    if XV:
        x0, x1, x2, x3, x4, x5, x6, x7 = _h2_x16(x_ptr, t, T, kk, k_hi, xs, EVEN_K)
        return acc + _h2_dot(q, x0, x1, x2, x3, x4, x5, x6, x7, ASM) * s2
    x0 = _h2_pair(x_ptr, t, T, kk + 0, k_hi, xs, ASM, EVEN_K)
    x1 = _h2_pair(x_ptr, t, T, kk + 1, k_hi, xs, ASM, EVEN_K)
    x2 = _h2_pair(x_ptr, t, T, kk + 2, k_hi, xs, ASM, EVEN_K)
    x3 = _h2_pair(x_ptr, t, T, kk + 3, k_hi, xs, ASM, EVEN_K)
    x4 = _h2_pair(x_ptr, t, T, kk + 8, k_hi, xs, ASM, EVEN_K)
    x5 = _h2_pair(x_ptr, t, T, kk + 9, k_hi, xs, ASM, EVEN_K)
    x6 = _h2_pair(x_ptr, t, T, kk + 10, k_hi, xs, ASM, EVEN_K)
    x7 = _h2_pair(x_ptr, t, T, kk + 11, k_hi, xs, ASM, EVEN_K)
    return acc + _h2_dot(q, x0, x1, x2, x3, x4, x5, x6, x7, ASM) * s2


# fp16x2 path for FP8 (E4M3) codes: one 16-byte unit = 16 codes (two 8-byte words, element e in
# byte e). cvt.rn.f16x2.e4m3x2 turns two codes into two fp16 values exactly (E4M3 is a subset of
# fp16); each is multiplied with the matching fp16x2 pair of the scaled activations (x_2i, x_2i+1),
# the 8 HFMA2 of a unit summed in fp16 (each half: 8 products), then the two halves in fp32.
# $0: fp32 result bits; $1, $2: the unit's two words; $3..$10: x pairs i = 0..7.
_FP8_H2_ASM = tl.constexpr("""
{
.reg .b32 lo, hi, w, acc;
.reg .b16 c0, c1, c2, c3;
.reg .f32 f0, f1;
mov.b64 {lo, hi}, $1;
mov.b32 {c0, c1}, lo;
mov.b32 {c2, c3}, hi;
cvt.rn.f16x2.e4m3x2 w, c0;
mul.rn.f16x2 acc, w, $3;
cvt.rn.f16x2.e4m3x2 w, c1;
fma.rn.f16x2 acc, w, $4, acc;
cvt.rn.f16x2.e4m3x2 w, c2;
fma.rn.f16x2 acc, w, $5, acc;
cvt.rn.f16x2.e4m3x2 w, c3;
fma.rn.f16x2 acc, w, $6, acc;
mov.b64 {lo, hi}, $2;
mov.b32 {c0, c1}, lo;
mov.b32 {c2, c3}, hi;
cvt.rn.f16x2.e4m3x2 w, c0;
fma.rn.f16x2 acc, w, $7, acc;
cvt.rn.f16x2.e4m3x2 w, c1;
fma.rn.f16x2 acc, w, $8, acc;
cvt.rn.f16x2.e4m3x2 w, c2;
fma.rn.f16x2 acc, w, $9, acc;
cvt.rn.f16x2.e4m3x2 w, c3;
fma.rn.f16x2 acc, w, $10, acc;
mov.b32 {c0, c1}, acc;
cvt.f32.f16 f0, c0;
cvt.f32.f16 f1, c1;
add.f32 f0, f0, f1;
mov.b32 $0, f0;
}
""")

#: the x scale of the FP8 fp16x2 path: max |x| * xs in [2^3, 2^4) (it may round up to 16 in fp16), so
#: that a half's 8 products (|E4M3| <= 448) sum to at most 8 * 448 * 16 = 57344 < 65504 (fp16 max)
_F8_TOP = tl.constexpr(4)


@triton.jit
def _e4m3_f32(b):
    # E4M3 (fn) code (int32 0..255) -> fp32 value, exactly (interpreter form of cvt.rn.f16x2.e4m3x2)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    v = tl.where(e == 0, m * 0.001953125, ((e + 120) << 23 | (b & 7) << 20).to(tl.float32, bitcast=True))
    v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def _f8_word(q, xa, xb, xc, xd):
    # interpreter form: sum of the 8 products of word q's codes with 4 x pairs, in fp32
    p = _e4m3_f32((q & 0xFF).to(tl.int32)) * _h2_x(xa, 0) + _e4m3_f32(((q >> 8) & 0xFF).to(tl.int32)) * _h2_x(xa, 1)
    p += _e4m3_f32(((q >> 16) & 0xFF).to(tl.int32)) * _h2_x(xb, 0) + _e4m3_f32(((q >> 24) & 0xFF).to(tl.int32)) * _h2_x(xb, 1)
    p += _e4m3_f32(((q >> 32) & 0xFF).to(tl.int32)) * _h2_x(xc, 0) + _e4m3_f32(((q >> 40) & 0xFF).to(tl.int32)) * _h2_x(xc, 1)
    p += _e4m3_f32(((q >> 48) & 0xFF).to(tl.int32)) * _h2_x(xd, 0) + _e4m3_f32(((q >> 56) & 0xFF).to(tl.int32)) * _h2_x(xd, 1)
    return p


@triton.jit
def _f8_dot(qa, qb, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """Sum of the 16 products of a unit's codes (words qa, qb: int64) with its 8 x pairs (fp32)."""
    if ASM:
        return tl.inline_asm_elementwise(_FP8_H2_ASM, "=r,l,l,r,r,r,r,r,r,r,r", [qa, qb, x0, x1, x2, x3, x4, x5, x6, x7],
                                         dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
    else:  # same products (exact in fp32), summed in fp32 instead of fp16
        return _f8_word(qa, x0, x1, x2, x3) + _f8_word(qb, x4, x5, x6, x7)


@triton.jit
def _f8_load(q_ptr, n3, n_ok, k0, k_hi, stride_wn, rw, G: tl.constexpr, EVEN_K: tl.constexpr):
    # FP8 codes of tile [G, BN, 2] (G 16-byte units of rows n3 from column k0, as 8-byte words)
    kw = tl.multiple_of(k0 // 8, 2 * G) + rw  # k0 is a multiple of BK = 16 G
    if EVEN_K:  # n3: rows clamped to N - 1 (their sums are not stored): no mask
        q = tl.load(q_ptr + n3 * stride_wn + kw)
    else:
        q = tl.load(q_ptr + n3 * stride_wn + kw, mask=n_ok[None, :, None] & (kw * 8 < k_hi), other=0)
    return q


@triton.jit
def _f8_col(acc, qa, qb, su, x_ptr, t, T, k0, k_hi, xs, G: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr):
    # acc [G, BN] += (unit sums of column t) * su (each unit's 128x128 block scale, [G, 1])
    kk = k0 + tl.arange(0, G)[:, None] * 16
    x0 = _h2_pair(x_ptr, t, T, kk + 0, k_hi, xs, ASM, EVEN_K, 1)
    x1 = _h2_pair(x_ptr, t, T, kk + 2, k_hi, xs, ASM, EVEN_K, 1)
    x2 = _h2_pair(x_ptr, t, T, kk + 4, k_hi, xs, ASM, EVEN_K, 1)
    x3 = _h2_pair(x_ptr, t, T, kk + 6, k_hi, xs, ASM, EVEN_K, 1)
    x4 = _h2_pair(x_ptr, t, T, kk + 8, k_hi, xs, ASM, EVEN_K, 1)
    x5 = _h2_pair(x_ptr, t, T, kk + 10, k_hi, xs, ASM, EVEN_K, 1)
    x6 = _h2_pair(x_ptr, t, T, kk + 12, k_hi, xs, ASM, EVEN_K, 1)
    x7 = _h2_pair(x_ptr, t, T, kk + 14, k_hi, xs, ASM, EVEN_K, 1)
    return acc + _f8_dot(qa, qb, x0, x1, x2, x3, x4, x5, x6, x7, ASM) * su


@triton.jit
def _ue4m3_raw(b):
    # UE4M3 byte (int32) -> fp32 with the same exponent/mantissa bits read as fp16 (bias 15
    # instead of 7): ggml_ue4m3_to_fp32(b) = this * 2^8 * 0.5; 0x7F (NaN) decodes to 0 as in ggml.
    v = ((b & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where(b == 0x7F, 0.0, v)


@triton.jit
def _tile(w_ptr, s_ptr, rn, n_ok, k0, k_hi, stride_wn, stride_sn,
          FMT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, GS: tl.constexpr,
          EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """Weight tile for rows rn (n_ok: rows to load), columns k0 .. k0 + G*GS: values
    w3 [BN, G, GS] (fp32, or fp16 for nvfp4, unscaled) and each GS-group's scale s2 [BN, G] (fp32)."""
    BK: tl.constexpr = G * GS
    rg = tl.arange(0, G)
    n3 = rn[:, None, None]
    n3_ok = n_ok[:, None, None]
    if FMT == 2:  # nvfp4: GS = 16 weights = 8 code bytes, one UE4M3 byte per group
        kb3 = k0 // 2 + rg[None, :, None] * (GS // 2) + tl.arange(0, GS // 2)[None, None, :]
        if EVEN_K:
            b3 = tl.load(w_ptr + n3 * stride_wn + kb3, mask=n3_ok, other=0)
        else:
            b3 = tl.load(w_ptr + n3 * stride_wn + kb3, mask=n3_ok & ((kb3 * 2) < k_hi), other=0)
        lo, hi = _nvfp4_pairs(b3, ASM)
        w3 = tl.reshape(tl.join(lo, hi), [BN, G, GS])  # natural element order
        sg = k0 // GS + rg[None, :]
        sb = tl.load(s_ptr + rn[:, None] * stride_sn + sg, mask=n_ok[:, None] & (sg * GS < k_hi),
                     other=0).to(tl.int32)
        s2 = _ue4m3_raw(sb) * 4194304.0  # 2^22 = 2^14 (E2M1 * 2^-14) * 2^8 (bias) * 0.5 (ggml half scale) * 2 (kv)
    else:
        k3 = k0 + rg[None, :, None] * GS + tl.arange(0, GS)[None, None, :]
        # masks constant along K (EVEN_K) keep 16-byte vector loads
        wm = n3_ok if EVEN_K else n3_ok & (k3 < k_hi)
        if FMT == 3:
            w3 = tl.load(w_ptr + n3 * stride_wn + k3, mask=wm, other=0)
        else:
            w3 = tl.load(w_ptr + n3 * stride_wn + k3, mask=wm, other=0.0)
        if FMT == 0:  # bf16
            s2 = tl.full([BN, G], 1.0, tl.float32)
        elif FMT == 1:  # fp8 block 128x128 (k0 is a multiple of min(BK, 128))
            if BK <= 128:  # one scale per row for the whole loop step
                s1 = tl.load(s_ptr + (rn // 128) * stride_sn + k0 // 128, mask=n_ok, other=0.0)
                s2 = tl.broadcast_to(s1[:, None], [BN, G])
            else:  # BK // 128 scales per row, each shared by 128 // GS groups
                kb = k0 // 128 + tl.arange(0, BK // 128)
                sb = tl.load(s_ptr + (rn // 128)[:, None] * stride_sn + kb[None, :],
                             mask=n_ok[:, None] & (kb * 128 < k_hi)[None, :], other=0.0)
                s2 = tl.reshape(tl.broadcast_to(sb[:, :, None], [BN, BK // 128, 128 // GS]), [BN, G])
        else:  # q8_0: GS = 32, fp16 d per group
            sg = k0 // GS + rg[None, :]
            s2 = tl.load(s_ptr + rn[:, None] * stride_sn + sg, mask=n_ok[:, None] & (sg * GS < k_hi),
                         other=0.0).to(tl.float32)
    return w3, s2


@triton.jit
def _x_group(x_ptr, t, T, k0, k_hi, stride_xt, G: tl.constexpr, GS: tl.constexpr, EVEN_K: tl.constexpr):
    # activation row t, columns k0 .. k0 + G*GS as fp32 [G, GS] (zeros for t >= T)
    k2 = k0 + tl.arange(0, G)[:, None] * GS + tl.arange(0, GS)[None, :]
    if EVEN_K:
        x = tl.load(x_ptr + t * stride_xt + k2, mask=t < T, other=0.0)
    else:
        x = tl.load(x_ptr + t * stride_xt + k2, mask=(k2 < k_hi) & (t < T), other=0.0)
    return x.to(tl.float32)


@triton.jit
def _fma(acc, w3, s2, x2, FMT: tl.constexpr):
    p = tl.sum(w3.to(tl.float32) * x2[None, :, :], axis=2)  # [BN, G]
    if FMT == 0:
        return acc + p
    return acc + p * s2


@triton.jit
def _put(y_ptr, yv, t, T, rn, n_ok, stride_yt, ATOMIC: tl.constexpr):
    ptr = y_ptr + t * stride_yt + rn
    m = n_ok & (t < T)
    if ATOMIC:
        tl.atomic_add(ptr, yv, mask=m, sem="relaxed")
    else:
        tl.store(ptr, yv.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _dot_cols(w_ptr, s_ptr, rn, n_ok, N, xp0, xp1, xp2, xp3, c0, cnt, k_lo, k_hi, stride_wn, stride_sn,
              FMT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, GS: tl.constexpr, NC: tl.constexpr,
              EVEN_K: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr, PREFETCH: tl.constexpr,
              S_ROW: tl.constexpr, XV: tl.constexpr = False):
    """sum_k x_i[k] W[rn, k] over [k_lo, k_hi) for the NC columns i whose rows start at xp_i
    (column c0 + i, masked when >= cnt): four fp32 [BN] vectors (unused ones 0). The CUDA-core
    inner products of both decode GEMVs (_gemv_kernel: columns 0..T-1 of x; the MoE kernels: a
    slot's tokens). w_ptr/s_ptr: the codes/scales (for nvfp4 or fp8 with F16, an int64 pointer:
    8-byte words). S_ROW (fp8 with F16): s_ptr is the one 128-row scale row of all BN rows (BN
    divides 128), else each row's own row of blocks is read.
    The K loops are ``tl.range(..., num_stages=1)``: plain loads (with PREFETCH: one step ahead in
    registers). Triton's pipelining of these loads through shared memory (cp.async, num_stages > 1)
    measured 1.4-1.6x slower for the MoE kernels (H100, benchmarks/results/issue14/moe-stages-sweep-h100.json).
    nvfp4 with F16 only: PREFETCH == 2 with EVEN_K loads the codes and scales two steps ahead
    (ptxas issues a loop-carried load at the end of the loop body, so one step ahead leaves it
    little time: benchmarks/results/issue14/h100-ncu-stalls-gemv-t1-*); XV: each sub-block's
    activations come from 16-byte vector loads (_h2_x16; x rows 16-byte aligned, bf16 or fp32,
    ASM) instead of 16 two- or four-byte loads. Both give the same bits as the default path."""
    BK: tl.constexpr = G * GS
    if FMT == 2 and F16:  # nvfp4, fp16x2 sub-block sums (as _gemv_kernel's F16 path)
        xs0, xi0 = _h2_xscale(xp0, c0, cnt, k_lo, k_hi, 16 * G)
        xs1, xi1 = xs0, xi0
        xs2, xi2 = xs0, xi0
        xs3, xi3 = xs0, xi0
        if NC > 1:
            xs1, xi1 = _h2_xscale(xp1, c0 + 1, cnt, k_lo, k_hi, 16 * G)
        if NC > 2:
            xs2, xi2 = _h2_xscale(xp2, c0 + 2, cnt, k_lo, k_hi, 16 * G)
            xs3, xi3 = _h2_xscale(xp3, c0 + 3, cnt, k_lo, k_hi, 16 * G)
        acc0 = tl.zeros([G // 2, BN, 2], dtype=tl.float32)
        acc1 = tl.zeros([G // 2, BN, 2], dtype=tl.float32)
        acc2 = tl.zeros([G // 2, BN, 2], dtype=tl.float32)
        acc3 = tl.zeros([G // 2, BN, 2], dtype=tl.float32)
        rg = tl.arange(0, G // 2)[:, None, None] * 2 + tl.arange(0, 2)[None, None, :]
        n3 = tl.minimum(rn, N - 1)[None, :, None]
        PF2: tl.constexpr = PREFETCH == 2 and EVEN_K
        if PREFETCH:
            q, sb = _h2_load(w_ptr, s_ptr, n3, n_ok, k_lo, k_hi, stride_wn, stride_sn, rg, G, EVEN_K)
        else:
            q = tl.zeros([G // 2, BN, 2], dtype=tl.int64)
            sb = tl.zeros([G // 2, BN, 2], dtype=tl.int32)
        if PF2:  # the step after k_lo (clamped to the last step: a re-read, never out of range)
            q1, sb1 = _h2_load(w_ptr, s_ptr, n3, n_ok, tl.minimum(k_lo + BK, k_hi - BK), k_hi, stride_wn,
                               stride_sn, rg, G, EVEN_K)
        else:
            q1 = q
            sb1 = sb
        for k0 in tl.range(k_lo, k_hi, BK, num_stages=1):
            if PF2:
                qn, sbn = _h2_load(w_ptr, s_ptr, n3, n_ok, tl.minimum(k0 + 2 * BK, k_hi - BK), k_hi, stride_wn,
                                   stride_sn, rg, G, EVEN_K)
            elif PREFETCH:
                if EVEN_K:
                    qn, sbn = _h2_load(w_ptr, s_ptr, n3, n_ok, tl.minimum(k0 + BK, k_hi - BK), k_hi, stride_wn,
                                       stride_sn, rg, G, EVEN_K)
                else:
                    qn, sbn = _h2_load(w_ptr, s_ptr, n3, n_ok & (k0 + BK < k_hi), k0 + BK, k_hi, stride_wn,
                                       stride_sn, rg, G, EVEN_K)
            else:
                q, sb = _h2_load(w_ptr, s_ptr, n3, n_ok, k0, k_hi, stride_wn, stride_sn, rg, G, EVEN_K)
                qn = q
                sbn = sb
            s2 = _ue4m3_raw(sb)
            acc0 = _h2_col(acc0, q, s2, xp0, c0, cnt, k0, k_hi, xs0, G, ASM, EVEN_K, XV)
            if NC > 1:
                acc1 = _h2_col(acc1, q, s2, xp1, c0 + 1, cnt, k0, k_hi, xs1, G, ASM, EVEN_K, XV)
            if NC > 2:
                acc2 = _h2_col(acc2, q, s2, xp2, c0 + 2, cnt, k0, k_hi, xs2, G, ASM, EVEN_K, XV)
                acc3 = _h2_col(acc3, q, s2, xp3, c0 + 3, cnt, k0, k_hi, xs3, G, ASM, EVEN_K, XV)
            if PF2:
                q = q1
                sb = sb1
                q1 = qn
                sb1 = sbn
            else:
                q = qn
                sb = sbn
        y0 = tl.sum(tl.sum(acc0, axis=2), axis=0) * xi0
        y1 = tl.sum(tl.sum(acc1, axis=2), axis=0) * xi1
        y2 = tl.sum(tl.sum(acc2, axis=2), axis=0) * xi2
        y3 = tl.sum(tl.sum(acc3, axis=2), axis=0) * xi3
    elif FMT == 1 and F16:  # fp8, fp16x2 unit sums (as _gemv_kernel's fp8 F16 path)
        xs0, xi0 = _pow2_xscale(xp0, c0, cnt, k_lo, k_hi, 16 * G, _F8_TOP)
        xs1, xi1 = xs0, xi0
        xs2, xi2 = xs0, xi0
        xs3, xi3 = xs0, xi0
        if NC > 1:
            xs1, xi1 = _pow2_xscale(xp1, c0 + 1, cnt, k_lo, k_hi, 16 * G, _F8_TOP)
        if NC > 2:
            xs2, xi2 = _pow2_xscale(xp2, c0 + 2, cnt, k_lo, k_hi, 16 * G, _F8_TOP)
            xs3, xi3 = _pow2_xscale(xp3, c0 + 3, cnt, k_lo, k_hi, 16 * G, _F8_TOP)
        acc0 = tl.zeros([G, BN], dtype=tl.float32)
        acc1 = tl.zeros([G, BN], dtype=tl.float32)
        acc2 = tl.zeros([G, BN], dtype=tl.float32)
        acc3 = tl.zeros([G, BN], dtype=tl.float32)
        ru = tl.arange(0, G)
        rw = ru[:, None, None] * 2 + tl.arange(0, 2)[None, None, :]
        rc = tl.minimum(rn, N - 1)
        n3 = rc[None, :, None]
        s_rows = s_ptr + (rc // 128)[None, :] * stride_sn  # each row's 128x128 block row (unless S_ROW)
        if PREFETCH:
            q = _f8_load(w_ptr, n3, n_ok, k_lo, k_hi, stride_wn, rw, G, EVEN_K)
        else:
            q = tl.zeros([G, BN, 2], dtype=tl.int64)
        for k0 in tl.range(k_lo, k_hi, BK, num_stages=1):
            if PREFETCH:
                if EVEN_K:
                    qn = _f8_load(w_ptr, n3, n_ok, tl.minimum(k0 + BK, k_hi - BK), k_hi, stride_wn, rw, G, EVEN_K)
                else:
                    qn = _f8_load(w_ptr, n3, n_ok & (k0 + BK < k_hi), k0 + BK, k_hi, stride_wn, rw, G, EVEN_K)
            else:
                q = _f8_load(w_ptr, n3, n_ok, k0, k_hi, stride_wn, rw, G, EVEN_K)
                qn = q
            qa, qb = tl.split(q)
            if S_ROW:
                ku1 = k0 + ru * 16
                su = tl.load(s_ptr + ku1 // 128, mask=ku1 < k_hi, other=0.0)[:, None]
            else:
                ku = (k0 + ru * 16)[:, None]
                su = tl.load(s_rows + ku // 128, mask=ku < k_hi, other=0.0)
            acc0 = _f8_col(acc0, qa, qb, su, xp0, c0, cnt, k0, k_hi, xs0, G, ASM, EVEN_K)
            if NC > 1:
                acc1 = _f8_col(acc1, qa, qb, su, xp1, c0 + 1, cnt, k0, k_hi, xs1, G, ASM, EVEN_K)
            if NC > 2:
                acc2 = _f8_col(acc2, qa, qb, su, xp2, c0 + 2, cnt, k0, k_hi, xs2, G, ASM, EVEN_K)
                acc3 = _f8_col(acc3, qa, qb, su, xp3, c0 + 3, cnt, k0, k_hi, xs3, G, ASM, EVEN_K)
            q = qn
        y0 = tl.sum(acc0, axis=0) * xi0
        y1 = tl.sum(acc1, axis=0) * xi1
        y2 = tl.sum(acc2, axis=0) * xi2
        y3 = tl.sum(acc3, axis=0) * xi3
    else:  # fp32 FMAs on the dequantized tile (as _gemv_kernel's DOT=False path)
        acc0 = tl.zeros([BN, G], dtype=tl.float32)
        acc1 = tl.zeros([BN, G], dtype=tl.float32)
        acc2 = tl.zeros([BN, G], dtype=tl.float32)
        acc3 = tl.zeros([BN, G], dtype=tl.float32)
        w3, s2 = _tile(w_ptr, s_ptr, rn, n_ok, k_lo, k_hi, stride_wn, stride_sn, FMT, BN, G, GS, EVEN_K, ASM)
        for k0 in tl.range(k_lo, k_hi, BK, num_stages=1):
            if PREFETCH:
                w3n, s2n = _tile(w_ptr, s_ptr, rn, n_ok & (k0 + BK < k_hi), k0 + BK, k_hi, stride_wn, stride_sn,
                                 FMT, BN, G, GS, EVEN_K, ASM)
            else:
                w3, s2 = _tile(w_ptr, s_ptr, rn, n_ok, k0, k_hi, stride_wn, stride_sn, FMT, BN, G, GS, EVEN_K, ASM)
                w3n = w3
                s2n = s2
            acc0 = _fma(acc0, w3, s2, _x_group(xp0, c0, cnt, k0, k_hi, 0, G, GS, EVEN_K), FMT)
            if NC > 1:
                acc1 = _fma(acc1, w3, s2, _x_group(xp1, c0 + 1, cnt, k0, k_hi, 0, G, GS, EVEN_K), FMT)
            if NC > 2:
                acc2 = _fma(acc2, w3, s2, _x_group(xp2, c0 + 2, cnt, k0, k_hi, 0, G, GS, EVEN_K), FMT)
                acc3 = _fma(acc3, w3, s2, _x_group(xp3, c0 + 3, cnt, k0, k_hi, 0, G, GS, EVEN_K), FMT)
            w3 = w3n
            s2 = s2n
        y0 = tl.sum(acc0, axis=1)
        y1 = tl.sum(acc1, axis=1)
        y2 = tl.sum(acc2, axis=1)
        y3 = tl.sum(acc3, axis=1)
    return y0, y1, y2, y3


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr,
                 T, N, K, k_per_split,
                 stride_xt, stride_yt, stride_wn, stride_sn,
                 FMT: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                 GS: tl.constexpr, DOT: tl.constexpr, ATOMIC: tl.constexpr,
                 EVEN_K: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr, PREFETCH: tl.constexpr,
                 PDL: tl.constexpr = False):
    """y[t, n] (+)= sum_k x[t, k] W[n, k] for rows pid_n*BN.., K range pid_k*k_per_split..

    DOT=False: BT in {1, 2, 4}, one fp32 accumulator [BN, G] per column t, fp32 FMAs; for
    nvfp4 with F16, fp16x2 sub-block sums instead (_NVFP4_H2_ASM; stride_wn in 8-byte words).
    DOT=True: BT = 16, tl.dot of x with the dequantized tile (cast to x's dtype, or with
    F16 both operands in fp16).
    """
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BK: tl.constexpr = G * GS
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if DOT:
        rt = tl.arange(0, BT)
        t_ok = rt < T
        acc = tl.zeros([BT, BN], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BK):
            w3, s2 = _tile(w_ptr, s_ptr, rn, n_ok, k0, k_hi, stride_wn, stride_sn, FMT, BN, G, GS, EVEN_K, ASM)
            rk = k0 + tl.arange(0, BK)
            if EVEN_K:
                x2 = tl.load(x_ptr + rt[:, None] * stride_xt + rk[None, :], mask=t_ok[:, None], other=0.0)
            else:
                x2 = tl.load(x_ptr + rt[:, None] * stride_xt + rk[None, :],
                             mask=t_ok[:, None] & (rk < k_hi)[None, :], other=0.0)
            if F16:
                x2 = x2.to(tl.float16)
            if FMT == 0:  # bf16 weights as they are
                acc += tl.dot(x2, tl.trans(tl.reshape(w3, [BN, BK]).to(x2.dtype)))
            elif FMT == 1 and BK <= 128:  # exact codes in the dot, the block scale on the product
                s1 = tl.load(s_ptr + (rn // 128) * stride_sn + k0 // 128, mask=n_ok, other=0.0)
                acc += tl.dot(x2, tl.trans(tl.reshape(w3, [BN, BK]).to(x2.dtype))) * s1[None, :]
            elif FMT == 2 and F16:  # E2M1 (h * 2^14) times the UE4M3 value: exact in fp16
                s16 = (s2 * 0.00006103515625).to(tl.float16)  # s2 * 2^-14 = UE4M3 value
                w2 = ((w3 * 16384.0).to(tl.float16) * s16[:, :, None]).to(tl.float16)
                acc += tl.dot(x2, tl.trans(tl.reshape(w2, [BN, BK])))
            else:
                w2 = tl.reshape(w3.to(tl.float32) * s2[:, :, None], [BN, BK]).to(x2.dtype)
                acc += tl.dot(x2, tl.trans(w2))
        yp = y_ptr + rt[:, None] * stride_yt + rn[None, :]
        ym = t_ok[:, None] & n_ok[None, :]
        if ATOMIC:
            tl.atomic_add(yp, acc, mask=ym, sem="relaxed")
        else:
            tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=ym)
    else:  # CUDA-core inner products (fp16x2 for nvfp4 / fp8 with F16, fp32 FMAs otherwise)
        if (FMT == 2 or FMT == 1) and F16:
            wq = w_ptr.to(tl.pointer_type(tl.int64))  # stride_wn: in 8-byte words here (host)
        else:
            wq = w_ptr
        if FMT == 1 and F16:
            sq = s_ptr + ((pid_n * BN) // 128) * stride_sn  # BN divides 128: one row block per program
        else:
            sq = s_ptr
        y0, y1, y2, y3 = _dot_cols(wq, sq, rn, n_ok, N, x_ptr, x_ptr + stride_xt, x_ptr + 2 * stride_xt,
                                   x_ptr + 3 * stride_xt, 0, T, k_lo, k_hi, stride_wn, stride_sn, FMT, BN, G, GS,
                                   BT, EVEN_K, ASM, F16, PREFETCH, True)
        _put(y_ptr, y0, 0, T, rn, n_ok, stride_yt, ATOMIC)
        if BT > 1:
            _put(y_ptr, y1, 1, T, rn, n_ok, stride_yt, ATOMIC)
        if BT > 2:
            _put(y_ptr, y2, 2, T, rn, n_ok, stride_yt, ATOMIC)
            _put(y_ptr, y3, 3, T, rn, n_ok, stride_yt, ATOMIC)
