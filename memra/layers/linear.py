"""Linear layers over quantized weights and embeddings.

The weight arrives as a :class:`~memra.quant.tensor.QTensor` in its checkpoint format.
On the CPU path it is dequantized once at load into the compute dtype (torch's GEMM is
the kernel); the packed QTensors are kept alongside (``qweights``) for inspection and for
kernels that read the packed format directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.tensor import QTensor
from ..quant.types import QType

__all__ = ["Linear", "Embedding"]


def _int4pack_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def q4_codes_scale_zero(qt: QTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks as codes and per-32 affine parameters.

    Returns (codes int32 [N, K] in 0..15, scale fp32 [N, K/32], zero fp32 [N, K/32]) with
    ``w = (q - 8) * scale + zero``: Q4_0 ``d * (q - 8)`` gives (d, 0); Q4_1 ``d * q + m``
    gives (d, m + 8 d). Layouts: ggml ``block_q4_0`` / ``block_q4_1`` (low nibbles are
    elements 0-15, high nibbles 16-31).

    Raises:
        ValueError: not a 2-D Q4_0/Q4_1 tensor.
    """
    if qt.qtype not in (QType.Q4_0, QType.Q4_1) or len(qt.shape) != 2:
        raise ValueError(f"{qt!r}: expected a 2-D Q4_0 or Q4_1 tensor")
    n, k = qt.shape
    blocks = qt.data.reshape(n * k // 32, -1)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float().reshape(n, k // 32)
    off = 2 if qt.qtype == QType.Q4_0 else 4
    qs = blocks[:, off : off + 16]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.int32).reshape(n, k)
    if qt.qtype == QType.Q4_0:
        return codes, d, torch.zeros_like(d)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float().reshape(n, k // 32)
    return codes, d, m + 8 * d


class Linear(nn.Module):
    """y = x @ W^T (+ b), W the row-concatenation of one or more packed weights.

    Args:
        weight: QTensor (out_features, in_features), or a list of them with equal
            in_features whose rows are stacked (fused QKV, gate+up); parts may differ in format.
        bias: optional fp32 tensor [out_features].
        dtype: compute dtype (fp32 for exactness, bf16 for speed).
    Input x: [..., in_features] in ``dtype``; output [..., out_features].

    Kernels, chosen at load by (dtype, formats) from measurements on the 2-core CI CPU
    (torch 2.13; ``memra bench cpu``):

    - ``"dense"``: the weight dequantized once into ``dtype``. fp32 is stored [in, out]
      (x @ W^T streams ~30% faster that way at decode widths); bf16 [out, in] (oneDNN).
    - ``"int4"``: bf16 with every part Q4_0/Q4_1: torch's int4 group-wise CPU kernel
      (``_weight_int4pack_mm_for_cpu``, group 32) reads the packed 4-bit codes directly,
      ~3x faster than a dense bf16 GEMV. Its scale/zero are bf16, so the GGUF's fp16
      ``d`` and ``m`` are rounded to bf16 (relative error <= 2^-9 per block parameter).

    Raises:
        ValueError: parts with different in_features.
    """

    def __init__(self, weight: QTensor | list[QTensor], bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        parts = weight if isinstance(weight, list) else [weight]
        if len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"cannot stack {parts}: input widths differ")
        self.qweights = parts
        self.dtype = dtype
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.register_buffer("bias", None if bias is None else bias.to(dtype), persistent=False)
        if (dtype == torch.bfloat16 and _int4pack_available() and len(parts[0].shape) == 2
                and all(p.qtype in (QType.Q4_0, QType.Q4_1) for p in parts)):
            self.kernel = "int4"
            codes, scale, zero = (torch.cat(t) for t in zip(*(q4_codes_scale_zero(p) for p in parts)))
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2),
                                 persistent=False)
            self.register_buffer("scale_zero", torch.stack([scale.t(), zero.t()], -1).to(dtype).contiguous(),
                                 persistent=False)
            return
        self.kernel = "dense"
        dense = torch.cat([p.dequantize(dtype) for p in parts]) if len(parts) > 1 else parts[0].dequantize(dtype)
        self.transposed = dtype == torch.float32
        self.register_buffer("stored", dense.t().contiguous() if self.transposed else dense, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The weight the kernel computes with, dense [out_features, in_features] in ``dtype``."""
        if self.kernel == "int4":
            eye = torch.eye(self.in_features, dtype=self.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, 32, self.scale_zero).t()
        return self.stored.t() if self.transposed else self.stored

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.packed, 32,
                                                             self.scale_zero).reshape(*x.shape[:-1], -1)
        elif not self.transposed:
            return F.linear(x, self.stored, self.bias)
        else:
            y = torch.matmul(x, self.stored)
        return y if self.bias is None else y + self.bias


class Embedding(nn.Module):
    """Token embedding lookup that dequantizes only the rows it needs.

    Args:
        weight: QTensor (vocab_size, hidden).
        dtype: output dtype.
        scale: multiplier applied to the looked-up rows (Gemma: sqrt(hidden), rounded
            to ``dtype`` first as in the reference implementation).
    Input ids: int64 [T] in [0, vocab_size); output [T, hidden].

    Raises:
        IndexError: a token id outside the vocabulary (message names the id).
    """

    def __init__(self, weight: QTensor, dtype: torch.dtype = torch.float32, scale: float = 1.0):
        super().__init__()
        self.qweight = weight
        self.vocab_size, self.hidden = weight.shape
        self.dtype = dtype
        self.scale = scale
        self.register_buffer("rows", weight.data, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0].item()
            raise IndexError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        q = self.qweight
        sub = QTensor(q.name, q.qtype, (ids.numel(), self.hidden), self.rows[ids])
        x = sub.dequantize(self.dtype)
        if self.scale != 1.0:
            x = x * torch.tensor(self.scale, dtype=self.dtype)
        return x
