"""Canonical partitions of sharded dimensions, and the block checks that refuse a bad split.

A sharded dimension of ``n`` elements is cut into ``P`` consecutive canonical parts, each a
whole number of ``unit`` elements (a head, or the weight format's block along that axis), the
larger parts first: :func:`split_sizes`. A split that cannot give every part at least one unit
(too few heads or blocks for ``P`` parts) is refused with an error that names the tensor and
says why: quantization blocks (FP8 128x128, NVFP4 16, Q8_0 / Q4 32, k-quants 256) are never cut.
"""

from __future__ import annotations

from ..quant.types import QType

__all__ = ["split_sizes", "offsets", "block_unit"]

_K_BLOCK = {QType.Q8_0: 32, QType.Q4_0: 32, QType.Q4_1: 32, QType.Q5_0: 32, QType.Q5_1: 32, QType.NVFP4: 16}


def split_sizes(n: int, parts: int, unit: int = 1, what: str = "") -> list[int]:
    """``n`` cut into ``parts`` consecutive sizes, each a positive multiple of ``unit``, as even as
    possible (the first ``(n / unit) % parts`` parts one unit larger).

    Raises: ValueError naming ``what`` if n is not a multiple of unit or n / unit < parts."""
    if unit < 1 or n % unit:
        raise ValueError(f"{what}: {n} is not a multiple of the sharding unit {unit} (a split would cut a "
                         f"head or a quantization block)")
    units = n // unit
    if units < parts:
        raise ValueError(f"{what}: {units} units of {unit} cannot fill {parts} canonical parts (a split would cut a "
                         f"head or a quantization block): this model cannot run at this tensor-parallel size with "
                         f"{parts} canonical parts")
    base, extra = divmod(units, parts)
    return [(base + (p < extra)) * unit for p in range(parts)]


def offsets(sizes: list[int]) -> list[int]:
    """Start offset of each part."""
    out, o = [], 0
    for s in sizes:
        out.append(o)
        o += s
    return out


def block_unit(w, axis: int) -> int:
    """The weight format's block along ``axis`` (0: rows / out_features, 1: columns / in_features):
    the smallest shard boundary that does not cut a block. ``w``: a QTensor or FP8BlockTensor."""
    block = getattr(w, "block", None)
    if block is not None:  # FP8BlockTensor: 128 x 128
        return int(block[axis])
    if axis == 0:
        return 1  # ggml blocks run along a row
    qt = getattr(w, "qtype", None)
    if qt in _K_BLOCK:
        return _K_BLOCK[qt]
    if qt is not None and getattr(w, "is_quantized", False):
        return 256  # k-quants: 256-element super-blocks
    return 1
