"""Triton source of the decode GEMV kernel (see :mod:`memra.kernels.gemv` for the math,
layouts and the host wrapper). Imported only when a kernel is launched, so the torch
references work without Triton."""

import triton
import triton.language as tl

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
def _gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr,
                 T, N, K, k_per_split,
                 stride_xt, stride_yt, stride_wn, stride_sn,
                 FMT: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
                 GS: tl.constexpr, DOT: tl.constexpr, ATOMIC: tl.constexpr,
                 EVEN_K: tl.constexpr, ASM: tl.constexpr, F16: tl.constexpr, PREFETCH: tl.constexpr):
    """y[t, n] (+)= sum_k x[t, k] W[n, k] for rows pid_n*BN.., K range pid_k*k_per_split..

    DOT=False: BT in {1, 2, 4}, one fp32 accumulator [BN, G] per column t, fp32 FMAs.
    DOT=True: BT = 16, tl.dot of x with the dequantized tile (cast to x's dtype, or with
    F16 both operands in fp16).
    """
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
    else:
        acc0 = tl.zeros([BN, G], dtype=tl.float32)
        acc1 = tl.zeros([BN, G], dtype=tl.float32)
        acc2 = tl.zeros([BN, G], dtype=tl.float32)
        acc3 = tl.zeros([BN, G], dtype=tl.float32)
        # PREFETCH: the next loop step's weight tile is loaded before this one is used
        # (software pipelining in registers; Triton pipelines only the loads that feed tl.dot)
        w3, s2 = _tile(w_ptr, s_ptr, rn, n_ok, k_lo, k_hi, stride_wn, stride_sn, FMT, BN, G, GS, EVEN_K, ASM)
        for k0 in range(k_lo, k_hi, BK):
            if PREFETCH:
                w3n, s2n = _tile(w_ptr, s_ptr, rn, n_ok & (k0 + BK < k_hi), k0 + BK, k_hi, stride_wn, stride_sn,
                                 FMT, BN, G, GS, EVEN_K, ASM)
            else:
                w3, s2 = _tile(w_ptr, s_ptr, rn, n_ok, k0, k_hi, stride_wn, stride_sn, FMT, BN, G, GS, EVEN_K, ASM)
                w3n = w3
                s2n = s2
            acc0 = _fma(acc0, w3, s2, _x_group(x_ptr, 0, T, k0, k_hi, stride_xt, G, GS, EVEN_K), FMT)
            if BT > 1:
                acc1 = _fma(acc1, w3, s2, _x_group(x_ptr, 1, T, k0, k_hi, stride_xt, G, GS, EVEN_K), FMT)
            if BT > 2:
                acc2 = _fma(acc2, w3, s2, _x_group(x_ptr, 2, T, k0, k_hi, stride_xt, G, GS, EVEN_K), FMT)
                acc3 = _fma(acc3, w3, s2, _x_group(x_ptr, 3, T, k0, k_hi, stride_xt, G, GS, EVEN_K), FMT)
            w3 = w3n
            s2 = s2n
        _put(y_ptr, tl.sum(acc0, axis=1), 0, T, rn, n_ok, stride_yt, ATOMIC)
        if BT > 1:
            _put(y_ptr, tl.sum(acc1, axis=1), 1, T, rn, n_ok, stride_yt, ATOMIC)
        if BT > 2:
            _put(y_ptr, tl.sum(acc2, axis=1), 2, T, rn, n_ok, stride_yt, ATOMIC)
            _put(y_ptr, tl.sum(acc3, axis=1), 3, T, rn, n_ok, stride_yt, ATOMIC)
