"""Triton source of the fused RMSNorm and q/k-norm + partial-RoPE kernels (see
:mod:`memra.kernels.norm_rope` for the math and the host wrappers). Imported only when a
kernel is launched."""

import triton
import triton.language as tl

from ._pdl_triton import pdl_enter


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, D, eps, s_x, s_r, s_y, s_s,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < D
    x = tl.load(x_ptr + row * s_x + offs, mask=ok, other=0.0)
    if HAS_RES:
        x = x + tl.load(r_ptr + row * s_r + offs, mask=ok, other=0.0)  # in x's dtype, as torch adds
        tl.store(s_ptr + row * s_s + offs, x, mask=ok)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(y_ptr + row * s_y + offs, (xf * r * w).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rope_row(src, dst, w_ptr, cos_row, sin_row, eps,
                   DH: tl.constexpr, ROT: tl.constexpr, BLOCK: tl.constexpr, HAS_W: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < DH
    HALF: tl.constexpr = ROT // 2
    in_rot = offs < ROT
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
    x = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=in_rot, other=0.0).to(tl.float32)
    if HAS_W:
        r = tl.rsqrt(tl.sum(x * x, 0) / DH + eps)
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        wp = tl.load(w_ptr + partner, mask=in_rot, other=0.0)
        # the model rounds the normed head to its dtype before RoPE: do the same
        x = (x * r * w).to(dst.dtype.element_ty).to(tl.float32)
        xp = (xp * r * wp).to(dst.dtype.element_ty).to(tl.float32)
    c = tl.load(cos_row + offs, mask=in_rot, other=1.0).to(tl.float32)
    s = tl.load(sin_row + offs, mask=in_rot, other=0.0).to(tl.float32)
    xp = tl.where(offs < HALF, -xp, xp)
    y = tl.where(in_rot, x * c + xp * s, x)
    tl.store(dst + offs, y.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, H, eps,
                         s_qt, s_qh, s_kt, s_kh, s_ct, s_st,
                         KV: tl.constexpr, DH: tl.constexpr, ROT: tl.constexpr, BLOCK: tl.constexpr,
                         HAS_QW: tl.constexpr, HAS_KW: tl.constexpr, PDL: tl.constexpr = False):
    # program (token t, head j): j < H a query head, else kv head j - H
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    cos_row = cos_ptr + t * s_ct
    sin_row = sin_ptr + t * s_st
    if j < H:
        _norm_rope_row(q_ptr + t * s_qt + j * s_qh, qo_ptr + (t * H + j) * DH, qw_ptr, cos_row, sin_row, eps,
                       DH, ROT, BLOCK, HAS_QW)
    else:
        jk = j - H
        _norm_rope_row(k_ptr + t * s_kt + jk * s_kh, ko_ptr + (t * KV + jk) * DH, kw_ptr, cos_row, sin_row, eps,
                       DH, ROT, BLOCK, HAS_KW)
