"""Gate activations of gated MLPs: SiLU (SwiGLU, Shazeer 2020) and tanh-approximated GELU (GeGLU, Gemma)."""

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS"]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}
