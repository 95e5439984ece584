"""RMSNorm.

y = x * rsqrt(mean(x^2) + eps) * w, computed in fp32 and cast back to x's dtype
(Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"). Zero-centred variants
(Gemma, Step-3.5: ``* (1 + w)``) are folded into ``w`` when the weights are loaded, so
there is one norm here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["rms_norm", "RMSNorm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x`` [..., D] and scale by ``weight`` [D]."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused op (decode is op-bound on CPU)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with an effective multiplier ``weight`` [D] (already 1 + w for zero-centred norms)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.float(), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "gpu", False) and x.dim() == 2:  # one fused launch (memra/kernels/norm_rope.py)
            from ..kernels.norm_rope import rms_norm as fused_rms_norm

            return fused_rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)
