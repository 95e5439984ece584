"""CPU linear kernels against the dequantized reference, on fresh random packed weights."""

from __future__ import annotations

import pytest
import torch

from memra.layers.linear import Linear, int4_digits
from memra.quant.tensor import QTensor
from memra.quant.types import QTYPE_INFO, QType


def random_q4(qtype: QType, n: int, k: int, seed: int) -> QTensor:
    """Random blocks of a per-32 affine format (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K): random codes
    and scale bytes, the fp16 scale (and min) fields set to finite values of realistic magnitude."""
    g = torch.Generator().manual_seed(seed)
    info = QTYPE_INFO[qtype]
    nb = n * k // info.block_size
    raw = torch.randint(0, 256, (nb, info.type_size), dtype=torch.uint8, generator=g)
    kquant = qtype in (QType.Q4_K, QType.Q5_K)
    d = (torch.rand(nb, generator=g) * (0.0005 if kquant else 0.02) + 0.0001).to(torch.float16)
    raw[:, 0:2] = d.view(torch.uint8).reshape(nb, 2)
    if qtype in (QType.Q4_1, QType.Q5_1, QType.Q4_K, QType.Q5_K):
        m = ((torch.rand(nb, generator=g) * 0.002) if kquant else (-torch.rand(nb, generator=g) * 0.1)).to(torch.float16)
        raw[:, 2:4] = m.view(torch.uint8).reshape(nb, 2)
    return QTensor("w", qtype, (n, k), raw.reshape(n, -1))


AFFINE = [QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.Q4_K, QType.Q5_K]


@pytest.mark.parametrize("qtype", AFFINE, ids=lambda q: q.name)
def test_int4_digits_are_exact(qtype):
    """The digits' weights, summed over the row blocks, are the dequantized weights (in fp32)."""
    qt = random_q4(qtype, 16, 256, 0)
    codes, sz, digits = int4_digits([qt])
    assert digits == (1 if qtype in (QType.Q4_0, QType.Q4_1, QType.Q4_K) else 2)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    w = (codes.double() - 8) * sz[..., 0].t().double().repeat_interleave(32, 1) + \
        sz[..., 1].t().double().repeat_interleave(32, 1)
    torch.testing.assert_close(w.view(digits, 16, 256).sum(0).float(), qt.dequantize(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", AFFINE, ids=lambda q: q.name)
@pytest.mark.parametrize("t", [1, 5, 20])  # 20 rows: the dense bf16 GEMM (INT4_MAX_ROWS)
def test_int4_kernel_matches_dequantized_reference(qtype, t, torch_cpu_paths):
    parts = [random_q4(qtype, 96, 256, 1), random_q4(qtype, 64, 256, 2)]  # fused rows, like gate+up
    bias = torch.randn(160)
    lin = Linear(parts, bias, torch.bfloat16)
    assert lin.kernel == "int4"
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(3))
    w = torch.cat([p.dequantize() for p in parts])
    ref = x @ w.t() + bias
    got = lin(x.to(torch.bfloat16)).float()
    dense = (x.to(torch.bfloat16) @ w.to(torch.bfloat16).t()).float() + bias  # the dense bf16 path's error
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    err_dense = ((dense - ref).abs().max() / ref.abs().max()).item()
    print(f"\n{qtype.name} t={t}: int4 kernel vs fp32 dequantized reference, max rel err {err:.2e} "
          f"(dense bf16 {err_dense:.2e})")
    assert err < max(5 * err_dense, 1.5e-2)  # bf16 scale/zero and per-digit output roundings
    # the weight it reports is the digits' with bf16 scales and zeros (the kernel's parameters), and
    # within their rounding of the checkpoint's
    codes, sz, digits = int4_digits(parts)
    sz = sz.to(torch.bfloat16).double()
    want = ((codes.double() - 8) * sz[..., 0].t().repeat_interleave(32, 1)
            + sz[..., 1].t().repeat_interleave(32, 1)).view(digits, 160, 256).sum(0)
    torch.testing.assert_close(lin.weight.double(), want, rtol=2 ** -7, atol=2 ** -8 * float(want.abs().max()))
    bound = 2 ** -8 * ((codes.double() - 8).abs() * sz[..., 0].t().abs().repeat_interleave(32, 1)
                       + sz[..., 1].t().abs().repeat_interleave(32, 1)).view(digits, 160, 256).sum(0)
    assert bool(((want - w.double()).abs() <= bound + 1e-12).all())


def test_dense_fp32_is_exact_and_mixed_formats_fall_back():
    parts = [random_q4(QType.Q4_1, 32, 64, 4), QTensor("v", QType.F32, (16, 64), torch.randn(16, 64))]
    lin = Linear(parts, None, torch.bfloat16)
    assert lin.kernel == "dense"
    lin32 = Linear(parts, None, torch.float32)
    x = torch.randn(3, 64)
    ref = x @ torch.cat([p.dequantize() for p in parts]).t()
    torch.testing.assert_close(lin32(x), ref, rtol=1e-5, atol=1e-5)


def test_requantize_fp8_blocks_bf16_gpu_weights_only():
    """Linear.requantize_fp8 (``--attention-weights fp8``): a bf16 packed weight becomes FP8 E4M3 with
    one scale per 128x128 block whose dequantization is the reference quantizer's; quantized
    weights are left alone; the CPU path is refused."""
    from memra.kernels.gemv import dequantize_packed
    from memra.quant.fp8 import quantize_fp8_block

    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 256, generator=g) * torch.linspace(0.1, 3.0, 300)[:, None]  # rows of different scale
    lin = Linear(QTensor("w", QType.BF16, (300, 256), w.to(torch.bfloat16)), None, torch.float32)
    with pytest.raises(ValueError, match="not on the GPU"):
        lin.requantize_fp8()
    lin.to_gpu("cpu")
    bf16 = lin.packed_weight.data.float()
    assert lin.requantize_fp8()
    p = lin.packed_weight
    assert p.fmt == "fp8" and tuple(p.scale.shape) == (3, 2)
    want = quantize_fp8_block(bf16).dequantize(torch.float32)
    assert torch.equal(dequantize_packed(p).float(), want)
    assert (want - bf16).abs().max() <= bf16.abs().max() / 16  # E4M3: 3 mantissa bits
    assert not lin.requantize_fp8()  # already FP8
