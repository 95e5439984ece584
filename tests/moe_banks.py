"""Random expert banks for the MoE kernel tests (tests/test_kernels_moe*.py)."""

from __future__ import annotations

import torch

from memra.kernels.moe_decode import fuse_gate_up, pack_expert_bank
from memra.quant.dequant import quantize_nvfp4, quantize_q8_0
from memra.quant.fp8 import quantize_fp8_block
from memra.quant.tensor import QTensor
from memra.quant.types import QType


def source(fmt: str, w: torch.Tensor):
    """w fp32 [E, N, K] in the checkpoint container of ``fmt``."""
    e, n, k = w.shape
    if fmt == "bf16":
        return w
    if fmt == "fp8":
        return quantize_fp8_block(w, name="w")
    if fmt == "q8_0":
        return QTensor("w", QType.Q8_0, (e, n, k), quantize_q8_0(w.reshape(e * n, k)).reshape(e * n, -1))
    return QTensor("w", QType.NVFP4, (e, n, k), quantize_nvfp4(w.reshape(e * n, k)).reshape(e * n, -1))


def banks(fmt: str, i: int, d: int, seed: int, experts: int):
    """(fused gate+up bank [E, 2I, D], down bank [E, D, I], the three checkpoint sources), random N(0, 0.09)."""
    g = torch.Generator().manual_seed(seed)
    srcs = [source(fmt, torch.randn(experts, n, k, generator=g) * 0.3) for n, k in ((i, d), (i, d), (d, i))]
    gate, up, down = (pack_expert_bank(s) for s in srcs)
    return fuse_gate_up(gate, up), down, srcs
