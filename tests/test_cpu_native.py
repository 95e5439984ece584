"""memra's native CPU decode kernels (memra/kernels/cpu/decode.c through memra/kernels/cpu_native.py),
each against its torch reference on fresh random data: the quantized GEMV (every packable format,
stacked and mixed parts, SwiGLU fused; int8 activations, and the float32 mode's exact weights), the
packed weights' dequantization, RMSNorm + residual, RoPE on strided views, paged and contiguous
decode attention, top-k, the wrappers' errors, the Linear layer's kernel choice, the builds without
VNNI / AVX2, and smollm2-135m's greedy tokens with the native paths on and off."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_dequant import random_blocks

from memra.kernels import cpu_native
from memra.kernels.fused import swiglu_torch
from memra.kernels.norm_rope import rope_torch
from memra.layers import attention as attention_layer
from memra.layers.linear import NATIVE_MAX_ROWS, Linear, dense_linear
from memra.layers.norm import RMSNorm
from memra.quant.dequant import q6_k_parts
from memra.quant.tensor import QTensor
from memra.quant.types import QTYPE_INFO, QType

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels did not compile here")

Q = QType
KQUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # 256-weight super-blocks: widths a multiple of 256
#: Formats whose fp16-parameter packing is the GGUF weights exactly (their block parameters are fp16).
EXACT = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)


def qtensor(qt: QType, n: int, k: int, rng: np.random.Generator) -> QTensor:
    """A random [n, k] QTensor of format ``qt`` (random codes, finite random fp16 scales)."""
    nb = n * k // QTYPE_INFO[qt].block_size
    return QTensor("w", qt, (n, k), torch.from_numpy(random_blocks(qt, nb, rng).reshape(-1)).view(n, -1))


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (fp64)."""
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def within_bf16(got: torch.Tensor, ref: torch.Tensor, slack: float) -> bool:
    """Whether bf16 ``got`` is within one bf16 rounding of fp32 ``ref`` (2^-8 relative), plus
    ``slack`` absolute (the fp32 math's own error)."""
    return bool(((got.float() - ref).abs() <= ref.abs() * 2.0**-8 + slack).all())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical fp32 tensors (NaN included)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def native_terms(w: cpu_native.NativeWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed weight's codes, scales and offsets, each fp32 [n, k] per weight (from its public
    fields: the kernel's layout as decode.c's header states it)."""
    n, k = w.n, w.k
    if w.fmt == cpu_native.FMT_U4:
        b = w.codes.view(n, -1, 16)
        c = torch.cat([b & 15, b >> 4], dim=2).reshape(n, k).float()
    else:
        c = w.codes.view(torch.int8).float()
    s = w.scales[:, :k // w.wb].float().repeat_interleave(w.wb, dim=1)
    o = torch.zeros(n, k) if w.offsets is None else w.offsets[:, :k // 32].float().repeat_interleave(32, dim=1)
    return c, s, o


def fp32_sum_bound(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Bound [T, N] of an fp32 dot product's rounding against the exact one, whatever its order:
    K * 2^-24 * sum_j |W_j x_j| (the first-order worst case; we take a quarter of K, far above the
    random-walk growth and far below any real error)."""
    return (x.abs().double() @ W.abs().double().t() * (x.shape[1] / 4) * 2.0**-24).float()


def q8_error_bound(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Bound [T, N] of |x W^T - xq W^T| for xq the int8-per-32 quantized activations: each x_j
    moves by at most half its block's step d = max|x| / 127."""
    T, K = x.shape
    d = x.float().view(T, K // 32, 32).abs().amax(-1) / 127.0
    step = (d / 2).repeat_interleave(32, dim=1)  # [T, K]
    return (step.double() @ W.abs().double().t()).float()


# ------------------------------------------------------------------------------------------------
# GEMV

#: Row-stacked parts (format, rows): one format in two parts of different row counts (168 rows:
#: both threads of a 2-core machine, an uneven split), and the mixes the packer takes.
STACKS = {q.name: [(q, 96), (q, 72)] for q in sorted(cpu_native.PACKABLE, key=lambda t: t.value)} | {
    "Q4_0+Q4_1": [(Q.Q4_0, 40), (Q.Q4_1, 24)],  # 64 rows: one thread
    "Q8_0+Q6_K": [(Q.Q8_0, 80), (Q.Q6_K, 56)],  # int8 codes, a scale per 16
    "Q5_0+Q8_0": [(Q.Q5_0, 136), (Q.Q8_0, 8)],  # int8 codes, symmetric: no offsets
    "Q6_K+Q5_0": [(Q.Q6_K, 32), (Q.Q5_0, 104)],
    "Q4_1+Q8_0": [(Q.Q4_1, 48), (Q.Q8_0, 88)],  # int8 codes, unsigned (Q4_1) and signed (Q8_0)
    "Q4_K+Q5_1": [(Q.Q4_K, 72), (Q.Q5_1, 72)],
}


def widths(stack: list[tuple[QType, int]]) -> list[int]:
    """576 is 18 blocks of 32: the kernel's 8-block chunks end in a tail of 2; K-quants need 256 | k."""
    return [256, 768] if any(q in KQUANTS for q, _ in stack) else [256, 576, 896]


GEMV_CASES = [(name, k) for name, stack in STACKS.items() for k in widths(stack)]


def make_stack(name: str, k: int, seed: int) -> tuple[list[QTensor], torch.Tensor]:
    rng = np.random.default_rng(seed)
    parts = [qtensor(q, n, k, rng) for q, n in STACKS[name]]
    return parts, torch.cat([p.dequantize() for p in parts])


@pytest.mark.parametrize("name,k", GEMV_CASES, ids=[f"{n}-k{k}" for n, k in GEMV_CASES])
def test_gemv_matches_twin_and_exact_product(name, k):
    """Native GEMV at T in {1, 2, 3, 4, 5, 8} rows (the 4-token groups and their remainders), x fp32
    and bf16, with and without bias, out fp32 and bf16: against gemv_torch (same int8 activations,
    float64, exact integer dots; per row, so one 8-row twin serves every T) to 1e-5 of the output's
    max; the bf16 output is the fp32 output rounded once (bit-identical); against the exact x @ W^T
    within the activation quantization's own bound (per output: sum_j |W_j| * step_j / 2) and 5e-2
    of the max overall."""
    parts, W = make_stack(name, k, seed=k)
    w = cpu_native.pack_weight(parts)
    assert (w.n, w.k) == (W.shape[0], k)
    g = torch.Generator().manual_seed(k + 1)
    for x_dtype in (torch.float32, torch.bfloat16):
        x8 = torch.randn(8, k, generator=g).to(x_dtype)
        bound8 = q8_error_bound(x8, W)
        for with_bias in (False, True):
            bias = torch.randn(w.n, generator=g) * 10 if with_bias else None
            twin8 = cpu_native.gemv_torch(x8, w, bias)
            exact8 = x8.float() @ W.t() + (0 if bias is None else bias)
            for T in (1, 2, 3, 4, 5, 8):
                what = f"T={T} x={x_dtype} bias={with_bias}"
                x, twin, exact = x8[:T], twin8[:T], exact8[:T]
                y = cpu_native.gemv(x, w, bias, out_dtype=torch.float32)
                assert y.shape == (T, w.n) and y.dtype == torch.float32
                assert rel(y, twin) < 1e-5, (what, rel(y, twin))
                yb = cpu_native.gemv(x, w, bias, out_dtype=torch.bfloat16)
                assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.to(torch.bfloat16)), what
                bound = bound8[:T] + 1e-5 * exact.abs().max()
                assert bool(((y - exact).abs() <= bound).all()), (what, rel(y, exact))
                assert rel(y, exact) < 5e-2, (what, rel(y, exact))
            assert cpu_native.gemv(x8, w, bias).dtype == x_dtype  # out_dtype defaults to x's


@pytest.mark.parametrize("name", list(STACKS))
def test_gemv_exact_weights(name):
    """The float32 mode's GEMV (pack_weight(exact=True): fp32 block parameters, fp32 activations,
    weights decoded in registers) at T in {1, 2, 3, 4, 5, 8}, with and without bias: against
    gemv_torch (x times the decoded weights in float64) and the exact x @ W^T of QTensor.dequantize,
    both within the fp32 sum's rounding bound; SwiGLU against swiglu_torch of the plain product.
    bf16 in or out is a ValueError."""
    k = 768 if any(q in KQUANTS for q, _ in STACKS[name]) else 576
    parts, W = make_stack(name, k, seed=13)
    w = cpu_native.pack_weight(parts, exact=True)
    assert w.exact and w.scales.dtype == torch.float32
    g = torch.Generator().manual_seed(14)
    x8 = torch.randn(8, k, generator=g)
    for with_bias in (False, True):
        bias = torch.randn(w.n, generator=g) if with_bias else None
        exact8 = (x8.double() @ W.double().t() + (0 if bias is None else bias.double())).float()
        twin8 = cpu_native.gemv_torch(x8, w, bias)
        bound8 = fp32_sum_bound(x8, W) + 1e-6 * (0 if bias is None else bias.abs()) + 1e-30
        for T in (1, 2, 3, 4, 5, 8):
            y = cpu_native.gemv(x8[:T], w, bias)
            assert y.dtype == torch.float32 and y.shape == (T, w.n)
            for ref in (exact8[:T], twin8[:T]):
                assert bool(((y - ref).abs() <= bound8[:T]).all()), (T, with_bias, rel(y, ref))
    if w.n % 2 == 0:
        for lim in (None, 1.0):
            y = cpu_native.gemv(x8[:3], w, bias, mode=cpu_native.MODE_SWIGLU, limit=lim)
            plain = cpu_native.gemv(x8[:3], w, bias)
            ref = swiglu_torch(*plain.chunk(2, dim=-1), lim)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    with pytest.raises(ValueError, match="exact takes and gives fp32"):
        cpu_native.gemv(x8.to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="exact takes and gives fp32"):
        cpu_native.gemv(x8, w, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("name", list(STACKS))
def test_native_weight_dequantize(name):
    """NativeWeight.dequantize against QTensor.dequantize (the gguf-checked dequantizer). Packed
    exact (fp32 block parameters): bit-exact for every format. Packed with fp16 parameters:
    bit-exact where every part is Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (their parameters are fp16);
    K-quants and Q6_K each weight within one fp16 rounding of its block parameters (|scale * code|
    + |offset|, 2^-11 relative; 2^-25 absolute for fp16 subnormals). Also the layout the kernel
    relies on: parameter rows padded with zeros to a multiple of 8 blocks of 32, and dequantize
    = scale * code + offset."""
    k = 768 if any(q in KQUANTS for q, _ in STACKS[name]) else 576
    parts, W = make_stack(name, k, seed=7)
    nbp = -(-k // 256) * 8
    for exact in (False, True):
        w = cpu_native.pack_weight(parts, exact=exact)
        assert w.exact == exact and w.nbp == nbp
        assert w.scales.dtype == (torch.float32 if exact else torch.float16)
        assert w.scales.shape == (w.n, nbp * 32 // w.wb) and bool((w.scales[:, k // w.wb:] == 0).all())
        if w.offsets is not None:
            assert w.offsets.shape == (w.n, nbp) and bool((w.offsets[:, k // 32:] == 0).all())
        assert w.nbytes == sum(t.numel() * t.element_size() for t in (w.codes, w.scales, w.offsets) if t is not None)
        dq = w.dequantize()
        c, s, o = native_terms(w)
        assert torch.equal(dq, (c.double() * s.double() + o.double()).float())
        if exact or all(q in EXACT for q, _ in STACKS[name]):
            assert torch.equal(dq, W), (exact, rel(dq, W))
        else:
            bound = 2.0**-11 * 1.01 * ((s * c).abs() + o.abs()) + 2.0**-25 * (c.abs() + 1)
            assert bool(((dq - W).abs() <= bound).all()), rel(dq, W)


def test_q6_k_parts_are_the_dequantized_weights():
    """q6_k_parts: codes in -32..31 and a scale per 16 whose product is QTensor.dequantize bit-exactly;
    ValueError for anything but whole 210-byte blocks."""
    qt = qtensor(Q.Q6_K, 12, 512, np.random.default_rng(3))
    codes, scale = q6_k_parts(qt.data.reshape(-1))
    assert codes.dtype == torch.int8 and codes.shape == (12 * 512,) and scale.shape == (12 * 512 // 16,)
    assert int(codes.min()) == -32 and int(codes.max()) == 31
    w = (codes.float().view(-1, 16) * scale[:, None]).view(12, 512)
    assert torch.equal(w, qt.dequantize())
    with pytest.raises(ValueError, match="210-byte"):
        q6_k_parts(qt.data.reshape(-1)[:-1])


def swiglu_bound(g: torch.Tensor, u: torch.Tensor, bg: torch.Tensor, bu: torch.Tensor, lim: float | None
                 ) -> torch.Tensor:
    """Bound of |swiglu(g', u') - swiglu(g, u)| for |g' - g| <= bg, |u' - u| <= bu: silu is
    1.1-Lipschitz and the clamps 1-Lipschitz, so it is 1.1 bg (|u| + bu) + (|a| + 1.1 bg) bu with a,
    u the clamped silu(g) and u."""
    a = F.silu(g)
    if lim is not None:
        a, u = a.clamp(max=lim), u.clamp(-lim, lim)
    return 1.1 * bg * (u.abs() + bu) + (a.abs() + 1.1 * bg) * bu


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0+Q6_K", "Q4_1+Q8_0"])
@pytest.mark.parametrize("limit", [None, "clamps"])
def test_gemv_swiglu(name, limit):
    """MODE_SWIGLU (rows [gate | up]) -> silu(gate) * up [T, N / 2] with the optional clamp, T in
    {1, 3, 4, 5}, with bias: against swiglu_torch of the native plain product (the same fp32 dots:
    1e-5 per value), against gemv_torch in the same mode and swiglu_torch of the exact x @ W^T, each
    within its plain product's error (1e-5 of the max; the int8 activations' bound) carried through
    silu and the product. The bf16 output is the fp32 one rounded once. ``limit`` is chosen so that
    some gates and ups are clamped and some are not."""
    rng = np.random.default_rng(11)
    (qg, _), (qu, _) = STACKS[name]
    k, inter = 256, 136  # 136 rows per half: both threads
    parts = [qtensor(qg, inter, k, rng), qtensor(qu, inter, k, rng)]
    w = cpu_native.pack_weight(parts)
    W = torch.cat([p.dequantize() for p in parts])
    g = torch.Generator().manual_seed(12)
    for T in (1, 3, 4, 5):
        x = torch.randn(T, k, generator=g).to(torch.bfloat16)
        bias = torch.randn(2 * inter, generator=g)
        plain = cpu_native.gemv(x, w, bias, out_dtype=torch.float32)
        gate, up = plain.chunk(2, dim=-1)
        lim = None
        if limit is not None:
            lim = min(float(up.abs().median()), float(F.silu(gate).quantile(0.75)))
            a = F.silu(gate)
            assert bool((a > lim).any() and (a < lim).any() and (up.abs() > lim).any() and (up.abs() < lim).any())
        y = cpu_native.gemv(x, w, bias, out_dtype=torch.float32, mode=cpu_native.MODE_SWIGLU, limit=lim)
        assert y.shape == (T, inter) and y.dtype == torch.float32
        ref = swiglu_torch(gate, up, lim)
        assert bool(((y - ref).abs() <= 1e-5 * ref.abs() + 1e-6 * ref.abs().max()).all()), T
        twin_plain = cpu_native.gemv_torch(x, w, bias)
        d = torch.full_like(gate, 1e-5 * float(twin_plain.abs().max()))
        twin = cpu_native.gemv_torch(x, w, bias, mode=cpu_native.MODE_SWIGLU, limit=lim)
        assert bool(((y - twin).abs() <= swiglu_bound(*twin_plain.chunk(2, dim=-1), d, d, lim) + 1e-30).all()), T
        ge, ue = (x.float() @ W.t() + bias).chunk(2, dim=-1)
        bg, bu = (b + 1e-5 * e.abs().max() for b, e in zip(q8_error_bound(x, W).chunk(2, dim=-1), (ge, ue)))
        assert bool(((y - swiglu_torch(ge, ue, lim)).abs() <= swiglu_bound(ge, ue, bg, bu, lim)).all()), T
        yb = cpu_native.gemv(x, w, bias, mode=cpu_native.MODE_SWIGLU, limit=lim)
        assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.to(torch.bfloat16))


def test_gemv_threads_and_concurrent_callers():
    """The output does not depend on the thread count (each row is one thread's, in a fixed order),
    and Python threads calling at once (ctypes releases the GIL; each has its own scratch) get what
    one caller gets, across calls of different row counts (the scratch regrows) alternating int8
    (bf16 x) and exact (fp32 x) weights, which share the scratch."""
    parts, _ = make_stack("Q4_K+Q5_1", 256, seed=5)
    w, we = cpu_native.pack_weight(parts), cpu_native.pack_weight(parts, exact=True)
    g = torch.Generator().manual_seed(6)
    calls = [(torch.randn(t, 256, generator=g).to(dtype), w if dtype == torch.bfloat16 else we)
             for t in (1, 8, 3, 5, 2, 4) * 3 for dtype in (torch.bfloat16, torch.float32)]
    ref = [cpu_native.gemv(x, v) for x, v in calls]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert all(torch.equal(cpu_native.gemv(x, v), r) for (x, v), r in zip(calls, ref))
    finally:
        torch.set_num_threads(threads)
    results: dict[int, list[torch.Tensor]] = {}

    def work(i: int) -> None:
        results[i] = [cpu_native.gemv(x, v) for _ in range(3) for x, v in calls[i::3]]

    pool = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    for i in range(3):
        assert len(results[i]) == 3 * len(ref[i::3])
        assert all(torch.equal(a, b) for a, b in zip(results[i], ref[i::3] * 3)), i


def test_gemv_of_no_rows():
    """x [0, K] gives y [0, N] (int8 and exact weights), also as a thread's first call (a fresh
    thread: no scratch allocated yet)."""
    parts = [qtensor(Q.Q4_0, 64, 256, np.random.default_rng(81))]
    w, we = cpu_native.pack_weight(parts), cpu_native.pack_weight(parts, exact=True)
    box: list = []

    def first_call() -> None:
        try:
            box.extend(cpu_native.gemv(torch.randn(0, 256), v).shape for v in (w, we))
        except RuntimeError as e:
            box.append(e)

    t = threading.Thread(target=first_call)
    t.start()
    t.join()
    assert box == [torch.Size([0, 64])] * 2, box


# ------------------------------------------------------------------------------------------------
# RMSNorm + residual, RoPE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("with_residual", [False, True], ids=["x", "x+res"])
def test_rms_norm_add(dtype, T, with_residual):
    """rms_norm_add: s = residual + x in fp32 (bit-exact: one fp32 add, or x widened), the residual
    not modified, and out = rmsnorm(s) * weight against torch's fp32 F.rms_norm (fp32: 2e-6 of each
    value's magnitude; bf16: within one bf16 rounding), rows of mean square 1e-4 .. 4 next to
    eps = 1e-2 (so eps counts); then RMSNorm.add (memra/layers/norm.py) with the native paths on is
    the native call, and with them off agrees the same way."""
    D, eps = 576, 1e-2
    g = torch.Generator().manual_seed(T * 10 + with_residual)
    rows = torch.tensor([0.1, 0.01, 2.0])[:T, None]
    x = (torch.randn(T, D, generator=g) * rows).to(dtype)
    weight = 1 + 0.5 * torch.randn(D, generator=g)
    residual = torch.randn(T, D, generator=g) * rows if with_residual else None
    kept = None if residual is None else residual.clone()
    out, s = cpu_native.rms_norm_add(x, weight, eps, residual)
    assert out.dtype == dtype and out.shape == (T, D) and s.dtype == torch.float32
    s_ref = x.float() if residual is None else residual + x.float()
    assert torch.equal(s, s_ref)
    if residual is not None:
        assert torch.equal(residual, kept)
    ref = F.rms_norm(s_ref, (D,), weight, eps)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    else:
        assert within_bf16(out, ref, 1e-5)
    norm = RMSNorm(weight, eps)
    n_out, n_s = norm.add(x, residual)
    assert torch.equal(n_out, out) and torch.equal(n_s, s)
    cpu_native.ENABLED, was = False, cpu_native.ENABLED
    try:
        t_out, t_s = norm.add(x, residual)
    finally:
        cpu_native.ENABLED = was
    assert torch.equal(t_s, s) and t_out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, t_out, rtol=2e-6, atol=1e-6)
    else:  # two roundings of nearly the same fp32 value: at most one bf16 step apart
        assert bool(((out.float() - t_out.float()).abs() <= t_out.float().abs() * 2.0**-7 + 1e-5).all())


def rope_tables(T: int, rot: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rot] of random positions (NeoX layout: the frequencies twice)."""
    pos = torch.randint(0, 4096, (T,), generator=g).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rot", [64, 32, 48], ids=["full", "half", "partial48"])
@pytest.mark.parametrize("T", [1, 3])
def test_rope_on_strided_views(dtype, rot, T):
    """rope_ in place on the q and k views of one [T, (H + 2 KV) D] qkv row (split + view, as
    memra/layers/attention.py makes them: rows strided, heads contiguous), cos / sin in x's dtype and
    in fp32: against rope_torch in fp32 (fp32: 1e-6; bf16: within one bf16 rounding); every other
    column of the qkv tensor (v, the dims past ``rot``) bit-identical to before; q and k's heads
    rotated in one call as one [T, H + KV, D] view give the same bits."""
    H, KV, D = 5, 2, 64
    g = torch.Generator().manual_seed(rot * 10 + T)
    for cs_dtype in dict.fromkeys([dtype, torch.float32]):  # x's dtype, then fp32 (once for fp32 x)
        qkv = torch.randn(T, (H + 2 * KV) * D, generator=g).to(dtype)
        before = qkv.clone()
        cos, sin = rope_tables(T, rot, cs_dtype, g)
        q, k, _ = qkv.split([H * D, KV * D, KV * D], dim=-1)
        q, k = q.view(T, H, D), k.view(T, KV, D)
        assert q.stride()[1:] == (D, 1) and (T == 1 or q.stride(0) == (H + 2 * KV) * D)
        refs = [rope_torch(t.float(), cos.float(), sin.float()) for t in (q, k)]
        for t, ref in zip((q, k), refs):
            assert cpu_native.rope_(t, cos, sin) is t
            if dtype == torch.float32:
                torch.testing.assert_close(t, ref, rtol=1e-6, atol=1e-6)
            else:
                assert within_bf16(t, ref, 1e-6), (t.float() - ref).abs().max()
        again = before.clone()  # q and k heads in one call (adjacent in the row, as Attention.norm_rope does)
        cpu_native.rope_(again[:, :(H + KV) * D].view(T, H + KV, D), cos, sin)
        assert torch.equal(again, qkv)
        heads = qkv.view(T, H + 2 * KV, D)
        moved = torch.zeros_like(heads, dtype=torch.bool)
        moved[:, :H + KV, :rot] = True
        assert torch.equal(heads[~moved], before.view(T, H + 2 * KV, D)[~moved])


# ------------------------------------------------------------------------------------------------
# decode attention


def attention_ref(q, kc, vc, slots, lens, scale):
    """memra.layers.attention.decode_attention on the gathered keys with the valid mask (the
    garbage slots zeroed first: torch's p * v would carry their NaN through a zero weight)."""
    L = slots.shape[1]
    valid = torch.arange(L)[None, :] < lens[:, None]
    clean = valid[:, :, None, None]
    k = torch.where(clean, kc[slots], 0.0)
    v = torch.where(clean, vc[slots], 0.0)
    return attention_layer.decode_attention(q.float(), k, v, valid, scale)  # fp32 out: one rounding to compare


def attention_close(got, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)
    else:
        assert got.dtype == torch.bfloat16 and within_bf16(got, ref.float(), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 3, 4], ids=lambda g: f"H/KV={g}")
def test_decode_attention(dtype, D, G):
    """decode_attention, contiguous form (start / length) and paged form (slots [B, L] a random
    permutation, B = 3 with lens 23 / 1 / 40, the padding slots past each len pointing at NaN- and
    1e30-filled slots that must not leak), GQA: against memra.layers.attention.decode_attention on
    the gathered keys (fp32: 1e-5; bf16 q: within one bf16 rounding). Batch invariance: each
    sequence's output alone is bit-identical to its row in the batch, and with one thread."""
    KV = 2
    H = KV * G
    S, L, scale = 160, 40, D**-0.5
    g = torch.Generator().manual_seed(D * 10 + G)
    kc = torch.randn(S, KV, D, generator=g) * 2
    vc = torch.randn(S, KV, D, generator=g)
    perm = torch.randperm(S, generator=g)
    bad, good = perm[:20], perm[20:]
    kc[bad[:10]], vc[bad[:10]] = float("nan"), float("nan")
    kc[bad[10:]], vc[bad[10:]] = 1e30, -1e30
    lens = torch.tensor([23, 1, 40])
    slots = good[:3 * L].reshape(3, L).clone()
    for b in range(3):  # padding: garbage slots
        slots[b, lens[b]:] = bad[torch.randint(0, 20, (L - int(lens[b]),), generator=g)]
    q = torch.randn(3, H, D, generator=g).to(dtype)
    # paged
    got = cpu_native.decode_attention(q, kc, vc, scale, slots=slots, lens=lens)
    assert got.shape == q.shape and got.dtype == dtype and bool(torch.isfinite(got).all())
    attention_close(got, attention_ref(q, kc, vc, slots, lens, scale), dtype)
    for b in range(3):
        alone = cpu_native.decode_attention(q[b:b + 1], kc, vc, scale, slots=slots[b:b + 1], lens=lens[b:b + 1])
        assert torch.equal(alone, got[b:b + 1]), b
        trimmed = cpu_native.decode_attention(q[b:b + 1], kc, vc, scale, slots=slots[b:b + 1, :lens[b]])
        assert torch.equal(trimmed, alone), b  # lens None: all L
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_native.decode_attention(q, kc, vc, scale, slots=slots, lens=lens), got)
    finally:
        torch.set_num_threads(threads)
    # contiguous: keys start .. start + length - 1, the slots around them garbage
    kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    start, length = 37, 29
    kc2[start:start + length], vc2[start:start + length] = kc[good[:length]], vc[good[:length]]
    got2 = cpu_native.decode_attention(q, kc2, vc2, scale, start=start, length=length)
    run = torch.arange(start, start + length).expand(3, length)
    ref2 = attention_layer.decode_attention(q.float(), kc2[run], vc2[run], None, scale)
    attention_close(got2, ref2, dtype)
    assert torch.equal(got2, cpu_native.decode_attention(q, kc2, vc2, scale, slots=run.contiguous()))
    assert torch.equal(got2[1:2], cpu_native.decode_attention(q[1:2], kc2, vc2, scale, start=start, length=length))
    tail = cpu_native.decode_attention(q, kc2[:start + length].contiguous(), vc2[:start + length].contiguous(), scale,
                                       start=start)  # length None: to the cache's end
    assert torch.equal(tail, got2)


@pytest.mark.parametrize("new_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_attention_writes_the_step(new_dtype):
    """decode_attention with k_new / v_new: this step's keys and values land in their cache slots
    (widened to fp32, bit-exact; nothing else in the caches changes) before the query reads them,
    so the output is bit-identical to writing them with torch first and attending then. Contiguous
    form (write_pos, B = 1) and paged form (write_slots, B = 3, each sequence's last key the new
    one), GQA 6 / 2, the new rows contiguous [B, KV, D]."""
    H, KV, D, S, scale = 6, 2, 64, 96, 0.125
    g = torch.Generator().manual_seed(71)
    kc, vc = torch.randn(S, KV, D, generator=g), torch.randn(S, KV, D, generator=g)
    # contiguous: keys 0 .. pos - 1 cached, the new one at pos; the slots after it garbage
    pos = 41
    kc[pos + 1:], vc[pos + 1:] = float("nan"), float("nan")
    q = torch.randn(1, H, D, generator=g)
    k_new, v_new = (torch.randn(1, KV, D, generator=g).to(new_dtype) for _ in range(2))
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k[pos], ref_v[pos] = k_new[0].float(), v_new[0].float()
    ref = cpu_native.decode_attention(q, ref_k, ref_v, scale, start=3, length=pos + 1 - 3)
    got = cpu_native.decode_attention(q, kc, vc, scale, start=3, length=pos + 1 - 3, k_new=k_new, v_new=v_new,
                                      write_pos=pos)
    assert same_bits(kc, ref_k) and same_bits(vc, ref_v) and torch.equal(got, ref)
    # paged: fresh slots per sequence, the written one last
    lens = torch.tensor([5, 1, 12])
    perm = torch.randperm(S, generator=g)
    slots = perm[:36].view(3, 12).clone()
    ws = slots[torch.arange(3), lens - 1].contiguous()
    q = torch.randn(3, H, D, generator=g)
    k_new, v_new = (torch.randn(3, KV, D, generator=g).to(new_dtype) for _ in range(2))
    kc.normal_(generator=g)
    vc.normal_(generator=g)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k[ws], ref_v[ws] = k_new.float(), v_new.float()
    ref = cpu_native.decode_attention(q, ref_k, ref_v, scale, slots=slots, lens=lens)
    attention_close(ref, attention_ref(q, ref_k, ref_v, slots, lens, scale), torch.float32)
    got = cpu_native.decode_attention(q, kc, vc, scale, slots=slots, lens=lens, k_new=k_new, v_new=v_new,
                                      write_slots=ws)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v) and torch.equal(got, ref)
    bad = dict(k_new=k_new, v_new=v_new, write_pos=0)  # write_pos needs B = 1
    with pytest.raises(ValueError, match="native decode_attention"):
        cpu_native.decode_attention(q, kc, vc, scale, slots=slots, lens=lens, **bad)
    with pytest.raises(ValueError, match="native decode_attention"):
        cpu_native.decode_attention(q, kc, vc, scale, slots=slots, k_new=k_new, v_new=v_new[:, :1], write_slots=ws)


def test_decode_attention_writes_strided_new_rows():
    """k_new / v_new as the strided views of a qkv row that memra/layers/attention.py makes (B = 3:
    not contiguous) are written as they are."""
    H, KV, D, S = 4, 2, 64, 100
    g = torch.Generator().manual_seed(72)
    kc, vc = torch.randn(S, KV, D, generator=g), torch.randn(S, KV, D, generator=g)
    qkv = torch.randn(3, (H + 2 * KV) * D, generator=g)
    q = qkv[:, :H * D].reshape(3, H, D)
    k_new, v_new = qkv[:, H * D:(H + KV) * D].view(3, KV, D), qkv[:, (H + KV) * D:].view(3, KV, D)
    assert not k_new.is_contiguous()
    slots = torch.arange(48).view(3, 16)
    ws = slots[:, -1].contiguous()
    cpu_native.decode_attention(q, kc, vc, 0.1, slots=slots, k_new=k_new, v_new=v_new, write_slots=ws)
    assert torch.equal(kc[ws], k_new) and torch.equal(vc[ws], v_new)


# ------------------------------------------------------------------------------------------------
# errors


def test_errors_name_the_problem():
    """Bad formats, shapes and dtypes raise ValueError saying what is wrong (before any native call)."""
    rng = np.random.default_rng(0)
    q4 = qtensor(Q.Q4_0, 32, 256, rng)
    f32 = QTensor("w", Q.F32, (32, 256), torch.randn(32, 256))
    bf16 = QTensor("w", Q.BF16, (32, 256), torch.randn(32, 256).to(torch.bfloat16))
    for parts in ([f32], [bf16], [q4, f32]):
        assert not cpu_native.packable(parts)
        with pytest.raises(ValueError, match="pack_weight:.*not 2-D parts of equal width"):
            cpu_native.pack_weight(parts)
    mix = [qtensor(Q.Q6_K, 16, 256, rng), qtensor(Q.Q4_1, 16, 256, rng)]
    assert not cpu_native.packable(mix)
    with pytest.raises(ValueError, match="Q6_K, a scale per 16, stacks only with Q8_0 / Q5_0"):
        cpu_native.pack_weight(mix)
    with pytest.raises(ValueError, match="pack_weight"):
        cpu_native.pack_weight([q4, qtensor(Q.Q4_0, 32, 512, rng)])  # widths differ
    with pytest.raises(ValueError, match="pack_weight"):
        cpu_native.pack_weight([])
    big = random_blocks(Q.Q4_K, 4, rng)
    big[:, 0:2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # d * sc past fp16's max
    big[:, 4:16] = 0xFF
    with pytest.raises(ValueError, match="does not fit fp16"):
        cpu_native.pack_weight([QTensor("w", Q.Q4_K, (4, 256), torch.from_numpy(big.reshape(-1)).view(4, -1))])

    w = cpu_native.pack_weight([q4])
    for x in (torch.randn(2, 288), torch.randn(256), torch.randn(2, 256).half()):
        with pytest.raises(ValueError, match=r"native gemv: x must be \[T, 256\] fp32 or bf16"):
            cpu_native.gemv(x, w)

    q = torch.randn(2, 4, 64)
    kc = torch.randn(10, 2, 64)
    with pytest.raises(ValueError, match="caches torch.float16"):
        cpu_native.decode_attention(q, kc.half(), kc.half(), 0.1, start=0, length=10)
    with pytest.raises(ValueError, match="native decode_attention"):
        cpu_native.decode_attention(torch.randn(2, 3, 64), kc, kc, 0.1)  # H % KV
    with pytest.raises(ValueError, match="native decode_attention"):
        cpu_native.decode_attention(q, kc, kc, 0.1, start=4, length=7)  # past the cache
    with pytest.raises(ValueError, match="native decode_attention"):
        cpu_native.decode_attention(q, kc, kc, 0.1, slots=torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="native decode_attention"):
        cpu_native.decode_attention(q, kc, kc.transpose(0, 1).contiguous().transpose(0, 1), 0.1)

    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="native rms_norm_add"):
        cpu_native.rms_norm_add(x, torch.ones(64, dtype=torch.bfloat16), 1e-6, None)
    with pytest.raises(ValueError, match="native rms_norm_add"):
        cpu_native.rms_norm_add(x, torch.ones(64), 1e-6, torch.randn(2, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match="native rms_norm_add"):
        cpu_native.rms_norm_add(x, torch.ones(32), 1e-6, None)

    x3 = torch.randn(2, 3, 64)
    cos = torch.randn(2, 64)
    with pytest.raises(ValueError, match="native rope_"):
        cpu_native.rope_(x3.transpose(1, 2).contiguous().transpose(1, 2), cos, cos)  # heads not contiguous
    with pytest.raises(ValueError, match="native rope_"):
        cpu_native.rope_(x3, cos[:, :63], cos[:, :63])  # odd rot
    with pytest.raises(ValueError, match="native rope_"):
        cpu_native.rope_(x3, torch.randn(2, 66), torch.randn(2, 66))  # rot > hd
    with pytest.raises(ValueError, match="native rope_"):
        cpu_native.rope_(x3, cos, cos.to(torch.bfloat16))
    with pytest.raises(ValueError, match="native rope_"):
        cpu_native.rope_(x3.half(), cos, cos)


# ------------------------------------------------------------------------------------------------
# the Linear layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_linear_picks_native_and_matches_dense(dtype):
    """A Linear over packable parts (Q8_0 + Q6_K rows; Q4_0 + Q4_1 rows) takes kernel "native" (bf16:
    int8 activations; fp32: the exact weights). Up to NATIVE_MAX_ROWS rows (also as [2, 2, K]) its
    output is the native GEMV's exactly and the fp32 dequantized product's within the kernel's error
    bound (bf16: the int8 activations' and 5e-2 of the max; fp32: the fp32 sum's); more rows take
    the dense GEMM (dense_linear over the stored weight, bit-exact; fp32 also within the fp32 sum's
    bound). Linear.swiglu is the fused call."""
    rng = np.random.default_rng(21)
    g = torch.Generator().manual_seed(22)
    for stack in ([(Q.Q8_0, 48), (Q.Q6_K, 80)], [(Q.Q4_0, 64), (Q.Q4_1, 64)]):
        parts = [qtensor(q, n, 256, rng) for q, n in stack]
        bias = torch.randn(128, generator=g)
        lin = Linear(parts, bias, dtype)
        assert lin.kernel == "native" and not lin.transposed
        W = torch.cat([p.dequantize() for p in parts])
        for T in range(1, NATIVE_MAX_ROWS + 3):
            x = torch.randn(T, 256, generator=g).to(dtype)
            y = lin(x.float())  # the fp32 residual stream in: the layer casts to its dtype
            assert y.dtype == dtype and y.shape == (T, 128)
            if T <= NATIVE_MAX_ROWS:
                assert lin.native_rows(x) and lin.native.exact == (dtype == torch.float32)
                assert torch.equal(y, cpu_native.gemv(x, lin.native, lin.bias))
                exact = x.float() @ W.t() + lin.bias.float()
                if dtype == torch.float32:
                    assert bool(((y - exact).abs() <= fp32_sum_bound(x, W) + 1e-6 * bias.abs()).all())
                else:
                    bound = q8_error_bound(x, W) + 2.0**-8 * exact.abs() + 1e-5 * exact.abs().max()
                    assert bool(((y.float() - exact).abs() <= bound).all()) and rel(y, exact) < 5e-2, T
            else:  # the dense GEMM (float32: oneDNN's, memra.layers.linear.dense_linear), vs the fp32 product
                assert not lin.native_rows(x)
                assert torch.equal(y, dense_linear(x, lin.stored, lin.bias))
                if dtype == torch.float32:
                    exact = x.double() @ W.double().t() + lin.bias.double()
                    assert bool(((y.double() - exact).abs() <= fp32_sum_bound(x, W) + 1e-6 * bias.abs()).all())
        x4 = torch.randn(2, 2, 256, generator=g).to(dtype)
        assert torch.equal(lin(x4), lin(x4.view(4, 256)).view(2, 2, 128))
        x = torch.randn(3, 256, generator=g).to(dtype)
        gate, up = cpu_native.gemv(x, lin.native, lin.bias, out_dtype=torch.float32).chunk(2, dim=-1)
        ref = swiglu_torch(gate, up, None)
        assert lin.swiglu(x).dtype == dtype
        assert bool(((lin.swiglu(x).float() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-5 * ref.abs().max()).all())
        with pytest.raises(ValueError, match="Linear.swiglu"):
            lin.swiglu(torch.randn(NATIVE_MAX_ROWS + 1, 256).to(dtype))


def test_linear_kernel_choice_without_native(torch_cpu_paths):
    """With the native paths off (torch_cpu_paths) a bf16 Linear of per-32 affine parts picks "int4",
    Q6_K (no per-32 affine form) "dense"; fp32 "dense" (stored transposed)."""
    rng = np.random.default_rng(31)
    assert not cpu_native.enabled()
    assert Linear([qtensor(Q.Q4_0, 64, 256, rng), qtensor(Q.Q8_0, 64, 256, rng)], dtype=torch.bfloat16).kernel == "int4"
    assert Linear(qtensor(Q.Q6_K, 64, 256, rng), dtype=torch.bfloat16).kernel == "dense"
    lin = Linear(qtensor(Q.Q4_K, 64, 256, rng), dtype=torch.float32)
    assert lin.kernel == "dense" and lin.transposed


# ------------------------------------------------------------------------------------------------
# top-k


def test_topk_indices():
    """topk_indices against torch.topk on random rows (k in {1, 8, 64}; the same values, the same
    indices: no ties in random fp32), ties to the lower index, NaN never chosen (a row with fewer
    than k others repeats index 0), -inf taken like any value; ValueError outside 1 <= k <= 64."""
    g = torch.Generator().manual_seed(61)
    y = torch.randn(5, 49152 + 7, generator=g)
    for k in (1, 8, 64):
        ref = y.topk(k, dim=-1)
        got = cpu_native.topk_indices(y, k)
        assert got.dtype == torch.int64 and torch.equal(got, ref.indices), k
    y = torch.tensor([[1.0, float("nan"), 3.0, 3.0, 2.0, float("-inf")],
                      [float("nan"), float("-inf"), float("nan"), 0.0, float("nan"), float("nan")]])
    assert cpu_native.topk_indices(y, 3).tolist() == [[2, 3, 4], [3, 1, 0]]
    assert cpu_native.topk_indices(y[:, 1:].contiguous(), 1).tolist() == [[1], [2]]
    for bad, k in ((y, 0), (y, 7), (torch.randn(2, 100), 65), (y.double(), 1), (y[0], 1)):
        with pytest.raises(ValueError, match="native topk_indices"):
            cpu_native.topk_indices(bad, k)


# ------------------------------------------------------------------------------------------------
# builds without VNNI / without AVX2


@pytest.mark.parametrize("flags", ["avx2", "portable"])
def test_other_builds_agree(flags, tmp_path, monkeypatch):
    """decode.c built for a CPU with AVX2 but no VNNI (maddubs / madd dots) and for one without AVX2
    (the portable C loops, the software fp16 conversion, fp16 subnormal scales included): the int8
    GEMV (U4, S8 with offsets, a scale per 16, the 8-block tail, T up to 5) against gemv_torch to
    1e-5 of the max; the exact GEMV, decode attention (GQA, a key count off the 8 lanes) and
    rms_norm_add against the default build (the fp32 sums may be ordered differently: 1e-6);
    topk_indices identical."""
    cpu = cpu_native._cpu_flags()
    if flags == "avx2" and not {"avx2", "fma", "f16c"} <= cpu:
        pytest.skip("no AVX2 here")
    want = {"avx2", "fma", "f16c"} if flags == "avx2" else set()
    rng = np.random.default_rng(51)
    g = torch.Generator().manual_seed(52)
    cases = []
    for stack, k in (([(Q.Q4_1, 40), (Q.Q4_0, 24)], 576), ([(Q.Q5_1, 136)], 576), ([(Q.Q6_K, 64), (Q.Q8_0, 72)], 256)):
        parts = [qtensor(q, n, k, rng) for q, n in stack]
        w, we = cpu_native.pack_weight(parts), cpu_native.pack_weight(parts, exact=True)
        x = torch.randn(5, k, generator=g)
        bias = torch.randn(w.n, generator=g)
        cases.append((w, we, x, bias, cpu_native.gemv(x, we, bias)))
    q = torch.randn(2, 6, 64, generator=g)
    kc, vc = torch.randn(50, 2, 64, generator=g), torch.randn(50, 2, 64, generator=g)
    att = cpu_native.decode_attention(q, kc, vc, 0.125, start=3, length=37)
    xn, wn = torch.randn(2, 64, generator=g), torch.rand(64, generator=g) + 0.5
    norm = cpu_native.rms_norm_add(xn, wn, 1e-6, None)
    logits = torch.randn(3, 1000, generator=g)
    top = cpu_native.topk_indices(logits, 8)
    monkeypatch.setenv("MEMRA_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: want)
    cpu_native._lib.cache_clear()
    try:
        lib = cpu_native._lib()
        assert lib is not None and lib.memra_has_avx2() == (flags == "avx2") and lib.memra_has_vnni() == 0
        for w, we, x, bias, y_exact in cases:
            for T in (1, 2, 5):
                xb = x[:T].to(torch.bfloat16)
                y = cpu_native.gemv(xb, w, bias, out_dtype=torch.float32)
                assert rel(y, cpu_native.gemv_torch(xb, w, bias)) < 1e-5, (flags, w.fmt, w.wb, T)
            torch.testing.assert_close(cpu_native.gemv(x, we, bias), y_exact, rtol=1e-6,
                                       atol=1e-6 * float(y_exact.abs().max()))
        torch.testing.assert_close(cpu_native.decode_attention(q, kc, vc, 0.125, start=3, length=37), att,
                                   rtol=1e-6, atol=1e-6)
        out, s = cpu_native.rms_norm_add(xn, wn, 1e-6, None)
        assert torch.equal(s, norm[1])
        torch.testing.assert_close(out, norm[0], rtol=1e-6, atol=1e-6)
        assert torch.equal(cpu_native.topk_indices(logits, 8), top)
    finally:
        monkeypatch.undo()
        cpu_native._lib.cache_clear()
    assert cpu_native._lib().memra_has_avx2() == int({"avx2", "fma", "f16c"} <= cpu)


# ------------------------------------------------------------------------------------------------
# end to end

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def greedy(dtype: str) -> tuple[list[list[int]], set[str]]:
    """smollm2-135m's greedy tokens (24 of each prompt) and its linear layers' kernels."""
    from memra import LLM, SamplingParams

    llm = LLM("smollm2-135m", dtype=dtype)
    kernels = {m.kernel for m in llm.model.modules() if isinstance(m, Linear)}
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    return [o.outputs[0].token_ids for o in out], kernels


def test_smollm2_native_on_and_off(monkeypatch):
    """smollm2-135m, greedy, 24 tokens of 2 prompts, native kernels on (every linear layer
    "native") and off (torch paths: dense fp32): float32 (exact weights, only the sums' order
    differs) gives the same 24 tokens. bfloat16 (int8 activations) is judged against float32,
    teacher-forced one decode step at a time over float32's own tokens: its greedy choice agrees at
    >= 90 % of the positions (``memra bench cpu`` measures 97.8 % over its 316-token text; free-running
    greedy texts of two approximations may part at any near-tie, so they are not compared)."""
    from memra import LLM
    from memra.engine.kv_cache import ContiguousKVCache, kv_storage_dtype

    assert cpu_native.enabled()
    tok_on, kernels_on = greedy("float32")
    assert kernels_on == {"native"}, kernels_on
    monkeypatch.setattr(cpu_native, "ENABLED", False)
    tok_off, kernels_off = greedy("float32")
    assert "native" not in kernels_off
    assert all(len(t) == 24 for t in tok_on + tok_off)
    assert tok_on == tok_off
    monkeypatch.setattr(cpu_native, "ENABLED", True)

    llm = LLM("smollm2-135m", dtype="bfloat16")
    assert {m.kernel for m in llm.model.modules() if isinstance(m, Linear)} == {"native"}
    agree = total = 0
    with torch.inference_mode():
        for prompt, toks in zip(PROMPTS, tok_on):
            ids = llm.tokenizer.encode(prompt) + toks
            kv = ContiguousKVCache(llm.config, len(ids) + 1, kv_storage_dtype(llm.model.dtype, "cpu"))
            n0 = len(ids) - len(toks)
            h = llm.model(torch.tensor(ids[:n0]), torch.arange(n0), kv)
            kv.advance(n0)
            for i in range(n0, len(ids)):
                agree += int(llm.model.logits(h[-1]).argmax()) == ids[i]
                total += 1
                h = llm.model(torch.tensor([ids[i]]), torch.tensor([i]), kv)
                kv.advance(1)
    print(f"\nsmollm2-135m bfloat16 native: float32's greedy token at {agree} of {total} positions")
    assert agree >= 0.9 * total, (agree, total)


def test_bad_inputs_are_refused_or_propagate_like_torch():
    """What review found: NaN / inf activations give NaN rows (not a silent finite result); a NaN
    key gives NaN wherever it sits (vector body or scalar tail of the softmax); a SwiGLU clamp of 0
    clamps (to 0); fp16 outputs, wrong bias lengths, odd SwiGLU rows, negative clamps, lengths past L
    and slots outside the cache raise ValueError before anything is written."""
    g = torch.Generator().manual_seed(99)
    w = cpu_native.pack_weight([qtensor(QType.Q4_1, 64, 256, np.random.default_rng(5))])
    x = torch.randn(3, 256, generator=g)
    x[1, 7] = float("nan")
    x[2, 40] = float("inf")
    y = cpu_native.gemv(x, w)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    z = cpu_native.gemv(x[:1], w, mode=cpu_native.MODE_SWIGLU, limit=0.0)
    assert torch.equal(z, torch.zeros_like(z))
    for kw, match in ((dict(out_dtype=torch.float16), "out_dtype"), (dict(bias=torch.randn(63)), "bias"),
                      (dict(mode=cpu_native.MODE_SWIGLU, limit=-1.0), "clamp")):
        with pytest.raises(ValueError, match=match):
            cpu_native.gemv(x[:1], w, **kw)
    w_odd = cpu_native.pack_weight([qtensor(QType.Q4_1, 63, 256, np.random.default_rng(6))])
    with pytest.raises(ValueError, match="even"):
        cpu_native.gemv(x[:1], w_odd, mode=cpu_native.MODE_SWIGLU)

    kc, vc = torch.randn(20, 1, 64, generator=g), torch.randn(20, 1, 64, generator=g)
    q = torch.randn(1, 2, 64, generator=g)
    for row in (3, 17):  # 3: in the first 8-lane chunk of the exp; 17: the scalar tail
        k2 = kc.clone()
        k2[row] = float("nan")
        assert torch.isnan(cpu_native.decode_attention(q, k2, vc, 0.125, start=0, length=20)).all(), row
    slots = torch.arange(8).view(1, 8)
    before = kc.clone()
    with pytest.raises(ValueError, match="length"):
        cpu_native.decode_attention(q, kc, vc, 0.125, slots=slots, lens=torch.tensor([9]))
    with pytest.raises(ValueError, match="slot"):
        cpu_native.decode_attention(q, kc, vc, 0.125, slots=slots + 13)
    with pytest.raises(ValueError, match="slot"):
        cpu_native.decode_attention(q, kc, vc, 0.125, slots=slots, k_new=torch.randn(1, 1, 64),
                                    v_new=torch.randn(1, 1, 64), write_slots=torch.tensor([20]))
    assert torch.equal(kc, before)


def test_tensors_off_the_host_never_reach_the_c_code():
    """A tensor off the host (here on the meta device; on a GPU machine, CUDA tensors of a
    tensor-parallel shard's torch path) is refused by every wrapper with ValueError, and the layers'
    native branches are not taken for it (RoPE and RMSNorm fall back to torch)."""
    w = cpu_native.pack_weight([qtensor(QType.Q4_1, 64, 256, np.random.default_rng(3))])
    m = torch.empty(1, 256, device="meta")
    with pytest.raises(ValueError, match="host tensors"):
        cpu_native.gemv(m, w)
    with pytest.raises(ValueError, match="host tensors"):
        cpu_native.rms_norm_add(m, torch.ones(256), 1e-6, None)
    with pytest.raises(ValueError, match="host tensors"):
        cpu_native.rope_(torch.empty(1, 2, 64, device="meta"), torch.empty(1, 64), torch.empty(1, 64))
    with pytest.raises(ValueError, match="host tensors"):
        cpu_native.topk_indices(torch.empty(2, 100, device="meta"), 4)
    norm = RMSNorm(torch.ones(256, device="meta"), 1e-6)
    h, s = norm.add(m, None)
    assert h.device.type == "meta" and s.device.type == "meta"
    attn = attention_layer.Attention.__new__(attention_layer.Attention)
    torch.nn.Module.__init__(attn)
    attn.q_norm = attn.k_norm = None
    q, k = attn.norm_rope(torch.empty(1, 2, 64, device="meta"), torch.empty(1, 1, 64, device="meta"),
                          torch.empty(1, 64, device="meta"), torch.empty(1, 64, device="meta"))
    assert q.device.type == "meta" and k.shape == (1, 1, 64)
