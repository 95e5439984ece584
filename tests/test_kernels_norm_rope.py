"""Fused RMSNorm and q/k norm + partial RoPE (memra/kernels/norm_rope.py) against their torch
references (which are the model's own functions).

CPU (CI): the Triton kernels under the interpreter at tiny shapes, fp32 and fp16.
GPU (``-m gpu``): real shapes in bf16 (Step-3.5 full layers H=64/KV=8/Dh=128/rotary 64,
sliding layers H=96 rotary 128, smollm2 H=9/KV=3/Dh=64 full rotary).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before memra.kernels._norm_rope_triton is imported

from memra.config import LayerConfig, RopeScaling  # noqa: E402
from memra.kernels.norm_rope import qk_norm_rope, qk_norm_rope_ref, rms_norm, rms_norm_ref  # noqa: E402
from memra.layers.norm import rms_norm as model_rms_norm  # noqa: E402
from memra.layers.rope import apply_rope, rope_cos_sin  # noqa: E402

triton = pytest.importorskip("triton")

_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2 ** -7}


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=_TOL[dtype], rtol=_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [64, 96, 200])
def test_rms_norm(dtype, D):
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(5, D, generator=g) * 3).to(dtype)
    res = torch.randn(5, D, generator=g).to(dtype)
    w = torch.rand(D, generator=g) + 0.5
    _close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)
    _close(rms_norm_ref(x, w, 1e-6), model_rms_norm(x, w, 1e-6), dtype)
    y, s = rms_norm(x, w, 1e-5, residual=res)
    yr, sr = rms_norm_ref(x, w, 1e-5, residual=res)
    assert torch.equal(s, sr) and s.dtype == dtype
    _close(y, yr, dtype)
    # strided rows
    xb = torch.randn(5, 2 * D, generator=g).to(dtype)
    _close(rms_norm(xb[:, D:], w, 1e-6), rms_norm_ref(xb[:, D:].contiguous(), w, 1e-6), dtype)


def _lc(Dh, rot, theta=10000.0, scaling=None):
    return LayerConfig("full", 4, 2, Dh, None, theta, rot, scaling)


QK_CASES = [
    # T, H, KV, Dh, rot, norm, scaling
    (3, 4, 2, 64, 64, True, None),
    (5, 9, 3, 64, 64, False, None),        # smollm2-like, llama (no q/k norm)
    (2, 8, 1, 128, 64, True, RopeScaling("llama3", 2.0, 1.0, 32.0, 131072)),  # Step-3.5 full-layer partial
    (4, 3, 1, 32, 16, True, None),
]


@pytest.mark.parametrize("case", range(len(QK_CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_norm_rope(case, dtype):
    T, H, KV, Dh, rot, norm, scaling = QK_CASES[case]
    g = torch.Generator().manual_seed(case)
    # a fused projection output [T, H*Dh | KV*Dh | KV*Dh]: q and k are strided views
    fused = (torch.randn(T, (H + 2 * KV) * Dh, generator=g) * 2).to(dtype)
    q = fused[:, :H * Dh].view(T, H, Dh)
    k = fused[:, H * Dh:(H + KV) * Dh].view(T, KV, Dh)
    qw = torch.rand(Dh, generator=g) + 0.5 if norm else None
    kw = torch.rand(Dh, generator=g) + 0.5 if norm else None
    lc = _lc(Dh, rot, 5e6 if scaling else 1e4, scaling)
    cos, sin = rope_cos_sin(lc, torch.arange(100, 100 + T), dtype)
    qo, ko = qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    qr, kr = qk_norm_rope_ref(q, k, qw, kw, 1e-6, cos, sin)
    assert qo.is_contiguous() and ko.is_contiguous() and qo.dtype == dtype
    _close(qo, qr, dtype)
    _close(ko, kr, dtype)
    # the reference is the model's path (GatedAttention: norms, then apply_rope on cat([q, k]))
    qn = model_rms_norm(q, qw, 1e-6) if norm else q
    kn = model_rms_norm(k, kw, 1e-6) if norm else k
    qm, km = apply_rope(torch.cat([qn, kn], dim=1), cos, sin).split([H, KV], dim=1)
    assert torch.equal(qm, qr) and torch.equal(km, kr)
    if rot < Dh:  # pass-through part is the (normed) input; fp32: F.rms_norm vs rsqrt, ulps apart
        _close(qo[..., rot:], qn[..., rot:], dtype)
        if dtype != torch.float32:
            assert torch.equal(qo[..., rot:], qn[..., rot:])


def test_errors():
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    cos = torch.randn(2, 63)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rope(q, k, None, None, 1e-6, cos, cos)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(3, 8), torch.ones(7), 1e-6)


# ---------------------------------------------------------------------------------------
# GPU: real shapes, bf16

GPU_QK = [
    ("step35-full", 64, 8, 128, 64, True, RopeScaling("llama3", 2.0, 1.0, 32.0, 131072), 5e6),
    ("step35-sliding", 96, 8, 128, 128, True, None, 1e4),
    ("smollm2", 9, 3, 64, 64, False, None, 1e5),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_QK, ids=[s[0] for s in GPU_QK])
@pytest.mark.parametrize("T", [1, 7, 64])
def test_gpu_qk_norm_rope(shape, T):
    _, H, KV, Dh, rot, norm, scaling, theta = shape
    g = torch.Generator(device="cuda").manual_seed(T)
    dt = torch.bfloat16
    fused = torch.randn(T, (H + 2 * KV) * Dh + H, device="cuda", dtype=dt, generator=g) * 2
    q = fused[:, :H * Dh].view(T, H, Dh)
    k = fused[:, H * Dh:(H + KV) * Dh].view(T, KV, Dh)
    qw = torch.rand(Dh, device="cuda", generator=g) + 0.5 if norm else None
    kw = torch.rand(Dh, device="cuda", generator=g) + 0.5 if norm else None
    cos, sin = rope_cos_sin(_lc(Dh, rot, theta, scaling), torch.arange(5000, 5000 + T, device="cuda"), dt)
    qo, ko = qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    qr, kr = qk_norm_rope_ref(q, k, qw, kw, 1e-6, cos, sin)
    for x, w, o, r in ((q, qw, qo, qr), (k, kw, ko, kr)):
        # the kernel rounds once: within 1 bf16 ulp of the fp32 rotation of the (rounded) normed head
        xn = model_rms_norm(x, w, 1e-6) if norm else x
        exact = apply_rope(xn.float(), cos.float(), sin.float())
        _close(o, exact, dt)
        # the reference rounds x*cos and rotate_half(x)*sin separately: ulps of the terms, not of the sum
        bound = 2 ** -6 * (xn.float().abs().amax(-1, keepdim=True) + 1e-3)  # <= 1.5 * 2^-7 * max|x| in theory
        assert ((o.float() - r.float()).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.parametrize("T,D", [(1, 4096), (64, 4096), (9, 576)])
def test_gpu_rms_norm(T, D):
    g = torch.Generator(device="cuda").manual_seed(D)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    r = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(D, device="cuda", generator=g) + 0.5
    _close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), torch.bfloat16)
    y, s = rms_norm(x, w, 1e-5, residual=r)
    yr, sr = rms_norm_ref(x, w, 1e-5, residual=r)
    assert torch.equal(s, sr)
    _close(y, yr, torch.bfloat16)
