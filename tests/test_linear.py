"""CPU linear kernels against the dequantized reference, on fresh random packed weights."""

from __future__ import annotations

import pytest
import torch

from memra.layers.linear import Linear, q4_codes_scale_zero
from memra.quant.tensor import QTensor
from memra.quant.types import QTYPE_INFO, QType


def random_q4(qtype: QType, n: int, k: int, seed: int) -> QTensor:
    """Random Q4_0/Q4_1 blocks with finite fp16 scales of realistic magnitude (never zero)."""
    g = torch.Generator().manual_seed(seed)
    info = QTYPE_INFO[qtype]
    nb = n * k // 32
    raw = torch.randint(0, 256, (nb, info.type_size), dtype=torch.uint8, generator=g)
    d = (torch.rand(nb, generator=g) * 0.02 + 0.001).to(torch.float16)
    raw[:, 0:2] = d.view(torch.uint8).reshape(nb, 2)
    if qtype == QType.Q4_1:
        m = (-torch.rand(nb, generator=g) * 0.1).to(torch.float16)
        raw[:, 2:4] = m.view(torch.uint8).reshape(nb, 2)
    return QTensor("w", qtype, (n, k), raw.reshape(n, -1))


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
def test_q4_affine_form_is_exact(qtype):
    qt = random_q4(qtype, 16, 128, 0)
    codes, scale, zero = q4_codes_scale_zero(qt)
    w = (codes.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    torch.testing.assert_close(w, qt.dequantize(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
@pytest.mark.parametrize("t", [1, 5])
def test_int4_kernel_matches_dequantized_reference(qtype, t):
    parts = [random_q4(qtype, 96, 256, 1), random_q4(qtype, 64, 256, 2)]  # fused rows, like gate+up
    bias = torch.randn(160)
    lin = Linear(parts, bias, torch.bfloat16)
    assert lin.kernel == "int4"
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(3))
    ref = x @ torch.cat([p.dequantize() for p in parts]).t() + bias
    got = lin(x.to(torch.bfloat16)).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"\n{qtype.name} t={t}: int4 kernel vs fp32 dequantized reference, max rel err {err:.2e}")
    assert err < 2e-2
    # and the weight it reports is the one it computes with
    torch.testing.assert_close(lin.weight.float(), torch.cat([p.dequantize() for p in parts]), rtol=1e-2, atol=2e-3)


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
