"""MoE decode kernels (memra/kernels/moe_decode.py) against their torch reference and the model's math.

CPU (CI): the Triton kernels run under the interpreter (TRITON_INTERPRET=1) at tiny shapes
(E = 8, D = 128, I = 64 or 128 for fp8) with fp16/fp32 activations, large tiles so that the
interpreter runs few programs. Routing always has experts shared by several tokens and
experts chosen by nobody (unused slots).
GPU (``-m gpu``, the H200): the flagship shape (E = 288, top-8, D = 4096, I = 1280), every
format, T = 1..64, bf16 activations, default launch configurations, and CUDA-graph capture.
Random data everywhere (never zeros).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before memra.kernels._moe_triton is imported

from memra.kernels.moe_decode import (  # noqa: E402
    ExpertBank,
    default_moe_config,
    dequantize_expert,
    fuse_gate_up,
    moe_decode,
    moe_decode_ref,
    moe_group,
    moe_route,
    pack_expert_bank,
)
from memra.quant.dequant import quantize_q8_0  # noqa: E402
from memra.quant.fp8 import quantize_fp8_block  # noqa: E402
from memra.quant.tensor import QTensor  # noqa: E402
from memra.quant.types import QType  # noqa: E402

triton = pytest.importorskip("triton")

from moe_banks import banks, source  # noqa: E402

E, D = 8, 128
FORMATS = ("nvfp4", "bf16", "fp8", "q8_0")


def _source(fmt: str, w: torch.Tensor):
    return source(fmt, w)


def _banks(fmt: str, i: int, d: int = D, seed: int = 0):
    return banks(fmt, i, d, seed, E)


def _i(fmt: str) -> int:
    return 128 if fmt == "fp8" else 64  # fp8 gate/up interleave in whole 128-row scale blocks


def _big_tiles(fmt: str, t: int, i: int, d: int = D, **over):
    """One program per slot and kernel (the interpreter runs programs one after another)."""
    cfg = default_moe_config(fmt, t, 3, E, i, d)
    return dataclasses.replace(cfg, ba=i, bn=d, bk1=min(d, 128), bk2=i, **over)


def _routing(t: int, k: int, experts: int, g: torch.Generator):
    """index [t, k] drawn from experts 0..experts-1 only (so E - experts are chosen by nobody)."""
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
    weight = torch.rand(t, k, generator=g) + 0.1
    return index, weight


def _rel(y: torch.Tensor, r: torch.Tensor) -> float:
    return float((y.float() - r.float()).abs().max() / r.float().abs().max())


# ---------------------------------------------------------------------------------------
# packing and grouping (torch only)


def test_pack_and_fuse_layout():
    g = torch.Generator().manual_seed(3)
    for fmt in FORMATS:
        i = _i(fmt)
        gu, down, srcs = _banks(fmt, i)
        assert gu.interleave == (128 if fmt == "fp8" else 16) and (gu.e, gu.n, gu.k) == (E, 2 * i, D)
        assert gu.nbytes == 2 * down.nbytes
        dense = [s.dequantize() if not isinstance(s, torch.Tensor) else s.to(torch.bfloat16).float() for s in srcs]
        for e in (0, 5):
            w = dequantize_expert(gu, e).reshape(-1, 2, gu.interleave, D)
            assert torch.equal(w[:, 0].reshape(i, D), dense[0][e])
            assert torch.equal(w[:, 1].reshape(i, D), dense[1][e])
            assert torch.equal(dequantize_expert(down, e), dense[2][e])
    # a list of 2-D experts packs to the same bank as the stacked tensor
    w = torch.randn(3, 32, 64, generator=g)
    q = QTensor("w", QType.Q8_0, (3, 32, 64), quantize_q8_0(w.reshape(96, 64)).reshape(96, -1))
    parts = [QTensor("w", QType.Q8_0, (32, 64), quantize_q8_0(w[j])) for j in range(3)]
    a, b = pack_expert_bank(q), pack_expert_bank(parts)
    assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
    # k-quants: dequantized to bf16
    from memra.quant.dequant import quantize_q4_k

    w4 = torch.randn(2, 4, 256, generator=g)
    q4 = QTensor("w4", QType.Q4_K, (2, 4, 256), quantize_q4_k(w4.reshape(8, 256)).reshape(8, -1))
    b4 = pack_expert_bank(q4)
    assert b4.fmt == "bf16" and torch.equal(b4.data.float(), q4.dequantize().to(torch.bfloat16).float())


def test_bank_errors():
    gu, down, _ = _banks("fp8", 128)
    gate = pack_expert_bank(quantize_fp8_block(torch.randn(2, 128, 128), name="g"))
    with pytest.raises(ValueError, match="multiple of 128"):
        fuse_gate_up(gate, gate, unit=16)
    nv = pack_expert_bank(_source("nvfp4", torch.randn(2, 48, 64)))
    with pytest.raises(ValueError, match="unit = 32 must divide"):
        fuse_gate_up(nv, nv, unit=32)
    with pytest.raises(ValueError, match="data is"):
        ExpertBank("nvfp4", 2, 48, 64, torch.zeros(2, 48, 31, dtype=torch.uint8), nv.scale)
    with pytest.raises(ValueError, match="unknown format"):
        ExpertBank("int4", 2, 48, 64, nv.data, nv.scale)
    with pytest.raises(ValueError, match="interleave"):
        ExpertBank("nvfp4", 2, 48, 64, nv.data, nv.scale, interleave=5)
    x = torch.randn(2, D)
    idx = torch.tensor([[0, 1], [1, 2]])
    w = torch.rand(2, 2)
    with pytest.raises(ValueError, match="fused gate/up"):
        moe_decode(x, idx, w, down, down, None)
    with pytest.raises(ValueError, match="x must be"):
        moe_decode(torch.randn(2, D + 1), idx, w, gu, down, None)
    with pytest.raises(ValueError, match="index must be int64"):
        moe_decode(x, idx.int(), w, gu, down, None)
    with pytest.raises(ValueError, match="weight must be"):
        moe_decode(x, idx, w[:, :1], gu, down, None)


@pytest.mark.parametrize("method", ["torch", "triton"])
def test_moe_group(method):
    index = torch.tensor([[5, 1, 3], [1, 6, 5]])
    perm, se, ss, sc = moe_group(index, 8, method)
    assert se.tolist() == [1, 3, 5, 6, -1, -1]
    assert sc.tolist() == [2, 1, 2, 1, 0, 0]
    assert ss.tolist() == [0, 2, 3, 5, 0, 0]
    assert perm.tolist() == [1, 3, 2, 0, 5, 4]
    g = torch.Generator().manual_seed(12)
    for t, k, e in ((1, 8, 288), (64, 8, 288), (7, 2, 8), (33, 4, 16)):
        index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        want = moe_group(index, e, "torch")
        got = moe_group(index, e, method)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), (t, k, e)
        perm = want[0].long()
        assert torch.equal(index.reshape(-1)[perm], index.reshape(-1).sort().values)
    with pytest.raises(ValueError, match="method"):
        moe_group(index, 16, "cub")


# ---------------------------------------------------------------------------------------
# kernels under the interpreter vs the torch twin


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_decode_formats(fmt):
    i = _i(fmt)
    gu, down, _ = _banks(fmt, i, seed=1)
    g = torch.Generator().manual_seed(2)
    tol = 2e-3  # fp16 output rounding (and the fp16x2 sub-block sums for nvfp4)
    for t, k, limit in ((1, 2, 0.5), (2, 3, None), (5, 3, 0.5)):
        index, weight = _routing(t, k, 6, g)  # experts 6, 7 never chosen; T=5: shared experts
        x = torch.randn(t, D, generator=g).half()
        y = moe_decode(x, index, weight, gu, down, limit, config=_big_tiles(fmt, t, i))
        r = moe_decode_ref(x, index, weight, gu, down, limit)
        assert y.dtype == torch.float16 and y.shape == (t, D)
        assert _rel(y, r) <= tol, (fmt, t)
    # fp32 activations: fp32 sums (exact weights) except the fp16x2 paths (nvfp4, fp8 by default)
    x = torch.randn(3, D, generator=g)
    index, weight = _routing(3, 3, 5, g)
    r = moe_decode_ref(x, index, weight, gu, down, 0.7)
    for f16 in (True, False):
        cfg = _big_tiles(fmt, 3, i, group="triton", f16=f16)
        y = moe_decode(x, index, weight, gu, down, 0.7, config=cfg)
        assert _rel(y, r) <= _tol(fmt, cfg), (fmt, f16)


def _tol(fmt: str, cfg) -> float:
    """fp16x2 paths (nvfp4 and fp8 with f16): fp16 sums of 16 products; else fp32 sums of exact weights."""
    return 2e-3 if fmt in ("nvfp4", "fp8") and cfg.f16 else 1e-5


@pytest.mark.parametrize("fmt,prefetch,tail", [("nvfp4", True, None), ("q8_0", False, None), ("fp8", True, None),
                                               ("fp8", False, None), ("nvfp4", False, True), ("nvfp4", True, False)])
def test_many_tokens_one_expert(fmt, prefetch, tail):
    """Seven tokens on expert 0: chunks of 4, 2 and 1 tokens; ``out=``; no-prefetch path, and the
    prefetch in the finishing 2- and 1-token chunks only (``prefetch_tail``) or everywhere but there."""
    i = _i(fmt)
    gu, down, _ = _banks(fmt, i, seed=4)
    g = torch.Generator().manual_seed(5)
    t = 7
    index = torch.stack([torch.tensor([0, 1 + j % 4]) for j in range(t)])
    weight = torch.rand(t, 2, generator=g) + 0.1
    x = torch.randn(t, D, generator=g)
    out = torch.empty(t, D)
    cfg = _big_tiles(fmt, t, i, prefetch=prefetch, nc=4, prefetch_tail=tail)
    y = moe_decode(x, index, weight, gu, down, 1.0, out=out, config=cfg)
    assert y is out
    assert _rel(y, moe_decode_ref(x, index, weight, gu, down, 1.0)) <= _tol(fmt, cfg)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_combine_modes_and_batch_invariance(fmt):
    """Both combines agree with the reference; the default per-pair combine ("sum") makes a
    token's output bit-identical whatever the other tokens of the call are (batch invariance),
    and alone (T = 1) as inside a batch when the launch tiles are the same."""
    i = _i(fmt)
    gu, down, _ = _banks(fmt, i, seed=12)
    g = torch.Generator().manual_seed(13)
    t = 4
    index, weight = _routing(t, 3, 6, g)
    x = torch.randn(t, D, generator=g)
    add = torch.randn(t, D, generator=g)
    r = moe_decode_ref(x, index, weight, gu, down, 0.5) + add
    cfg = _big_tiles(fmt, t, i)
    tol = _tol(fmt, cfg)
    assert cfg.combine == "sum"
    for c in ("sum", "atomic"):
        y = moe_decode(x, index, weight, gu, down, 0.5, add=add, config=dataclasses.replace(cfg, combine=c))
        assert _rel(y, r) <= tol, (fmt, c)
    y = moe_decode(x, index, weight, gu, down, 0.5, config=cfg)
    index2, weight2 = _routing(t, 3, 6, g)
    x2 = torch.randn(t, D, generator=g)
    index2[1], weight2[1], x2[1] = index[1], weight[1], x[1]
    y2 = moe_decode(x2, index2, weight2, gu, down, 0.5, config=cfg)
    y1 = moe_decode(x[1:2], index[1:2], weight[1:2], gu, down, 0.5, config=cfg)
    assert torch.equal(y[1], y2[1]) and torch.equal(y[1], y1[0]), fmt
    with pytest.raises(ValueError, match="invalid config"):
        moe_decode(x, index, weight, gu, down, 0.5, config=dataclasses.replace(cfg, combine="tree"))


def _spy_launches(monkeypatch, pick) -> list:
    """Record (kernel name, pick(launch kwargs)) for every MoE decode launch, then launch."""
    import memra.kernels.moe_decode as md

    seen = []

    class Spy:
        def __init__(self, k):
            self.k = k

        def __getitem__(self, grid):
            def launch(*a, **kw):
                seen.append((self.k.__name__, pick(kw)))
                return self.k[grid](*a, **kw)
            return launch

    real = md._kernels()
    monkeypatch.setattr(md, "_kernels", lambda: tuple(Spy(k) for k in real))
    return seen


def test_register_caps_reach_the_launches(monkeypatch):
    """``maxnreg1`` / ``maxnreg2`` go to the gate+up / down launches as Triton's ``maxnreg`` (left
    out when None); results unchanged (the cap changes register allocation, not the arithmetic);
    a cap that is not an int in 24..255 is refused by name."""
    seen = _spy_launches(monkeypatch, lambda kw: kw.get("maxnreg", "absent"))
    gu, down, _ = _banks("nvfp4", _i("nvfp4"), seed=14)
    g = torch.Generator().manual_seed(15)
    index, weight = _routing(3, 2, 6, g)
    x = torch.randn(3, D, generator=g)
    cfg = _big_tiles("nvfp4", 3, _i("nvfp4"))
    y0 = moe_decode(x, index, weight, gu, down, 0.5, config=cfg)
    y1 = moe_decode(x, index, weight, gu, down, 0.5, config=dataclasses.replace(cfg, maxnreg1=128, maxnreg2=96))
    assert seen == [("_moe_gate_up_kernel", "absent"), ("_moe_down_kernel", "absent"),
                    ("_moe_gate_up_kernel", 128), ("_moe_down_kernel", 96)]
    assert torch.equal(y0, y1)
    for bad in (16, 256, 128.0, True, "128"):
        with pytest.raises(ValueError, match="invalid config"):
            moe_decode(x, index, weight, gu, down, 0.5, config=dataclasses.replace(cfg, maxnreg2=bad))


def test_xvec_and_prefetch_depth_reach_the_launches(monkeypatch):
    """``xvec`` passes XV=True to a launch only where its 16-byte loads apply (nvfp4 fp16x2 path,
    inline PTX: never in the interpreter, so here never) and is otherwise left out, keeping the
    default launches' cache keys; ``prefetch_depth=2`` passes PREFETCH=2 only with ``prefetch``;
    results unchanged; a depth other than 1 or 2, or a non-bool xvec, is refused by name."""
    import memra.kernels.moe_decode as md

    seen = _spy_launches(monkeypatch, lambda kw: (kw.get("XV", "absent"), kw["PREFETCH"]))
    gu, down, _ = _banks("nvfp4", _i("nvfp4"), seed=16)
    g = torch.Generator().manual_seed(17)
    index, weight = _routing(3, 2, 6, g)
    x = torch.randn(3, D, generator=g)
    cfg = dataclasses.replace(_big_tiles("nvfp4", 3, _i("nvfp4")), prefetch=True)
    y0 = moe_decode(x, index, weight, gu, down, 0.5, config=cfg)
    y1 = moe_decode(x, index, weight, gu, down, 0.5, config=dataclasses.replace(cfg, xvec=True, prefetch_depth=2))
    y2 = moe_decode(x, index, weight, gu, down, 0.5,
                    config=dataclasses.replace(cfg, prefetch=False, prefetch_tail=False, prefetch_depth=2))
    assert seen == [("_moe_gate_up_kernel", ("absent", True)), ("_moe_down_kernel", ("absent", True)),
                    ("_moe_gate_up_kernel", ("absent", 2)), ("_moe_down_kernel", ("absent", 2)),
                    ("_moe_gate_up_kernel", ("absent", False)), ("_moe_down_kernel", ("absent", False))]
    assert torch.equal(y0, y1) and torch.equal(y0, y2)
    for bad in (dict(prefetch_depth=3), dict(prefetch_depth=0), dict(xvec=1)):
        with pytest.raises(ValueError, match="invalid config"):
            moe_decode(x, index, weight, gu, down, 0.5, config=dataclasses.replace(cfg, **bad))
    assert md._xvec(dataclasses.replace(cfg, xvec=True), gu, x.to(torch.bfloat16), True)
    assert not md._xvec(dataclasses.replace(cfg, xvec=True), gu, x.to(torch.float16), True)
    assert not md._xvec(dataclasses.replace(cfg, xvec=True), gu, x.to(torch.bfloat16), False)
    assert not md._xvec(dataclasses.replace(cfg, xvec=False), gu, x.to(torch.bfloat16), True)
    assert default_moe_config("nvfp4", 1, 8, 288, 1280, 4096).xvec  # on by default for nvfp4 (H100 sweep)
    assert not default_moe_config("fp8", 1, 8, 288, 1280, 4096).xvec


def test_prefetch_two_steps_ahead():
    """``prefetch_depth=2`` (codes and scales two K steps ahead, the last steps' loads clamped to
    the final step) gives the one-step prefetch's bits with 1, 2 and 4 K steps, in full chunks of 2
    tokens and the 1-token chunks that finish a slot (interpreter)."""
    gu, down, _ = _banks("nvfp4", _i("nvfp4"), seed=18)
    g = torch.Generator().manual_seed(19)
    index, weight = _routing(3, 2, 4, g)
    x = torch.randn(3, D, generator=g)
    r = moe_decode_ref(x, index, weight, gu, down, 0.5)
    for bk1, bk2 in ((D, 64), (D // 2, 32), (D // 4, 32)):
        cfg = dataclasses.replace(_big_tiles("nvfp4", 3, _i("nvfp4")), bk1=bk1, bk2=bk2, nc=2, prefetch=True)
        y0 = moe_decode(x, index, weight, gu, down, 0.5, config=cfg)
        y2 = moe_decode(x, index, weight, gu, down, 0.5, config=dataclasses.replace(cfg, prefetch_depth=2))
        assert torch.equal(y0, y2), (bk1, bk2)
        assert _rel(y2, r) <= 2e-2, (bk1, bk2, _rel(y2, r))


def test_add_accumulates_onto_the_given_tensor():
    """``add=`` (the shared expert's output): y = routed sum + add, add itself untouched."""
    gu, down, _ = _banks("q8_0", _i("q8_0"), seed=10)
    g = torch.Generator().manual_seed(11)
    index, weight = _routing(3, 2, 6, g)
    x = torch.randn(3, D, generator=g)
    add = torch.randn(3, D, generator=g)
    keep = add.clone()
    y = moe_decode(x, index, weight, gu, down, 0.5, add=add)
    assert torch.equal(add, keep)
    assert _rel(y, moe_decode_ref(x, index, weight, gu, down, 0.5) + add) <= 1e-5
    with pytest.raises(ValueError, match="add"):
        moe_decode(x, index, weight, gu, down, 0.5, add=add[:2])


def test_default_config_and_uneven_k():
    """The default launch configuration (several programs per slot) and a D that is not a
    multiple of the loop step (masked K tail), nvfp4 (fp16x2) and bf16 (FMA)."""
    g = torch.Generator().manual_seed(6)
    gu, down, _ = _banks("nvfp4", 64, seed=7)
    index, weight = _routing(2, 2, 4, g)
    x = torch.randn(2, D, generator=g).half()
    y = moe_decode(x, index, weight, gu, down, None)
    assert _rel(y, moe_decode_ref(x, index, weight, gu, down, None)) <= 2e-3
    for fmt in ("nvfp4", "bf16"):
        gu, down, _ = _banks(fmt, 64, d=192, seed=8)
        x = torch.randn(2, 192, generator=g)
        cfg = dataclasses.replace(_big_tiles(fmt, 2, 64, 192), bk1=128, bn=256)
        y = moe_decode(x, index, weight, gu, down, 0.5, config=cfg)
        assert _rel(y, moe_decode_ref(x, index, weight, gu, down, 0.5)) <= (2e-3 if fmt == "nvfp4" else 1e-5), fmt


# ---------------------------------------------------------------------------------------
# agreement with the model's math (memra/models/step3p5.py)


def test_moe_route_matches_model():
    from memra.layers.moe import MoE

    g = torch.Generator().manual_seed(9)
    router = torch.randn(E, D, generator=g) * 0.1
    bias = torch.randn(E, generator=g) * 0.5
    h = torch.randn(5, D, generator=g).to(torch.bfloat16)
    for b in (bias, None):
        moe = MoE(router, b, experts=None, shared=None, top_k=3, scaling=2.5)
        i0, w0 = moe.route(h)
        i1, w1 = moe_route(h, router, b, 3, 2.5)  # the fused kernel's sigmoid may differ by an ulp
        assert torch.equal(i0, i1) and torch.allclose(w0, w1, rtol=1e-6, atol=1e-7)
        assert i1.dtype == torch.int64 and w1.dtype == torch.float32


@pytest.mark.parametrize("shape", [pytest.param((288, 4096, 64), marks=pytest.mark.gpu), (40, 192, 5)],
                         ids=["flagship", "small"])
def test_router_logits_match_reference_and_are_batch_invariant(shape):
    """The decode router GEMV (fused.router_logits: bf16 h read as it is, fp32 sums) against
    ``h.float() @ router^T`` (fp64 error bound), and each token's logits bit-identical whether it is
    routed alone or with the others (the kernel's summation order does not depend on T)."""
    from memra.kernels.fused import router_logits, router_logits_ref

    E_, D_, T = shape
    dev = "cuda" if shape[0] == 288 else ("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(12)
    router = (torch.randn(E_, D_, generator=g) * D_ ** -0.5).to(dev)
    h = (torch.randn(T, D_, generator=g) * 3).to(torch.bfloat16).to(dev)
    got = router_logits(h, router)
    exact = h.double() @ router.double().t()
    bound = 4 * D_ * 2 ** -24 * (h.double().abs() @ router.double().abs().t())  # fp32 summation error
    assert got.dtype == torch.float32 and ((got.double() - exact).abs() <= bound).all()
    assert torch.allclose(got, router_logits_ref(h, router), rtol=1e-5, atol=1e-5)
    for t in (0, T // 2, T - 1):
        assert torch.equal(router_logits(h[t:t + 1], router), got[t:t + 1])
    with pytest.raises(ValueError, match="router must be a contiguous fp32"):
        router_logits(h, router.to(torch.bfloat16))


def test_ref_matches_routed_experts():
    from memra.layers.moe import RoutedExperts

    i = 64
    gu, down, srcs = _banks("nvfp4", i, seed=10)
    experts = RoutedExperts(srcs[0], srcs[1], srcs[2], 0.6, torch.float32)
    g = torch.Generator().manual_seed(11)
    index, weight = _routing(6, 3, 6, g)
    x = torch.randn(6, D, generator=g)
    want = experts(x, index, weight)
    got = moe_decode_ref(x, index, weight, gu, down, 0.6)
    assert _rel(got, want) <= 1e-5
    # and the kernel agrees with both
    assert _rel(moe_decode(x, index, weight, gu, down, 0.6, config=_big_tiles("nvfp4", 6, i)), want) <= 2e-3


# ---------------------------------------------------------------------------------------
# GPU: the flagship shape


FLAG_T = (1, 2, 4, 8, 16, 64)
# nvfp4 fp16x2 path: each expert's GEMVs have the gemv path's ~3-6e-4 error of their own max |y|;
# the weighted sum of 8 experts' outputs cancels partly, so relative to max |y| of the sum the
# error measured on the H200 was 1.8-2.4e-3 (random weights and routing): bound 4e-3.
NVFP4_TOL = 4e-3


@pytest.fixture(scope="module")
def flagship_banks():
    cache = {}

    def get(fmt):
        if fmt not in cache:
            from memra.bench.common import random_moe

            cache.clear()  # one format resident at a time
            torch.cuda.empty_cache()
            cache[fmt] = random_moe(fmt, torch.device("cuda"), seed=1)
        return cache[fmt]

    return get


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_flagship_shape(fmt, flagship_banks):
    from memra.bench.common import random_routing

    gu, down, gen = flagship_banks(fmt)
    for t in FLAG_T:
        index, weight = random_routing(t, 288, 8, "cuda", gen)
        if t >= 4:  # the first t // 2 tokens all choose expert 0 (plus 7 others each)
            h = t // 2
            rest = torch.rand(h, 287, device="cuda", generator=gen).argsort(dim=1)[:, :7] + 1
            index[:h] = torch.cat([torch.zeros(h, 1, dtype=torch.int64, device="cuda"), rest], dim=1)
        x = torch.randn(t, 4096, device="cuda", generator=gen).to(torch.bfloat16) * 0.5
        r = moe_decode_ref(x.float(), index, weight, gu, down, 7.0)
        y32 = moe_decode(x.float(), index, weight, gu, down, 7.0)
        tol = NVFP4_TOL if fmt in ("nvfp4", "fp8") else 1e-5  # the fp16x2 paths (default for both)
        assert _rel(y32, r) <= tol, (fmt, t, _rel(y32, r))
        cfg = dataclasses.replace(default_moe_config(fmt, t, 8, 288, 1280, 4096), group="triton")
        yt = moe_decode(x.float(), index, weight, gu, down, 7.0, config=cfg)
        assert _rel(yt, r) <= tol, (fmt, t, "triton grouping")
        y = moe_decode(x, index, weight, gu, down, 7.0)
        assert y.dtype == torch.bfloat16 and _rel(y, r) <= 1e-2, (fmt, t, _rel(y, r))


@pytest.mark.gpu
def test_flagship_register_caps(flagship_banks):
    """The register caps the sweep tries (benchmarks/moe_occupancy_sweep.py ``maxnreg``, chosen by
    ``benchmarks/sass_census.py --caps``) compile, run and give the uncapped kernels' bits at the
    flagship shape (nvfp4, bf16 x, T = 1, 2, 4)."""
    from memra.bench.common import random_routing

    gu, down, gen = flagship_banks("nvfp4")
    for t in (1, 2, 4):
        index, weight = random_routing(t, 288, 8, "cuda", gen)
        x = (torch.randn(t, 4096, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        r = moe_decode_ref(x.float(), index, weight, gu, down, 7.0)
        base = default_moe_config("nvfp4", t, 8, 288, 1280, 4096)
        y0 = moe_decode(x, index, weight, gu, down, 7.0, config=base)
        for m1, m2 in ((128, None), (None, 96), (120, 80)):
            y = moe_decode(x, index, weight, gu, down, 7.0,
                           config=dataclasses.replace(base, maxnreg1=m1, maxnreg2=m2))
            assert _rel(y, r) <= 1e-2 and torch.equal(y, y0), (t, m1, m2, _rel(y, r))


@pytest.mark.gpu
def test_flagship_xvec_and_prefetch_depth_same_bits(flagship_banks):
    """16-byte activation loads (``xvec``) and the two-step code prefetch (``prefetch_depth=2``)
    give the default kernels' bits at the flagship shape (nvfp4, bf16 x, T = 1, 2, 4, 9: one- and
    two-token chunks and the chunks that finish a slot), with 256- and 512-wide K steps, the
    "atomic" combine with split K (the down kernel's K range starting inside the rows), and an x
    whose rows are not 16-byte aligned (the scalar loads' fallback)."""
    from memra.bench.common import random_routing

    gu, down, gen = flagship_banks("nvfp4")
    for t in (1, 2, 4, 9):
        index, weight = random_routing(t, 288, 8, "cuda", gen)
        x = (torch.randn(t, 4096, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        r = moe_decode_ref(x.float(), index, weight, gu, down, 7.0)
        base = default_moe_config("nvfp4", t, 8, 288, 1280, 4096)
        for b in (base, dataclasses.replace(base, prefetch=True), dataclasses.replace(base, bk1=256, bk2=128),
                  dataclasses.replace(base, combine="atomic", split_k=3, prefetch=True)):
            y0 = moe_decode(x, index, weight, gu, down, 7.0, config=b)
            for kw in (dict(xvec=True), dict(prefetch_depth=2), dict(xvec=True, prefetch_depth=2)):
                y = moe_decode(x, index, weight, gu, down, 7.0, config=dataclasses.replace(b, **kw))
                if b.combine == "atomic":  # the order of a token's k atomic adds varies from run to run
                    assert _rel(y, r) <= 1e-2 and _rel(y, y0) <= 1e-3, (t, b, kw, _rel(y, r))
                else:
                    assert _rel(y, r) <= 1e-2 and torch.equal(y, y0), (t, b, kw, _rel(y, r))
        # contiguous rows starting 2 bytes past a 16-byte boundary: moe_decode keeps it as it is, and
        # _xvec sends it to the scalar loads
        xo = torch.empty(t * 4096 + 8, device="cuda", dtype=torch.bfloat16)[1:1 + t * 4096].view(t, 4096)
        xo.copy_(x)
        assert xo.is_contiguous() and xo.data_ptr() % 16 == 2
        assert torch.equal(moe_decode(xo, index, weight, gu, down, 7.0, config=dataclasses.replace(base, xvec=True)),
                           moe_decode(x, index, weight, gu, down, 7.0, config=base))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,group", [("nvfp4", "torch"), ("fp8", "torch"), ("nvfp4", "triton")])
def test_flagship_cuda_graph(fmt, group, flagship_banks):
    gu, down, gen = flagship_banks(fmt)
    router = torch.randn(288, 4096, device="cuda", generator=gen) * 0.02
    bias = torch.randn(288, device="cuda", generator=gen) * 0.01
    for t in (1, 8, 64):
        xs = torch.randn(t, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        ys = torch.empty_like(xs)

        cfg = dataclasses.replace(default_moe_config(fmt, t, 8, 288, 1280, 4096), group=group)

        def step(xs=xs, ys=ys, cfg=cfg):
            index, weight = moe_route(xs, router, bias, 8, 3.0)
            moe_decode(xs, index, weight, gu, down, 7.0, out=ys, config=cfg)

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(2):
            xs.copy_(torch.randn(t, 4096, device="cuda", generator=gen).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            index, weight = moe_route(xs, router, bias, 8, 3.0)
            eager = moe_decode(xs, index, weight, gu, down, 7.0)
            ref = moe_decode_ref(xs.float(), index, weight, gu, down, 7.0)
            assert _rel(ys, eager) <= 1e-2 and _rel(ys, ref) <= 1e-2, (fmt, t)
        del graph
