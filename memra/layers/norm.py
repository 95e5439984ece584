"""RMSNorm, with the residual add fused in: one call, torch on the CPU, one Triton launch on the GPU.

y = x * rsqrt(mean(x^2) + eps) * w, computed in fp32 and cast back to x's dtype
(Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"). Zero-centred variants
(Gemma, Step-3.5: ``* (1 + w)``) are folded into ``w`` when the weights are loaded, so
there is one norm here. The math: memra/kernels/norm_rope.py ``rms_norm_torch`` (CPU) and
its fused kernel ``rms_norm`` (GPU).
"""

from __future__ import annotations

import torch

from ..kernels import cpu_native
from ..kernels.norm_rope import rms_norm as fused_rms_norm
from ..kernels.norm_rope import rms_norm_torch
from .device import KernelLayer

__all__ = ["rms_norm", "RMSNorm"]

rms_norm = rms_norm_torch  # RMS-normalise the last dimension of x [..., D], scale by weight [D]

#: Rows up to which a CPU norm takes the native kernel (one call, the sum of squares in float64;
#: prefill keeps torch's multi-threaded F.rms_norm).
NATIVE_NORM_MAX_ROWS = 16


class RMSNorm(KernelLayer):
    """RMSNorm with an effective multiplier ``weight`` fp32 [D] (already 1 + w for zero-centred norms).

    ``norm(x)`` [..., D] -> [..., D] in x's dtype; ``norm.add(x, residual)`` -> (norm(x + residual),
    x + residual), the pre-norm residual stream's step. On the GPU the sum is rounded to x's dtype
    (the fused kernel); on the CPU the stream is kept in fp32 whatever the compute dtype (the sum
    is returned in fp32, the normed output in x's dtype): in bfloat16 mode that keeps the greedy
    tokens closer to the exact float32 mode's at no measurable cost (``memra bench cpu``, top-1).
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.float(), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels and x.dim() == 2:
            return fused_rms_norm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) with s = x + residual [T, D] (``residual`` None: s = x)."""
        if self.kernels:
            if residual is None:
                return self(x), x
            return fused_rms_norm(x, self.weight, self.eps, residual=residual)
        if x.device.type != "cpu":  # e.g. tensor-parallel GPU shards (torch, not the fused kernel)
            s = x if residual is None else x + residual
            return rms_norm_torch(s, self.weight, self.eps), s
        if x.is_cpu and x.dim() == 2 and x.shape[0] <= NATIVE_NORM_MAX_ROWS \
                and x.dtype in (torch.bfloat16, torch.float32) and cpu_native.enabled():
            return cpu_native.rms_norm_add(x, self.weight, self.eps, residual)  # decode: one call
        s = x.float() if residual is None else residual + x  # residual: fp32
        return rms_norm_torch(s, self.weight, self.eps).to(x.dtype), s
