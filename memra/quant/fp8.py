"""FP8 block-scaled weights (HF / DeepSeek-V3 style "fp8" checkpoints, Step-3.5-Flash-FP8).

A weight ``W [.., out, in]`` is stored as FP8 E4M3 codes of the same shape plus one fp32
``weight_scale_inv`` per ``block_out x block_in`` tile (128 x 128 in every released
checkpoint): ``W[.., r, c] = code[.., r, c] * scale_inv[.., r // 128, c // 128]``. The
last tile of a row or column may be partial, so the scale grid is
``[.., ceil(out / 128), ceil(in / 128)]``. Leading dims (stacked experts ``[E, out, in]``)
carry one scale grid each.

:class:`FP8BlockTensor` keeps the codes and scales packed (1 byte per weight + 4 bytes per
tile) and offers the same surface as :class:`~memra.quant.tensor.QTensor` that the layers
use (``name``, ``shape``, ``numel``, ``nbytes``, ``is_quantized``, ``dequantize``), so
:class:`~memra.layers.linear.Linear` and the MoE experts take either.

Source: shared/FORMATS.md ("FP8 block (HF)"); the FP8 checkpoints' ``quantization_config``
(``quant_method: fp8``, ``weight_block_size: [128, 128]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FP8BlockTensor", "FP8_E4M3_MAX", "quantize_fp8_block", "fp8_scale_shape"]

FP8_E4M3_MAX = 448.0  # largest finite E4M3 (e4m3fn) value


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int] = (128, 128)) -> tuple[int, ...]:
    """Shape of the ``weight_scale_inv`` grid for a weight of ``shape`` (torch order, >= 2-D)."""
    if len(shape) < 2:
        raise ValueError(f"an FP8 block weight must be at least 2-D, got shape {tuple(shape)}")
    *lead, out, inp = shape
    return (*lead, -(-out // block[0]), -(-inp // block[1]))


@dataclass
class FP8BlockTensor:
    """An FP8 E4M3 weight with fp32 block scales, kept packed.

    Attributes:
        name: tensor name in its checkpoint (for error messages).
        shape: logical shape ``(.., out, in)`` in torch order.
        codes: ``torch.float8_e4m3fn`` tensor of ``shape``.
        scale_inv: fp32 tensor of ``fp8_scale_shape(shape, block)``; the value multiplied into
            every code of its tile (the checkpoint's ``weight_scale_inv``).
        block: tile size ``(rows, cols)``; (128, 128) in the released checkpoints.

    Raises:
        ValueError: codes not float8_e4m3fn of ``shape``, or ``scale_inv`` not fp32 of the
            expected grid shape (the message names the tensor and both shapes).
    """

    name: str
    shape: tuple[int, ...]
    codes: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        self.shape = tuple(int(d) for d in self.shape)
        if self.codes.dtype != torch.float8_e4m3fn or tuple(self.codes.shape) != self.shape:
            raise ValueError(f"tensor {self.name!r}: FP8 codes are {self.codes.dtype} {tuple(self.codes.shape)}, "
                             f"expected torch.float8_e4m3fn {self.shape}")
        want = fp8_scale_shape(self.shape, self.block)
        if tuple(self.scale_inv.shape) != want:
            raise ValueError(
                f"tensor {self.name!r}: weight_scale_inv has shape {tuple(self.scale_inv.shape)}, expected {want} "
                f"(one scale per {self.block[0]}x{self.block[1]} block of the {self.shape} weight)")
        if self.scale_inv.dtype != torch.float32:
            raise ValueError(
                f"tensor {self.name!r}: weight_scale_inv is {self.scale_inv.dtype}, expected torch.float32")

    @property
    def numel(self) -> int:
        return self.codes.numel()

    @property
    def nbytes(self) -> int:
        """Bytes in the packed format (codes + scales)."""
        return self.codes.numel() + 4 * self.scale_inv.numel()

    @property
    def is_quantized(self) -> bool:
        return True

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``code * scale_inv`` of its block, as a dense tensor of ``shape`` (computed in fp32, exact
        up to the one rounding of the product; then cast to ``dtype``)."""
        out, inp = self.shape[-2:]
        s = self.scale_inv.repeat_interleave(self.block[0], dim=-2)[..., :out, :]
        s = s.repeat_interleave(self.block[1], dim=-1)[..., :inp]
        return (self.codes.to(torch.float32) * s).to(dtype)

    def __getitem__(self, i: int) -> FP8BlockTensor:
        """The ``i``-th slice along the first (stacked-expert) dimension."""
        if len(self.shape) < 3:
            raise ValueError(f"tensor {self.name!r}: indexing needs a stacked (>= 3-D) weight, got {self.shape}")
        return FP8BlockTensor(f"{self.name}[{i}]", self.shape[1:], self.codes[i], self.scale_inv[i], self.block)

    def __repr__(self) -> str:
        return f"FP8BlockTensor({self.name!r}, shape={self.shape}, block={self.block})"


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128), name: str = "") -> FP8BlockTensor:
    """Reference quantizer: per-tile absmax scaling to E4M3 (``scale_inv = amax / 448``).

    Args:
        w: float weight ``[.., out, in]``.
    Returns:
        :class:`FP8BlockTensor` whose ``dequantize()`` approximates ``w`` (relative error
        per element about 2^-4 of its tile's absmax at worst). All-zero tiles get scale 1.
    """
    w = w.float()
    *lead, out, inp = w.shape
    rb, cb = -(-out // block[0]), -(-inp // block[1])
    padded = torch.zeros(*lead, rb * block[0], cb * block[1], device=w.device)
    padded[..., :out, :inp] = w
    tiles = padded.view(*lead, rb, block[0], cb, block[1])
    amax = tiles.abs().amax(dim=(-3, -1))  # [.., rb, cb]
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    codes = q.view(*lead, rb * block[0], cb * block[1])[..., :out, :inp].to(torch.float8_e4m3fn).contiguous()
    return FP8BlockTensor(name, tuple(w.shape), codes, scale.contiguous(), block)
