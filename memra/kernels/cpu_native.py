"""memra's native CPU decode kernels (memra/kernels/cpu/decode.c) and their torch twins.

The C source is compiled on first use with the system C compiler (``$CC``, ``cc``, ``gcc`` or
``clang``) into ``~/.cache/memra/cpu-kernels/<hash>/`` (``MEMRA_CACHE`` moves it): ``-O3 -fopenmp``,
plus ``-mavx2 -mfma -mf16c`` and the VNNI flags where /proc/cpuinfo lists them (a portable C loop
otherwise). OpenMP resolves to the ``libgomp`` torch has already loaded, so the kernels and torch
share one thread pool. It is called through ctypes. Without a compiler (or with
``MEMRA_CPU_KERNELS=0``) :func:`available` is False (a warning says why) and the layers keep their
torch paths; :data:`ENABLED` is the switch tests use.

What it computes (decode.c's comments have the formats and the math):

- :func:`gemv`: ``y = x W^T`` over weights repacked at load by :func:`pack_weight` from GGUF's
  per-32 affine formats (Q4_0, Q4_1, Q4_K -> 4-bit codes; Q5_0, Q5_1, Q5_K, Q8_0 -> int8 codes)
  and Q6_K (int8 codes, a scale per 16). bf16 mode: the activations quantized to int8 per 32
  values as llama.cpp's ``q8_1`` (the idea, not its code), integer dot products; twin
  :func:`gemv_torch`. Exact (float32) mode: fp32 block parameters, fp32 activations, the weights
  the gguf dequantizer's bit for bit. MODE_SWIGLU fuses SwiGLU (with Step-3.5's clamp).
- :class:`DecoderLayers`: a Llama-family decode step over every decoder layer in one call, the
  functions below in the layer-by-layer path's order (bit-identical to it).
- :func:`rms_norm_add` (twin: memra/layers/norm.py ``RMSNorm.add``), :func:`rope_` (twin:
  memra/kernels/norm_rope.py ``rope_torch``), :func:`decode_attention` (twin:
  memra/layers/attention.py ``decode_attention``; writes the step's K/V too), :func:`topk_indices`.

Every wrapper takes host tensors only (ValueError otherwise).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..quant.dequant import AFFINE32_BITS, affine32, q6_k_parts
from ..quant.tensor import QTensor
from ..quant.types import QType

__all__ = ["DecoderLayer", "DecoderLayers", "KVPointers", "NativeKV", "NativeWeight", "available", "decode_attention", "enabled", "gemv", "gemv_torch", "pack_weight", "packable",
           "gemv_fast", "quantize_q8_torch", "rms_norm_add", "rope_", "topk_indices", "PACKABLE"]

SOURCE = Path(__file__).parent / "cpu" / "decode.c"
FMT_U4, FMT_S8 = 0, 1
MODE_STORE, MODE_SWIGLU = 0, 1
_NAN = float("nan")  # the kernels' "no SwiGLU clamp"
#: Formats :func:`pack_weight` takes (others stay on the torch path).
PACKABLE = frozenset(AFFINE32_BITS) | {QType.Q6_K}
#: The one switch of the native paths (tests set it False to pin the torch paths); they run only
#: where the library also compiled (:func:`enabled`).
ENABLED = True


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _compile_flags() -> list[str]:
    flags = ["-O3", "-fPIC", "-shared", "-std=c11", "-D_GNU_SOURCE"]
    cpu = _cpu_flags()
    if {"avx2", "fma", "f16c"} <= cpu:
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if {"avx512_vnni", "avx512vl", "avx512bw"} <= cpu:  # vpdpbusd on ymm (EVEX)
            flags += ["-mavx512vnni", "-mavx512vl", "-mavx512bw"]
        elif "avx_vnni" in cpu:  # the same instruction, VEX-encoded
            flags += ["-mavxvnni"]
    return flags


def _build() -> Path:
    """Compile decode.c (once per source, compiler and flags); returns the library's path.
    Raises RuntimeError with the compiler's message when it fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang; or set CC)")
    src = SOURCE.read_bytes()
    flags = _compile_flags()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(src + repr((flags, version, sys.platform)).encode()).hexdigest()[:16]
    root = Path(os.environ.get("MEMRA_CACHE", Path.home() / ".cache" / "memra")) / "cpu-kernels" / key
    lib = root / "libmemra_cpu.so"
    if lib.is_file():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    errors = []
    for omp in (["-fopenmp"], []):  # a compiler without OpenMP (macOS clang) still gets one thread
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        r = subprocess.run([cc, *flags, *omp, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if r.returncode == 0:
            os.replace(tmp, lib)  # atomic: concurrent builders agree
            return lib
        os.unlink(tmp)
        errors.append(r.stderr[-2000:])
    raise RuntimeError(f"{cc} failed to compile {SOURCE}:\n" + "\n".join(errors))


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    if os.environ.get("MEMRA_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"memra: the native CPU decode kernels could not be built or loaded ({e}); the CPU layers "
                      f"take their torch paths (slower decode; MEMRA_CPU_KERNELS=0 silences this)", stacklevel=1)
        return None
    p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.memra_gemv.argtypes = [p, i, i, i, L, p, i, i, i, p, p, p, p, i, i, f, i]
    lib.memra_gemv.restype = i
    lib.memra_quantize_q8.argtypes = [p, i, i, i, i, p, p, p]
    lib.memra_quantize_q8.restype = None
    lib.memra_rmsnorm_add.argtypes = [p, i, p, p, p, f, i, i, p, i]
    lib.memra_rmsnorm_add.restype = None
    lib.memra_rope.argtypes = [p, i, i, L, i, i, i, p, p, i]
    lib.memra_rope.restype = None
    lib.memra_decode_attention.argtypes = [p, i, i, i, i, i, p, p, L, p, L, i, p, f, p, i, p, p, i, p, L, i]
    lib.memra_decode_attention.restype = i
    lib.memra_gemv_f32.argtypes = [p, i, i, L, p, i, i, i, p, p, p, p, i, f, i]
    lib.memra_gemv_f32.restype = i
    lib.memra_topk.argtypes = [p, i, L, i, p, i]
    lib.memra_topk.restype = None
    lib.memra_decoder_layers.argtypes = [p, i, i, i, i, p, p, i, p, p, i, p, p, L, p, L, i, p, p, L, i]
    lib.memra_decoder_layers.restype = i
    lib.memra_has_avx2.restype = i
    lib.memra_has_vnni.restype = i
    return lib


def available() -> bool:
    """Whether the native kernels compiled and loaded here (cached; warns once if they did not)."""
    return _lib() is not None


def enabled() -> bool:
    """Whether the layers take the native paths: :data:`ENABLED` and :func:`available`."""
    return ENABLED and available()


@dataclass
class NativeWeight:
    """A weight [n, k] in a native kernel format (decode.c header).

    Attributes: ``codes`` uint8 [n, k / 2] (``fmt`` FMT_U4) or int8 viewed as uint8 [n, k]
    (FMT_S8); ``scales`` fp16 [n, nbp * 32 / wb]; ``offsets`` fp16 [n, nbp] or None; ``wb`` 32 or
    16; ``nbp`` the row's blocks of 32 rounded up to a multiple of 8 (the scale rows are padded
    with zeros: the kernel converts 8 blocks' scales at once).
    """

    n: int
    k: int
    fmt: int
    wb: int
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    @property
    def nbp(self) -> int:
        """Blocks of 32 per row rounded up to a multiple of 8 (the parameter rows' padded length)."""
        return -(-self.k // 256) * 8

    @functools.cached_property
    def cargs(self) -> tuple:
        """The kernel's weight arguments (k, n, codes, fmt, wb, nbp, scales, offsets), built once."""
        return (self.k, self.n, self.codes.data_ptr(), self.fmt, self.wb, self.nbp, self.scales.data_ptr(),
                None if self.offsets is None else self.offsets.data_ptr())

    @property
    def exact(self) -> bool:
        """fp32 block parameters (the float32 mode: :func:`gemv` takes fp32 activations then)."""
        return self.scales.dtype == torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes a product reads: codes + scales + offsets (the padding of the parameter rows included)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The weight fp32 [n, k] (what the kernel multiplies by)."""
        c = _codes(self).double()  # scale x code is exact in float64; one rounding with the offset (= fma)
        w = c.view(self.n, -1, self.wb) * self._scales().double().view(self.n, -1, 1)
        w = w.view(self.n, self.k)
        if self.offsets is not None:
            w = (w.view(self.n, -1, 32) + self._offsets().double().view(self.n, -1, 1)).view(self.n, self.k)
        return w.float()

    def _scales(self) -> torch.Tensor:
        """[n, k / wb], fp16 or (exact) fp32: the padding dropped."""
        return self.scales[:, :self.k // self.wb]

    def _offsets(self) -> torch.Tensor:
        return self.offsets[:, :self.k // 32]


def _codes(w: NativeWeight) -> torch.Tensor:
    """Codes as int16 [n, k] (U4 unpacked in weight order)."""
    if w.fmt == FMT_U4:
        b = w.codes.view(w.n, -1, 16)
        return torch.cat([b & 15, b >> 4], dim=2).view(w.n, w.k).to(torch.int16)
    return w.codes.view(torch.int8).to(torch.int16)


def packable(parts: list[QTensor]) -> bool:
    """Whether :func:`pack_weight` takes these row-stacked parts (2-D, equal widths that are a
    multiple of 32, formats in :data:`PACKABLE`; Q6_K only with Q8_0 / Q5_0)."""
    if not parts or any(len(p.shape) != 2 or p.qtype not in PACKABLE for p in parts):
        return False
    k = parts[0].shape[1]
    if k % 32 or any(p.shape[1] != k for p in parts):
        return False
    return not any(p.qtype == QType.Q6_K for p in parts) or all(p.qtype in _SYMMETRIC for p in parts)


_SYMMETRIC = frozenset({QType.Q6_K, QType.Q8_0, QType.Q5_0})


def _fp16(t: torch.Tensor, what: str) -> torch.Tensor:
    h = t.to(torch.float16)
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"pack_weight: a {what} does not fit fp16")
    return h


def pack_weight(parts: list[QTensor], exact: bool = False) -> NativeWeight:
    """Row-stacked ``parts`` (each [n_i, k], formats in :data:`PACKABLE`) in one native format:
    4-bit codes when every part's codes have <= 4 bits, else int8 codes (a scale per 16 if a part
    is Q6_K, then every part must be symmetric: Q6_K, Q8_0 or Q5_0).

    Codes are the format's own (``affine32``): unsigned with the offset for Q4_0 / Q4_1 / Q4_K and
    Q5_1 / Q5_K (5-bit codes fit int8), signed and offset-free for Q8_0 (q), Q5_0 (q - 16) and
    Q6_K (q - 32). With ``exact`` the scales and offsets are kept in fp32 (``NativeWeight.exact``):
    ``fma(scale, code, offset)`` is then the gguf dequantizer's weight bit for bit (the float32
    mode's kernel). Otherwise fp16: exact for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0; K-quants' ``d * sc``
    and ``dmin * m`` and Q6_K's ``d * scale`` are rounded to fp16 (relative error <= 2^-11 of a
    block parameter), next to the int8 activations' ~2^-8.

    Raises: ValueError for parts of other formats or widths, k % 32 != 0, a mix this cannot hold, or
    (without ``exact``) a scale / offset outside fp16.
    """
    if not packable(parts):
        raise ValueError(f"pack_weight: {parts} are not 2-D parts of equal width (a multiple of 32) in "
                         f"{', '.join(sorted(t.name for t in PACKABLE))} (Q6_K, a scale per 16, stacks only with "
                         f"Q8_0 / Q5_0)")
    k = parts[0].shape[1]
    four = all(AFFINE32_BITS.get(p.qtype, 8) <= 4 for p in parts)
    q6k = any(p.qtype == QType.Q6_K for p in parts)
    codes, scales, offsets = [], [], []
    wb = 16 if q6k else 32
    for p in parts:
        n = p.shape[0]
        raw = p.data.reshape(-1)
        if p.qtype == QType.Q6_K:
            c, s = q6_k_parts(raw)  # int8 codes in -32..31, scale per 16
            codes.append(c.view(n, k))
            scales.append(s.view(n, k // 16))
            offsets.append(torch.zeros(n, k // 32))
            continue
        q, s, o = affine32(raw, p.qtype)
        q, s, o = q.view(n, k), s.view(n, k // 32), o.view(n, k // 32)
        if four:
            b = q.view(n, -1, 2, 16)
            codes.append((b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2))
        elif p.qtype in _SYMMETRIC:  # Q8_0 / Q5_0: w = s (q - mid), the offset -mid s folded away exactly
            mid = 1 << (AFFINE32_BITS[p.qtype] - 1)
            codes.append((q.to(torch.int16) - mid).to(torch.int8))
            o = torch.zeros_like(o)
        else:  # Q5_1 / Q5_K: codes 0..31 as they are, with their offsets
            codes.append(q.to(torch.int8))
        scales.append(s if wb == 32 else s.repeat_interleave(2, dim=1))
        offsets.append(o)
    cat = torch.cat(codes)
    pad = -(-k // 256) * 8 - k // 32  # parameter rows padded to a multiple of 8 blocks (zeros)
    conv = (lambda t, what: t.float()) if exact else _fp16
    scale = torch.nn.functional.pad(conv(torch.cat(scales), "scale"), (0, pad * 32 // wb))
    off = conv(torch.cat(offsets), "offset")
    off = None if bool((off == 0).all()) else torch.nn.functional.pad(off, (0, pad))
    return NativeWeight(cat.shape[0], k, FMT_U4 if four else FMT_S8, wb,
                        cat.view(torch.uint8).contiguous(), scale.contiguous(), None if off is None else off.contiguous())


def quantize_q8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization in torch: x [T, K] -> (q int8 [T, K], d fp32 [T, K / 32],
    ds = d * sum(q) fp32 [T, K / 32]); per 32 values d = max|x| / 127, q = round-half-even(x * (1 / d))."""
    T, K = x.shape
    xb = x.float().view(T, K // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])
    return q.to(torch.int8).view(T, K), d, d * q.sum(-1)


def gemv_torch(x: torch.Tensor, w: NativeWeight, bias: torch.Tensor | None = None, mode: int = MODE_STORE,
               limit: float | None = None) -> torch.Tensor:
    """The native GEMV's math in float64 torch: x [T, K] -> fp32 [T, N] (or [T, N / 2] with
    MODE_SWIGLU: silu(gate) * up, clamped as memra/kernels/fused.py ``swiglu_torch`` when ``limit``).
    An ``exact`` weight: x times the decoded weights (no activation quantization)."""
    if w.exact:  # the float32 mode: fp32 activations times the exactly decoded weights
        y = x.double() @ w.dequantize().double().t()
        return _epilogue(y, bias, mode, limit)
    q, d, ds = quantize_q8_torch(x)
    T = x.shape[0]
    c = _codes(w).double()  # [N, K]
    qb = q.double().view(T, -1, w.wb)  # [T, K / wb, wb]
    dots = torch.einsum("tbj,nbj->tnb", qb, c.view(w.n, -1, w.wb))  # exact integer dots
    s = w._scales().double()  # [N, K / wb]
    dd = d.double().repeat_interleave(32 // w.wb, dim=1)  # [T, K / wb]
    y = (dots * s[None] * dd[:, None]).sum(-1)
    if w.offsets is not None:
        y = y + ds.double() @ w._offsets().double().t()
    return _epilogue(y, bias, mode, limit)


def _epilogue(y: torch.Tensor, bias: torch.Tensor | None, mode: int, limit: float | None) -> torch.Tensor:
    if bias is not None:
        y = y + bias.double()
    if mode == MODE_SWIGLU:
        g, u = y.chunk(2, dim=-1)
        a = torch.nn.functional.silu(g)
        if limit is not None:
            a, u = a.clamp(max=limit), u.clamp(-limit, limit)
        y = a * u
    return y.float()


def gemv(x: torch.Tensor, w: NativeWeight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
         mode: int = MODE_STORE, limit: float | None = None) -> torch.Tensor:
    """y = x W^T through the native kernel: int8 activations (fp16-parameter weights), or with an
    ``exact`` weight (:func:`pack_weight`) fp32 activations and fp32 outputs (the float32 mode).

    Args:
        x: [T, K] fp32 or bf16 (exact weights: fp32).
        w: the packed weight [N, K].
        bias: fp32 [N] or None.
        out_dtype: fp32 or bf16 (default x's dtype).
        mode: MODE_STORE -> [T, N]; MODE_SWIGLU (rows [gate | up]) -> silu(gate) * up [T, N / 2].
        limit: SwiGLU clamp (MODE_SWIGLU), None for none.
    Raises: RuntimeError if the kernels are not available or its scratch allocation failed;
        ValueError for a shape or dtype it does not take.
    """
    lib = _need(x, bias, w.codes)
    if x.dim() != 2 or x.shape[1] != w.k or x.dtype not in _FLOATS:
        raise ValueError(f"native gemv: x must be [T, {w.k}] fp32 or bf16, got {x.dtype} {tuple(x.shape)}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _FLOATS:
        raise ValueError(f"native gemv: out_dtype must be fp32 or bf16, got {out_dtype}")
    if bias is not None and bias.shape != (w.n,):
        raise ValueError(f"native gemv: bias must be [{w.n}], got {tuple(bias.shape)}")
    if mode == MODE_SWIGLU and w.n % 2:
        raise ValueError(f"native gemv: SwiGLU needs [gate | up] rows, an even count (got {w.n})")
    if mode not in (MODE_STORE, MODE_SWIGLU):
        raise ValueError(f"native gemv: unknown mode {mode}")
    if limit is not None and not limit >= 0:
        raise ValueError(f"native gemv: the SwiGLU clamp must be >= 0, got {limit}")
    lim = _NAN if limit is None else float(limit)
    x = x.contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    if w.exact and (x.dtype != torch.float32 or out_dtype != torch.float32):
        raise ValueError(f"native gemv: a weight packed exact takes and gives fp32 (x {x.dtype}, out {out_dtype})")
    return _gemv_call(lib, x, w, bias, out_dtype, mode, lim)


def _gemv_call(lib: ctypes.CDLL, x: torch.Tensor, w: NativeWeight, bias32: torch.Tensor | None,
               out_dtype: torch.dtype, mode: int, lim: float) -> torch.Tensor:
    """The one call of the GEMV kernels (arguments already checked): exact weights -> memra_gemv_f32."""
    T = x.shape[0]
    y = torch.empty(T, w.n // 2 if mode == MODE_SWIGLU else w.n, dtype=out_dtype)
    k, n, codes, fmt, wb, nbp, sc, of = w.cargs
    b = None if bias32 is None else bias32.data_ptr()
    if w.exact:  # the float32 mode: fp32 activations, the block parameters in fp32
        rc = lib.memra_gemv_f32(x.data_ptr(), T, k, n, codes, fmt, wb, nbp, sc, of, b, y.data_ptr(), mode, lim,
                                torch.get_num_threads())
    else:
        rc = lib.memra_gemv(x.data_ptr(), x.dtype == torch.bfloat16, T, k, n, codes, fmt, wb, nbp, sc, of, b,
                            y.data_ptr(), out_dtype == torch.bfloat16, mode, lim, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"native gemv: scratch allocation for {T} x {k} activations failed")
    return y


def _need(*tensors: torch.Tensor | None) -> ctypes.CDLL:
    """The library; raises RuntimeError if it is not available, ValueError for a tensor not in host
    memory (the C code would dereference a device pointer)."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("memra's native CPU kernels are not available (see the warning at first use)")
    for t in tensors:
        if t is not None and not t.is_cpu:
            raise ValueError(f"memra's native CPU kernels take host tensors, got one on {t.device}")
    return lib


_FLOATS = (torch.float32, torch.bfloat16)


def rms_norm_add(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """memra/layers/norm.py ``RMSNorm.add`` on the CPU in one native call: s = residual + x in fp32
    (``residual`` None: s = x widened); returns (rmsnorm(s) * weight in x's dtype, s fp32 [T, D]).

    Args: x [T, D] fp32 or bf16; weight fp32 [D]; residual fp32 [T, D] or None (not modified).
    The mean of squares is summed in float64 (torch's F.rms_norm sums in fp32: the last bits differ).
    Raises: ValueError for other shapes or dtypes."""
    lib = _need(x, weight, residual)
    if not (x.dim() == 2 and x.dtype in _FLOATS and x.is_contiguous() and weight.dtype == torch.float32
            and weight.shape == (x.shape[1],) and weight.is_contiguous()
            and (residual is None or (residual.dtype == torch.float32 and residual.shape == x.shape
                                      and residual.is_contiguous()))):  # (the decode loop's case: no copies)
        if (x.dim() != 2 or x.dtype not in _FLOATS or weight.shape != (x.shape[1],) or weight.dtype != torch.float32
                or (residual is not None and (residual.shape != x.shape or residual.dtype != torch.float32))):
            raise ValueError(f"native rms_norm_add: x [T, D] fp32/bf16, weight fp32 [D], residual fp32 [T, D]; got "
                             f"x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}, residual "
                             f"{None if residual is None else (residual.dtype, tuple(residual.shape))}")
        x, weight = x.contiguous(), weight.contiguous()
        residual = None if residual is None else residual.contiguous()
    out = torch.empty_like(x)
    s = torch.empty(x.shape, dtype=torch.float32)
    lib.memra_rmsnorm_add(x.data_ptr(), x.dtype == torch.bfloat16, None if residual is None else residual.data_ptr(),
                          s.data_ptr(), weight.data_ptr(), eps, x.shape[0], x.shape[1], out.data_ptr(),
                          x.dtype == torch.bfloat16)
    return out, s


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """memra/kernels/norm_rope.py ``rope_torch`` in place and in one native call: x [T, n, hd]
    (fp32 or bf16; rows may be strided, heads contiguous), cos / sin [T, rot] (fp32 or bf16, the
    same dtype). Computed in fp32 and rounded once (rope_torch rounds each product in x's dtype).
    Returns x. Raises: ValueError for other layouts or dtypes."""
    lib = _need(x, cos, sin)
    T, n, hd = x.shape
    rot = cos.shape[-1]
    if (x.dtype not in _FLOATS or x.stride(2) != 1 or x.stride(1) != hd or cos.shape != (T, rot)
            or sin.shape != cos.shape or cos.dtype != sin.dtype or cos.dtype not in _FLOATS or rot % 2 or rot > hd):
        raise ValueError(f"native rope_: x [T, n, hd] with contiguous heads, cos/sin [T, rot] of one dtype; got x "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}, cos {cos.dtype} {tuple(cos.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    lib.memra_rope(x.data_ptr(), x.dtype == torch.bfloat16, T, x.stride(0), n, hd, rot, cos.data_ptr(),
                   sin.data_ptr(), cos.dtype == torch.bfloat16)
    return x


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                     slots: torch.Tensor | None = None, start: int = 0, length: int | None = None,
                     lens: torch.Tensor | None = None, k_new: torch.Tensor | None = None,
                     v_new: torch.Tensor | None = None, write_slots: torch.Tensor | None = None,
                     write_pos: int | None = None) -> torch.Tensor:
    """One query per sequence over its cached keys, in one native call (fp32 math): the CPU twin
    of memra/layers/attention.py ``decode_attention`` without the gather.

    Args:
        q: [B, H, D] fp32 or bf16.
        k_cache, v_cache: fp32 [S, KV, D] contiguous (a contiguous cache, or a paged cache's
            blocks flattened to slots).
        scale: softmax scale.
        slots: int64 [B, L]: sequence b's keys are slots[b, :lens[b]]; None: every sequence
            reads slots start .. start + length - 1.
        lens: int64 [B] (with ``slots``; None: all L).
        k_new, v_new: this step's keys and values [B, KV, D] (fp32 or bf16, one dtype), written into
            the caches first (the slot of row b: ``write_slots[b]``, int64 [B], or ``write_pos``
            when B = 1), so that the cache write and the attention are one call.
    Returns [B, H, D] in q's dtype (zeros for a sequence with no keys, where softmax over nothing
    is undefined). Raises: ValueError for shapes or dtypes it does not take, a length outside
    [0, L] or a slot outside the cache (checked before anything is written); RuntimeError if its
    scratch could not be allocated.
    """
    lib = _need(q, k_cache, v_cache, slots, lens, k_new, v_new, write_slots)
    B, H, D = q.shape
    S, KV, Dk = k_cache.shape
    fast = (slots is None and k_new is not None and write_pos is not None and B == 1 and length is not None
            and q.is_contiguous() and k_new.is_contiguous() and v_new.is_contiguous()
            and q.dtype == k_new.dtype == v_new.dtype and q.dtype in _FLOATS and k_new.shape == v_new.shape == (1, KV, D)
            and Dk == D and H % KV == 0 and k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
            and 0 <= start and start + length <= S and 0 <= write_pos < S)
    if fast:  # the contiguous cache's decode step (memra/engine/kv_cache.py): all checked, nothing to copy
        return _attend_call(lib, q, k_cache, v_cache, scale, None, start, length, None, k_new, v_new, None, write_pos)
    ok = (q.dtype in _FLOATS and k_cache.dtype == v_cache.dtype == torch.float32 and Dk == D and H % KV == 0
          and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape)
    if slots is not None:
        ok = ok and slots.dtype == torch.int64 and slots.dim() == 2 and slots.shape[0] == B and (
            lens is None or (lens.dtype == torch.int64 and lens.shape == (B,)))
        L = slots.shape[1]
    else:
        L = S - start if length is None else length
        ok = ok and 0 <= start and start + L <= S
    if k_new is not None:
        ok = ok and v_new is not None and k_new.shape == v_new.shape == (B, KV, D) and k_new.dtype == v_new.dtype \
            and k_new.dtype in _FLOATS and ((write_slots is not None and write_slots.dtype == torch.int64
                                             and write_slots.shape == (B,)) or (write_pos is not None and B == 1
                                                                                and 0 <= write_pos < S))
    if not ok:
        raise ValueError(f"native decode_attention: q {q.dtype} {tuple(q.shape)}, caches {k_cache.dtype} "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}, slots "
                         f"{None if slots is None else (slots.dtype, tuple(slots.shape))}, start {start}, L {L}")
    # contiguous copies held in locals: they must outlive the call
    slots = None if slots is None else slots.contiguous()
    lens = None if lens is None else lens.contiguous()
    k_new = None if k_new is None else k_new.contiguous()
    v_new = None if v_new is None else v_new.contiguous()
    write_slots = None if write_slots is None else write_slots.contiguous()
    return _attend_call(lib, q.contiguous(), k_cache, v_cache, scale, slots, start, L, lens, k_new, v_new,
                        write_slots, write_pos)


def _attend_call(lib, q, k_cache, v_cache, scale, slots, start, L, lens, k_new, v_new, write_slots, write_pos):
    """The one call of memra_decode_attention (arguments checked, contiguous)."""
    B, H, D = q.shape
    S, KV = k_cache.shape[:2]
    out = torch.empty_like(q)
    rc = lib.memra_decode_attention(q.data_ptr(), q.dtype == torch.bfloat16, B, H, KV, D, k_cache.data_ptr(),
                                    v_cache.data_ptr(), S, None if slots is None else slots.data_ptr(), start, L,
                                    None if lens is None else lens.data_ptr(), scale, out.data_ptr(),
                                    q.dtype == torch.bfloat16, None if k_new is None else k_new.data_ptr(),
                                    None if v_new is None else v_new.data_ptr(),
                                    k_new is not None and k_new.dtype == torch.bfloat16,
                                    None if write_slots is None else write_slots.data_ptr(),
                                    -1 if write_pos is None else write_pos, torch.get_num_threads())
    _attention_rc(rc, "native decode_attention", L, S)
    return out


def _attention_rc(rc: int, who: str, L: int, S: int) -> None:
    """Raise for memra_decode_attention's (and memra_decoder_layers') error codes: -2 a length
    outside [0, L], -3 a slot outside [0, S) (ValueError), another non-zero: scratch (RuntimeError)."""
    if rc == -2:
        raise ValueError(f"{who}: a length in lens is outside [0, {L}]")
    if rc == -3:
        raise ValueError(f"{who}: a slot (read or written) is outside the cache's [0, {S})")
    if rc != 0:
        raise RuntimeError(f"{who}: scratch allocation failed")


def topk_indices(y: torch.Tensor, k: int) -> torch.Tensor:
    """Indices int64 [R, k] of the k largest values of each row of y (fp32 [R, V], contiguous),
    largest first, ties to the lower index; NaN is never chosen (a row with fewer than k non-NaN
    values repeats index 0). One native pass per row: torch.topk costs ~0.3 ms on a 49k-row head.
    Raises: ValueError unless 1 <= k <= min(64, V) and y is fp32 2-D."""
    lib = _need(y)
    if y.dim() != 2 or y.dtype != torch.float32 or not 1 <= k <= min(64, y.shape[1]):
        raise ValueError(f"native topk_indices: y fp32 [R, V] and 1 <= k <= min(64, V); got {y.dtype} "
                         f"{tuple(y.shape)}, k={k}")
    y = y.contiguous()
    out = torch.empty(y.shape[0], k, dtype=torch.int64)
    lib.memra_topk(y.data_ptr(), y.shape[0], y.shape[1], k, out.data_ptr(), torch.get_num_threads())
    return out



def gemv_fast(x: torch.Tensor, w: NativeWeight, bias32: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`gemv` (MODE_STORE) without its argument checks, for the decode loop's layers, whose
    shapes were checked when they were built: x [T, k] contiguous (fp32 for an exact weight, else
    fp32 or bf16), T >= 1; bias32 fp32 [n] contiguous or None; out_dtype fp32 (exact) or fp32 /
    bf16. Saves ~3 µs a call (decode on these CPUs calls it ~120 times a token)."""
    return _gemv_call(_lib(), x, w, bias32, out_dtype, MODE_STORE, _NAN)


# ------------------------------------------------------------------ the fused decode step
class _CLinear(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("N", ctypes.c_long), ("K", ctypes.c_int), ("fmt", ctypes.c_int),
                ("wb", ctypes.c_int), ("nbp", ctypes.c_int), ("exact", ctypes.c_int)]


class _CLayer(ctypes.Structure):  # decode.c decoder_layer_t
    _fields_ = [("qkv", _CLinear), ("o", _CLinear), ("gate_up", _CLinear), ("down", _CLinear),
                ("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("attn_eps", ctypes.c_float),
                ("ffn_eps", ctypes.c_float), ("scale", ctypes.c_float), ("limit", ctypes.c_float),
                ("H", ctypes.c_int), ("KV", ctypes.c_int), ("D", ctypes.c_int), ("rot", ctypes.c_int),
                ("cache", ctypes.c_int)]


def _clinear(w: NativeWeight, bias32: torch.Tensor | None) -> _CLinear:
    k, n, codes, fmt, wb, nbp, sc, of = w.cargs
    return _CLinear(codes, sc, of, None if bias32 is None else bias32.data_ptr(), n, k, fmt, wb, nbp, int(w.exact))


@dataclass
class DecoderLayer:
    """One Llama-family decoder layer as :class:`DecoderLayers` takes it (memra/models/llama.py
    ``LlamaForCausalLM.Layer``): fp32 norm weights [hidden], packed weights (qkv rows
    [q (heads x head_dim) | k | v], gate_up rows [gate | up]), the qkv bias fp32 or None, RoPE
    over the first ``rotary_dim`` dims of each head (NeoX order), softmax ``scale``, SwiGLU clamp
    ``limit`` (None: none), ``cache_index``: its slot in the KV cache."""

    attn_norm: torch.Tensor
    attn_eps: float
    qkv: NativeWeight
    qkv_bias: torch.Tensor | None
    o: NativeWeight
    ffn_norm: torch.Tensor
    ffn_eps: float
    gate_up: NativeWeight
    down: NativeWeight
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    scale: float
    limit: float | None
    cache_index: int


class KVPointers:
    """A KV cache's per-slot K and V storage as the fused decode step reads it: built once by the
    cache that owns the tensors (and used only while it lives).

    Args: k, v: per slot an fp32 [S, KV, D] contiguous host tensor (one S), or None for a slot no
        layer uses. Raises: ValueError otherwise."""

    def __init__(self, k: list[torch.Tensor | None], v: list[torch.Tensor | None]):
        if len(k) != len(v) or not any(t is not None for t in k):
            raise ValueError("KVPointers: k and v need one entry per slot and at least one tensor")
        S = next(t for t in k if t is not None).shape[0]
        self.S, self.geometry = S, []
        for i, (a, b) in enumerate(zip(k, v)):
            if a is None or b is None:
                self.geometry.append(None)
                continue
            if not all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 3
                       and t.shape == a.shape and t.shape[0] == S for t in (a, b)):
                raise ValueError(f"KVPointers: slot {i}: K and V must be fp32 [{S}, KV, D] contiguous on the host, "
                                 f"got {a.dtype} {tuple(a.shape)} / {b.dtype} {tuple(b.shape)} on {a.device}")
            self.geometry.append(tuple(a.shape[1:]))
        arr = ctypes.c_void_p * len(k)
        self.k = arr(*[None if t is None else t.data_ptr() for t in k])
        self.v = arr(*[None if t is None else t.data_ptr() for t in v])


@dataclass
class NativeKV:
    """One decode step's attention addressing for :class:`DecoderLayers` (memra_decode_attention's):
    each of the step's B sequences (one query each) reads slots ``idx[b, :lens[b]]`` (int64 [B, L],
    lens int64 [B]) or, with ``idx`` None, slots ``lo .. lo + L - 1`` of every layer's cache
    (``pointers``); its new key and value go to slot ``write_slots[b]`` (int64 [B]) or, for B = 1,
    ``write_pos``."""

    pointers: KVPointers
    L: int
    idx: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    write_slots: torch.Tensor | None = None
    lo: int = 0
    write_pos: int = -1


class DecoderLayers:
    """Every decoder layer of a Llama-family model's decode step in one native call
    (decode.c ``memra_decoder_layers``): the same kernels, order and roundings as the
    layer-by-layer native path, so the same bits, without ~8 ctypes calls and the Python between
    them per layer (smollm2-135m: ~250 calls a token).

    Args:
        layers: the decoder layers, in order; all with one hidden size, one compute dtype.
        dtype: torch.bfloat16 (int8 activations) or torch.float32 (every weight packed exact).
    Raises: ValueError for weights of the other mode, mismatched sizes, or a shape the kernels
        do not take.
    """

    def __init__(self, layers: list[DecoderLayer], dtype: torch.dtype):
        if not layers:
            raise ValueError("DecoderLayers: no layers")
        if dtype not in _FLOATS:
            raise ValueError(f"DecoderLayers: dtype must be fp32 or bf16, got {dtype}")
        self.layers, self.dtype = layers, dtype
        self.hidden = layers[0].attn_norm.shape[0]
        exact = dtype == torch.float32
        for i, ly in enumerate(layers):
            H, KV, D, Dm = ly.num_heads, ly.num_kv_heads, ly.head_dim, self.hidden
            checks = {
                "norm weights fp32 [hidden]": all(t.dtype == torch.float32 and t.shape == (Dm,) and t.is_contiguous()
                                                  for t in (ly.attn_norm, ly.ffn_norm)),
                "qkv [(H + 2 KV) D, hidden]": ly.qkv.n == (H + 2 * KV) * D and ly.qkv.k == Dm,
                "o [hidden, H D]": ly.o.n == Dm and ly.o.k == H * D,
                "gate_up [2 I, hidden], down [hidden, I]": ly.gate_up.n % 2 == 0 and ly.gate_up.k == Dm
                and ly.down.n == Dm and ly.down.k == ly.gate_up.n // 2,
                f"every weight packed {'exact' if exact else 'fp16'}": all(
                    w.exact == exact for w in (ly.qkv, ly.o, ly.gate_up, ly.down)),
                "qkv bias fp32 [(H + 2 KV) D]": ly.qkv_bias is None or (
                    ly.qkv_bias.dtype == torch.float32 and ly.qkv_bias.shape == (ly.qkv.n,)
                    and ly.qkv_bias.is_contiguous()),
                "heads: KV divides H, even rotary_dim <= head_dim": KV > 0 and H % KV == 0
                and 0 <= ly.rotary_dim <= D and ly.rotary_dim % 2 == 0,
                "SwiGLU clamp >= 0": ly.limit is None or ly.limit >= 0,
            }
            bad = [what for what, ok in checks.items() if not ok]
            if bad:
                raise ValueError(f"DecoderLayers: layer {i}: expected {'; '.join(bad)}")
        self.rotary_dim = layers[0].rotary_dim
        if any(ly.rotary_dim != self.rotary_dim for ly in layers):
            raise ValueError("DecoderLayers: the layers' rotary_dim differ (one cos/sin table serves them all)")
        self._c = (_CLayer * len(layers))(*[
            _CLayer(_clinear(ly.qkv, ly.qkv_bias), _clinear(ly.o, None), _clinear(ly.gate_up, None),
                    _clinear(ly.down, None), ly.attn_norm.data_ptr(), ly.ffn_norm.data_ptr(), ly.attn_eps, ly.ffn_eps,
                    ly.scale, _NAN if ly.limit is None else ly.limit, ly.num_heads, ly.num_kv_heads, ly.head_dim,
                    ly.rotary_dim, ly.cache_index) for ly in layers])
        self._checked: KVPointers | None = None  # the last caches whose geometry was checked (held: ids stay unique)

    def _check(self, p: KVPointers) -> None:
        if p is self._checked:
            return
        for i, ly in enumerate(self.layers):
            ci = ly.cache_index
            got = p.geometry[ci] if 0 <= ci < len(p.geometry) else None
            if got != (ly.num_kv_heads, ly.head_dim):
                raise ValueError(f"DecoderLayers: layer {i} needs cache slot {ci} of [S, {ly.num_kv_heads}, "
                                 f"{ly.head_dim}], the cache has {got}")
        self._checked = p

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 kv: NativeKV) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers on the residual stream (memra/models/base.py ``CausalLM``'s form).

        Args:
            x: [T, hidden] in ``dtype``, T the step's sequences (one token each): the embeddings
                (``residual`` None) or the pending sublayer output.
            residual: fp32 [T, hidden] or None (not modified).
            cos, sin: [T, rotary_dim] of one dtype (fp32 or bf16).
            kv: the step's addressing (:class:`NativeKV`).
        Returns (x', residual'): the last layer's MLP output [T, hidden] in ``dtype`` and the
        stream before it, fp32 [T, hidden]. Raises: ValueError for shapes, dtypes or caches it does
        not take, or a slot or length out of range (found before any cache is written);
        RuntimeError if scratch could not be allocated.
        """
        lib = _need(x, residual, cos, sin)
        T, Dm = x.shape
        rot = self.rotary_dim
        if not (x.dtype == self.dtype and Dm == self.hidden and T >= 1
                and (residual is None or (residual.dtype == torch.float32 and residual.shape == x.shape))
                and cos.shape == sin.shape == (T, rot) and cos.dtype == sin.dtype and cos.dtype in _FLOATS
                and (kv.idx is None or (kv.idx.dtype == torch.int64 and kv.idx.dim() == 2 and kv.idx.shape[0] == T
                                        and kv.idx.shape[1] == kv.L and kv.lens is not None
                                        and kv.lens.dtype == torch.int64 and kv.lens.shape == (T,)))
                and (kv.write_slots is not None and kv.write_slots.dtype == torch.int64
                     and kv.write_slots.shape == (T,) or (kv.write_slots is None and T == 1 and kv.write_pos >= 0))):
            raise ValueError(f"DecoderLayers: x {self.dtype} [T, {self.hidden}] (got {x.dtype} {tuple(x.shape)}), "
                             f"residual fp32 like x, cos/sin [T, {rot}] of one dtype (got {cos.dtype} "
                             f"{tuple(cos.shape)}), one write slot and an idx row per sequence")
        self._check(kv.pointers)
        S = kv.pointers.S
        out = x.clone(memory_format=torch.contiguous_format)
        s = torch.empty(T, Dm, dtype=torch.float32)
        if residual is not None:
            s.copy_(residual)
        cos, sin = cos.contiguous(), sin.contiguous()
        idx = None if kv.idx is None else kv.idx.contiguous()
        lens = None if kv.lens is None else kv.lens.contiguous()
        ws = None if kv.write_slots is None else kv.write_slots.contiguous()
        rc = lib.memra_decoder_layers(self._c, len(self.layers), T, Dm, self.dtype == torch.bfloat16, out.data_ptr(),
                                      s.data_ptr(), residual is not None, cos.data_ptr(), sin.data_ptr(),
                                      cos.dtype == torch.bfloat16, kv.pointers.k, kv.pointers.v, S,
                                      None if idx is None else idx.data_ptr(), kv.lo, kv.L,
                                      None if lens is None else lens.data_ptr(), None if ws is None else ws.data_ptr(),
                                      kv.write_pos, torch.get_num_threads())
        _attention_rc(rc, "DecoderLayers", kv.L, S)
        return out, s
