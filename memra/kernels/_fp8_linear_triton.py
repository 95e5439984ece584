"""Triton source of the FP8 block-recipe linear (see :mod:`memra.kernels.fp8_linear` for the math
and the host wrapper). The activation quantization kernel is the MoE prefill one
(``_moe_prefill_triton._act_quant_kernel``). Imported only when a kernel is launched."""

import triton
import triton.language as tl

from ._pdl_triton import pdl_enter


@triton.jit
def _fp8_linear_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, T, N, k_per_split,
                       stride_xq, stride_xs, stride_w, stride_ws, stride_y,
                       BN: tl.constexpr, BT: tl.constexpr, ATOMIC: tl.constexpr, PDL: tl.constexpr = False):
    """y[t, n] (+)= sum over the split's K of (xq[t, k] xs[t, k/128]) (w[n, k] ws[n/128, k/128]).

    Weights are the M side of the product ("swap AB": a [BN, 128] E4M3 tile), tokens the N side
    (an E4M3 [BT, 128] tile, transposed), so one tile of W serves BT tokens; every 128-K step's
    dot is scaled by its row / column scales and added to the fp32 accumulator (the promotion of
    the DeepSeek-V3 recipe: Hopper's FP8 MMA accumulates with ~14 bits inside one step).
    K (and k_per_split) are multiples of 128. ATOMIC: fp32 atomic add into a zeroed y."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_t = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rt = pid_t * BT + tl.arange(0, BT)
    n_ok = rn < N
    t_ok = rt < T
    rt64 = rt.to(tl.int64)
    rn64 = rn.to(tl.int64)  # N * K may pass 2^31 (a head of 128896 x 16384)
    k_lo = pid_k * k_per_split
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, 128):
        rk = k0 + tl.arange(0, 128)
        w = tl.load(w_ptr + rn64[:, None] * stride_w + rk[None, :], mask=n_ok[:, None], other=0.0)
        xq = tl.load(xq_ptr + rt64[:, None] * stride_xq + rk[None, :], mask=t_ok[:, None], other=0.0)
        ws = tl.load(ws_ptr + (rn // 128) * stride_ws + k0 // 128, mask=n_ok, other=0.0)
        xs = tl.load(xs_ptr + rt64 * stride_xs + k0 // 128, mask=t_ok, other=0.0)
        acc += tl.dot(w, tl.trans(xq)) * ws[:, None] * xs[None, :]
    yp = y_ptr + rt64[None, :] * stride_y + rn[:, None]
    ym = n_ok[:, None] & t_ok[None, :]
    if ATOMIC:
        tl.atomic_add(yp, acc, mask=ym, sem="relaxed")
    else:
        tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=ym)
