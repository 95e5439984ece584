"""QTensor: a weight kept in its on-disk format.

A checkpoint's tensors are loaded into :class:`QTensor` objects that hold the raw
bytes (for block-quantized types) or the plain tensor (F32/F16/BF16) together with the
logical shape. Paths that need real numbers call :meth:`QTensor.dequantize`; paths
with kernels for the packed format (the GPU linear kernels) use ``data`` directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .types import QTYPE_INFO, QType

__all__ = ["QTensor"]

_PLAIN_DTYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}


@dataclass
class QTensor:
    """A weight tensor in a ggml format.

    Attributes:
        name: tensor name in its checkpoint (for error messages).
        qtype: the storage format.
        shape: logical shape in torch order, e.g. ``(out_features, in_features)`` for a
            linear weight; the last dimension is the one blocks run along.
        data: for F32/F16/BF16 a tensor of that dtype and ``shape``; otherwise a uint8
            tensor of shape ``(prod(shape[:-1]), row_bytes)`` holding the blocks row by row.

    Source: ggml block layouts (``ggml-common.h``), shared/FORMATS.md.
    """

    name: str
    qtype: QType
    shape: tuple[int, ...]
    data: torch.Tensor

    def __post_init__(self) -> None:
        info = QTYPE_INFO[self.qtype]
        if self.shape[-1] % info.block_size:
            raise ValueError(
                f"tensor {self.name!r}: last dimension {self.shape[-1]} is not a multiple of "
                f"the {self.qtype.name} block size {info.block_size}"
            )
        if self.qtype in _PLAIN_DTYPES:
            want = _PLAIN_DTYPES[self.qtype]
            if self.data.dtype != want or tuple(self.data.shape) != tuple(self.shape):
                raise ValueError(
                    f"tensor {self.name!r}: data is {self.data.dtype} {tuple(self.data.shape)}, "
                    f"expected {want} {tuple(self.shape)}"
                )
        else:
            rows = 1
            for d in self.shape[:-1]:
                rows *= d
            want_shape = (rows, info.nbytes(self.shape[-1]))
            if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want_shape:
                raise ValueError(
                    f"tensor {self.name!r}: raw data is {self.data.dtype} {tuple(self.data.shape)}, "
                    f"expected uint8 {want_shape} for {self.qtype.name} {tuple(self.shape)}"
                )

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes the tensor occupies in its storage format."""
        return QTYPE_INFO[self.qtype].nbytes(self.numel)

    @property
    def is_quantized(self) -> bool:
        return self.qtype not in _PLAIN_DTYPES

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense tensor of ``shape`` and ``dtype`` (values exact in fp32)."""
        if not self.is_quantized:
            return self.data.to(dtype)
        from .dequant import dequantize_blocks

        flat = dequantize_blocks(self.data.reshape(-1), self.qtype)
        return flat.reshape(self.shape).to(dtype)

    def permute_rows(self, index: torch.Tensor) -> QTensor:
        """A copy whose first-dimension rows are ``self[index]`` (2-D tensors only).

        Works on the packed bytes (blocks never span rows), so no dequantization.
        """
        if len(self.shape) != 2:
            raise ValueError(f"tensor {self.name!r}: permute_rows needs 2-D, got shape {self.shape}")
        return QTensor(self.name, self.qtype, self.shape, self.data[index.to(self.data.device)].contiguous())

    def __repr__(self) -> str:
        return f"QTensor({self.name!r}, {self.qtype.name}, shape={self.shape})"
