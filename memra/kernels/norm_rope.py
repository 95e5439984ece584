"""Fused RMSNorm (optionally with the residual add) and per-head q/k RMSNorm + NeoX partial RoPE.

The plain-torch definitions here (:func:`rms_norm_torch`, :func:`rope_torch`) are the math
itself: memra/layers/norm.py and memra/layers/rope.py run them on the CPU and the Triton
kernels below on the GPU, behind one call.

Math:
- :func:`rms_norm`: ``y = x * rsqrt(mean(x^2) + eps) * w`` in fp32, rounded once to x's dtype;
  ``w`` fp32 [D] is the effective multiplier (1 + w already folded in for zero-centred norms).
  With ``residual``: ``s = x + residual`` in x's dtype (rounded, as torch adds), returns
  ``(rms_norm(s), s)``. One launch, one row per program.
- :func:`qk_norm_rope`: per head, the RMSNorm above over head_dim with ``q_weight`` /
  ``k_weight`` (None: no norm, llama-style), rounded to q's dtype like the model's
  ``RMSNorm`` module, then RoPE on the first ``rotary_dim = cos.shape[-1]`` dims:
  ``out = x * cos + rotate_half(x) * sin`` (``rotate_half(x) = [-x2, x1]``), the rest of the
  head passing through. cos/sin [T, rotary_dim] are whatever the model built
  (memra/layers/rope.py ``rope_cos_sin``, rounded to the activation dtype). q, k may be
  strided views into a fused projection output; the results are new contiguous tensors.
  One launch for q and k together (program = token x head).

Rounding: the reference applies RoPE in the activation dtype (``x*cos`` and
``rotate_half(x)*sin`` each rounded, then their sum); the kernel computes the rotation in
fp32 and rounds once, so in bf16 the two differ by at most ~1.5 bf16 ulps of the result
(tests use atol = rtol = 2^-7 for bf16, 1e-5 for fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pdl import pdl_args

__all__ = ["rms_norm", "rms_norm_ref", "rms_norm_torch", "qk_norm_rope", "qk_norm_rope_ref", "rope_torch"]


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension of ``x`` [..., D] scaled by fp32 ``weight`` [D]:
    ``x * rsqrt(mean(x^2) + eps) * weight`` in fp32, rounded once to x's dtype (fp32 inputs:
    torch's fused ``F.rms_norm``, one op: decode on the CPU is op-bound). Zhang & Sennrich
    2019, "Root Mean Square Layer Normalization"."""
    if x.device.type == "cpu":  # fp32 math (x widened), one rounding back
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


_HALF_SIGNS: dict[tuple, torch.Tensor] = {}


def _half_signs(rot: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[-1] * (rot / 2) + [1] * (rot / 2): ``roll(x, rot / 2) * signs = rotate_half(x) = cat(-x2, x1)``
    (cached per shape, dtype, device; callers must not modify it)."""
    key = (rot, dtype, device)
    if key not in _HALF_SIGNS:
        half = rot // 2
        _HALF_SIGNS[key] = torch.cat([-torch.ones(half, dtype=dtype, device=device),
                                       torch.ones(rot - half, dtype=dtype, device=device)])
    return _HALF_SIGNS[key]


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (rotate-half) RoPE of the first ``rot = cos.shape[-1]`` dims of each head of ``x``
    [T, H, D]: ``x * cos + rotate_half(x) * sin`` in x's dtype, the other dims passed through.
    cos, sin [T, rot]. Su et al. 2021, "RoFormer". On the CPU ``rotate_half(x) * sin`` is
    ``roll(x) * (sin * signs)`` (exact: the signs are +-1; two small ops instead of slices, a
    negation and a concatenation, decode on the CPU being op-bound; an earlier signed-permutation
    matmul cost 19 µs a layer in bf16)."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    xr = x[..., :rot] if rot != x.shape[-1] else x
    if x.device.type == "cpu":
        rotated, sin = torch.roll(xr, rot // 2, dims=-1), sin * _half_signs(rot, sin.dtype, sin.device)
    else:
        rotated = torch.cat([-xr[..., rot // 2:], xr[..., :rot // 2]], dim=-1)
    out = xr * cos + rotated * sin  # not addcmul: its fused rounding differs between vector body and tail
    if rot == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rot:]], dim=-1)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"rms_norm: x must be [T, D], got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: weight must be [{x.shape[1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual must be {x.dtype} {tuple(x.shape)}, got {residual.dtype} "
                         f"{tuple(residual.shape)}")


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`rms_norm`: :func:`rms_norm_torch` after an optional residual add."""
    _check_norm(x, weight, residual)
    if residual is None:
        return rms_norm_torch(x, weight, eps)
    s = x + residual
    return rms_norm_torch(s, weight, eps), s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of ``x`` [T, D] (module docstring), by one Triton launch.

    Returns ``y`` [T, D] in x's dtype, or ``(y, x + residual)`` when ``residual`` is given.
    Raises ValueError on mismatched shapes or dtypes."""
    _check_norm(x, weight, residual)
    if x.stride(1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    w = weight.float().contiguous()
    T, D = x.shape
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else y
    if T:
        from ._norm_rope_triton import _rms_norm_kernel

        block = _next_pow2(D)
        r = residual if residual is not None else x
        _rms_norm_kernel[(T,)](x, r, w, y, s, D, float(eps), x.stride(0), r.stride(0), y.stride(0), s.stride(0),
                               BLOCK=block, HAS_RES=residual is not None,
                               num_warps=max(1, min(16, block // 256)), **pdl_args(x.device))
    return y if residual is None else (y, s)


def _check_qk(q, k, q_weight, k_weight, cos, sin) -> tuple[int, int, int, int, int]:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"qk_norm_rope: q [T, H, Dh] and k [T, KV, Dh] expected, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"qk_norm_rope: q is {q.dtype}, k is {k.dtype}; expected one dtype")
    T, H, Dh = q.shape
    KV = k.shape[1]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and w.shape != (Dh,):
            raise ValueError(f"qk_norm_rope: {name} must be [{Dh}], got {tuple(w.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != T:
        raise ValueError(f"qk_norm_rope: cos/sin must be [{T}, rotary_dim], got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    rot = cos.shape[1]
    if rot % 2 or rot > Dh or rot < 2:
        raise ValueError(f"qk_norm_rope: rotary_dim {rot} must be even, >= 2 and <= head dim {Dh}")
    return T, H, KV, Dh, rot


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                     k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`qk_norm_rope`: exactly :func:`rms_norm_torch` then :func:`rope_torch`."""
    _check_qk(q, k, q_weight, k_weight, cos, sin)
    if q_weight is not None:
        q = rms_norm_torch(q, q_weight, eps)
    if k_weight is not None:
        k = rms_norm_torch(k, k_weight, eps)
    return rope_torch(q, cos, sin).contiguous(), rope_torch(k, cos, sin).contiguous()


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k RMSNorm + partial NeoX RoPE (module docstring) in one Triton launch.

    Args:
        q [T, H, Dh], k [T, KV, Dh]: same dtype; any strides with a unit stride along Dh
            (copied otherwise), e.g. views into a fused qkv projection.
        q_weight, k_weight: fp32 [Dh] effective norm multipliers, or None (no norm).
        eps: RMSNorm epsilon.
        cos, sin: [T, rotary_dim] tables (rotary_dim even, <= Dh).
    Returns:
        New contiguous (q, k) in q's dtype.
    """
    T, H, KV, Dh, rot = _check_qk(q, k, q_weight, k_weight, cos, sin)
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    if cos.stride(1) != 1:
        cos = cos.contiguous()
    if sin.stride(1) != 1:
        sin = sin.contiguous()
    qo = torch.empty(T, H, Dh, dtype=q.dtype, device=q.device)
    ko = torch.empty(T, KV, Dh, dtype=q.dtype, device=q.device)
    if T:
        from ._norm_rope_triton import _qk_norm_rope_kernel

        qw = q_weight.float().contiguous() if q_weight is not None else cos
        kw = k_weight.float().contiguous() if k_weight is not None else cos
        block = _next_pow2(Dh)
        _qk_norm_rope_kernel[(T, H + KV)](
            q, k, qw, kw, cos, sin, qo, ko, H, float(eps),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            KV=KV, DH=Dh, ROT=rot, BLOCK=block, HAS_QW=q_weight is not None, HAS_KW=k_weight is not None,
            num_warps=1 if block <= 128 else 2, **pdl_args(q.device),
        )
    return qo, ko
