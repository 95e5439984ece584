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

from ..kernels import cpu_native
from ..kernels.batch_invariant import batch_invariant, invariant_linear
from ..kernels.fp8_linear import FP8_ACT_MIN_T, fp8_act_linear, fp8_act_supported
from ..kernels.gemv import MAX_T, DecodeWeight, decode_linear, dequantize_packed, pack_bf16, pack_weight
from ..quant.dequant import AFFINE32_BITS
from ..quant.tensor import QTensor
from .device import KernelLayer

__all__ = ["Linear", "Embedding", "gpu_linear", "head_logits", "int4_digits", "pack_for_gpu"]


def _int4pack_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def dense_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w^T + b`` (x [..., in], w [out, in]) as ``F.linear``; float32 on the CPU through oneDNN's
    GEMM (``torch.ops.mkldnn._linear_pointwise``) where this torch has it.

    Why: the CPU's exact (float32) mode prefills with dense fp32 weights, and torch's ``F.linear``
    calls MKL's sgemm, which ran at 100-138 GFLOP/s against oneDNN's 171-186 on the prefill shapes of
    smollm2-135m and qwen2.5-coder-0.5b (128 rows, 2 threads, the project's AMD EPYC; medians of 30).
    Both are float32 GEMMs (float32 products and sums, in their own order). Other dtypes and
    devices: ``F.linear``."""
    if (_ONEDNN and x.dtype == torch.float32 and w.dtype == torch.float32 and x.is_cpu and w.is_cpu and x.numel()
            and w.is_contiguous()):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(x2 if x2.is_contiguous() else x2.contiguous(), w, b, "none", [], "")
        return y.reshape(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, b)


def int4_digit_count(parts: list[QTensor]) -> int:
    """4-bit digits per code of row-stacked ``parts`` in :func:`int4_digits`: 1 when every part's
    codes have at most 4 bits, else 2 (formats outside ``AFFINE32_BITS`` count as 8 bits)."""
    return 1 if max(AFFINE32_BITS.get(p.qtype, 8) for p in parts) <= 4 else 2


def int4_digits(parts: list[QTensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row-stacked ``parts`` of per-32 affine formats (memra/quant/dequant.py ``AFFINE32_BITS``) as
    4-bit digits for torch's group-32 int4 kernel, whose weight is ``(c - 8) * scale + zero``.

    A ``b``-bit code ``q`` (``w = s q + o`` per 32 weights) with ``b <= 4`` is one digit,
    ``scale = s``, ``zero = 8 s + o``. With ``4 < b <= 8`` it is two: the top digit
    ``h = q >> (b - 4)`` (0..15) with ``scale = 2^(b-4) s`` and ``zero = 8 scale + o``, the low digit
    ``l = q & (2^(b-4) - 1)`` with ``scale = s``, ``zero = 8 s`` (its term ``s l >= 0``). Q8_0's and
    Q5_0's offsets centre the top digit (its zero is then ~0), so the kernel's bf16 scale and zero
    roundings stay small next to the weight, and so do the partial sums. The digits are row blocks
    ``[top rows | low rows]`` of a ``D N``-row weight; the product's blocks summed give ``x W^T``.

    Returns (codes int32 [D N, K] in 0..15, scale_zero fp32 [K / 32, D N, 2], D).
    Raises: ValueError for a part not 2-D, a format without a per-32 affine form or parts of
    different widths.
    """
    from ..quant.dequant import AFFINE32_BITS, affine32

    if any(len(p.shape) != 2 or p.qtype not in AFFINE32_BITS for p in parts) or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"int4_digits: {parts} are not 2-D parts of equal width in "
                         f"{', '.join(t.name for t in AFFINE32_BITS)}")
    k = parts[0].shape[1]
    digits = int4_digit_count(parts)
    blocks: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in range(digits)]
    for p in parts:
        q, sc, off = affine32(p.data.reshape(-1), p.qtype)
        n = p.shape[0]
        q, sc, off = q.reshape(n, k), sc.reshape(n, k // 32), off.reshape(n, k // 32)
        shift = max(AFFINE32_BITS[p.qtype] - 4, 0)
        top = sc * 2.0 ** shift
        blocks[0].append((q >> shift, top, 8 * top + off))
        if digits == 2:
            blocks[1].append((q & ((1 << shift) - 1), sc, 8 * sc))
    codes, scale, zero = (torch.cat([t[i] for d in blocks for t in d]) for i in range(3))
    return codes.to(torch.int32), torch.stack([scale.t(), zero.t()], -1), digits


#: Rows of x up to which the native kernel runs; more rows (prefill) take the dense bf16 GEMM.
NATIVE_MAX_ROWS = 4

#: Rows of x up to which the CPU's int4 kernel runs; more rows (prefill) take the dense bf16 GEMM.
#: The int4 kernel's time grows linearly with the rows, the GEMM's far slower: on the 2-core CI
#: CPU (torch 2.13) at [3072, 576] int4 / dense are 0.06 / 0.11 ms at 1 row, 0.10 / 0.13 at 4,
#: 0.40 / 0.23 at 16, 3.1 / 1.1 at 128; at [9728, 896] 0.46 / 1.33, 0.83 / 1.70, 3.4 / 2.7, 27 / 11.
INT4_MAX_ROWS = 8


class Linear(KernelLayer):
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
      Also held next to the int4 codes: inputs of more than :data:`INT4_MAX_ROWS` rows take it.
    - ``"native"``: every part in a format memra's native CPU kernels read (Q4_0, Q4_1, Q4_K,
      Q5_0, Q5_1, Q5_K, Q8_0, Q6_K; memra/kernels/cpu_native.py): at decode (up to
      :data:`NATIVE_MAX_ROWS` rows) the weight stays in 4-bit or int8 codes. bf16: the
      activations are quantized to int8 per 32 values (llama.cpp's q8_1 scheme), integer dot
      products. float32: fp32 activations and the block parameters in fp32 (the weights they
      define are the checkpoint dequantizer's bit for bit), each block summed as
      scale * sum(code x) + offset * sum(x) in fp32: the exact mode reads ~5x fewer bytes than
      a dense fp32 weight, with fp32 rounding in the sums only. Prefill takes the dense GEMM. Chosen over ``"int4"`` and
      ``"dense"`` where the kernels compiled.
    - ``"int4"``: bf16 with every part in a per-32 affine format (Q4_0/Q4_1/Q4_K: one 4-bit
      digit; Q5_0/Q5_1/Q5_K/Q8_0: two, :func:`int4_digits`): torch's int4 group-wise CPU kernel
      (``_weight_int4pack_mm_for_cpu``, group 32) reads the packed codes directly: at decode
      ~2.5x faster than a dense bf16 GEMV with one digit, ~2x with two (0.63 / 1.25 bytes per
      weight against 2; ``memra bench cpu``). Its scale/zero are bf16, so the GGUF's fp16
      scales and offsets are rounded to bf16 (relative error <= 2^-9 per block parameter).

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
        dev = weight_device(parts[0])
        if dev.type == "cuda":  # weights already in GPU memory are packed in place, never dequantized
            self.bias = None if bias is None else bias.to(dev, dtype)
            self.packed_weight = pack_for_gpu(parts, dev, name=parts[0].name)
            self.qweights, self.kernel, self.kernels = [], "gpu", True
            return
        self.digits = int4_digit_count(parts)
        int4 = (dtype == torch.bfloat16 and _int4pack_available() and len(parts[0].shape) == 2
                and all(p.qtype in AFFINE32_BITS for p in parts) and self.in_features % 32 == 0
                and self.digits * self.out_features % 16 == 0)  # the int4 packer's row granularity
        native = dtype in (torch.bfloat16, torch.float32) and cpu_native.packable(parts) and cpu_native.enabled()
        self.kernel = "native" if native else "int4" if int4 else "dense"
        self.transposed = dtype == torch.float32 and self.kernel == "dense"
        self._built = False  # the CPU forms are built on first use (a layer bound for a GPU never needs them)

    def build(self) -> Linear:
        """Build the CPU forms of the weight (idempotent; called by the first forward, by ``weight``
        and by the CPU loader once a model is complete): the int4 codes and bf16 scale/zero, and the
        dense weight in ``dtype`` (the GEMM of prefill, and of everything without the int4 kernel).
        Returns self."""
        if self.kernel == "gpu" or self._built:
            return self
        parts = self.qweights
        if self.kernel == "native":  # float32: fp32 block parameters, weights decoded exactly
            self.native = cpu_native.pack_weight(parts, exact=self.dtype == torch.float32)
            self._bias32 = None if self.bias is None else self.bias.float().contiguous()
        if self.kernel == "int4":
            codes, scale_zero, _ = int4_digits(parts)
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2),
                                 persistent=False)
            self.register_buffer("scale_zero", scale_zero.to(self.dtype).contiguous(), persistent=False)
        dense = torch.cat([p.dequantize(self.dtype) for p in parts]) if len(parts) > 1 else \
            parts[0].dequantize(self.dtype)
        self.register_buffer("stored", dense.t().contiguous() if self.transposed else dense, persistent=False)
        self._built = True
        return self

    # ------------------------------------------------------------------ GPU
    @classmethod
    def from_packed(cls, weight: DecodeWeight, bias: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> Linear:
        """A GPU linear over an already packed weight (no host copy kept; used to build models
        directly in GPU memory, e.g. synthetic full-size ones). ``weight`` [out, in] on its device."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.qweights, self.dtype = [], dtype
        self.in_features, self.out_features = weight.k, weight.n
        self.register_buffer("bias", None if bias is None else bias.to(weight.device, dtype), persistent=False)
        self.kernel, self.packed_weight, self.kernels = "gpu", weight, True
        return self

    def to_gpu(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> None:
        """Move this layer to a CUDA ``device`` in place, with the weight kept in its checkpoint
        format (:func:`pack_for_gpu`); the host copies are dropped. Compute dtype becomes ``dtype``."""
        self.packed_weight = pack_for_gpu(self.qweights, device, name=self.qweights[0].name if self.qweights else "")
        for name in ("stored", "packed", "scale_zero"):
            if name in self._buffers:
                delattr(self, name)
        self.__dict__.pop("native", None)
        self.qweights = []
        if self.bias is not None:
            self.bias = self.bias.to(device, dtype)
        self.kernel, self.dtype, self.kernels = "gpu", dtype, True

    def requantize_fp8(self) -> bool:
        """GPU form only: requantize a bf16 packed weight to FP8 E4M3 with one fp32 scale per
        128x128 block (``scale = block absmax / 448``, memra/quant/fp8.py ``quantize_fp8_block``,
        the DeepSeek-V3 / Step-3.5-FP8 recipe), decoded by the FP8 GEMV kernel. Weights already in a
        quantized format are left as they are. Returns whether the weight changed.

        Raises: ValueError if the layer is not on its GPU path."""
        from ..kernels.gemv import pack_fp8
        from ..quant.fp8 import quantize_fp8_block

        if self.kernel != "gpu":
            raise ValueError("requantize_fp8: the layer is not on the GPU (to_gpu first)")
        w = self.packed_weight
        if w.fmt != "bf16":
            return False
        self.packed_weight = pack_fp8(quantize_fp8_block(w.data, name=w.name))
        return True

    @property
    def weight(self) -> torch.Tensor:
        """The weight, dense [out_features, in_features] in ``dtype`` (the int4 path's decode kernel
        computes with bf16-rounded scales and zeros: within 2^-8 of each weight's scale terms)."""
        if self.kernel == "gpu":
            return dequantize_packed(self.packed_weight).to(self.dtype)
        self.build()
        return self.stored.t() if self.transposed else self.stored

    def _int4(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] bf16 through the int4 kernel: [M, D N], the digits' row blocks summed -> [M, N]."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, 32, self.scale_zero)
        if self.digits == 1:
            return y
        n = self.out_features
        out = y[:, :n].float()
        for j in range(1, self.digits):
            out += y[:, j * n:(j + 1) * n]
        return out.to(y.dtype)

    def native_rows(self, x: torch.Tensor) -> bool:
        """Whether ``x`` [..., in_features] goes through the native kernel (few enough rows)."""
        return self.kernel == "native" and x.is_cpu and x.numel() <= NATIVE_MAX_ROWS * self.in_features

    def swiglu(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """silu(gate) * up of this gate+up projection (rows [gate | up]) in one native call, SwiGLU
        fused into the GEMV (fp32, one rounding; ``limit``: Step-3.5's clamp): [T, I] in ``dtype``.
        Only where :meth:`native_rows`. Raises ValueError otherwise."""
        if not self.native_rows(x):
            raise ValueError(f"Linear.swiglu: the native kernel does not take this input ({self.kernel}, "
                             f"{tuple(x.shape)})")
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        return cpu_native.gemv(x.reshape(-1, self.in_features), self.native, self.bias, mode=cpu_native.MODE_SWIGLU,
                               limit=limit).reshape(*x.shape[:-1], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "native" and self._built and x.is_cpu and x.dim() == 2 and 0 < x.shape[0] <= NATIVE_MAX_ROWS \
                and x.shape[1] == self.in_features and x.dtype == self.dtype and x.is_contiguous():
            return cpu_native.gemv_fast(x, self.native, self._bias32, self.dtype)  # the decode loop's path
        if self.kernel == "gpu":
            return gpu_linear(x, self.packed_weight, self.bias)
        if not self._built:
            self.build()
        if x.dtype != self.dtype:  # the CPU's fp32 residual stream (memra/layers/norm.py) feeding a bf16 layer
            x = x.to(self.dtype)
        if self.native_rows(x):
            return cpu_native.gemv(x.reshape(-1, self.in_features), self.native, self.bias).reshape(*x.shape[:-1], -1)
        if self.kernel == "int4" and x.numel() <= INT4_MAX_ROWS * self.in_features:
            y = self._int4(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], -1)
        elif not self.transposed:
            return dense_linear(x, self.stored, self.bias)
        else:
            y = torch.matmul(x, self.stored)
        return y if self.bias is None else y + self.bias


#: Candidates :func:`head_logits` re-scores exactly.
RESCORE_TOP_K = 8


def head_logits(head: Linear, hidden: torch.Tensor, top_k: int = RESCORE_TOP_K) -> torch.Tensor:
    """An LM head's fp32 logits [..., vocab] of ``hidden`` [..., in_features].

    On the CPU in bfloat16 (the int4 kernel or the dense GEMM) the output is bf16: a logit near 20
    is rounded to a multiple of 1/16, enough to swap the two best tokens (smollm2-135m: 8 of 271 greedy tokens of a text
    differed from float32's that way, ``memra bench cpu`` top-1). There the ``top_k`` largest
    logits of each row are recomputed in fp32 from the checkpoint's rows dequantized exactly
    (the argmax and the head of the distribution that sampling sees; ~0.1 ms per row). Other
    paths return ``head(hidden).float()``.
    """
    y = head(hidden).float()
    if (not isinstance(head, Linear) or head.kernel not in ("native", "int4", "dense") or head.dtype == torch.float32
            or len(head.qweights) != 1):
        return y
    q = head.qweights[0]
    flat = y.view(-1, head.out_features)
    h = hidden.reshape(-1, head.in_features).float()
    k = min(top_k, head.out_features)
    top = (cpu_native.topk_indices(flat, k) if flat.is_cpu and k <= 64 and cpu_native.enabled()
           else flat.topk(k, dim=-1).indices)  # [R, k]
    rows = QTensor(q.name, q.qtype, (top.numel(), head.in_features), q.data[top.reshape(-1)]).dequantize()
    exact = torch.bmm(rows.view(*top.shape, -1), h[:, :, None])[..., 0]  # [R, k]
    if head.bias is not None:
        exact = exact + head.bias.float()[top]
    flat.scatter_(1, top, exact)
    return y


def weight_device(w) -> torch.device:
    """Where a QTensor's / FP8BlockTensor's data lives."""
    return (w.codes if hasattr(w, "codes") else w.data).device


def pack_for_gpu(parts: list, device: torch.device | str, name: str = "") -> DecodeWeight:
    """Row-stacked ``parts`` (QTensor / FP8BlockTensor, equal in_features) as one
    :class:`~memra.kernels.gemv.DecodeWeight` on ``device``.

    Parts in one format with a decode kernel (F32/F16/BF16 as bf16, Q8_0, NVFP4, FP8 block
    with every part's rows a multiple of 128) keep it: codes and scales are concatenated
    along the rows. Anything else (k-quants, Q4_0, mixed formats, FP8 parts not 128-row
    aligned) is dequantized to bf16 once, here: 2 bytes per weight instead of the format's
    0.5-1.1, but one code path (see memra/kernels/NOTES.md).

    Raises: ValueError for an empty list or parts whose in_features differ.
    """
    if not parts:
        raise ValueError(f"pack_for_gpu({name!r}): no weight parts")
    try:
        packed = [pack_weight(p) for p in parts]
    except ValueError:
        packed = None
    if packed is not None and len({p.fmt for p in packed}) == 1 and len({p.k for p in packed}) == 1 and (
            packed[0].fmt != "fp8" or all(p.n % 128 == 0 for p in packed[:-1])):
        if len(packed) == 1:
            return packed[0].to(device)
        p0 = packed[0]
        scale = None if p0.scale is None else torch.cat([p.scale for p in packed])
        return DecodeWeight(p0.fmt, sum(p.n for p in packed), p0.k, torch.cat([p.data for p in packed]), scale,
                            name).to(device)
    dense = torch.cat([p.dequantize(torch.float32) for p in parts])
    return pack_bf16(dense, name).to(device)


def gpu_linear(x: torch.Tensor, w: DecodeWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ b) with ``W`` packed on the GPU; x [..., K] -> [..., N] in x.dtype.

    bf16 weights: cuBLAS. FP8 block weights (K a multiple of 128) from
    :data:`~memra.kernels.fp8_linear.FP8_ACT_MIN_T` (4) rows of x, prefill included: the FP8
    block recipe (activations quantized per 1x128 group, FP8 tensor cores;
    memra/kernels/fp8_linear.py). Other formats, and FP8 below that: one decode kernel launch
    (memra/kernels/gemv.py, W read once) for up to :data:`~memra.kernels.gemv.MAX_T` (64) rows of
    x; more rows (prefill): W dequantized to x.dtype for the call, then cuBLAS (the grouped
    prefill GEMMs are separate work). Capturable in a CUDA graph (no host synchronisation).
    In batch-invariant mode (memra/kernels/batch_invariant.py) every format and every T takes
    :func:`~memra.kernels.batch_invariant.invariant_linear` instead.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    t = x2.shape[0]
    if batch_invariant():
        y = invariant_linear(x2, w)
    elif w.fmt == "bf16":
        y = torch.nn.functional.linear(x2, w.data if x2.dtype == torch.bfloat16 else w.data.to(x2.dtype))
    elif t == 0:
        y = x2.new_empty(0, w.n)
    elif t >= FP8_ACT_MIN_T and fp8_act_supported(w):
        y = fp8_act_linear(x2, w, out_dtype=x2.dtype)
    elif t <= MAX_T:
        y = decode_linear(x2, w, out_dtype=x2.dtype)
    else:
        y = torch.nn.functional.linear(x2, dequantize_packed(w).to(x2.dtype))
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, w.n)


class Embedding(KernelLayer):
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
        if weight.data.device.type == "cuda":
            self.to_gpu(weight.data.device, dtype)

    def to_gpu(self, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> None:
        """Hold the table dequantized in ``dtype`` on a CUDA ``device`` (a row gather per lookup).

        On the GPU the lookup does not check ids (a check would synchronise with the host and
        cannot run inside a CUDA graph): callers validate them first (the engine does)."""
        table = self.qweight.dequantize(torch.float32).to(dtype) if self.qweight.is_quantized else \
            self.qweight.data.to(dtype)
        self.rows = table.to(device)
        self.qweight = None
        self.dtype, self.on_gpu, self.kernels = dtype, True, True
        self.scale_t = torch.tensor(self.scale, dtype=dtype, device=device)  # rounded to dtype first, as on the CPU

    @classmethod
    def from_table(cls, table: torch.Tensor, scale: float = 1.0) -> Embedding:
        """A GPU embedding over a dense [vocab, hidden] table already on its device."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.qweight = None
        self.vocab_size, self.hidden = table.shape
        self.dtype, self.scale, self.on_gpu, self.kernels = table.dtype, scale, True, True
        self.register_buffer("rows", table, persistent=False)
        self.scale_t = torch.tensor(scale, dtype=table.dtype, device=table.device)
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            x = self.rows[ids]
            return x * self.scale_t if self.scale != 1.0 else x
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0].item()
            raise IndexError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        q = self.qweight
        sub = QTensor(q.name, q.qtype, (ids.numel(), self.hidden), self.rows[ids])
        x = sub.dequantize(self.dtype)
        if self.scale != 1.0:
            x = x * torch.tensor(self.scale, dtype=self.dtype)
        return x
