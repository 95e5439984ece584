"""Weight-resident decode linear kernels: ``y[t, n] = sum_k x[t, k] * W[n, k]`` for T = 1..64.

Decode at small batch is memory-bound: the weight is read once per step and each weight
byte meets only T activations. These kernels read ``W`` in its stored format (no
dequantized copy anywhere) and aim at the device's copy bandwidth.

Formats and their GPU layout (made once at load by the ``pack_*`` functions; nothing here
changes a weight's value):

| fmt | ``data`` | ``scale`` | bytes / weight | from |
| --- | --- | --- | --- | --- |
| ``bf16`` | bf16 [N, K] | - | 2 | a bf16/fp16/fp32 tensor or an F16/BF16/F32 QTensor |
| ``fp8`` | float8_e4m3fn [N, K] | fp32 [ceil(N/128), ceil(K/128)] (``weight_scale_inv``) | 1 + 4/128^2 | :class:`~memra.quant.fp8.FP8BlockTensor` |
| ``nvfp4`` | uint8 [N, K/2]: byte i of a row = element 2i (low nibble) and 2i+1 (high nibble) | uint8 [N, K/16]: the UE4M3 byte of each 16-element sub-block | 0.5625 | NVFP4 :class:`~memra.quant.tensor.QTensor` (ggml 36-byte blocks) |
| ``q8_0`` | int8 [N, K] | fp16 [N, K/32] (``d``) | 1.0625 | Q8_0 QTensor (ggml 34-byte blocks) |

The repacks split each row's scales from its codes so that the codes of a row are one
contiguous run (16-byte vector loads, no 34/36-byte strides) and reorder NVFP4 nibbles
from ggml's "element j low, element j+8 high" to adjacent pairs; the byte count is that
of the GGUF blocks exactly.

Math, per format (shared/FORMATS.md; memra/quant/dequant.py is the bit-exact torch form):
- fp8: ``W[n, k] = code[n, k] * scale[n // 128, k // 128]``.
- nvfp4: ``W = kv[nibble] * ggml_ue4m3_to_fp32(d)`` with kv the doubled E2M1 table and
  ``ggml_ue4m3_to_fp32`` = UE4M3 value * 0.5 (0x00 and 0x7F give 0).
- q8_0: ``W = d * q``.

The kernel (:func:`decode_linear`) tiles W into ``bn`` rows x ``bk`` columns per loop step
and splits K over ``split_k`` programs (fp32 atomic adds into a zeroed output) so that
small N still fills the 132 SMs. Two inner products:
- ``dot=False`` (T <= 4): fp32 FMAs on CUDA cores. The tile is viewed as [bn, G, GS] with
  GS weights sharing one scale (or one 16-byte vector); products are summed over GS in
  fp32, multiplied by the group's scale and accumulated per group and column; the groups
  are summed at the end. Weight values are exact in fp32, so the result is the fp32
  reference up to summation order. NVFP4 nibbles are decoded 8 at a time by a few
  integer instructions (inline PTX, ``_NVFP4_ASM``; the interpreter uses the same
  arithmetic in Triton ops). ``prefetch`` double-buffers the weight tile in registers.
- ``dot=False, f16=True``, nvfp4 only (T <= 4; the default at T <= 2): fp16x2 products. Each
  16-element sub-block is read as one 8-byte word and decoded to 8 fp16x2 registers
  (E2M1 * 2^-14, exact); x is scaled per program and column by a power of two so that
  max |x| lands in [2^14, 2^15), converted to fp16 pairs, and the 16 products are summed by
  HMUL2/HFMA2 in fp16 (``_NVFP4_H2_ASM``); the sum goes to fp32, times the UE4M3 scale, and
  the power of two is undone at the end. Error: fp16 rounding of the sub-block sums (measured
  relative error 3-6e-4 of max |y| at the flagship shapes, vs ~1e-7 for the fp32 path); x
  elements below max |x| * 2^-24 of their program's K range are lost to fp16 underflow.
- ``dot=False, f16=True``, fp8 (T <= 4): fp16x2 products. Each 16-byte unit of 16 codes is
  converted two codes at a time (``cvt.rn.f16x2.e4m3x2``, exact) and multiplied with fp16x2 pairs
  of x scaled per program and column by a power of two (max |x| lands in [8, 16), so that 8
  products of |code| <= 448 stay below the fp16 maximum); 8 HFMA2 sum a unit in fp16
  (``_FP8_H2_ASM``), the sum goes to fp32, times the unit's 128x128 block scale. About 1.3
  instructions per weight against ~5 for the fp32 path; error: fp16 rounding of the products and
  unit sums, as for nvfp4.
- ``dot=True`` (any T, padded to 16): ``tl.dot`` of x [16, bk] with the dequantized tile on
  tensor cores (bf16 operands). Exact operands for bf16, NVFP4 and FP8 (codes in the dot,
  the 128x128 block scale applied to the fp32 product when ``bk <= 128``); Q8_0 weights
  (code * d) are rounded to bf16, a relative error <= 2^-9 per weight.
- bf16 weights default to cuBLAS (``torch.mm``, ``library=True``): on the H200 it streams
  at 72-101 % of the copy bandwidth at the TP1 shapes >= 60 MB for every T <= 16 (44-50 %
  at the 10-20 MB shared-expert shapes), faster than these kernels except at 3 small T=1 shapes.
Launch configurations come from memra/kernels/gemv_configs.json (tuned per format, shape and
T bucket by ``memra bench census --tune``), else :func:`default_config`. Measured speeds:
benchmarks/results/census-h200.json and memra/kernels/NOTES.md.

Errors: :class:`ValueError` for shapes, dtypes or devices that do not match, naming the
argument and what was expected.

Sources: shared/FORMATS.md; ggml ``dequantize_row_nvfp4`` / ``dequantize_row_q8_0``;
the split-K GEMV pattern as in Triton's matmul tutorial and in vLLM / llama.cpp decode
kernels (ideas only).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..quant.dequant import NVFP4_KVALUES, ue4m3_half_table
from ..quant.fp8 import FP8BlockTensor
from ..quant.tensor import QTensor
from ..quant.types import QType
from .envflags import triton_interpreted
from .pdl import pdl_args

__all__ = [
    "FORMATS",
    "DecodeWeight",
    "GemvConfig",
    "pack_bf16",
    "pack_fp8",
    "pack_nvfp4",
    "pack_q8_0",
    "pack_weight",
    "dequantize_packed",
    "decode_linear_ref",
    "decode_linear",
    "default_config",
    "load_config_table",
]

FORMATS = ("bf16", "fp8", "nvfp4", "q8_0")
_GS = {"bf16": 8, "fp8": 16, "nvfp4": 16, "q8_0": 32}  # weights per inner group (one vector / one scale)
#: Most columns (tokens) one decode_linear call takes. Tuned table buckets T = 1, 2, 4, 8, 16, 32, 64
#: (CUDA cores up to 4, tensor cores above; a shape without a 32/64 entry takes its 16 entry's
#: tensor-core tile); 16 < T <= 64: tensor cores with one program's tile covering
#: all T columns (BT = 32 or 64), so the weights are still read once (in 16-column slices they were
#: read T / 16 times: an FP8-attention flagship step at batch 64 took 2.7x the bf16 one's attention).
MAX_T = 64
_TABLE_MAX_T = 64  # the largest T bucket of the tuned table (buckets 1, 2, 4, 8, 16, 32, 64)


def packed_nbytes(data: torch.Tensor, scale: torch.Tensor | None) -> int:
    """Bytes of a packed weight: codes (or values) plus scales."""
    return data.numel() * data.element_size() + (0 if scale is None else scale.numel() * scale.element_size())


def check_layout(owner: str, what_for: str, fmt: str, parts) -> None:
    """Checks (name, tensor, dtype, shape) ``parts`` of a packed weight: each a contiguous tensor
    of that dtype and shape, or None where the dtype is None (no scale).

    Raises: ValueError naming ``owner``, the part, what it is and what was expected."""
    for what, t, dt, shape in parts:
        if dt is None:
            if t is not None:
                raise ValueError(f"{owner}: {fmt} has no scale, got {type(t).__name__}")
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != dt or tuple(t.shape) != shape or not t.is_contiguous():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{owner}: {what} is {got}, expected contiguous {dt} {shape} for {what_for}")


@dataclass
class DecodeWeight:
    """A linear weight ``W [N, K]`` in a decode kernel's GPU layout (see the module table).

    Attributes:
        fmt: one of :data:`FORMATS`.
        n, k: output and input features.
        data: codes (or bf16 values), layout per ``fmt``.
        scale: scales per ``fmt`` (``None`` for bf16).
        name: for error messages.
    """

    fmt: str
    n: int
    k: int
    data: torch.Tensor
    scale: torch.Tensor | None = None
    name: str = ""

    def __post_init__(self) -> None:
        """Checks the layout of the module table.

        Raises: ValueError naming the weight, the field, what it is and what was expected
        (unknown format, wrong dtype/shape, non-contiguous, or >= 2^31 elements: the kernel
        indexes with 32-bit offsets)."""
        n, k = self.n, self.k
        want = {
            "bf16": (torch.bfloat16, (n, k), None, None),
            "fp8": (torch.float8_e4m3fn, (n, k), torch.float32, (-(-n // 128), -(-k // 128))),
            "nvfp4": (torch.uint8, (n, k // 2), torch.uint8, (n, k // 16)),
            "q8_0": (torch.int8, (n, k), torch.float16, (n, k // 32)),
        }
        if self.fmt not in want:
            raise ValueError(f"DecodeWeight {self.name!r}: unknown format {self.fmt!r}; expected one of {FORMATS}")
        ddt, dshape, sdt, sshape = want[self.fmt]
        block = {"nvfp4": 64, "q8_0": 32}.get(self.fmt, 1)
        if n < 1 or k < 1 or k % block:
            raise ValueError(f"DecodeWeight {self.name!r}: {self.fmt} needs N >= 1 and K a positive multiple "
                             f"of {block}, got N={n}, K={k}")
        check_layout(f"DecodeWeight {self.name!r}", f"{self.fmt} [{n}, {k}]", self.fmt,
                     (("data", self.data, ddt, dshape), ("scale", self.scale, sdt, sshape)))
        if self.data.numel() >= 2**31:
            raise ValueError(f"DecodeWeight {self.name!r}: {self.data.numel()} code elements; the kernel's 32-bit "
                             f"offsets allow < 2^31 (split the weight)")
        if self.scale is not None and self.scale.device != self.data.device:
            raise ValueError(f"DecodeWeight {self.name!r}: data on {self.data.device}, scale on {self.scale.device}")

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for the whole weight (codes + scales)."""
        return packed_nbytes(self.data, self.scale)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> DecodeWeight:
        """A copy on ``device``."""
        s = None if self.scale is None else self.scale.to(device)
        return DecodeWeight(self.fmt, self.n, self.k, self.data.to(device), s, self.name)


# ---------------------------------------------------------------------------------------
# load-time repacking


def pack_bf16(w: torch.Tensor | QTensor, name: str = "") -> DecodeWeight:
    """bf16 layout from a float tensor [N, K] or an F32/F16/BF16 :class:`QTensor`.

    Raises: ValueError for a non-2-D or non-float input (fp32/fp16 values are rounded to bf16).
    """
    if isinstance(w, QTensor):
        if w.is_quantized:
            raise ValueError(f"pack_bf16({w.name!r}): expected a plain F32/F16/BF16 tensor, got {w.qtype.name}")
        name, w = name or w.name, w.data
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"pack_bf16({name!r}): expected a 2-D float tensor [N, K], got "
                         f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
    n, k = w.shape
    return DecodeWeight("bf16", n, k, w.to(torch.bfloat16).contiguous(), None, name)


def pack_fp8(w: FP8BlockTensor) -> DecodeWeight:
    """FP8 block layout from an :class:`FP8BlockTensor` (2-D, 128x128 blocks): codes and
    ``scale_inv`` kept as they are (made contiguous).

    Raises: ValueError for a stacked (3-D) tensor or another block size.
    """
    if not isinstance(w, FP8BlockTensor) or len(w.shape) != 2 or tuple(w.block) != (128, 128):
        raise ValueError(f"pack_fp8: expected a 2-D FP8BlockTensor with 128x128 blocks, got {w!r}")
    n, k = w.shape
    return DecodeWeight("fp8", n, k, w.codes.contiguous(), w.scale_inv.contiguous(), w.name)


def _check_q(w: QTensor, qtype: QType, fn: str) -> tuple[int, int]:
    if not isinstance(w, QTensor) or w.qtype != qtype or len(w.shape) != 2:
        raise ValueError(f"{fn}: expected a 2-D {qtype.name} QTensor, got {w!r}")
    return w.shape


def pack_nvfp4(w: QTensor) -> DecodeWeight:
    """NVFP4 layout from a ggml NVFP4 :class:`QTensor` [N, K] (K a multiple of 64).

    ggml block (36 bytes / 64 weights): d[4] then qs[32]; sub-block s uses qs[8s..8s+7],
    low nibble of qs[8s+j] = element 16s+j, high nibble = element 16s+j+8. Output: scales
    [N, K/16] = the d bytes in order; codes [N, K/2] with byte i = element 2i | element 2i+1 << 4.
    """
    n, k = _check_q(w, QType.NVFP4, "pack_nvfp4")
    blocks = w.data.reshape(n, k // 64, 36)
    scale = blocks[:, :, 0:4].reshape(n, k // 16).contiguous()
    qs = blocks[:, :, 4:36].reshape(n, k // 64, 4, 8)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=3)  # [n, b, s, 16] element order
    pairs = codes.reshape(n, k // 64, 4, 8, 2)
    data = (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(n, k // 2).contiguous()
    return DecodeWeight("nvfp4", n, k, data, scale, w.name)


def pack_q8_0(w: QTensor) -> DecodeWeight:
    """Q8_0 layout from a ggml Q8_0 :class:`QTensor` [N, K] (K a multiple of 32):
    int8 codes [N, K] and fp16 scales [N, K/32]."""
    n, k = _check_q(w, QType.Q8_0, "pack_q8_0")
    blocks = w.data.reshape(n, k // 32, 34)
    scale = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(n, k // 32).contiguous()
    data = blocks[:, :, 2:34].contiguous().view(torch.int8).reshape(n, k).contiguous()
    return DecodeWeight("q8_0", n, k, data, scale, w.name)


def pack_weight(w: torch.Tensor | QTensor | FP8BlockTensor) -> DecodeWeight:
    """Dispatch to the ``pack_*`` function of ``w``'s format.

    Raises: ValueError for formats without a decode kernel (e.g. k-quants: dequantize those to bf16).
    """
    if isinstance(w, FP8BlockTensor):
        return pack_fp8(w)
    if isinstance(w, QTensor):
        if not w.is_quantized:
            return pack_bf16(w)
        if w.qtype == QType.NVFP4:
            return pack_nvfp4(w)
        if w.qtype == QType.Q8_0:
            return pack_q8_0(w)
        raise ValueError(f"pack_weight({w.name!r}): no decode kernel for {w.qtype.name}; "
                         f"supported: F32/F16/BF16 (as bf16), Q8_0, NVFP4, FP8 block")
    return pack_bf16(w)


def dequantize_packed(w: DecodeWeight) -> torch.Tensor:
    """The weight as fp32 [N, K] from the packed layout (torch; exact: every value is the
    fp32 product of a code and its scale, as in memra/quant/dequant.py)."""
    n, k = w.n, w.k
    if w.fmt == "bf16":
        return w.data.float()
    if w.fmt == "fp8":
        s = w.scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        return w.data.float() * s
    if w.fmt == "q8_0":
        return (w.data.float().reshape(n, k // 32, 32) * w.scale.float().unsqueeze(-1)).reshape(n, k)
    if w.fmt == "nvfp4":
        kv = torch.tensor(NVFP4_KVALUES, dtype=torch.float32, device=w.device)
        codes = torch.stack([w.data & 0x0F, w.data >> 4], dim=-1).reshape(n, k // 16, 16)
        s = ue4m3_half_table(w.device)[w.scale.long()].unsqueeze(-1)
        return (kv[codes.long()] * s).reshape(n, k)
    raise ValueError(f"dequantize_packed: unknown format {w.fmt!r}; expected one of {FORMATS}")


def _check_args(x: torch.Tensor, w: DecodeWeight) -> None:
    if w.fmt not in FORMATS:
        raise ValueError(f"decode_linear({w.name!r}): unknown format {w.fmt!r}; expected one of {FORMATS}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"decode_linear({w.name!r}): x must be [T, {w.k}], got {tuple(getattr(x, 'shape', ()))}")
    if not 1 <= x.shape[0] <= MAX_T:
        raise ValueError(f"decode_linear({w.name!r}): T = {x.shape[0]} columns; decode kernels take 1..{MAX_T}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"decode_linear({w.name!r}): x is {x.dtype}; expected bf16, fp16 or fp32")
    if x.device != w.device:
        raise ValueError(f"decode_linear({w.name!r}): x on {x.device}, weight on {w.device}")


def decode_linear_ref(x: torch.Tensor, w: DecodeWeight, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference: dequantize ``w`` to fp32 and ``y = x.float() @ W^T`` in fp32.

    Args: x [T, K] (bf16/fp16/fp32); w packed [N, K]. Returns y [T, N] in ``out_dtype``.
    """
    _check_args(x, w)
    return (x.float() @ dequantize_packed(w).T).to(out_dtype)


# ---------------------------------------------------------------------------------------
# launch configuration


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: ``bn`` rows x ``bk`` columns per loop step, ``split_k`` programs
    along K, ``dot`` (tensor cores, T padded to 16), ``num_warps``, ``num_stages``;
    ``f16``: with ``dot``, both dot operands in fp16 (x is converted in the kernel: exact for
    bf16 x with 2^-14 <= |x| < 65504 or x = 0, rounded below that, inf above: use it only
    where activations are known to be in range); without ``dot``, nvfp4 and fp8: the fp16x2
    path (x scaled by a power of two per program, any finite range; fp16 sums of 16 products,
    ~5e-4 relative error; nvfp4: ``bk >= 32``; fp8: ``bn <= 128``, K a multiple of 16);
    ``library``: bf16 only, call cuBLAS
    (``torch.mm``) instead of the Triton kernel; ``prefetch``: without ``dot``, load the next
    loop step's weight tile before using the current one (register double buffering; weight
    loads pipelined through shared memory by Triton instead measured 1.4-1.6x slower on the
    MoE decode kernels, H100 2026-12-05, and were removed)."""

    bn: int
    bk: int
    split_k: int = 1
    dot: bool = False
    num_warps: int = 4
    num_stages: int = 2
    f16: bool = False
    library: bool = False
    prefetch: bool = False


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def default_config(fmt: str, n: int, k: int, t: int, sm_count: int = 132) -> GemvConfig:
    """A configuration for shapes the tuned table lacks: cuBLAS for bf16 (faster than these
    kernels at most decode shapes); nvfp4 at T <= 2: the fp16x2 path, 64 x 512 with prefetch;
    fp8 at T <= 2 (K a multiple of 16): the fp16x2 path, 64 x 256 with prefetch;
    else the tile most often fastest in the H200 census (fp8/q8_0 16 x 256 on CUDA cores for
    T <= 2; 32 x 128 tensor-core tiles for T > 2), split along K until there are ~4 programs per SM."""
    if fmt == "bf16":
        return GemvConfig(16, 128, 1, True, library=True)
    if t <= 2 and (fmt == "nvfp4" or (fmt == "fp8" and k % 16 == 0)):
        # fp16x2 path (f16), 64 rows x (512 nvfp4 / 256 fp8) columns, next tile prefetched
        bk, bk_min = (512, 32) if fmt == "nvfp4" else (256, 16)
        while bk > bk_min and (bk > k or k % bk):
            bk //= 2
        split = 1
        while -(-n // 64) * split < 4 * sm_count and k // (bk * split * 2) >= 2 and split < 8:
            split *= 2
        return GemvConfig(64, bk, split, False, 4, 2, f16=True, prefetch=True)
    dot = t > 2
    bn, bk = (32, 128) if dot else {"fp8": (16, 256), "q8_0": (16, 256), "nvfp4": (8, 512)}[fmt]
    while bk > _GS[fmt] and (bk > k or k % bk):  # whole loop steps keep 16-byte vector loads
        bk //= 2
    n_prog = -(-n // bn)
    split = 1
    while n_prog * split < 4 * sm_count and k // (bk * split * 2) >= 2 and split < 8:
        split *= 2
    return GemvConfig(bn, bk, split, dot, 4, 3 if dot else 2)


_TABLE_PATH = Path(__file__).with_name("gemv_configs.json")


@functools.lru_cache(maxsize=1)
def load_config_table(path: str | None = None) -> dict[str, GemvConfig]:
    """Tuned configurations keyed ``"fmt:N:K:T"`` (from ``memra bench census --tune``),
    stored in memra/kernels/gemv_configs.json; an empty dict if the file is missing."""
    p = Path(path) if path else _TABLE_PATH
    if not p.exists():
        return {}
    raw = json.loads(p.read_text())
    return {key: GemvConfig(**v) for key, v in raw.get("configs", {}).items()}


def _bucket_t(t: int) -> int:
    """T rounded up to a power of two: 1, 2, 4, 8, 16 (the tuned table's keys and the FMA path's BT),
    32 or 64."""
    return 1 if t <= 1 else 1 << (t - 1).bit_length()


def pick_config(fmt: str, n: int, k: int, t: int, device: torch.device) -> GemvConfig:
    """The tuned configuration for (fmt, N, K, T bucket), else, for T > 16 without a tuned 32 or 64
    bucket, the 16 bucket's entry if it is a tensor-core or cuBLAS one, else :func:`default_config`."""
    table = load_config_table()
    cfg = table.get(f"{fmt}:{n}:{k}:{min(_bucket_t(t), _TABLE_MAX_T)}")
    if cfg is None and t > 16:
        cfg = table.get(f"{fmt}:{n}:{k}:16")
        cfg = cfg if cfg is not None and (cfg.dot or cfg.library) else None
    return cfg if cfg is not None else default_config(fmt, n, k, t, _sm_count(device))


# ---------------------------------------------------------------------------------------
# the Triton kernel


def _kernel():
    from ._gemv_triton import _gemv_kernel

    return _gemv_kernel


_FMT_ID = {"bf16": 0, "fp8": 1, "nvfp4": 2, "q8_0": 3}


def _validate_config(cfg: GemvConfig, fmt: str) -> None:
    gs = _GS[fmt]
    if cfg.bk % gs or cfg.bk & (cfg.bk - 1):
        raise ValueError(f"GemvConfig.bk = {cfg.bk} must be a power of two and a multiple of {gs} for {fmt}")
    if cfg.bn & (cfg.bn - 1) or cfg.split_k < 1:
        raise ValueError(f"GemvConfig: bn = {cfg.bn} must be a power of two and split_k = {cfg.split_k} >= 1")
    if cfg.dot and (cfg.bn < 16 or cfg.bk < 16):
        raise ValueError(f"GemvConfig: dot=True needs bn, bk >= 16, got {cfg.bn}, {cfg.bk}")
    if fmt == "nvfp4" and cfg.f16 and not cfg.dot and cfg.bk < 32:
        raise ValueError(f"GemvConfig: nvfp4 with f16 and dot=False needs bk >= 32, got {cfg.bk}")
    if fmt == "fp8" and cfg.f16 and not cfg.dot and cfg.bn > 128:
        raise ValueError(f"GemvConfig: fp8 with f16 and dot=False needs bn <= 128 (one 128-row scale block "
                         f"per program), got {cfg.bn}")


def decode_linear(x: torch.Tensor, w: DecodeWeight, out_dtype: torch.dtype = torch.float32,
                  config: GemvConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W^T`` with ``W`` read in its packed format by one Triton kernel.

    Args:
        x: activations [T, K], 1 <= T <= 64 (:data:`MAX_T`; T > 4 only on tensor cores, ``dot``),
            bf16 (GPU), fp16 or fp32; contiguous rows.
        w: :class:`DecodeWeight` [N, K] on the same device.
        out_dtype: fp32 or bf16 (fp16 also accepted). With ``split_k > 1`` the kernel adds
            fp32 partial sums atomically (summation order varies from run to run within fp32
            rounding); a non-fp32 output is then converted by one extra pass.
        config: launch parameters; default: the tuned table, else :func:`default_config`.
        out: optional preallocated [T, N] tensor of ``out_dtype`` (written in full).

    Returns: y [T, N] in ``out_dtype``.

    Raises: ValueError on a shape/dtype/device mismatch or an invalid config.
    """
    _check_args(x, w)
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"decode_linear: out_dtype {out_dtype} not supported (fp32, bf16, fp16)")
    t, k = x.shape
    n = w.n
    cfg = config or pick_config(w.fmt, n, k, t, x.device)
    if cfg.library:
        if w.fmt != "bf16":
            raise ValueError(f"decode_linear: library=True is for bf16 weights only, got {w.fmt}")
        y = torch.mm(x.to(torch.bfloat16), w.data.t())
        if out is not None:
            out.copy_(y)
            return out
        return y.to(out_dtype)
    _validate_config(cfg, w.fmt)
    if not cfg.dot and t > 4:
        raise ValueError(f"decode_linear: dot=False handles T <= 4 columns, got T = {t}")
    if x.stride(1) != 1:
        x = x.contiguous()
    bt = max(16, _bucket_t(t)) if cfg.dot else _bucket_t(t)  # one tile covers every column: W read once
    bk = cfg.bk
    steps = -(-k // bk)
    split = min(cfg.split_k, steps)
    k_per_split = -(-steps // split) * bk
    split = -(-k // k_per_split)
    atomic = split > 1
    if out is not None and (tuple(out.shape) != (t, n) or out.dtype != out_dtype or out.stride(1) != 1):
        raise ValueError(f"decode_linear: out must be {out_dtype} [{t}, {n}] with unit column stride")
    if atomic:
        y = out if (out is not None and out_dtype == torch.float32) else torch.empty(t, n, device=x.device,
                                                                                    dtype=torch.float32)
        y.zero_()
    else:
        y = out if out is not None else torch.empty(t, n, device=x.device, dtype=out_dtype)
    s = w.scale if w.scale is not None else w.data
    stride_w = w.data.stride(0)
    if w.fmt == "nvfp4" and cfg.f16 and not cfg.dot:
        stride_w //= 8  # the fp16x2 path reads the codes as 8-byte words (K/2 is a multiple of 32)
    if w.fmt == "fp8" and cfg.f16 and not cfg.dot:
        if k % 16:  # (DecodeWeight rows are contiguous: the row stride is K)
            raise ValueError(f"decode_linear({w.name!r}): the fp8 fp16x2 path reads 16-code units; K = {k} must be "
                             f"a multiple of 16 (use f16=False)")
        stride_w //= 8  # codes read as 8-byte words
    grid = (-(-n // cfg.bn), split)
    _kernel()[grid](
        x, w.data, s, y, t, n, k, k_per_split,
        x.stride(0), y.stride(0), stride_w, s.stride(0),
        FMT=_FMT_ID[w.fmt], BT=bt, BN=cfg.bn, G=bk // _GS[w.fmt], GS=_GS[w.fmt],
        DOT=cfg.dot, ATOMIC=atomic, EVEN_K=(k % bk == 0), ASM=not interpret_mode(), F16=cfg.f16, PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device),
    )
    if atomic and y.dtype != out_dtype:
        if out is not None:
            out.copy_(y)
            return out
        return y.to(out_dtype)
    return y


def config_to_json(cfg: GemvConfig) -> dict:
    """The launch configuration as a JSON-able dict (the form kept in gemv_configs.json)."""
    return asdict(cfg)


def interpret_mode() -> bool:
    """True when Triton runs through its CPU interpreter (``TRITON_INTERPRET=1``; Triton's own
    reading of the variable: :func:`memra.kernels.envflags.triton_interpreted`)."""
    return triton_interpreted()
