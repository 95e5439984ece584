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

__all__ = ["Linear", "Embedding"]


class Linear(nn.Module):
    """y = x @ W^T (+ b), W the row-concatenation of one or more packed weights.

    Args:
        weight: QTensor (out_features, in_features), or a list of them with equal
            in_features whose rows are stacked (fused QKV, gate+up); parts may differ in format.
        bias: optional fp32 tensor [out_features].
        dtype: compute dtype of the dense copy (fp32 for exactness, bf16 for speed).
    Input x: [..., in_features] in ``dtype``; output [..., out_features].

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
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        dense = torch.cat([p.dequantize(dtype) for p in parts]) if len(parts) > 1 else parts[0].dequantize(dtype)
        # Layout by measurement on the CPU (2-core Xeon, torch 2.13): fp32 GEMV streams the
        # weight ~30% faster from [in, out] (x @ W^T with W^T contiguous); bf16/fp16 run
        # 2-3x faster from [out, in] (F.linear, oneDNN/AMX path).
        self.transposed = dtype == torch.float32
        w = dense.t().contiguous() if self.transposed else dense
        self.register_buffer("stored", w, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.to(dtype), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [out_features, in_features] (a view when stored transposed)."""
        return self.stored.t() if self.transposed else self.stored

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.stored, self.bias)
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
