"""The FP8 block recipe for linear layers with FP8 block weights: activations quantized per
token and 128-column group, E4M3 x E4M3 products on Hopper FP8 tensor cores.

Math (DeepSeek-V3 technical report, arXiv 2412.19437, section 3.3 "FP8 training": 1x128
activation tiles, 128x128 weight blocks, fp32 promotion every 128 K; the same recipe as the
MoE prefill GEMMs' ``fp8_act``, memra/kernels/moe_prefill.py):

- ``xs[t, g] = max(amax |x[t, 128g : 128g + 128]|, 1e-10) / 448`` and
  ``xq[t, k] = e4m3_rne(clamp(x[t, k] / xs[t, k // 128], +-448))`` (``quantize_act_fp8_ref`` in
  memra/kernels/moe_prefill.py);
- ``y[t, n] = sum_g xs[t, g] ws[n // 128, g] sum_{k in group g} xq[t, k] w[n, k]``, each group's
  inner sum one tensor-core product (Hopper accumulates FP8 MMA with ~14 bits: relative error
  ~1e-4 against fp32 per group), the scaled group sums added in fp32.

The activation rounding (3 mantissa bits) costs ~2-3 % relative error per product on random
data, on top of the weights' own FP8 rounding (``decode_linear`` keeps bf16 activations).

Why: at 16-64 tokens ``decode_linear`` on FP8 weights converts every weight tile to bf16 in
registers for ``tl.dot`` and reaches 22-33 % of copy bandwidth, slower than cuBLAS on the bf16
weights it halves; this path reads the codes straight into the FP8 MMA (H200, the four TP1
attention shapes, ``python3 benchmarks/fp8_w8a8_probe.py``: 1.3-1.8x faster than bf16 cuBLAS and
2-2.3x faster than ``decode_linear`` at T = 16, 32, 64, the quantization kernel included).
:func:`memra.layers.linear.gpu_linear` takes it for FP8 weights from :data:`FP8_ACT_MIN_T` rows
(prefill included), so a token's projections depend on the number of rows of its step: across
that line (bf16 vs FP8 activations), and above it wherever :func:`fp8_linear_config` picks another
tile or K split for another T (the same math, summed in another order: ~1e-7 relative). FP8
weights are therefore not batch-invariant across that line (in batch-invariant mode,
memra/kernels/batch_invariant.py, gpu_linear does not take this path at all). A row does not depend on the values
of the other rows at one configuration. NaN in x does not propagate (the quantization's max drops
it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gemv import DecodeWeight, dequantize_packed
from .pdl import pdl_args

__all__ = ["FP8_ACT_MIN_T", "Fp8LinearConfig", "fp8_act_supported", "fp8_linear_config", "quantize_act_fp8",
           "fp8_act_linear", "fp8_act_linear_ref"]

FP8_ACT_MIN_T = 4
"""Rows of x from which :func:`memra.layers.linear.gpu_linear` runs FP8 weights through
:func:`fp8_act_linear` (below: ``decode_linear``'s bf16-activation GEMV). Measured crossover
(``python3 benchmarks/fp8_w8a8_probe.py``, H100, the flagship's four TP1 attention shapes,
benchmarks/results/issue14/fp8-w8a8-probe-cbadcd5-h100.json): at 1 row ``decode_linear`` is faster on
all four (16.8-22.9 vs 22.2-30.4 µs), at 2 rows on three of four, at 4 rows the recipe is faster on
all four (22.3-30.4 vs 30.0-48.5 µs: ``decode_linear``'s 4-row tiles are not on its fp16x2 path)."""


@dataclass(frozen=True)
class Fp8LinearConfig:
    """Launch configuration of :func:`fp8_act_linear`: ``bn`` weight rows x ``bt`` tokens per
    program, K split in ``split`` (1 or 2) parts, ``num_warps``, ``num_stages``."""

    bn: int = 64
    bt: int = 16
    split: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        if self.bn not in (64, 128) or self.bt not in (16, 32, 64, 128) or self.split not in (1, 2):
            raise ValueError(f"Fp8LinearConfig: bn in (64, 128), bt in (16, 32, 64, 128) and split in (1, 2); got {self}")


def fp8_act_supported(w: DecodeWeight) -> bool:
    """True when ``w`` can run the recipe: FP8 block weights with K a multiple of 128."""
    return w.fmt == "fp8" and w.k % 128 == 0


def fp8_linear_config(t: int, n: int, k: int, sm_count: int = 132) -> Fp8LinearConfig:
    """The tile rule (H200 sweep of benchmarks/fp8_w8a8_probe.py at the attention shapes):
    ``bt`` = T rounded up to a power of two in 16..64; ``bn`` 64 up to 32 tokens, else 128; the K
    range split in two when the tiles alone leave SMs idle (``split`` 1 or 2 only: adding two
    partial sums to a zeroed fp32 output is exact in either order, so the result stays
    deterministic; 4 measured up to 15 % faster on 4096-row outputs but is not)."""
    bt = min(64, max(16, 1 << (max(t, 1) - 1).bit_length()))
    bn = 64 if t <= 32 else 128
    tiles = -(-n // bn) * -(-t // bt)
    split = 2 if tiles < sm_count and k % 256 == 0 else 1
    return Fp8LinearConfig(bn=bn, bt=bt, split=split)


def fp8_act_linear_ref(x: torch.Tensor, w: DecodeWeight) -> torch.Tensor:
    """The torch twin of :func:`fp8_act_linear`: x [T, K] quantized as the kernel does
    (``quantize_act_fp8_ref``), dequantized, times the dequantized weight, in fp32 -> [T, N].
    Unlike the kernel it propagates NaN in x (torch's amax keeps it; the kernel's max drops it)."""
    from .moe_prefill import _fp8_roundtrip

    return _fp8_roundtrip(x) @ dequantize_packed(w).t()


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantization of the recipe on x's device (the FP8 MoE prefill's kernel).

    Args: x [T, K] floating point, K a multiple of 128 (T = 0 gives empty results).
    Returns: (codes float8_e4m3fn [T, K], scales fp32 [T, K // 128]): ``s = max(amax, 1e-10) / 448``
    per 1x128 group, ``code = e4m3_rne(clamp(x / s, +-448))``, as ``quantize_act_fp8_ref`` except
    that on the GPU ``amax / 448`` is Triton's approximate division (scales may differ from torch's
    by an ulp, so a few codes by one step). One launch; no host synchronisation.
    Raises: ValueError for another shape, or a CPU tensor outside the interpreter.
    """
    from .gemv import interpret_mode

    if x.dim() != 2 or x.shape[1] % 128:
        raise ValueError(f"quantize_act_fp8: x must be [T, K] with K a multiple of 128, got {tuple(x.shape)}")
    if x.device.type != "cuda" and not interpret_mode():
        raise ValueError(f"quantize_act_fp8: a Triton kernel; x must be on a CUDA device (on the CPU only under "
                         f"TRITON_INTERPRET=1), got {x.device}")
    from ._moe_prefill_triton import _act_quant_kernel

    x = x.contiguous()
    t, k = x.shape
    xq = torch.empty(t, k, device=x.device, dtype=torch.float8_e4m3fn)
    xs = torch.empty(t, k // 128, device=x.device, dtype=torch.float32)
    bt = 16
    _act_quant_kernel[(-(-t // bt), k // 128)](x, xq, xs, t, x.stride(0), xq.stride(0), xs.stride(0),
                                               BT=bt, EXACT=interpret_mode(), num_warps=4, **pdl_args(x.device))
    return xq, xs


def fp8_act_linear(x: torch.Tensor, w: DecodeWeight, out_dtype: torch.dtype = torch.float32,
                   config: Fp8LinearConfig | None = None) -> torch.Tensor:
    """y = x @ W^T by the FP8 block recipe (module docstring), on the GPU (on the CPU only under
    the Triton interpreter, ``TRITON_INTERPRET=1``, as the tests run it).

    Args:
        x: [T, K] bf16/fp16/fp32 activations (T = 0 gives [0, N]), on W's device.
        w: FP8 block weight: ``pack_fp8(quantize_fp8_block(W))`` (``DecodeWeight`` fmt ``"fp8"``,
            codes [N, K], scales [ceil(N/128), K/128]; any N).
        out_dtype: dtype of y.
        config: launch configuration (default :func:`fp8_linear_config`).
    Returns: y [T, N] in ``out_dtype``. Two launches (quantization, GEMM), four with ``split`` 2
    (zeroing, cast); capturable in a CUDA graph.
    Raises: TypeError if w is not a DecodeWeight; ValueError for another format, K not a multiple of
    128, a ``config.split`` that does not divide K into 128-column steps, a shape mismatch, x not
    floating point on W's device, or a CPU device outside the interpreter.
    """
    if not isinstance(w, DecodeWeight):
        raise TypeError(f"fp8_act_linear: w must be a packed DecodeWeight (memra.kernels.gemv.pack_fp8), got "
                        f"{type(w).__name__}")
    if not fp8_act_supported(w):
        raise ValueError(f"fp8_act_linear({w.name!r}): needs an fp8 weight with K a multiple of 128, got "
                         f"{w.fmt} [{w.n}, {w.k}]")
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"fp8_act_linear({w.name!r}): x must be [T, {w.k}], got {tuple(x.shape)}")
    if not x.is_floating_point() or x.device != w.device:
        raise ValueError(f"fp8_act_linear({w.name!r}): x must be floating point on {w.device}, got {x.dtype} "
                         f"on {x.device}")
    from ._fp8_linear_triton import _fp8_linear_kernel
    from .gemv import _sm_count

    t, k = x.shape
    n = w.n
    cfg = config or fp8_linear_config(t, n, k, _sm_count(x.device))
    if k % (128 * cfg.split):
        raise ValueError(f"fp8_act_linear({w.name!r}): split {cfg.split} needs K a multiple of {128 * cfg.split}, "
                         f"got K = {k}")
    split = cfg.split
    xq, xs = quantize_act_fp8(x)
    y = torch.zeros(t, n, device=x.device, dtype=torch.float32) if split > 1 else \
        torch.empty(t, n, device=x.device, dtype=out_dtype)
    grid = (-(-n // cfg.bn), split, -(-t // cfg.bt))
    _fp8_linear_kernel[grid](xq, xs, w.data, w.scale, y, t, n, k // split,
                             xq.stride(0), xs.stride(0), w.data.stride(0), w.scale.stride(0), y.stride(0),
                             BN=cfg.bn, BT=cfg.bt, ATOMIC=split > 1, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages, **pdl_args(x.device))
    return y if y.dtype == out_dtype else y.to(out_dtype)
