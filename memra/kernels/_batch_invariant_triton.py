"""Triton source of the batch-invariant linear layer (see :mod:`memra.kernels.batch_invariant`)."""

import triton
import triton.language as tl

from ._pdl_triton import pdl_enter


@triton.jit
def _bi_linear_kernel(x_ptr, w_ptr, y_ptr, T, N, K, stride_x, stride_w, stride_y,
                      BN: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False):
    # y[t, n] = sum_k x[t, k] w[n, k]: program (pid_n, pid_t) computes the [BN, BT] tile W x^T (weights
    # as the MMA's M side, tokens as its N side) over K in BK steps, one fixed order; a token's column
    # never meets another token's values, so it does not depend on T or on the other rows.
    pdl_enter(PDL)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rt = tl.program_id(1) * BT + tl.arange(0, BT)
    rk = tl.arange(0, BK)
    n_ok = rn < N
    t_ok = rt < T
    wp = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    xp = x_ptr + rt[None, :].to(tl.int64) * stride_x + rk[:, None]
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = k0 + rk < K
        w = tl.load(wp + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(xp + k0, mask=t_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, x.to(w.dtype), acc)
    yp = y_ptr + rt[None, :].to(tl.int64) * stride_y + rn[:, None]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])
