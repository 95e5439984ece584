"""Grouped MoE prefill GEMMs (memra/kernels/moe_prefill.py) against their torch references.

CPU (CI): the Triton kernels run under the interpreter (TRITON_INTERPRET=1) at tiny shapes
(E = 8, D = 128, I = 64, or 128 for fp8 whose gate/up interleave is whole 128-row scale
blocks) with fp16/fp32 activations (the interpreter's bf16 tl.dot is wrong), small row blocks
(block_m = 16) so that T = 33 spans several blocks per expert, and large column tiles so that
the interpreter runs few programs. Routing: uniform over 6 of the 8 experts (2 experts with
zero rows), and skewed (every token on expert 0).
GPU (``-m gpu``, the H200; NOT yet run): the flagship shape (E = 288, top-8, D = 4096,
I = 1280), T = 512 and 4096, nvfp4 / fp8 / bf16, bf16 activations, default configurations,
skewed and uniform routing, and CUDA-graph capture. Random data everywhere (never zeros).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before memra.kernels._moe_prefill_triton is imported

from memra.kernels.moe_decode import moe_decode_ref  # noqa: E402
from memra.kernels.moe_prefill import (  # noqa: E402
    MoePrefillConfig,
    align_sizes,
    default_prefill_config,
    grouped_decode_config,
    moe_align,
    moe_prefill,
    moe_prefill_ref,
    quantize_act_fp8_ref,
)

triton = pytest.importorskip("triton")

from moe_banks import banks  # noqa: E402

E, D = 8, 128
FORMATS = ("nvfp4", "bf16", "fp8", "q8_0")


def _banks(fmt: str, i: int, d: int = D, seed: int = 0):
    return banks(fmt, i, d, seed, E)[:2]


def _i(fmt: str) -> int:
    return 128 if fmt == "fp8" else 64


def _cfg(fmt: str, i: int, d: int = D, **over) -> MoePrefillConfig:
    """block_m 16; one kernel-A program per row block (block_n = I) and one kernel-B program
    (block_n_down = D); K steps of 64."""
    base = MoePrefillConfig(block_m=16, block_n=i, block_k=64, block_n_down=d, block_k_down=64,
                            fp8_act=fmt == "fp8", num_warps=4, num_stages=2)
    return dataclasses.replace(base, **over)


def _routing(t: int, k: int, kind: str, g: torch.Generator):
    """index [t, k], weight [t, k]: "uniform" over experts 0..5 (6, 7 get no rows), "skewed":
    every token chooses expert 0 plus k - 1 of experts 1..4 (7 gets none)."""
    if kind == "uniform":
        index = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(t)])
    else:
        rest = torch.stack([torch.randperm(4, generator=g)[: k - 1] + 1 for _ in range(t)])
        index = torch.cat([torch.zeros(t, 1, dtype=torch.int64), rest], dim=1)
    weight = torch.rand(t, k, generator=g) + 0.1
    return index, weight


def _rel(y: torch.Tensor, r: torch.Tensor) -> float:
    return float((y.float() - r.float()).abs().max() / r.float().abs().max())


def _rms_rel(y: torch.Tensor, r: torch.Tensor) -> float:
    return float((y.float() - r.float()).pow(2).mean().sqrt() / r.float().pow(2).mean().sqrt())


# ---------------------------------------------------------------------------------------
# moe_align (torch only)


def _check_align(index: torch.Tensor, e: int, bm: int) -> None:
    ids, bexp, used = moe_align(index, e, bm)
    n = index.numel()
    p_pad, nb = align_sizes(n, e, bm)
    assert ids.dtype == torch.int32 and bexp.dtype == torch.int32 and used.dtype == torch.int32
    assert ids.shape == (p_pad,) and bexp.shape == (nb,) and used.shape == (1,)
    flat = index.reshape(-1)
    ids_l = ids.long()
    valid = ids_l < n
    assert bool((ids_l <= n).all())
    # every pair exactly once
    assert torch.equal(ids_l[valid].sort().values, torch.arange(n))
    counts = torch.bincount(flat, minlength=e)
    nused = int(used)
    assert nused == int(((counts + bm - 1) // bm).sum())
    assert bool((bexp[:nused] >= 0).all()) and bool((bexp[nused:] == -1).all())
    blocks = ids_l.reshape(nb, bm)
    # every block one expert: its valid pairs all choose it; blocks past the used ones are padding
    for b in range(nb):
        row = blocks[b]
        v = row[row < n]
        if b >= nused:
            assert v.numel() == 0
            continue
        assert v.numel() > 0  # padding never fills a whole block
        assert bool((flat[v] == int(bexp[b])).all())
        # valid entries first, then padding (one expert per block, runs start at block starts)
        assert bool((row[: v.numel()] < n).all())
        assert torch.equal(v, v.sort().values)  # ties by pair number
    # experts in increasing order, each expert's blocks contiguous
    be = bexp[:nused]
    assert bool((be[1:] >= be[:-1]).all())
    for ex in range(e):
        assert int((be == ex).sum()) == -(-int(counts[ex]) // bm)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy on the NaN, interpreted)
@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_nan_token_stays_nan_through_the_swiglu_clamp(dev, fmt):
    """A token whose activations hold a NaN comes out NaN from the MoE prefill (fp8: through the
    quantized activations), the MoE decode kernel and the fused SwiGLU, with Step-3.5's clamp
    on, as torch.clamp keeps a NaN (``moe_prefill_ref``); the other tokens stay finite. On the
    GPU min / max drop a NaN unless told to keep it (the interpreter's numpy keeps it anyway)."""
    if dev == "cpu" and torch.cuda.is_available():
        pytest.skip("the interpreter run: CPU machines")
    from memra.bench.common import random_moe
    from memra.kernels.fused import swiglu
    from memra.kernels.moe_decode import moe_decode

    i = _i(fmt)
    gu, down, gen = random_moe(fmt, torch.device(dev), seed=5, e=E, d=D, i=i)
    t = 6
    g = torch.Generator().manual_seed(6)
    index, weight = (v.to(dev) for v in _routing(t, 2, "uniform", g))
    x = (torch.randn(t, D, generator=g) * 0.5).to(torch.float16 if dev == "cpu" else torch.bfloat16).to(dev)
    x[3, 5] = float("nan")
    ok = [0, 1, 2, 4, 5]
    r = moe_prefill_ref(x.float(), index, weight, gu, down, 0.5)
    assert torch.isnan(r[3]).all() and torch.isfinite(r[ok]).all()
    for y in (moe_prefill(x, index, weight, gu, down, 0.5, config=_cfg(fmt, i)),
              moe_decode(x[:4], index[:4], weight[:4], gu, down, 0.5)):
        y = y.float().cpu()
        assert torch.isnan(y[3]).all(), (fmt, y[3])
        assert torch.isfinite(y[[k for k in ok if k < len(y)]]).all()
    gu2 = torch.randn(4, 2 * 128, generator=g).to(x.dtype).to(dev)
    gu2[1, 7] = float("nan")  # a gate value
    gu2[2, 128 + 9] = float("nan")  # an up value
    a = swiglu(gu2, 0.5).float().cpu()
    assert torch.isnan(a[1, 7]) and torch.isnan(a[2, 9]) and int(torch.isnan(a).sum()) == 2


def test_moe_align_invariants():
    g = torch.Generator().manual_seed(0)
    cases = [(1, 2, 8, 16), (7, 3, 8, 16), (33, 3, 8, 16), (33, 2, 8, 64), (64, 8, 288, 64), (512, 8, 288, 16),
             (5, 4, 300, 128)]
    for t, k, e, bm in cases:
        for kind in ("uniform", "skewed", "few"):
            if kind == "uniform":
                index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            elif kind == "skewed":
                index = torch.stack([torch.cat([torch.tensor([0]), torch.randperm(e - 1, generator=g)[: k - 1] + 1])
                                     for _ in range(t)])
            else:  # only experts k..2k-1 chosen: all others have zero rows
                index = torch.stack([torch.randperm(k, generator=g) + k for _ in range(t)]) % e
            _check_align(index, e, bm)
    # exact layout on a small case
    index = torch.tensor([[5, 1], [1, 6], [5, 1]])
    ids, bexp, used = moe_align(index, 8, 2)
    n = 6
    assert bexp.tolist()[:4] == [1, 1, 5, 6] and int(used) == 4 and bool((bexp[4:] == -1).all())
    assert ids.tolist()[:8] == [1, 2, 5, n, 0, 4, 3, n]
    assert bool((ids[8:] == n).all())
    with pytest.raises(ValueError, match="index must be"):
        moe_align(index.float(), 8, 16)
    with pytest.raises(ValueError, match="block_m"):
        moe_align(index, 8, 0)


def test_moe_align_triton_equals_torch():
    """The one-launch alignment (method "triton", decode-size calls) gives exactly the torch
    version's sorted_ids, block_expert and used blocks: uniform, skewed and few-expert routings,
    several block sizes, T = 1..256 at the flagship's E = 288."""
    g = torch.Generator().manual_seed(3)
    cases = [(1, 8, 288, 16), (2, 8, 288, 16), (16, 8, 288, 16), (64, 8, 288, 16), (7, 3, 8, 16), (33, 3, 8, 32),
             (5, 2, 4, 64), (40, 4, 9, 16)]
    for t, k, e, bm in cases:
        for kind in ("uniform", "skewed", "few"):
            if kind == "uniform":
                index = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            elif kind == "skewed":
                index = torch.stack([torch.cat([torch.tensor([0]), torch.randperm(e - 1, generator=g)[: k - 1] + 1])
                                     for _ in range(t)])
            else:
                index = torch.stack([torch.randperm(k, generator=g) + k for _ in range(t)]) % e
            ref = moe_align(index, e, bm)
            got = moe_align(index, e, bm, method="triton")
            for a, b, what in zip(ref, got, ("sorted_ids", "block_expert", "used")):
                assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), (t, k, e, bm, kind, what)
    with pytest.raises(ValueError, match="method"):
        moe_align(index, e, 16, method="cuda")


def _routing_wide(t: int, k: int, g: torch.Generator):
    index = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(t)])
    return index, torch.rand(t, k, generator=g) + 0.1


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_decode_path(fmt):
    """The multi-token decode configuration (grouped_decode_config: 16-row blocks, one-launch
    alignment, per-pair combine, exact fp8 weights) and its swap_ab form vs moe_prefill_ref at
    T = 2 and 5, with ``add``; and batch invariance: each token's output row is bit-identical
    (torch.equal) whether the other tokens of the call are different tokens or absent."""
    i = _i(fmt)
    gu, down = _banks(fmt, i, seed=7)
    g = torch.Generator().manual_seed(8)
    for t, dt, limit in ((2, torch.float32, 0.5), (5, torch.float16, None)):
        cfg = grouped_decode_config(fmt, t, 3, E, i, D)
        assert cfg.combine == "sum" and cfg.align == "triton" and not cfg.fp8_act and cfg.block_m == 16
        index, weight = _routing_wide(t, 3, g)
        x = torch.randn(t, D, generator=g).to(dt)
        add = torch.randn(t, D, generator=g).to(dt)
        r = moe_prefill_ref(x, index, weight, gu, down, limit, add=add)
        for c in (cfg, dataclasses.replace(cfg, swap_ab=True)) if fmt != "fp8" else (cfg,):
            y = moe_prefill(x, index, weight, gu, down, limit, add=add, config=c)
            assert y.dtype == dt and _rel(y, r) <= (1e-5 if dt == torch.float32 else 2e-3), (fmt, t, c, _rel(y, r))
    # batch invariance: rows 0 and 2 of a 4-token call vs the same tokens among other tokens / alone
    t = 4
    cfg = grouped_decode_config(fmt, t, 3, E, i, D)
    index, weight = _routing_wide(t, 3, g)
    x = torch.randn(t, D, generator=g)
    y = moe_prefill(x, index, weight, gu, down, 0.5, config=cfg)
    index2, weight2 = _routing_wide(t, 3, g)
    x2 = torch.randn(t, D, generator=g)
    for r_ in (0, 2):
        index2[r_], weight2[r_], x2[r_] = index[r_], weight[r_], x[r_]
    y2 = moe_prefill(x2, index2, weight2, gu, down, 0.5, config=cfg)
    keep = [0, 2]
    y3 = moe_prefill(x[keep].contiguous(), index[keep].contiguous(), weight[keep].contiguous(), gu, down, 0.5,
                     config=grouped_decode_config(fmt, 2, 3, E, i, D))
    assert torch.equal(y[0], y2[0]) and torch.equal(y[2], y2[2]), fmt
    assert torch.equal(y[keep], y3), fmt


# ---------------------------------------------------------------------------------------
# kernels under the interpreter vs the torch references


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_prefill_formats(fmt):
    """Each format vs moe_prefill_ref and moe_decode_ref: T = 1, 7, 33; uniform and skewed
    routing (experts with zero rows); fp32 (exact weights: fp32 sums) and fp16 activations."""
    i = _i(fmt)
    gu, down = _banks(fmt, i, seed=1)
    g = torch.Generator().manual_seed(2)
    cases = ((1, 2, "uniform", torch.float32, None), (7, 3, "skewed", torch.float16, 0.5),
             (33, 3, "uniform", torch.float32, 0.5), (33, 2, "skewed", torch.float32, 0.7))
    for t, k, kind, dt, limit in cases:
        index, weight = _routing(t, k, kind, g)
        x = torch.randn(t, D, generator=g).to(dt)
        # fp8 banks: the FP8 recipe (default) and the exact-weight path
        for f8 in ((True, False) if fmt == "fp8" else (False,)):
            cfg = _cfg(fmt, i, fp8_act=f8)
            y = moe_prefill(x, index, weight, gu, down, limit, config=cfg)
            assert y.dtype == dt and y.shape == (t, D)
            r = moe_prefill_ref(x, index, weight, gu, down, limit, fp8_act=f8)
            r0 = moe_decode_ref(x, index, weight, gu, down, limit)
            tol = 1e-5 if dt == torch.float32 else 2e-3  # fp16: act and output rounding
            assert _rel(y, r) <= tol, (fmt, t, kind, f8, _rel(y, r))
            if f8:  # E4M3 activations (3 mantissa bits, 2.6 % rms per rounding) vs exact fp32: measured
                # 4.3-4.7 % rms without a clamp or with limit 7, 7-9 % with limit 0.5 (most act values at
                # the clamp, where the up/gate errors decide the sign)
                assert _rms_rel(y, r0) <= 0.12, (fmt, t, kind, _rms_rel(y, r0))
            else:
                assert _rel(y, r0) <= tol, (fmt, t, kind, _rel(y, r0))


def test_ref_is_decode_ref_plus_add():
    gu, down = _banks("q8_0", 64, seed=3)
    g = torch.Generator().manual_seed(4)
    index, weight = _routing(5, 3, "uniform", g)
    x = torch.randn(5, D, generator=g)
    add = torch.randn(5, D, generator=g)
    r = moe_prefill_ref(x, index, weight, gu, down, 0.5, add=add)
    assert torch.allclose(r, moe_decode_ref(x, index, weight, gu, down, 0.5) + add, rtol=0, atol=1e-6)


@pytest.mark.parametrize("combine", ["atomic", "sum"])
def test_add_and_combine(combine):
    """``add=`` (the shared expert's output) with both combine modes; add is not modified."""
    gu, down = _banks("nvfp4", 64, seed=5)
    g = torch.Generator().manual_seed(6)
    index, weight = _routing(9, 3, "skewed", g)
    x = torch.randn(9, D, generator=g)
    add = torch.randn(9, D, generator=g)
    keep = add.clone()
    cfg = _cfg("nvfp4", 64, combine=combine)
    y = moe_prefill(x, index, weight, gu, down, 0.5, add=add, config=cfg)
    assert torch.equal(add, keep)
    assert _rel(y, moe_decode_ref(x, index, weight, gu, down, 0.5) + add) <= 1e-5
    y16 = moe_prefill(x.half(), index, weight, gu, down, 0.5, add=add.half(), config=cfg)
    assert y16.dtype == torch.float16
    assert _rel(y16, moe_prefill_ref(x.half(), index, weight, gu, down, 0.5, add=add.half())) <= 2e-3
    with pytest.raises(ValueError, match="add must be"):
        moe_prefill(x, index, weight, gu, down, 0.5, add=add[:2], config=cfg)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("fmt", ["nvfp4", "q8_0", "bf16"])
def test_uneven_k_and_tiles(fmt, swap):
    """D and I not multiples of the K steps (masked K tails), several programs along I and D,
    block_m 32, group_m 2 (the swizzle), the default configuration; ``swap``: both kernels
    compute the transposed products (swap_ab), also with the deterministic combine."""
    d = 192
    gu, down = _banks(fmt, 64, d=d, seed=7)
    g = torch.Generator().manual_seed(8)
    index, weight = _routing(20, 3, "uniform", g)
    x = torch.randn(20, d, generator=g)
    cfg = MoePrefillConfig(block_m=32, block_n=32, block_k=128, block_n_down=64, block_k_down=128 if fmt != "q8_0"
                           else 32, group_m=2, num_warps=4, num_stages=2, swap_ab=swap)
    y = moe_prefill(x, index, weight, gu, down, 0.5, config=cfg)
    assert _rel(y, moe_decode_ref(x, index, weight, gu, down, 0.5)) <= 1e-5, fmt
    if swap:  # mixed: only kernel A swapped; and the per-pair-rows combine
        for c in (dataclasses.replace(cfg, swap_ab_down=False), dataclasses.replace(cfg, combine="sum")):
            y = moe_prefill(x, index, weight, gu, down, 0.5, config=c)
            assert _rel(y, moe_decode_ref(x, index, weight, gu, down, 0.5)) <= 1e-5, (fmt, c)
        return
    if fmt == "nvfp4":
        y = moe_prefill(x, index, weight, gu, down, None)  # default config
        assert _rel(y, moe_decode_ref(x, index, weight, gu, down, None)) <= 1e-5


@pytest.mark.parametrize("bn, bn2", [(128, 128), (256, 256), (128, 64)])
def test_fp8_scale_paths(bn, bn2):
    """fp8 banks at I = D = 256: several kernel-A programs per row block (one block scale per tile,
    SCALAR_S, at a column offset), tiles spanning two 128-row scale blocks (per-row scales), and
    down tiles inside one block; the FP8 recipe and exact E4M3 weights, vs the emulating reference."""
    d = 256
    gu, down = _banks("fp8", 256, d=d, seed=12)
    g = torch.Generator().manual_seed(13)
    index, weight = _routing(12, 3, "skewed", g)
    x = torch.randn(12, d, generator=g)
    for f8 in (True, False):
        cfg = MoePrefillConfig(block_m=16, block_n=bn, block_k=64, block_n_down=bn2, block_k_down=64,
                               fp8_act=f8, num_warps=4, num_stages=2)
        y = moe_prefill(x, index, weight, gu, down, 0.5, config=cfg)
        r = moe_prefill_ref(x, index, weight, gu, down, 0.5, fp8_act=f8)
        assert _rel(y, r) <= 1e-5, (bn, bn2, f8, _rel(y, r))


def test_fp8_activation_quantization():
    """The kernels' E4M3 rounding (exact emulation under the interpreter, whose own fp32 -> fp8
    cast is wrong at binade carries) vs torch's cast, through the x-quantization kernel."""
    from memra.kernels._moe_prefill_triton import _act_quant_kernel
    from memra.kernels.gemv import interpret_mode

    g = torch.Generator().manual_seed(9)
    t = 20
    x = torch.randn(t, 256, generator=g) * torch.logspace(-3, 3, t)[:, None]
    # values that round up into the next binade (126.5 -> 128) and exact ties, relative to amax
    x[0, :8] = torch.tensor([448.0, 126.5, -126.5, 31.9770, 15.99, 0.0625 + 2**-10, 17.0, -9.0])
    x[1] = 0.0  # an all-zero group
    x[2, 5] = 1e-8  # a subnormal E4M3 code after scaling
    q = torch.empty(t, 256, dtype=torch.float8_e4m3fn)
    s = torch.empty(t, 2)
    _act_quant_kernel[(2, 2)](x, q, s, t, x.stride(0), q.stride(0), s.stride(0), BT=16, EXACT=interpret_mode())
    qr, sr = quantize_act_fp8_ref(x)
    assert torch.equal(s, sr)
    assert torch.equal(q.float(), qr.float())
    assert float(q.float().abs().max()) == 448.0


def test_config_validation_and_defaults():
    gu, down = _banks("fp8", 128, seed=10)
    x = torch.randn(2, D)
    index = torch.tensor([[0, 1], [1, 2]])
    w = torch.rand(2, 2)
    with pytest.raises(ValueError, match="multiple of 128"):
        moe_prefill(x, index, w, gu, down, None, config=_cfg("fp8", 128, block_n=64))
    with pytest.raises(ValueError, match="divide 128"):
        moe_prefill(x, index, w, gu, down, None, config=_cfg("fp8", 128, block_k=256))
    with pytest.raises(ValueError, match="power of two"):
        moe_prefill(x, index, w, gu, down, None, config=_cfg("fp8", 128, block_m=24))
    with pytest.raises(ValueError, match="invalid config"):
        moe_prefill(x, index, w, gu, down, None, config=_cfg("fp8", 128, combine="tree"))
    gq, dq = _banks("q8_0", 64, seed=10)
    with pytest.raises(ValueError, match="multiple of 32"):
        moe_prefill(x, index, w, gq, dq, None, config=_cfg("q8_0", 64, block_k=16))
    gn, dn = _banks("nvfp4", 64, seed=10)  # the parity decode's dots take K = block_k / 2 >= 16
    with pytest.raises(ValueError, match="block_k = 16 for nvfp4 must be a multiple of 32"):
        moe_prefill(x, index, w, gn, dn, None, config=_cfg("nvfp4", 64, block_k=16))
    with pytest.raises(ValueError, match="block_k_down = 16 for nvfp4 must be a multiple of 32"):
        moe_prefill(x, index, w, gn, dn, None, config=_cfg("nvfp4", 64, block_k=32, block_k_down=16))
    # the wide nvfp4 decode tiles only for 16-bit activations (fp32 operands would overflow shared memory)
    wide, narrow = (grouped_decode_config("nvfp4", 16, x_dtype=dt) for dt in (torch.bfloat16, torch.float32))
    assert (wide.block_n, wide.block_k, wide.block_n_down, wide.block_k_down) == (128, 256, 128, 256)
    assert (narrow.block_n, narrow.block_k, narrow.block_n_down, narrow.block_k_down) == (64, 128, 64, 128)
    with pytest.raises(ValueError, match="fused gate/up"):
        moe_prefill(x, index, w, dq, dq, None)
    with pytest.raises(ValueError, match="x must be"):
        moe_prefill(torch.randn(2, D + 1), index, w, gq, dq, None)
    # heuristic defaults: block_m follows the mean rows per expert; the fp8 recipe where it applies
    assert default_prefill_config("nvfp4", 512, tuned=False).block_m == 16
    assert default_prefill_config("nvfp4", 4096, tuned=False).block_m == 64
    c = default_prefill_config("fp8", 4096, tuned=False)
    assert c.fp8_act and c.block_n % 128 == 0 and 128 % c.block_k == 0
    assert not default_prefill_config("fp8", 4096, i=96).fp8_act
    with pytest.raises(ValueError, match="unknown format"):
        default_prefill_config("int4", 8)
    with pytest.raises(ValueError, match="swap_ab is not implemented for fp8"):
        moe_prefill(x, index, w, gu, down, None, config=_cfg("fp8", 128, swap_ab=True))
    g16, _ = _banks("bf16", 128, seed=11)  # bf16 gate_up, fp8 down: kernel A writes the fp8 act
    with pytest.raises(ValueError, match="fp8 down recipe"):
        moe_prefill(x, index, w, g16, down, None, config=_cfg("fp8", 128, swap_ab=True, swap_ab_down=False))


def test_tuned_table_lookup_and_tuner_candidates(tmp_path, monkeypatch):
    """default_prefill_config takes the tuned entry nearest in log2(T) for the flagship shape, the
    heuristic elsewhere; a malformed table is refused naming the file; the tuner's candidates are
    valid configs, without swap_ab for fp8."""
    import json

    import memra.kernels.moe_prefill as mp
    from memra.bench.common import FLAGSHIP
    from memra.bench.moe_tune import candidates

    table = {"configs": {mp.table_key("nvfp4", 8, 288, 1280, 4096): [
        {"t": 512, "config": {"block_m": 16, "block_n": 128}},
        {"t": 4096, "config": {"block_m": 128, "block_n": 64, "swap_ab": True}}]}}
    f = tmp_path / "tuned.json"
    f.write_text(json.dumps(table))
    monkeypatch.setattr(mp, "TUNED_TABLE", f)
    mp.tuned_table.cache_clear()
    try:
        assert default_prefill_config("nvfp4", 1).block_m == 16
        assert default_prefill_config("nvfp4", 1400).block_m == 16  # log2: nearer 512 than 4096
        c = default_prefill_config("nvfp4", 1500)
        assert (c.block_m, c.block_n, c.swap_ab) == (128, 64, True)
        assert default_prefill_config("nvfp4", 65536).block_m == 128
        assert default_prefill_config("nvfp4", 4096, d=2048).swap_ab is False  # another shape: heuristic
        assert mp.tuned_prefill_config("fp8", 4096) is None
        f.write_text(json.dumps({"configs": {"x": [{"t": 0, "config": {}}]}}))
        mp.tuned_table.cache_clear()
        with pytest.raises(ValueError, match="tuned.json"):
            default_prefill_config("nvfp4", 64)
    finally:
        mp.tuned_table.cache_clear()
    for fmt in ("fp8", "nvfp4"):
        c = candidates(fmt, 4096, FLAGSHIP, quick=True)
        assert set(c) == {64, 128}
        for v in c.values():
            cfgs = v["a"] + v["b"]
            assert cfgs and all(x.block_m in c for x in cfgs)
            assert any(x.swap_ab or x.swap_ab_down for x in cfgs) == (fmt != "fp8")


def test_sm90_compile_of_the_defaults():
    """The default configurations compile for sm_90 (Triton's bundled ptxas, no GPU) at the
    flagship shape, T = 4096, with Hopper wgmma, cp.async pipelining, no register spills and no
    float min / max that drops a NaN (the SwiGLU clamp, the FP8 activation quantization; a
    separate process: the interpreter replaces the JIT functions in this one)."""
    import json
    import subprocess
    import sys

    code = ("import json; from memra.kernels.moe_prefill import sm90_compile_report as r; "
            "print(json.dumps({f: r(f, 4096) for f in ('nvfp4', 'fp8')}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    for fmt, kernels in rep.items():
        for name, k in kernels.items():
            assert k["wgmma"] and k["cp_async"] and k["stack"] == 0 and k["smem"] <= 227 * 1024, (fmt, name, k)
            assert k["nan_dropping_minmax"] == 0, (fmt, name, k)


# ---------------------------------------------------------------------------------------
# GPU: the flagship shape (run on the H200 with -m gpu)


FLAG = dict(e=288, k=8, d=4096, i=1280)
# bf16 activations and bf16 act scratch vs the fp32 reference: bound as moe_decode's bf16 output
BF16_TOL = 1e-2


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


def _flag_routing(t: int, kind: str, gen: torch.Generator):
    from memra.bench.common import random_routing

    index, weight = random_routing(t, FLAG["e"], FLAG["k"], "cuda", gen)
    if kind == "skewed":  # half the tokens on expert 0, all tokens within experts 0..63 (224 empty)
        h = t // 2
        rest = torch.rand(t, 63, device="cuda", generator=gen).argsort(dim=1)[:, :7] + 1
        index = torch.rand(t, 64, device="cuda", generator=gen).argsort(dim=1)[:, :8]
        index[:h] = torch.cat([torch.zeros(h, 1, dtype=torch.int64, device="cuda"), rest[:h]], dim=1)
    return index.contiguous(), weight


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "bf16"])
@pytest.mark.parametrize("t", [512, 4096])
def test_flagship_shape(fmt, t, flagship_banks):
    gu, down, gen = flagship_banks(fmt)
    for kind in ("uniform", "skewed"):
        index, weight = _flag_routing(t, kind, gen)
        _check_align(index.cpu(), FLAG["e"], default_prefill_config(fmt, t).block_m)
        x = torch.randn(t, FLAG["d"], device="cuda", generator=gen).to(torch.bfloat16) * 0.5
        add = torch.randn(t, FLAG["d"], device="cuda", generator=gen).to(torch.bfloat16) * 0.1
        r = moe_prefill_ref(x.float(), index, weight, gu, down, 7.0, add=add.float())
        y = moe_prefill(x, index, weight, gu, down, 7.0, add=add)
        assert y.dtype == torch.bfloat16
        if fmt == "fp8":  # default: the FP8 recipe; vs its exact emulation, and vs exact fp32 (rms)
            re = moe_prefill_ref(x.float(), index, weight, gu, down, 7.0, add=add.float(), fp8_act=True)
            assert _rel(y, re) <= BF16_TOL, (t, kind, _rel(y, re))
            assert _rms_rel(y, r) <= 0.08, (t, kind, _rms_rel(y, r))
            cfg = dataclasses.replace(default_prefill_config(fmt, t), fp8_act=False, block_n=64)
            y2 = moe_prefill(x, index, weight, gu, down, 7.0, add=add, config=cfg)
            assert _rel(y2, r) <= BF16_TOL, (t, kind, "fp8_act=False", _rel(y2, r))
        else:
            assert _rel(y, r) <= BF16_TOL, (fmt, t, kind, _rel(y, r))
        # the deterministic combine agrees
        cfg = dataclasses.replace(default_prefill_config(fmt, t), combine="sum")
        ys = moe_prefill(x, index, weight, gu, down, 7.0, add=add, config=cfg)
        assert _rel(ys, y) <= BF16_TOL, (fmt, t, kind, "sum")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
@pytest.mark.parametrize("t", [512, 4096])
def test_flagship_swap_ab(fmt, t, flagship_banks):
    """Both kernels in the transposed (swap_ab) form at the flagship shape, whatever the tuned
    table picks, skewed routing (experts with zero rows), block_m 16 and 128."""
    gu, down, gen = flagship_banks(fmt)
    index, weight = _flag_routing(t, "skewed", gen)
    x = torch.randn(t, FLAG["d"], device="cuda", generator=gen).to(torch.bfloat16) * 0.5
    r = moe_prefill_ref(x.float(), index, weight, gu, down, 7.0)
    for bm in (16, 128):
        cfg = MoePrefillConfig(block_m=bm, block_n=64, block_k=64, block_n_down=128, block_k_down=64,
                               fp8_act=False, swap_ab=True)
        y = moe_prefill(x, index, weight, gu, down, 7.0, config=cfg)
        assert _rel(y, r) <= BF16_TOL, (fmt, t, bm, _rel(y, r))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_flagship_cuda_graph(fmt, flagship_banks):
    from memra.kernels.moe_decode import moe_route

    gu, down, gen = flagship_banks(fmt)
    router = torch.randn(288, 4096, device="cuda", generator=gen) * 0.02
    bias = torch.randn(288, device="cuda", generator=gen) * 0.01
    for t in (512, 4096):
        xs = torch.randn(t, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        ys = torch.empty_like(xs)

        def step(xs=xs, ys=ys):
            index, weight = moe_route(xs, router, bias, 8, 3.0)
            ys.copy_(moe_prefill(xs, index, weight, gu, down, 7.0))

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
            eager = moe_prefill(xs, index, weight, gu, down, 7.0)
            assert _rel(ys, eager) <= BF16_TOL, (fmt, t)
            ref = moe_prefill_ref(xs.float(), index, weight, gu, down, 7.0, fp8_act=fmt == "fp8")
            assert _rel(ys, ref) <= BF16_TOL, (fmt, t, _rel(ys, ref))
        del graph


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "bf16", "q8_0"])
def test_flagship_grouped_decode(fmt, flagship_banks):
    """The multi-token decode path (grouped_decode_config) at the flagship shape, T = 2..256:
    vs the fp32 reference (with ``add``), batch invariance (a token's row bit-identical among
    other tokens and alone in a 2-token call), and CUDA-graph capture with moe_route."""
    from memra.kernels.moe_decode import moe_route

    gu, down, gen = flagship_banks(fmt)
    for t in (2, 4, 16, 64, 256):
        cfg = grouped_decode_config(fmt, t)
        for kind in ("uniform", "skewed"):
            index, weight = _flag_routing(t, kind, gen)
            x = torch.randn(t, FLAG["d"], device="cuda", generator=gen).to(torch.bfloat16) * 0.5
            add = torch.randn(t, FLAG["d"], device="cuda", generator=gen).to(torch.bfloat16) * 0.1
            r = moe_prefill_ref(x.float(), index, weight, gu, down, 7.0, add=add.float())
            y = moe_prefill(x, index, weight, gu, down, 7.0, add=add, config=cfg)
            assert y.dtype == torch.bfloat16 and _rel(y, r) <= BF16_TOL, (fmt, t, kind, _rel(y, r))
            y_again = moe_prefill(x, index, weight, gu, down, 7.0, add=add, config=cfg)
            assert torch.equal(y, y_again), (fmt, t, kind, "run-to-run")
            keep = [0, t - 1]
            y2 = moe_prefill(x[keep].contiguous(), index[keep].contiguous(), weight[keep].contiguous(), gu, down,
                             7.0, add=add[keep].contiguous(), config=grouped_decode_config(fmt, 2))
            assert torch.equal(y[keep], y2), (fmt, t, kind, "batch invariance")
    router = torch.randn(288, 4096, device="cuda", generator=gen) * 0.02
    xs = torch.randn(16, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    ys = torch.empty_like(xs)

    def step():
        index, weight = moe_route(xs, router, None, 8, 3.0)
        ys.copy_(moe_prefill(xs, index, weight, gu, down, 7.0, config=grouped_decode_config(fmt, 16)))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    xs.copy_(torch.randn(16, 4096, device="cuda", generator=gen).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    index, weight = moe_route(xs, router, None, 8, 3.0)
    assert _rel(ys, moe_prefill_ref(xs.float(), index, weight, gu, down, 7.0)) <= BF16_TOL
