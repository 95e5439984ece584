"""Reference dequantization (and two reference quantizers) for ggml block formats.

Every function here is plain, vectorised torch: no Python loop runs over blocks, and
only device-agnostic ops are used, so the same code runs on CPU and CUDA tensors.
These are the references the fast kernels are tested against.

Byte layouts follow ggml's ``ggml-common.h`` block structs and the dequantize_row_*
functions of ``ggml-quants.c`` (summarised in shared/FORMATS.md). The oracle is the
``gguf`` package's numpy implementation (``gguf.quants``): results are bit-identical to
``gguf.quants.dequantize`` in float32 because every value is computed with the same
float32 operations in the same order (fp16 -> fp32 conversions are exact; ``d * q`` with
small integer ``q`` is a single rounded product, and the types with a minimum compute
``(d * q) + m`` / ``(d * sc) * q - (dmin * m)`` as two separately rounded steps, as
gguf does). ggml's C code writes the same expressions; a C compiler that contracts them
into fused multiply-adds can differ from gguf (and from us) by one ulp on Q4_1, Q5_1,
Q4_K and Q5_K values. We follow gguf, the oracle named in DESIGN.md.
"""

from __future__ import annotations

import torch

from .types import QTYPE_INFO, QType, UnsupportedQTypeError

__all__ = [
    "AFFINE32_BITS",
    "q6_k_parts",
    "affine32",
    "dequantize_blocks",
    "quantize_q8_0",
    "quantize_nvfp4",
    "ue4m3_half_table",
    "NVFP4_KVALUES",
]

QK_K = 256  # super-block size of the k-quants (ggml-common.h)

# E2M1 values doubled, indexed by the 4-bit code (ggml ``kvalues_mxfp4``): bit 3 is the
# sign, bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (times 2).
NVFP4_KVALUES: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

_FP16_MAX = 65504.0
_UE4M3_MAX = 448.0


def _ue4m3_half(code: int) -> float:
    """ggml ``ggml_ue4m3_to_fp32`` for one byte: the UE4M3 value times 0.5.

    Unsigned E4M3 with exponent bias 7: exponent bits 3-6, mantissa bits 0-2; bit 7 is
    ignored except that the bytes 0x00 and 0x7F decode to 0 (0x7F is E4M3's NaN).
    The factor 0.5 undoes the doubling of :data:`NVFP4_KVALUES`. All 256 results are
    exactly representable in float32 (computed here in float64, exactly).
    """
    if code in (0x00, 0x7F):
        return 0.0
    exp = (code >> 3) & 0xF
    man = code & 0x7
    raw = man * 2.0**-9 if exp == 0 else (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return raw * 0.5


_UE4M3_HALF = tuple(_ue4m3_half(c) for c in range(256))


def ue4m3_half_table(device: torch.device | str | None = None) -> torch.Tensor:
    """float32 [256] table: byte -> ``ggml_ue4m3_to_fp32(byte)`` (UE4M3 value * 0.5).

    Source: ``ggml_ue4m3_to_fp32`` in ggml ``ggml-impl.h``.
    """
    return torch.tensor(_UE4M3_HALF, dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------
# helpers


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, as float32 [n_blocks, 1] (exact)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Low and high 4-bit halves of uint8 bytes (same shape, uint8)."""
    return qs & 0x0F, qs >> 4


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """Bits of uint8 bytes, little-endian: [..., k] -> [..., k, 8] (uint8 0/1)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return (qh.unsqueeze(-1) >> shifts) & 1


# ---------------------------------------------------------------------------------------
# plain types


def _dequant_f32(raw: torch.Tensor) -> torch.Tensor:
    """F32 (ggml type 0): 4 little-endian bytes per weight, reinterpreted (a view of raw)."""
    return raw.view(torch.float32)


def _dequant_f16(raw: torch.Tensor) -> torch.Tensor:
    """F16 (ggml type 1): IEEE binary16 per weight, widened exactly to float32."""
    return raw.view(torch.float16).to(torch.float32)


def _dequant_bf16(raw: torch.Tensor) -> torch.Tensor:
    """BF16 (ggml type 30): the upper 16 bits of a float32 (``ggml_compute_bf16_to_fp32``).

    Done with integer shifts so every bit pattern (NaN payloads included) is kept.
    """
    return (raw.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


# ---------------------------------------------------------------------------------------
# 32-weight block types


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 (ggml type 2), ``block_q4_0`` in ggml-common.h: 18 bytes / 32 weights.

    Layout: fp16 d; u8 qs[16] (low nibble of qs[j] is element j, high nibble element
    j + 16). Value: ``d * (q - 8)`` (``dequantize_row_q4_0``).
    """
    d = _f16(blocks, 0)
    lo, hi = _nibbles(blocks[:, 2:18])
    q = torch.cat([lo, hi], dim=1).to(torch.float32) - 8.0
    return d * q


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 (ggml type 3), ``block_q4_1``: 20 bytes / 32 weights.

    Layout: fp16 d, fp16 m; u8 qs[16] (low nibbles elements 0-15, high nibbles 16-31).
    Value: ``(d * q) + m``, two rounded float32 steps (``dequantize_row_q4_1``, gguf).
    """
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    lo, hi = _nibbles(blocks[:, 4:20])
    q = torch.cat([lo, hi], dim=1).to(torch.float32)
    return d * q + m


def _q5_high_bits(qh4: torch.Tensor) -> torch.Tensor:
    """u8 qh[4] (a little-endian uint32; bit j is the 5th bit of element j) -> [n, 32]."""
    return _bits(qh4).reshape(qh4.shape[0], 32)


def _dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 (ggml type 6), ``block_q5_0``: 22 bytes / 32 weights.

    Layout: fp16 d; u8 qh[4] (bit j of the little-endian uint32 is bit 4 of element j);
    u8 qs[16] (low nibbles elements 0-15, high nibbles 16-31). Value: ``d * (q - 16)``
    (``dequantize_row_q5_0``).
    """
    d = _f16(blocks, 0)
    hb = _q5_high_bits(blocks[:, 2:6])
    lo, hi = _nibbles(blocks[:, 6:22])
    q = torch.cat([lo, hi], dim=1) | (hb << 4)
    return d * (q.to(torch.float32) - 16.0)


def _dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1 (ggml type 7), ``block_q5_1``: 24 bytes / 32 weights.

    Layout: fp16 d, fp16 m; u8 qh[4] (5th bits, as Q5_0); u8 qs[16].
    Value: ``(d * q) + m`` (``dequantize_row_q5_1``).
    """
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    hb = _q5_high_bits(blocks[:, 4:8])
    lo, hi = _nibbles(blocks[:, 8:24])
    q = torch.cat([lo, hi], dim=1) | (hb << 4)
    return d * q.to(torch.float32) + m


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 (ggml type 8), ``block_q8_0``: 34 bytes / 32 weights.

    Layout: fp16 d; int8 qs[32]. Value: ``d * q`` (``dequantize_row_q8_0``).
    """
    d = _f16(blocks, 0)
    q = blocks[:, 2:34].view(torch.int8).to(torch.float32)
    return q * d


# ---------------------------------------------------------------------------------------
# k-quants: 256-weight super-blocks


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12 scale bytes of Q4_K/Q5_K into 8 six-bit scales and 8 six-bit mins.

    ``get_scale_min_k4`` in ggml-quants.c: for sub-block j < 4, scale = s[j] & 63 and
    min = s[j + 4] & 63; for j >= 4, scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4)
    and min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4). Returns two uint8 [n, 8].
    """
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]  # bytes 0-3, 4-7, 8-11
    sc = torch.cat([a & 63, (c & 0x0F) | ((a >> 6) << 4)], dim=1)
    mn = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return sc, mn


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K (ggml type 12), ``block_q4_K``: 144 bytes / 256 weights.

    Layout: fp16 d, fp16 dmin; u8 scales[12] (8 sub-blocks of 32: six-bit scale and
    min, see :func:`_k_scale_min`); u8 qs[128]: each 32-byte chunk c holds sub-block 2c
    in its low nibbles and sub-block 2c + 1 in its high nibbles.
    Value: ``(d * sc) * q - (dmin * m)`` (``dequantize_row_q4_K``).
    """
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).unsqueeze(-1)  # [n, 8, 1]
    ml = (dmin * mn.to(torch.float32)).unsqueeze(-1)
    qs = blocks[:, 16:144].reshape(n, 4, 1, 32)
    lo, hi = _nibbles(qs)
    q = torch.cat([lo, hi], dim=2).reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K (ggml type 13), ``block_q5_K``: 176 bytes / 256 weights.

    Layout: fp16 d, fp16 dmin; u8 scales[12] (as Q4_K); u8 qh[32] (bit i of qh[l] is
    the 5th bit of element l of sub-block i); u8 qs[128] (nibbles as Q4_K).
    Value: ``(d * sc) * q - (dmin * m)`` (``dequantize_row_q5_K``).
    """
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    dl = (d * sc.to(torch.float32)).unsqueeze(-1)
    ml = (dmin * mn.to(torch.float32)).unsqueeze(-1)
    qh = _bits(blocks[:, 16:48]).transpose(1, 2)  # [n, 8 (sub-block), 32]
    lo, hi = _nibbles(blocks[:, 48:176].reshape(n, 4, 1, 32))
    ql = torch.cat([lo, hi], dim=2).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K (ggml type 14), ``block_q6_K``: 210 bytes / 256 weights.

    Layout: u8 ql[128] (low 4 bits), u8 qh[64] (high 2 bits), int8 scales[16] (one
    per 16 weights), fp16 d. Each half h of 128 weights uses ql[64h .. 64h + 63] and
    qh[32h .. 32h + 31]: element l (0-31) of quarter k (0-3) has low bits from the low
    nibble of ql[l + 32 (k % 2)] for k < 2, the high nibble for k >= 2, and high bits
    (qh[l] >> 2k) & 3. Value: ``(d * scale) * (q - 32)`` (``dequantize_row_q6_K``).
    """
    n = blocks.shape[0]
    q, ds = _q6_k_codes(blocks)
    return (ds.unsqueeze(-1) * q.to(torch.float32)).reshape(n, QK_K)


def _q6_k_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks [n, 210] -> (signed codes q - 32, int8 [n, 16, 16]; d * scale fp32 [n, 16])."""
    n = blocks.shape[0]
    d = _f16(blocks, 208)
    ds = d * blocks[:, 192:208].view(torch.int8).to(torch.float32)  # [n, 16]
    lo, hi = _nibbles(blocks[:, 0:128].reshape(n, 2, 1, 64))
    ql = torch.cat([lo, hi], dim=2).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).reshape(1, 1, 4, 1)
    qh = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).to(torch.int8)
    return q.reshape(n, 16, 16), ds


def q6_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K raw bytes (uint8, whole 210-byte blocks) -> (codes int8 [n] in -32 .. 31, scale fp32
    [n / 16]) with weight i equal to ``scale[i // 16] * codes[i]`` (``dequantize_row_q6_K``).

    Raises: ValueError for anything but 1-D uint8 whole blocks."""
    size = QTYPE_INFO[QType.Q6_K].type_size
    if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() % size:
        raise ValueError(f"q6_k_parts: raw must be 1-D uint8 whole {size}-byte blocks, got {raw.dtype} "
                         f"{tuple(raw.shape)}")
    q, ds = _q6_k_codes(raw.contiguous().view(-1, size))
    return q.reshape(-1), ds.reshape(-1)


# ---------------------------------------------------------------------------------------
# NVFP4


def _dequant_nvfp4(blocks: torch.Tensor) -> torch.Tensor:
    """NVFP4 (ggml type 40), ``block_nvfp4``: 36 bytes / 64 weights.

    Layout: u8 d[4] (one UE4M3 scale per 16-weight sub-block); u8 qs[32]: sub-block s
    uses qs[8s .. 8s + 7], the low nibble of qs[8s + j] is element 16s + j and the high
    nibble element 16s + j + 8. Value: ``kvalues_mxfp4[code] * ggml_ue4m3_to_fp32(d[s])``
    (doubled E2M1 times half the scale: exact) (``dequantize_row_nvfp4``).
    """
    n = blocks.shape[0]
    scale = ue4m3_half_table(blocks.device)[blocks[:, 0:4].long()].unsqueeze(-1)  # [n, 4, 1]
    lo, hi = _nibbles(blocks[:, 4:36].reshape(n, 4, 8))
    codes = torch.cat([lo, hi], dim=2)  # [n, 4, 16]
    kv = torch.tensor(NVFP4_KVALUES, dtype=torch.float32, device=blocks.device)
    return (scale * kv[codes.long()]).reshape(n, 64)


_BLOCK_FNS = {
    QType.Q4_0: _dequant_q4_0,
    QType.Q4_1: _dequant_q4_1,
    QType.Q5_0: _dequant_q5_0,
    QType.Q5_1: _dequant_q5_1,
    QType.Q8_0: _dequant_q8_0,
    QType.Q4_K: _dequant_q4_k,
    QType.Q5_K: _dequant_q5_k,
    QType.Q6_K: _dequant_q6_k,
    QType.NVFP4: _dequant_nvfp4,
}
_PLAIN_FNS = {QType.F32: _dequant_f32, QType.F16: _dequant_f16, QType.BF16: _dequant_bf16}


def _as_qtype(qtype: object) -> QType:
    try:
        return QType(int(qtype))  # accepts QType, gguf.GGMLQuantizationType and ints
    except (TypeError, ValueError):
        supported = ", ".join(t.name for t in QType)
        raise UnsupportedQTypeError(
            f"dequantize_blocks: type {qtype!r} is not supported; supported types: {supported}"
        ) from None


def dequantize_blocks(raw: torch.Tensor, qtype: QType) -> torch.Tensor:
    """Dequantize whole ggml blocks to float32.

    Args:
        raw: uint8 [n_blocks * type_size], the blocks back to back as stored in GGUF
            (any device; non-contiguous or misaligned input is copied first).
        qtype: the block format (:class:`QType`, a ``gguf.GGMLQuantizationType`` or the
            ggml type id).

    Returns:
        float32 [n_blocks * block_size] on ``raw.device``, values in storage order.
        For F32 the result is a view of ``raw``'s memory (no copy).

    Raises:
        ValueError: ``raw`` is not a 1-D uint8 tensor, or its length is not a whole
            number of blocks (the message names the type, the length and the block bytes).
        UnsupportedQTypeError (a ValueError): a type memra does not dequantize.

    Source: ggml ``ggml-common.h`` / ``ggml-quants.c`` (per-type docstrings below);
    bit-identical to ``gguf.quants.dequantize`` (see the module docstring).
    """
    qt = _as_qtype(qtype)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
        what = f"{raw.dtype} tensor of shape {tuple(raw.shape)}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise ValueError(f"dequantize_blocks({qt.name}): raw must be a 1-D uint8 tensor, got {what}")
    info = QTYPE_INFO[qt]
    if raw.numel() % info.type_size:
        raise ValueError(
            f"dequantize_blocks({qt.name}): raw length {raw.numel()} bytes is not a whole number "
            f"of {info.type_size}-byte blocks ({info.block_size} weights each)"
        )
    if not raw.is_contiguous() or raw.storage_offset() % 4:
        raw = raw.clone(memory_format=torch.contiguous_format)  # dtype views need stride 1, aligned start
    if qt in _PLAIN_FNS:
        return _PLAIN_FNS[qt](raw)
    blocks = raw.reshape(-1, info.type_size)
    return _BLOCK_FNS[qt](blocks).reshape(-1)


# ---------------------------------------------------------------------------------------
# codes and per-32 affine parameters (what a group-wise integer kernel reads)

#: Formats whose every 32 consecutive weights share one affine map ``w = scale * q + offset`` of
#: unsigned integer codes ``q``, with the codes' bit width: the ones a group-32 integer kernel can
#: read without dequantizing (Q6_K, Q2_K, Q3_K have 16-weight groups; NVFP4 is not affine).
AFFINE32_BITS: dict[QType, int] = {QType.Q4_0: 4, QType.Q4_1: 4, QType.Q5_0: 5, QType.Q5_1: 5, QType.Q8_0: 8,
                                   QType.Q4_K: 4, QType.Q5_K: 5}


def affine32(raw: torch.Tensor, qtype: QType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split blocks of an :data:`AFFINE32_BITS` format into codes and per-32 affine parameters.

    Args:
        raw: uint8 blocks as :func:`dequantize_blocks` takes them (n weights in all, n % 32 == 0).
        qtype: the format.
    Returns:
        (codes uint8 [n] in 0 .. 2**bits - 1, scale fp32 [n / 32], offset fp32 [n / 32]) with weight
        i equal to ``scale[i // 32] * codes[i] + offset[i // 32]``: Q4_0 ``d (q - 8)`` -> (d, -8 d);
        Q5_0 ``d (q - 16)`` -> (d, -16 d); Q8_0 ``d q`` with signed q -> codes q + 128, (d, -128 d);
        Q4_1 / Q5_1 ``d q + m`` -> (d, m); Q4_K / Q5_K ``(d sc) q - dmin m`` per 32-weight
        sub-block -> (d sc, -dmin m). Same layouts as the dequantizers above; the values equal
        theirs up to one fp32 rounding of the offset products.
    Raises:
        UnsupportedQTypeError: a format not in :data:`AFFINE32_BITS`; ValueError as dequantize_blocks.
    """
    qt = _as_qtype(qtype)
    if qt not in AFFINE32_BITS:
        raise UnsupportedQTypeError(f"affine32: {qt.name} has no per-32 affine form (supported: "
                                    f"{', '.join(t.name for t in AFFINE32_BITS)})")
    info = QTYPE_INFO[qt]
    if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() % info.type_size:
        raise ValueError(f"affine32({qt.name}): raw must be 1-D uint8 whole {info.type_size}-byte blocks, got "
                         f"{raw.dtype} {tuple(raw.shape)}")
    b = raw.contiguous().reshape(-1, info.type_size)
    n = b.shape[0]
    if qt in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0):
        d = _f16(b, 0)
        if qt == QType.Q8_0:
            q = (b[:, 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            return q.reshape(-1), d.reshape(-1), (-128.0 * d).reshape(-1)
        off = {QType.Q4_0: 2, QType.Q4_1: 4, QType.Q5_0: 6, QType.Q5_1: 8}[qt]
        lo, hi = _nibbles(b[:, off:off + 16])
        q = torch.cat([lo, hi], dim=1)
        if qt in (QType.Q5_0, QType.Q5_1):
            q = q | (_q5_high_bits(b[:, off - 4:off]) << 4)
        m = _f16(b, 2) if qt in (QType.Q4_1, QType.Q5_1) else -(8.0 if qt == QType.Q4_0 else 16.0) * d
        return q.reshape(-1), d.reshape(-1), m.reshape(-1)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = d * sc.to(torch.float32)  # [n, 8]
    offset = -(dmin * mn.to(torch.float32))
    qs = b[:, 16:144] if qt == QType.Q4_K else b[:, 48:176]
    lo, hi = _nibbles(qs.reshape(n, 4, 1, 32))
    q = torch.cat([lo, hi], dim=2).reshape(n, 8, 32)
    if qt == QType.Q5_K:
        q = q | (_bits(b[:, 16:48]).transpose(1, 2) << 4)
    return q.reshape(-1), scale.reshape(-1), offset.reshape(-1)


# ---------------------------------------------------------------------------------------
# reference quantizers


def _as_blocks(w: torch.Tensor, block: int, name: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError(f"{name}: w must be a floating-point tensor, got {type(w).__name__} {getattr(w, 'dtype', '')}")
    if w.dim() == 0 or w.shape[-1] % block:
        raise ValueError(
            f"{name}: last dimension of shape {tuple(w.shape)} must be a positive multiple of {block}"
        )
    x = w.to(torch.float32).reshape(-1, block)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: w contains NaN or Inf")
    return x


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: nearest integer, halves away from zero (exact in float32)."""
    a = v.abs()
    f = torch.floor(a)
    r = f + (a - f >= 0.5).to(a.dtype)  # a - f is exact for a < 2^24
    return torch.copysign(r, v)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """Quantize to Q8_0 blocks with ggml's reference rounding.

    Per 32 weights: ``d = amax / 127``, ``q = roundf(x * (1 / d))`` (halves away from
    zero), d stored as fp16 (round to nearest even). Byte-identical to
    ``quantize_row_q8_0_ref`` (ggml-quants.c) and ``gguf.quants.quantize(..., Q8_0)``.

    Args:
        w: float tensor [..., K], K a multiple of 32 (any float dtype; taken to float32).

    Returns:
        uint8 [..., K // 32 * 34] on ``w.device`` (``block_q8_0`` structs, row by row);
        ``.reshape(-1, K // 32 * 34)`` is a :class:`~memra.quant.tensor.QTensor`'s data.

    Raises:
        ValueError: not a float tensor, K not a multiple of 32, NaN/Inf in ``w``, or a
            block whose scale overflows fp16 (``amax / 127 > 65504``): nothing is clamped.
    """
    x = _as_blocks(w, 32, "quantize_q8_0")
    amax = x.abs().amax(dim=1, keepdim=True)
    d = amax / 127.0
    if bool((d > _FP16_MAX).any()):
        raise ValueError(
            f"quantize_q8_0: a block's absolute max {float(amax.max())} gives a scale above the "
            f"fp16 maximum {_FP16_MAX} (values must be below {_FP16_MAX * 127})"
        )
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = _round_half_away(x * inv).to(torch.int8)
    d16 = d.to(torch.float16).view(torch.uint8)  # [n, 2] little-endian fp16
    out = torch.cat([d16, q.view(torch.uint8)], dim=1)
    return out.reshape(*w.shape[:-1], w.shape[-1] // 32 * 34)


def _fp32_to_ue4m3(x: torch.Tensor) -> torch.Tensor:
    """ggml ``ggml_fp32_to_ue4m3`` (ggml-impl.h), vectorised: float32 -> uint8 code.

    Non-positive -> 0; clamps at 448; subnormals round half up via ``int(x*512 + 0.5)``;
    normals round half up on the 4th mantissa bit; exponent >= 15 saturates to 0x7E.
    """
    x = torch.clamp(x, max=_UE4M3_MAX)
    bits = x.contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + 7
    man = (bits >> 20) & 0x7
    man = man + ((bits >> 19) & 1)
    carry = man > 7
    man = torch.where(carry, torch.zeros_like(man), man)
    e_n = torch.where(carry, e + 1, e)
    normal = torch.where(e_n >= 15, torch.full_like(e_n, 0x7E), (e_n << 3) | man)
    sub = torch.clamp((x * 512.0 + 0.5).to(torch.int32), max=7)  # < 1 gives 0 anyway
    code = torch.where(e <= 0, sub, normal)
    code = torch.where(x > 0, code, torch.zeros_like(code))
    return code.to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor, *, chunk_blocks: int = 16384) -> torch.Tensor:
    """Quantize to ggml NVFP4 blocks with ggml's reference rounding.

    Per 16-weight sub-block (``quantize_row_nvfp4_ref``, ggml-quants.c): scale byte
    ``ue = ggml_fp32_to_ue4m3(amax / 6)``; each weight gets the code i in 0..15 that
    minimises ``|kvalues_mxfp4[i] * ggml_ue4m3_to_fp32(ue) - x|`` (first i on ties);
    codes packed as in :func:`_dequant_nvfp4`. The ``gguf`` package has no NVFP4
    quantizer; tests check this against a scalar port of the C reference.

    As in ggml: sub-blocks whose ``amax / 6`` is below half the smallest UE4M3 step
    (2^-10) quantize to zero, and subnormal scales cap their mantissa at 7, so
    ``amax / 6`` in [7.5, 8) * 2^-9 gets the scale 7 * 2^-9 and its largest values
    clip to 6 times that.

    Args:
        w: float tensor [..., K], K a multiple of 64 (taken to float32).
        chunk_blocks: blocks processed per step (bounds the [chunk, 64, 16] temporaries).

    Returns:
        uint8 [..., K // 64 * 36] on ``w.device``.

    Raises:
        ValueError: not a float tensor, K not a multiple of 64, NaN/Inf in ``w``, or a
            sub-block with ``amax / 6 > 448`` (its scale would be clamped).
    """
    x = _as_blocks(w, 64, "quantize_nvfp4")
    dev = x.device
    lut = ue4m3_half_table(dev)
    kv = torch.tensor(NVFP4_KVALUES, dtype=torch.float32, device=dev)
    out = []
    for start in range(0, x.shape[0], chunk_blocks):
        xb = x[start : start + chunk_blocks].reshape(-1, 4, 16)  # [n, sub-block, 16]
        s = xb.abs().amax(dim=2) / 6.0  # [n, 4]
        if bool((s > _UE4M3_MAX).any()):
            raise ValueError(
                f"quantize_nvfp4: a sub-block's absolute max {float(s.max()) * 6} exceeds the "
                f"largest NVFP4 magnitude {6 * _UE4M3_MAX} (6 * 448); the scale would be clamped"
            )
        ue = _fp32_to_ue4m3(s)
        d = lut[ue.long()].unsqueeze(-1).unsqueeze(-1)  # [n, 4, 1, 1]
        err = (kv * d - xb.unsqueeze(-1)).abs()  # [n, 4, 16, 16 codes]
        code = torch.argmin(err, dim=-1).to(torch.uint8)  # first minimum, as ggml's strict <
        qs = code[:, :, 0:8] | (code[:, :, 8:16] << 4)  # [n, 4, 8]
        out.append(torch.cat([ue, qs.reshape(-1, 32)], dim=1))
    blocks = torch.cat(out, dim=0) if out else torch.empty(0, 36, dtype=torch.uint8, device=dev)
    return blocks.reshape(*w.shape[:-1], w.shape[-1] // 64 * 36)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """Quantize to Q4_K blocks (ggml type 12) with a simple min/max encoder.

    Per 256-weight super-block, per 32-weight sub-block j: ``lo_j = min(0, min x)``,
    ``step_j = (max x - lo_j) / 15``; the super-block scales are ``d = max_j step_j / 63`` and
    ``dmin = max_j (-lo_j) / 63`` (stored fp16, the codes computed from the fp16 values);
    six-bit ``sc_j = round(step_j / d)``, ``m_j = round(-lo_j / dmin)``, and each weight gets
    ``q = clamp(round((x + dmin * m_j) / (d * sc_j)), 0, 15)``. Packing as
    :func:`_dequant_q4_k` reads it (``get_scale_min_k4`` layout, sub-blocks 2c / 2c + 1 in the
    low / high nibbles of 32-byte chunk c). This is a valid block stream but *not*
    byte-identical to llama.cpp's ``quantize_row_q4_K_ref`` (which searches each sub-block's
    scale and min iteratively, ``make_qkx2_quants``); its error is a little larger. Tests
    check it against ``gguf.quants.dequantize`` (the ``gguf`` package has no Q4_K quantizer).

    Args:
        w: float tensor [..., K], K a multiple of 256 (taken to float32).

    Returns:
        uint8 [..., K // 256 * 144] on ``w.device``.

    Raises:
        ValueError: not a float tensor, K not a multiple of 256, NaN/Inf in ``w``, or a
            super-block whose scale overflows fp16.
    """
    x = _as_blocks(w, QK_K, "quantize_q4_k").reshape(-1, 8, 32)
    n = x.shape[0]
    lo = x.amin(dim=2).clamp(max=0.0)  # [n, 8]
    step = (x.amax(dim=2) - lo) / 15.0
    d = (step.amax(dim=1) / 63.0)
    dmin = ((-lo).amax(dim=1) / 63.0)
    if bool((d > _FP16_MAX).any() or (dmin > _FP16_MAX).any()):
        raise ValueError("quantize_q4_k: a super-block's scale exceeds the fp16 maximum")
    d16, dmin16 = d.to(torch.float16), dmin.to(torch.float16)
    df, dminf = d16.float().unsqueeze(1), dmin16.float().unsqueeze(1)  # [n, 1]
    sc = torch.where(df > 0, _round_half_away(step / torch.where(df > 0, df, 1.0)), 0.0).clamp(0, 63)
    mq = torch.where(dminf > 0, _round_half_away(-lo / torch.where(dminf > 0, dminf, 1.0)), 0.0).clamp(0, 63)
    scale = (df * sc).unsqueeze(-1)  # [n, 8, 1]
    offs = (dminf * mq).unsqueeze(-1)
    q = torch.where(scale > 0, _round_half_away((x + offs) / torch.where(scale > 0, scale, 1.0)), 0.0)
    q = q.clamp(0, 15).to(torch.uint8).reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    sc8, m8 = sc.to(torch.uint8), mq.to(torch.uint8)
    scales = torch.cat([sc8[:, :4] | ((sc8[:, 4:] >> 4) << 6),  # bytes 0-3
                        m8[:, :4] | ((m8[:, 4:] >> 4) << 6),  # bytes 4-7
                        (sc8[:, 4:] & 0x0F) | ((m8[:, 4:] & 0x0F) << 4)], dim=1)  # bytes 8-11
    out = torch.cat([d16.view(torch.uint8).reshape(n, 2), dmin16.view(torch.uint8).reshape(n, 2), scales, qs], dim=1)
    return out.reshape(*w.shape[:-1], w.shape[-1] // QK_K * 144)
