"""Decode linear kernels (memra/kernels/gemv.py) against their torch reference.

CPU (CI): the Triton kernel runs under the interpreter (TRITON_INTERPRET=1) at tiny shapes
with fp16/fp32 activations (the interpreter's tl.dot is wrong on bf16: shared/GPU.md).
GPU (``-m gpu``, the H200): the flagship's real shapes, bf16 activations, every format and
T = 1, 2, 4, 8, 16, with the launch configurations the kernels pick by default.
Random data everywhere (never zeros).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before memra.kernels._gemv_triton is imported

from memra.kernels.gemv import (  # noqa: E402
    DecodeWeight,
    GemvConfig,
    decode_linear,
    decode_linear_ref,
    dequantize_packed,
    pack_bf16,
    pack_fp8,
    pack_nvfp4,
    pack_q8_0,
    pack_weight,
)
from memra.quant.dequant import quantize_nvfp4, quantize_q8_0  # noqa: E402
from memra.quant.fp8 import quantize_fp8_block  # noqa: E402
from memra.quant.tensor import QTensor  # noqa: E402
from memra.quant.types import QType  # noqa: E402

triton = pytest.importorskip("triton")


def _weights(n: int, k: int, seed: int = 0) -> dict[str, DecodeWeight]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    return {
        "bf16": pack_bf16(w),
        "fp8": pack_fp8(quantize_fp8_block(w, name="w")),
        "q8_0": pack_q8_0(QTensor("w", QType.Q8_0, (n, k), quantize_q8_0(w).reshape(n, -1))),
        "nvfp4": pack_nvfp4(QTensor("w", QType.NVFP4, (n, k), quantize_nvfp4(w).reshape(n, -1))),
    }


# ---------------------------------------------------------------------------------------
# load-time repacking (torch only)


def test_repack_is_exact():
    n, k = 24, 256
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g) * 3
    q8 = QTensor("q", QType.Q8_0, (n, k), quantize_q8_0(w).reshape(n, -1))
    fp4 = QTensor("f", QType.NVFP4, (n, k), quantize_nvfp4(w).reshape(n, -1))
    fp8 = quantize_fp8_block(w, name="e")
    assert torch.equal(dequantize_packed(pack_weight(q8)), q8.dequantize())
    assert torch.equal(dequantize_packed(pack_weight(fp4)), fp4.dequantize())
    assert torch.equal(dequantize_packed(pack_weight(fp8)), fp8.dequantize())
    assert torch.equal(dequantize_packed(pack_weight(w)), w.to(torch.bfloat16).float())
    p = pack_nvfp4(fp4)
    assert p.nbytes == fp4.nbytes and pack_q8_0(q8).nbytes == q8.nbytes


def test_nvfp4_every_scale_byte_and_code():
    """All 256 UE4M3 bytes (0x00 and 0x7F decode to 0, 0xFF does not) and all 16 codes,
    through the repack, the torch reference and the kernel."""
    n, k = 16, 4096  # 256 sub-blocks per row: one per scale byte
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (n, k // 64, 36), generator=g, dtype=torch.uint8)
    blocks[:, :, 0:4] = torch.arange(256, dtype=torch.uint8).reshape(1, 64, 4)
    qt = QTensor("f", QType.NVFP4, (n, k), blocks.reshape(n, -1))
    p = pack_nvfp4(qt)
    ref = qt.dequantize()
    assert torch.equal(dequantize_packed(p), ref)
    x = torch.randn(1, k, generator=g)
    y = decode_linear(x.to(_DEV), p.to(_DEV), config=GemvConfig(8, 512, 1, False))
    yr = x @ ref.T
    assert float((y.cpu() - yr).abs().max() / yr.abs().max()) < 1e-5


def test_pack_errors():
    with pytest.raises(ValueError, match="Q8_0"):
        pack_q8_0(QTensor("f", QType.F32, (2, 32), torch.randn(2, 32)))
    with pytest.raises(ValueError, match="no decode kernel for Q4_K"):
        pack_weight(QTensor("k", QType.Q4_K, (1, 256), torch.zeros(1, 144, dtype=torch.uint8)))
    with pytest.raises(ValueError, match="2-D float"):
        pack_bf16(torch.randn(3))
    with pytest.raises(ValueError, match=r"scale is torch.float32 \(2, 2\), expected contiguous torch.float16"):
        DecodeWeight("q8_0", 2, 64, torch.zeros(2, 64, dtype=torch.int8), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="unknown format"):
        DecodeWeight("q4_k", 2, 256, torch.zeros(2, 144, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 64"):
        DecodeWeight("nvfp4", 2, 96, torch.zeros(2, 48, dtype=torch.uint8), torch.zeros(2, 6, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------
# the kernel under the interpreter (CPU) or on the GPU at tiny shapes

_DEV = "cuda" if torch.cuda.is_available() else "cpu"
_CPU_X = torch.float16  # interpreter: fp16 activations (its bf16 tl.dot is broken)

_CASES = [
    # (T, config): FMA path at T = 1, 2, 3 (padded to 4), split-K (atomic), tensor-core path
    (1, GemvConfig(8, 64, 1, False)),
    (2, GemvConfig(16, 128, 2, False)),
    (3, GemvConfig(8, 64, 3, False)),
    (1, GemvConfig(16, 64, 1, True)),
    (5, GemvConfig(16, 128, 2, True)),
    (40, GemvConfig(16, 128, 2, True)),  # one 64-column tile (T > 16): W read once
    (64, GemvConfig(32, 64, 1, True)),
    (16, GemvConfig(32, 64, 1, True)),
    (1, GemvConfig(8, 64, 2, False, prefetch=True)),  # register double buffering, split-K
    (4, GemvConfig(16, 128, 1, False, prefetch=True)),
]


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "q8_0", "nvfp4"])
def test_kernel_matches_reference(fmt):
    n, k = 40, 384  # N not a multiple of the row tiles; K not a multiple of bk=256 below
    w = _weights(n, k, seed=3)[fmt].to(_DEV)
    g = torch.Generator().manual_seed(4)
    xdt = torch.bfloat16 if _DEV == "cuda" else _CPU_X
    extra = [(2, GemvConfig(8, 256, 1, False))]
    if fmt == "nvfp4":  # fp16x2 path: EVEN_K and ragged K (bk = 256), split-K, prefetch, T = 3 padded to 4
        extra += [(1, GemvConfig(8, 64, 1, False, f16=True)),
                  (2, GemvConfig(16, 128, 2, False, f16=True, prefetch=True)),
                  (3, GemvConfig(32, 32, 3, False, f16=True, num_warps=8)), (2, GemvConfig(8, 256, 1, False, f16=True)),
                  (1, GemvConfig(64, 256, 2, False, f16=True, prefetch=True))]
    if fmt == "fp8":  # fp16x2 path: ragged K (bk = 256), split-K, prefetch, T = 3 padded to 4, 8 warps
        extra += [(1, GemvConfig(8, 64, 1, False, f16=True)),
                  (2, GemvConfig(16, 128, 2, False, f16=True, prefetch=True)),
                  (3, GemvConfig(32, 16, 3, False, f16=True, num_warps=8)), (2, GemvConfig(8, 256, 1, False, f16=True)),
                  (4, GemvConfig(64, 256, 2, False, f16=True, prefetch=True))]
    for t, cfg in _CASES + extra:
        x = torch.randn(t, k, generator=g).to(xdt).to(_DEV)
        y = decode_linear(x, w, config=cfg)
        yr = decode_linear_ref(x, w)
        rel = float((y - yr).abs().max() / yr.abs().max())
        # exact weights in fp32 FMAs / exact dot operands: rounding of the sums only; dot with
        # code * scale rounded to x's dtype: fp8 block and q8_0 (<= 2^-9 bf16, 2^-11 fp16 each)
        tol = 5e-3 if (cfg.dot and fmt == "q8_0") or (cfg.dot and fmt == "fp8" and cfg.bk > 128) else 1e-5
        if xdt == torch.bfloat16 and cfg.dot:
            tol = max(tol, 1e-4)
        if cfg.f16 and not cfg.dot:  # fp16x2 paths: fp16 sums of 16 products (the interpreter sums in fp32)
            tol = 2e-3
        assert y.shape == (t, n) and y.dtype == torch.float32
        assert rel < tol, (fmt, t, cfg, rel)


@pytest.mark.parametrize("fmt", ["fp8", "q8_0", "nvfp4"])
def test_kernel_default_config(fmt):
    """No tuned entry for this shape: default_config (CUDA cores at T <= 2, fp16x2 for nvfp4 and fp8;
    tensor cores above)."""
    w = _weights(24, 192, seed=7)[fmt].to(_DEV)
    g = torch.Generator().manual_seed(8)
    xdt = torch.bfloat16 if _DEV == "cuda" else _CPU_X
    for t in (1, 3):
        x = torch.randn(t, 192, generator=g).to(xdt).to(_DEV)
        y, yr = decode_linear(x, w), decode_linear_ref(x, w)
        tol = 5e-3 if fmt == "q8_0" and t > 2 else 2e-3 if fmt in ("nvfp4", "fp8") and t <= 2 else 1e-4  # fp16x2
        assert float((y - yr).abs().max() / yr.abs().max()) < tol


def test_pick_config_buckets_above_16(monkeypatch):
    """T > 16: the tuned 32 / 64 bucket when the table has it; else the 16 bucket's entry only if
    it is a tensor-core one (a CUDA-core tile takes T <= 4); else default_config."""
    from memra.kernels import gemv

    c16, c32, c64 = GemvConfig(32, 128, 4, True), GemvConfig(128, 128, 2, True, 8), GemvConfig(64, 64, 1, True)
    fma16 = GemvConfig(16, 256, 1, False)
    table = {"fp8:512:256:16": c16, "fp8:512:256:32": c32, "fp8:512:256:64": c64,
             "fp8:1024:256:16": c16, "fp8:2048:256:16": fma16}
    monkeypatch.setattr(gemv, "load_config_table", lambda path=None: table)
    cpu = torch.device("cpu")
    assert [gemv.pick_config("fp8", 512, 256, t, cpu) for t in (16, 17, 32, 33, 64)] == [c16, c32, c32, c64, c64]
    assert gemv.pick_config("fp8", 1024, 256, 40, cpu) == c16
    assert gemv.pick_config("fp8", 2048, 256, 40, cpu) == gemv.default_config("fp8", 2048, 256, 40, 132)
    assert gemv.pick_config("fp8", 2048, 256, 40, cpu).dot


def test_nvfp4_f16_activation_range():
    """The fp16x2 path scales x per program by a power of two (max |x| into [2^14, 2^15)):
    huge and tiny activations, a zero column, and N not a multiple of the row tile."""
    w = _weights(24, 256, seed=9)["nvfp4"].to(_DEV)
    g = torch.Generator().manual_seed(10)
    xdt = torch.bfloat16 if _DEV == "cuda" else torch.float32
    cfg = GemvConfig(16, 64, 2, False, f16=True, prefetch=True)
    for scale in (2.0**40, 1.0, 2.0**-40):
        x = torch.randn(2, 256, generator=g) * scale
        x[1] = 0.0
        x = x.to(xdt).to(_DEV)
        y, yr = decode_linear(x, w, config=cfg), decode_linear_ref(x, w)
        assert torch.isfinite(y).all() and torch.equal(y[1], torch.zeros_like(y[1]))
        assert float((y - yr).abs().max() / yr.abs().max()) < 2e-3, scale


def test_fp8_f16_row_blocks_codes_and_range():
    """The fp8 fp16x2 path: programs in different 128-row scale blocks and a partial last
    128-column block (N = 272, K = 400), every E4M3 code but NaN once per row, distinct block
    scales, huge / tiny activations (x is scaled per program into [8, 16)) and a zero column."""
    n, k = 272, 400
    g = torch.Generator().manual_seed(11)
    codes = torch.empty(n, k, dtype=torch.uint8)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes
    for r in range(n):
        codes[r] = finite[torch.randint(0, finite.numel(), (k,), generator=g)]
        codes[r, :finite.numel()] = finite[torch.randperm(finite.numel(), generator=g)]
    scale = torch.rand(3, 4, generator=g) * 2.0**-6 + 2.0**-9
    w = DecodeWeight("fp8", n, k, codes.view(torch.float8_e4m3fn), scale, "w8").to(_DEV)
    wd = dequantize_packed(w).cpu()
    assert torch.isfinite(wd).all()
    xdt = torch.bfloat16 if _DEV == "cuda" else torch.float32
    for cfg in (GemvConfig(16, 128, 1, False, f16=True, prefetch=True), GemvConfig(64, 256, 2, False, f16=True),
                GemvConfig(128, 64, 1, False, f16=True)):
        for xscale in (2.0**40, 1.0, 2.0**-40):
            x = torch.randn(3, k, generator=g) * xscale
            x[1] = 0.0
            x = x.to(xdt)
            y = decode_linear(x.to(_DEV), w, config=cfg).cpu()
            yr = x.float() @ wd.T
            assert torch.isfinite(y).all() and torch.equal(y[1], torch.zeros_like(y[1])), (cfg, xscale)
            assert float((y - yr).abs().max() / yr.abs().max()) < 2e-3, (cfg, xscale)
    with pytest.raises(ValueError, match="bn <= 128"):
        decode_linear(torch.randn(1, k).to(xdt).to(_DEV), w, config=GemvConfig(256, 64, 1, False, f16=True))


def test_tuner_candidates_are_distinct_and_cover_each_path():
    """``memra bench census --tune`` candidates: no configuration twice; the fp16x2 tiles for fp8 up to
    4 columns next to the fp32-FMA tiles (T <= 4) and the tensor-core tiles (T > 2); none above 4."""
    from memra.bench.census import _candidates

    for fmt in ("bf16", "fp8", "nvfp4", "q8_0"):
        for t in (1, 2, 4, 8, 16):
            c = _candidates(fmt, t)
            assert len(c) == len(set(c)), (fmt, t)
            fma = [x for x in c if not x.dot and not x.f16 and not x.library]
            f16 = [x for x in c if x.f16 and not x.dot]
            assert bool(fma) == (t <= 4), (fmt, t)
            assert bool(f16) == ((fmt == "fp8" and t <= 4) or (fmt == "nvfp4" and t <= 2)), (fmt, t)
            assert any(x.dot and not x.library for x in c) == (t > 2), (fmt, t)


def test_kernel_out_dtype_and_out_buffer():
    w = _weights(24, 128, seed=5)["q8_0"].to(_DEV)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(6)).to(_DEV)
    yr = decode_linear_ref(x, w)
    yb = decode_linear(x, w, out_dtype=torch.bfloat16, config=GemvConfig(8, 64, 2, False))
    assert yb.dtype == torch.bfloat16
    assert float((yb.float() - yr).abs().max() / yr.abs().max()) < 1e-2
    out = torch.full((2, 24), float("nan"), device=_DEV)  # poisoned: every element must be written
    decode_linear(x, w, config=GemvConfig(16, 64, 1, False), out=out)
    assert torch.isfinite(out).all()
    assert float((out - yr).abs().max() / yr.abs().max()) < 1e-5


def test_kernel_errors():
    w = _weights(8, 64)["bf16"]
    with pytest.raises(ValueError, match=r"x must be \[T, 64\]"):
        decode_linear(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="1..64"):
        decode_linear(torch.randn(65, 64), w)
    with pytest.raises(ValueError, match="T <= 4"):
        decode_linear(torch.randn(17, 64), _weights(8, 64)["q8_0"], config=GemvConfig(8, 64, 1, False))
    with pytest.raises(ValueError, match="multiple of 32"):
        decode_linear(torch.randn(1, 64), _weights(8, 64)["q8_0"], config=GemvConfig(8, 16))
    with pytest.raises(ValueError, match="T <= 4"):
        decode_linear(torch.randn(6, 64), w, config=GemvConfig(8, 64, 1, False))


# ---------------------------------------------------------------------------------------
# GPU: the flagship's decode shapes (shared/STEP35.md), default (tuned) configurations

_GPU_SHAPES = [(14432, 4096), (10304, 4096), (4096, 8192), (4096, 12288), (2560, 4096), (4096, 1280),
               (22528, 4096), (4096, 11264), (5152, 4096), (4096, 640), (128896, 4096)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "q8_0", "nvfp4"])
@pytest.mark.parametrize("n,k", _GPU_SHAPES)
def test_gpu_real_shapes(fmt, n, k):
    from memra.bench.census import _random_weight

    g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    w = _random_weight(fmt, n, k, g, torch.device("cuda"))
    wd = dequantize_packed(w)
    for t in (1, 2, 4, 8, 16, 40, 64):
        x = torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16)
        yr = x.float() @ wd.T
        y = decode_linear(x, w)
        rel = float((y - yr).abs().max() / yr.abs().max())
        assert torch.isfinite(y).all()
        assert rel < 5e-3, (fmt, n, k, t, rel)  # bf16 rounding of code * scale in the dot path at most
        yb = decode_linear(x, w, out_dtype=torch.bfloat16)
        assert float((yb.float() - yr).abs().max() / yr.abs().max()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_f16_at_the_fp16_bound():
    """The fp8 fp16x2 path at its overflow bound: every code +-448 (0x7E / 0xFE) and every x equal,
    at the top of its binade. fp32 x = (2 - 2^-22) 2^j: the power-of-two scale brings it to
    16 - 2^-19, which fp16 rounds to 16, so each fp16 half sums 8 products of 7168 to exactly
    +-57344 (fp16 max 65504); bf16 x = (2 - 2^-7) 2^j: 15.9375 (exact), halves of 57120. Any larger
    scale or more products per half would overflow to inf here."""
    n, k = 256, 4096
    sign = (torch.arange(n) % 2).to(torch.uint8)[:, None] * 0x80
    codes = (torch.full((n, k), 0x7E, dtype=torch.uint8) | sign).view(torch.float8_e4m3fn)
    w = DecodeWeight("fp8", n, k, codes, torch.full((2, 32), 2.0**-10), "bound").to("cuda")
    wd = dequantize_packed(w).cpu()
    for dt, top in ((torch.float32, 2 - 2.0**-22), (torch.bfloat16, 2 - 2.0**-7)):
        for j in (-20, 0, 20):
            x = torch.full((2, k), top * 2.0**j).to(dt)
            yr = x.float() @ wd.T
            for cfg in (GemvConfig(64, 256, 1, False, f16=True, prefetch=True), GemvConfig(32, 512, 4, False, f16=True)):
                y = decode_linear(x.cuda(), w, config=cfg).cpu()
                assert torch.isfinite(y).all(), (dt, j, cfg)
                assert float((y - yr).abs().max() / yr.abs().max()) < 1e-3, (dt, j, cfg)
