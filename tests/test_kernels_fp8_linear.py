"""The FP8 block-recipe linear (memra/kernels/fp8_linear.py) against its torch twin.

CPU (CI): the Triton kernels under the interpreter (TRITON_INTERPRET=1) at small shapes, where
the twin is matched to fp32 summation order and the activation codes equal quantize_act_fp8_ref's.
GPU: the quantization kernel's scale ``amax / 448`` is Triton's approximate fp32 division (the
H100 run of 2026-12-06 found scales an ulp apart from torch's, and so a few codes one E4M3 step
apart: benchmarks/results/issue14/gpu-tests-fp8-5c7d482-h100-kernel.log), so the GEMM is checked
against the twin of the codes the kernel produced, and the codes against the reference within
one step; Hopper's FP8 MMA accumulates each 128-K product with ~14 bits (relative error ~2e-4
of the output's largest value measured on the H200).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton sources are imported

from memra.kernels.fp8_linear import (  # noqa: E402
    FP8_ACT_MIN_T,
    Fp8LinearConfig,
    fp8_act_linear,
    fp8_act_linear_ref,
    fp8_act_supported,
    fp8_linear_config,
    quantize_act_fp8,
)
from memra.kernels.gemv import DecodeWeight, decode_linear_ref, dequantize_packed, pack_bf16, pack_fp8  # noqa: E402
from memra.kernels.moe_prefill import dequantize_act_fp8_ref, quantize_act_fp8_ref  # noqa: E402
from memra.quant.fp8 import quantize_fp8_block  # noqa: E402

triton = pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
X_DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16  # (the interpreter reads fp16 exactly as well)


def _fp8_weight(n: int, k: int, seed: int) -> DecodeWeight:
    g = torch.Generator().manual_seed(seed)
    # rows with different magnitudes, so that the 128x128 block scales differ
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).add(0.1)
    return pack_fp8(quantize_fp8_block(w, name="w")).to(DEV)


def _x(t: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # per-column spread so that the 1x128 groups get different scales
    return (torch.randn(t, k, generator=g) * torch.linspace(0.05, 3.0, k)).to(X_DTYPE).to(DEV)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float().cpu() - ref.float().cpu()).abs().max() / ref.float().abs().max())


TOL = 1e-3 if DEV == "cuda" else 1e-5


@pytest.mark.parametrize("t,n,k,cfg", [
    (1, 320, 384, Fp8LinearConfig(64, 16, 1)),
    (5, 320, 384, Fp8LinearConfig(64, 16, 1)),
    (5, 200, 256, Fp8LinearConfig(64, 16, 1)),  # N not a tile multiple without the split: the store mask
    (9, 129, 384, None),  # the default rule (fp8_linear_config)
    (20, 200, 256, Fp8LinearConfig(64, 32, 2)),  # K split in two (atomics into zeros), N not a tile multiple
    (40, 136, 512, Fp8LinearConfig(128, 16, 2)),  # three T tiles, the last partial
])
def test_matches_twin(t, n, k, cfg):
    w = _fp8_weight(n, k, seed=t + n)
    x = _x(t, k, seed=k + t)
    y = fp8_act_linear(x, w, config=cfg)
    ref = _twin_of_kernel_codes(x, w)
    assert y.shape == (t, n) and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert _rel(y, ref) < TOL, (t, n, k, cfg, _rel(y, ref))
    # the activation rounding is real (3 mantissa bits): the bf16-activation result differs by ~1e-2
    exact_x = decode_linear_ref(x.float().cpu(), w.to("cpu"))
    assert 1e-3 < _rel(y, exact_x) < 0.1
    yb = fp8_act_linear(x, w, out_dtype=torch.bfloat16, config=cfg)
    assert yb.dtype == torch.bfloat16 and _rel(yb, ref) < 1e-2
    # and against the reference quantization (codes at most one step apart on the GPU)
    assert _rel(y, fp8_act_linear_ref(x.float().cpu(), w.to("cpu"))) < (1e-2 if DEV == "cuda" else TOL)


def _twin_of_kernel_codes(x: torch.Tensor, w: DecodeWeight) -> torch.Tensor:
    """fp32 twin of the GEMM on the codes the quantization kernel produced."""
    return (dequantize_act_fp8_ref(*quantize_act_fp8(x)) @ dequantize_packed(w).t()).cpu()


def test_quantized_codes_are_the_twins():
    """The activation codes and scales that reach the GEMM are quantize_act_fp8_ref's: exactly
    under the interpreter; on the GPU scales within 2 ulp and codes at most one E4M3 step apart."""
    t, k = 7, 384
    x = _x(t, k, seed=3)
    xq, xs = quantize_act_fp8(x)
    rq, rs = quantize_act_fp8_ref(x.float().cpu())
    if DEV == "cpu":
        assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(xs, rs)
    else:
        assert float(((xs.cpu() - rs).abs() / rs).max()) <= 2.5e-7
        a, b = xq.cpu().float(), rq.float()
        assert bool(((a - b).abs() <= b.abs() * 2.0**-3 + 2.0**-9).all())
        assert float((a != b).float().mean()) < 0.01


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (numpy's inf / inf, interpreted)
def test_non_finite_activations_are_quantized_as_the_twin_does():
    """A NaN in x makes its 1x128 group's scale and codes NaN (Triton's tl.max and min / max
    drop a NaN: the group dequantized finite); an inf makes the scale inf, its own code NaN and
    the group's other codes 0, as ``quantize_act_fp8_ref`` does. So the GEMM rows they
    feed are not finite, and no other row is touched."""
    t, n, k = 5, 192, 384
    w = _fp8_weight(n, k, seed=21)
    x = _x(t, k, seed=22)
    x[2, 130] = float("nan")
    x[4, 300] = float("inf")
    xq, xs = quantize_act_fp8(x)
    rq, rs = quantize_act_fp8_ref(x.float().cpu())
    xq, xs = xq.cpu().float(), xs.cpu()
    assert torch.isnan(xs[2, 1]) and torch.isnan(rs[2, 1]) and xs[4, 2] == rs[4, 2] == float("inf")
    bad = torch.zeros_like(rs, dtype=torch.bool)
    bad[2, 1] = bad[4, 2] = True
    assert torch.isfinite(xs[~bad]).all() and torch.isfinite(rs[~bad]).all()
    for r, g in ((2, 1), (4, 2)):  # the non-finite groups' codes: the twin's, NaN where it is NaN
        a, b = xq[r, g * 128:(g + 1) * 128], rq.float()[r, g * 128:(g + 1) * 128]
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)])
    assert int(torch.isnan(xq).sum()) == 128 + 1  # the NaN's group, the inf itself
    y = fp8_act_linear(x, w, config=Fp8LinearConfig(64, 16, 1)).cpu()
    # (row 4: NaN on the GPU; the interpreter reads the NaN code 0x7F as 480, and inf comes out)
    assert torch.isnan(y[2]).all() and not torch.isfinite(y[4]).any()
    assert torch.isfinite(y[[0, 1, 3]]).all()


def test_rows_do_not_depend_on_each_other():
    """A token's row is the same bits whichever other tokens share the call (same tile shape),
    and a split-in-two K gives the same bits on every run (two partial sums into zeros; only the
    GPU runs the two halves concurrently, the interpreter one after the other). Under the
    interpreter the rows agree to an ulp only: its tl.dot is numpy's BLAS matmul, whose result for
    a row can depend on the row's place in the tile (seen on an AMD EPYC host, not on others)."""
    n, k = 192, 512
    w = _fp8_weight(n, k, seed=11)
    x = _x(24, k, seed=12)
    cfg = Fp8LinearConfig(64, 32, 2)
    full = fp8_act_linear(x, w, config=cfg)
    part = fp8_act_linear(x[5:17], w, config=cfg)
    if DEV == "cuda":
        assert torch.equal(full[5:17], part)
    else:
        assert float((full[5:17].float() - part.float()).abs().max()) <= 4e-6 * float(part.float().abs().max())
    assert torch.equal(fp8_act_linear(x, w, config=cfg), full)


def test_config_rule():
    c = fp8_linear_config(8, 14432, 4096, 132)
    assert (c.bn, c.bt, c.split) == (64, 16, 1)  # 226 tiles: no split
    c = fp8_linear_config(64, 4096, 12288, 132)
    assert (c.bn, c.bt, c.split) == (128, 64, 2)  # 32 tiles on 132 SMs: K in two
    c = fp8_linear_config(33, 10304, 4096, 132)
    assert (c.bn, c.bt, c.split) == (128, 64, 2)
    assert fp8_linear_config(4096, 14432, 4096, 132).bt == 64  # prefill: 64-token tiles
    assert fp8_linear_config(20, 4096, 384, 132).split == 1  # K = 3 x 128 cannot halve
    with pytest.raises(ValueError, match="split in"):
        Fp8LinearConfig(64, 16, 4)


def test_errors():
    w = _fp8_weight(64, 256, seed=1)
    with pytest.raises(ValueError, match=r"x must be \[T, 256\]"):
        fp8_act_linear(_x(3, 128, 0), w)
    with pytest.raises(TypeError, match="packed DecodeWeight"):
        fp8_act_linear(_x(3, 256, 0), quantize_fp8_block(torch.randn(64, 256), name="raw"))
    with pytest.raises(ValueError, match="K a multiple of 128"):
        quantize_act_fp8(torch.ones(2, 200, device=DEV))
    with pytest.raises(ValueError, match="floating point"):
        fp8_act_linear(torch.ones(3, 256, dtype=torch.int32, device=DEV), w)
    b = pack_bf16(torch.randn(64, 256)).to(DEV)
    assert not fp8_act_supported(b)
    with pytest.raises(ValueError, match="needs an fp8 weight"):
        fp8_act_linear(_x(3, 256, 0), b)
    odd = pack_fp8(quantize_fp8_block(torch.randn(64, 200), name="odd")).to(DEV)
    assert not fp8_act_supported(odd)
    with pytest.raises(ValueError, match="K a multiple of 128"):
        fp8_act_linear(_x(3, 200, 0), odd)
    w384 = _fp8_weight(64, 384, seed=2)  # 3 K steps: an explicit split 2 cannot halve them (no silent fallback)
    with pytest.raises(ValueError, match="split 2 needs K a multiple of 256"):
        fp8_act_linear(_x(3, 384, 0), w384, config=Fp8LinearConfig(64, 16, 2))


def test_cpu_outside_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA device"):
        quantize_act_fp8(torch.ones(2, 128))


def test_gpu_linear_takes_the_recipe_from_the_threshold():
    """gpu_linear: FP8 weights below FP8_ACT_MIN_T rows keep bf16 activations (decode_linear);
    from it on (prefill included) the FP8 block recipe; K not a multiple of 128 never takes it."""
    from memra.layers.linear import gpu_linear

    n, k = 160, 256
    w = _fp8_weight(n, k, seed=5)
    for t in (FP8_ACT_MIN_T - 1, FP8_ACT_MIN_T, 70):
        x = _x(t, k, seed=t)
        y = gpu_linear(x, w).float().cpu()
        recipe = fp8_act_linear_ref(x.float().cpu(), w.to("cpu"))
        exact_x = x.float().cpu() @ dequantize_packed(w.to("cpu")).t()
        near, far = (recipe, exact_x) if t >= FP8_ACT_MIN_T else (exact_x, recipe)
        assert _rel(y, near) < 5e-3 < _rel(y, far), (t, _rel(y, near), _rel(y, far))
    odd = _fp8_weight(n, 200, seed=6)  # K = 200: the recipe cannot take it at any T
    x = _x(FP8_ACT_MIN_T, 200, seed=7)
    exact_x = x.float().cpu() @ dequantize_packed(odd.to("cpu")).t()
    assert _rel(gpu_linear(x, odd), exact_x) < 5e-3


_ATTN = [(10304, 4096), (4096, 8192), (14432, 4096), (4096, 12288)]  # the flagship's TP1 attention shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", _ATTN)
def test_gpu_attention_shapes(n, k):
    from memra.bench.census import _random_weight

    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = _random_weight("fp8", n, k, g, torch.device("cuda"))
    for t in (8, 16, 33, 64, 300):
        x = torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16)
        y = fp8_act_linear(x, w, out_dtype=torch.bfloat16)
        ref = _twin_of_kernel_codes(x, w)
        assert torch.isfinite(y).all() and _rel(y, ref) < 1e-2, (n, k, t, _rel(y, ref))  # bf16 output rounding
        assert _rel(fp8_act_linear(x, w), ref) < TOL, (n, k, t)
