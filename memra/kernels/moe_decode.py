"""Routed-expert (MoE) decode kernels: ``y[t] = sum_j w[t, j] * down_e(swiglu(gate_e x[t], up_e x[t]))``.

The routed experts of a MoE layer at decode batch sizes (T = 1..64 tokens, top-k = 8 of
E = 288 experts in Step-3.5-Flash, hidden D = 4096, expert intermediate I = 1280) are
memory-bound: each chosen expert's weights are streamed once per step and meet only the
few tokens that chose it. Two Triton kernels (memra/kernels/_moe_triton.py) read the
weights in their stored format (the :mod:`memra.kernels.gemv` layouts plus a leading
expert dimension, :class:`ExpertBank`) and read each DISTINCT chosen expert once per
call, however many tokens chose it:

1. grouping (:func:`moe_group`, on the GPU, no host sync): the T*k (token, expert) pairs,
   numbered ``p = t * k + j``, are sorted by expert; the distinct experts fill
   ``S = min(E, T*k)`` fixed slots (expert id, first sorted position, pair count; unused
   slots have expert -1 and their programs do nothing). Torch ops (default) or one Triton
   launch (``MoeDecodeConfig.group = "triton"``).
2. gate+up kernel, grid (ceil(I / BA), S): a program owns ``BA`` activation columns of its
   slot's expert, i.e. ``BA`` gate rows and the ``BA`` matching up rows of the interleaved
   bank from :func:`fuse_gate_up`, loops over its slot's pairs in chunks of up to 4 tokens,
   reduces over all of D (no split-K: SwiGLU needs the full sums) and writes
   ``act[pos, :] = min(silu(g), limit) * clamp(u, -limit, limit)`` (fp32 scratch [T*k, I],
   in sorted-pair order ``pos``).
3. down kernel, grid (ceil(D / BN), S, split_k): ``w[t, j] * act[pos] @ W_down_e^T`` (the
   routing weight fused), stored as per-pair fp32 rows [T*k, D], then one combine launch that
   sums each token's k rows in a fixed order (+ ``add``) and casts to x's dtype: deterministic
   and batch-invariant (``MoeDecodeConfig.combine = "sum"``, the default); or, "atomic", fp32
   atomic adds into a zeroed [T, D] buffer and a cast.

Inner products are those of :func:`memra.kernels.gemv.decode_linear`'s CUDA-core path
(helpers ``_tile``, ``_fma``, ``_h2_load``, ``_h2_col``, ``_h2_xscale`` are imported from
``_gemv_triton``): fp32 FMAs for bf16 / fp8 / q8_0 (exact weights, fp32 sums; measured
relative error ~5e-7 of max |y| at the flagship shape), and for nvfp4 the fp16x2 path
(sub-block sums of 16 products in fp16, ~3-6e-4 per GEMV as in memra/kernels/NOTES.md;
measured 1.8-2.4e-3 of max |y| for the whole layer, where the weighted sum over the 8
experts partly cancels; random weights, H200). Under the Triton interpreter the inline PTX is
replaced by the same arithmetic in Triton ops (``ASM=False``).

Every grid size depends only on (T, k, E, n, k, config), so :func:`moe_route` +
:func:`moe_decode` can be captured in a CUDA graph.

Math source: memra/layers/moe.py (``MoE.route``, ``RoutedExperts.forward``,
``swiglu``) and STEP35.md ("router", "SwiGLU clamp", "combine"). Kernel pattern: the
grouped "fused MoE" decode GEMVs of vLLM / SGLang / llama.cpp (``mul_mat_vec_id``), ideas only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.dequant import dequantize_blocks
from ..quant.fp8 import FP8BlockTensor
from ..quant.tensor import QTensor
from ..quant.types import QType
from . import gemv
from .gemv import FORMATS, DecodeWeight, check_layout, dequantize_packed, interpret_mode, packed_nbytes
from .pdl import pdl_args

__all__ = [
    "ExpertBank",
    "MoeDecodeConfig",
    "pack_expert_bank",
    "fuse_gate_up",
    "moe_route",
    "moe_group",
    "moe_decode",
    "moe_decode_ref",
    "dequantize_expert",
    "default_moe_config",
]

_GS = {"bf16": 8, "fp8": 16, "nvfp4": 16, "q8_0": 32}
_FMT_ID = {"bf16": 0, "fp8": 1, "nvfp4": 2, "q8_0": 3}


# ---------------------------------------------------------------------------------------
# the weight container


@dataclass
class ExpertBank:
    """``E`` expert weights ``W_e [n, k]`` stacked, in one :class:`~memra.kernels.gemv.DecodeWeight`
    format with a leading expert dimension.

    | fmt | ``data`` | ``scale`` |
    | --- | --- | --- |
    | ``bf16`` | bf16 [E, n, k] | ``None`` |
    | ``fp8`` | float8_e4m3fn [E, n, k] | fp32 [E, ceil(n/128), ceil(k/128)] |
    | ``nvfp4`` | uint8 [E, n, k/2] (adjacent-pair nibbles) | uint8 [E, n, k/16] (UE4M3) |
    | ``q8_0`` | int8 [E, n, k] | fp16 [E, n, k/32] |

    ``interleave`` > 0: the bank is a fused gate/up bank (:func:`fuse_gate_up`) whose n = 2I
    rows are gate and up rows in alternating blocks of ``interleave`` rows:
    ``[g_0..g_{u-1}, u_0..u_{u-1}, g_u..g_{2u-1}, u_u..u_{2u-1}, ...]``.

    Raises: ValueError (naming the bank and the field) for an unknown format, wrong
    dtype/shape, non-contiguous tensors, data and scale on different devices, a per-expert
    size >= 2^31 elements (32-bit offsets inside an expert), or an invalid ``interleave``
    (must divide n / 2; a multiple of 128 for fp8 so that the 128-row scale blocks stay whole).
    """

    fmt: str
    e: int
    n: int
    k: int
    data: torch.Tensor
    scale: torch.Tensor | None
    name: str = ""
    interleave: int = 0

    def __post_init__(self) -> None:
        e, n, k = self.e, self.n, self.k
        want = {
            "bf16": (torch.bfloat16, (e, n, k), None, None),
            "fp8": (torch.float8_e4m3fn, (e, n, k), torch.float32, (e, -(-n // 128), -(-k // 128))),
            "nvfp4": (torch.uint8, (e, n, k // 2), torch.uint8, (e, n, k // 16)),
            "q8_0": (torch.int8, (e, n, k), torch.float16, (e, n, k // 32)),
        }
        if self.fmt not in want:
            raise ValueError(f"ExpertBank {self.name!r}: unknown format {self.fmt!r}; expected one of {FORMATS}")
        block = {"nvfp4": 64, "q8_0": 32}.get(self.fmt, 1)
        if e < 1 or n < 1 or k < 1 or k % block:
            raise ValueError(f"ExpertBank {self.name!r}: {self.fmt} needs E, n >= 1 and k a positive multiple of "
                             f"{block}, got E={e}, n={n}, k={k}")
        ddt, dshape, sdt, sshape = want[self.fmt]
        check_layout(f"ExpertBank {self.name!r}", f"{self.fmt} [{e}, {n}, {k}]", self.fmt,
                     (("data", self.data, ddt, dshape), ("scale", self.scale, sdt, sshape)))
        if self.data.numel() // e >= 2**31:
            raise ValueError(f"ExpertBank {self.name!r}: {self.data.numel() // e} code elements per expert; the "
                             f"kernels' 32-bit offsets inside an expert allow < 2^31")
        if self.scale is not None and self.scale.device != self.data.device:
            raise ValueError(f"ExpertBank {self.name!r}: data on {self.data.device}, scale on {self.scale.device}")
        u = self.interleave
        if u < 0 or (u and (n % (2 * u) or (self.fmt == "fp8" and u % 128))):
            raise ValueError(f"ExpertBank {self.name!r}: interleave = {u} must be 0 or divide n / 2 = {n / 2}"
                             + (" and be a multiple of 128 for fp8" if self.fmt == "fp8" else ""))

    @property
    def nbytes(self) -> int:
        """Bytes of the whole bank (codes + scales)."""
        return packed_nbytes(self.data, self.scale)

    @property
    def expert_nbytes(self) -> int:
        """Bytes the kernels read per expert (codes + scales of one [n, k] weight)."""
        return self.nbytes // self.e

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str) -> ExpertBank:
        """A copy on ``device``."""
        s = None if self.scale is None else self.scale.to(device)
        return ExpertBank(self.fmt, self.e, self.n, self.k, self.data.to(device), s, self.name, self.interleave)

    def expert(self, i: int) -> DecodeWeight:
        """Expert ``i`` as a :class:`DecodeWeight` [n, k] (views, rows in bank order)."""
        s = None if self.scale is None else self.scale[i]
        return DecodeWeight(self.fmt, self.n, self.k, self.data[i], s, f"{self.name}[{i}]")


# ---------------------------------------------------------------------------------------
# load-time packing


def _pack_2d_as_bank(p: DecodeWeight, e: int, n: int, name: str) -> ExpertBank:
    """A packed [E*n, k] DecodeWeight (rows expert-major) as an [E, n, k] bank (per-row formats)."""
    s = None if p.scale is None else p.scale.reshape(e, n, -1)
    return ExpertBank(p.fmt, e, n, p.k, p.data.reshape(e, n, -1), s, name)


def pack_expert_bank(w, name: str = "") -> ExpertBank:
    """An :class:`ExpertBank` from stacked expert weights ``[E, N, K]``.

    Args:
        w: one of
            - a stacked :class:`QTensor` [E, N, K]: NVFP4 -> nvfp4, Q8_0 -> q8_0, F32/F16/BF16 -> bf16
              (rounded to bf16); any other ggml type (k-quants, Q4_0, ...) is dequantized to fp32
              and stored as bf16 (no decode kernel reads those formats directly);
            - a stacked :class:`FP8BlockTensor` [E, N, K] with 128x128 blocks -> fp8 (codes and
              ``scale_inv`` as they are);
            - a float torch tensor [E, N, K] -> bf16;
            - a list of E 2-D weights of one kind (each as for :func:`memra.kernels.gemv.pack_weight`).
        name: for error messages (default: the tensor's name).

    Returns: the bank on ``w``'s device; bytes per expert equal the source format's.

    Raises: ValueError for other inputs (wrong rank, empty list, mixed formats/shapes).
    """
    if isinstance(w, (list, tuple)):
        if not w:
            raise ValueError(f"pack_expert_bank({name!r}): empty list of experts")
        ps = []
        for i, wi in enumerate(w):
            if isinstance(wi, QTensor) and wi.is_quantized and wi.qtype not in (QType.NVFP4, QType.Q8_0):
                wi = wi.dequantize(torch.float32)
            p = gemv.pack_weight(wi)
            if ps and (p.fmt, p.n, p.k) != (ps[0].fmt, ps[0].n, ps[0].k):
                raise ValueError(f"pack_expert_bank({name!r}): expert {i} is {p.fmt} [{p.n}, {p.k}], expert 0 is "
                                 f"{ps[0].fmt} [{ps[0].n}, {ps[0].k}]")
            ps.append(p)
        s = None if ps[0].scale is None else torch.stack([p.scale for p in ps])
        return ExpertBank(ps[0].fmt, len(ps), ps[0].n, ps[0].k, torch.stack([p.data for p in ps]), s,
                          name or getattr(w[0], "name", ""))
    if isinstance(w, FP8BlockTensor):
        if len(w.shape) != 3 or tuple(w.block) != (128, 128):
            raise ValueError(f"pack_expert_bank: expected a stacked [E, N, K] FP8BlockTensor with 128x128 blocks, "
                             f"got {w!r}")
        e, n, k = w.shape
        return ExpertBank("fp8", e, n, k, w.codes.contiguous(), w.scale_inv.contiguous(), name or w.name)
    if isinstance(w, QTensor):
        if len(w.shape) != 3:
            raise ValueError(f"pack_expert_bank: expected a stacked [E, N, K] QTensor, got {w!r}")
        e, n, k = w.shape
        name = name or w.name
        if not w.is_quantized:
            return ExpertBank("bf16", e, n, k, w.data.to(torch.bfloat16).contiguous(), None, name)
        flat = QTensor(w.name, w.qtype, (e * n, k), w.data.reshape(e * n, -1))
        if w.qtype == QType.NVFP4:
            return _pack_2d_as_bank(gemv.pack_nvfp4(flat), e, n, name)
        if w.qtype == QType.Q8_0:
            return _pack_2d_as_bank(gemv.pack_q8_0(flat), e, n, name)
        # no kernel for this type: dequantize (per expert, to bound the fp32 temporary) to bf16
        raw = w.data.reshape(e, -1)
        data = torch.stack([dequantize_blocks(raw[i].contiguous(), w.qtype).reshape(n, k).to(torch.bfloat16)
                            for i in range(e)])
        return ExpertBank("bf16", e, n, k, data, None, name)
    if isinstance(w, torch.Tensor):
        if w.dim() != 3 or not w.is_floating_point():
            raise ValueError(f"pack_expert_bank({name!r}): expected a float tensor [E, N, K], got {w.dtype} "
                             f"{tuple(w.shape)}")
        e, n, k = w.shape
        return ExpertBank("bf16", e, n, k, w.to(torch.bfloat16).contiguous(), None, name)
    raise ValueError(f"pack_expert_bank({name!r}): unsupported input {type(w).__name__}; expected a stacked "
                     f"QTensor / FP8BlockTensor / torch tensor [E, N, K] or a list of 2-D weights")


def fuse_gate_up(gate: ExpertBank, up: ExpertBank, unit: int | None = None) -> ExpertBank:
    """One bank [E, 2I, K] whose rows interleave ``gate`` and ``up`` [E, I, K] in blocks of ``unit`` rows.

    Row order: ``[g_0..g_{u-1}, up_0..up_{u-1}, g_u..g_{2u-1}, up_u..up_{2u-1}, ...]``, so act
    column j's gate row is ``(j // u) * 2u + j % u`` and its up row that + u. Pure byte
    movement (codes and scales are copied, never re-quantized).

    Args:
        gate, up: banks of the same format and shape [E, I, K], not interleaved.
        unit: rows per block; default (None) 16, or 128 for fp8: the fp8 128x128 scale blocks
            are interleaved with the rows, which needs ``unit`` a multiple of 128 (a smaller
            unit would need per-row scales, i.e. more bytes, or re-quantization; neither is done).
            So fp8 needs I % 128 == 0 (the flagship's I = 1280 is; a model with a partial last
            block, e.g. I = 96, gets a ValueError: pad the experts' I to a multiple of 128 with
            zero codes, exact for SwiGLU since silu(0) * 0 = 0, if it is ever needed).

    Raises: ValueError for mismatched banks, ``I % unit != 0``, or an fp8 unit not a multiple of 128.
    """
    if unit is None:
        unit = 128 if gate.fmt == "fp8" else 16
    if (gate.fmt, gate.e, gate.n, gate.k) != (up.fmt, up.e, up.n, up.k) or gate.interleave or up.interleave:
        raise ValueError(f"fuse_gate_up: gate {gate.fmt} [{gate.e}, {gate.n}, {gate.k}] (interleave "
                         f"{gate.interleave}) and up {up.fmt} [{up.e}, {up.n}, {up.k}] (interleave {up.interleave}) "
                         f"must be plain banks of one format and shape")
    e, i, k = gate.e, gate.n, gate.k
    if unit < 1 or i % unit or (gate.fmt == "fp8" and unit % 128):
        raise ValueError(f"fuse_gate_up: unit = {unit} must divide I = {i}"
                         + (" and be a multiple of 128 for fp8 (128-row scale blocks)" if gate.fmt == "fp8" else ""))

    def inter(a: torch.Tensor, b: torch.Tensor, u: int) -> torch.Tensor:
        rest = a.shape[2:]
        x = torch.stack([a.reshape(e, -1, u, *rest), b.reshape(e, -1, u, *rest)], dim=2)
        return x.reshape(e, -1, *rest).contiguous()

    data = inter(gate.data, up.data, unit)
    scale = None
    if gate.scale is not None:
        scale = inter(gate.scale, up.scale, unit // 128 if gate.fmt == "fp8" else unit)
    name = f"{gate.name}+{up.name}" if gate.name or up.name else ""
    return ExpertBank(gate.fmt, e, 2 * i, k, data, scale, name, unit)


def dequantize_expert(bank: ExpertBank, i: int) -> torch.Tensor:
    """Expert ``i`` of ``bank`` as fp32 [n, k] (rows in bank order, exact as
    :func:`memra.kernels.gemv.dequantize_packed`)."""
    return dequantize_packed(bank.expert(i))


def _deinterleave(w: torch.Tensor, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [.., 2I] of an interleaved gate/up product -> (gate [.., I], up [.., I])."""
    lead = w.shape[:-1]
    v = w.reshape(*lead, -1, 2, unit)
    return v[..., 0, :].reshape(*lead, -1), v[..., 1, :].reshape(*lead, -1)


# ---------------------------------------------------------------------------------------
# routing and grouping


def moe_route(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, top_k: int,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing on the device: the math of ``MoE.route`` (memra/layers/moe.py,
    STEP35.md "router") in two launches: fp32 logits ``h.float() @ router^T`` (up to
    :data:`~memra.kernels.fused.ROUTER_LOGITS_MAX_T` tokens :func:`memra.kernels.fused.router_logits`,
    which reads h as it is; more tokens: the cast, then cuBLAS; every T in batch-invariant mode), then
    :func:`memra.kernels.fused.router_topk` (sigmoid, the top-k of ``s + bias``, the bias only
    choosing; weights ``s[chosen] / sum * scaling``). The model's GPU path calls this.

    Args: h [T, D] any float dtype; router fp32 [E, D]; bias fp32 [E] or None; top_k <= E.
    Returns: (index int64 [T, top_k], weight fp32 [T, top_k]). No host sync (CUDA-graph safe).
    Raises: ValueError on shape mismatches.
    """
    from .batch_invariant import batch_invariant
    from .fused import ROUTER_LOGITS_MAX_T, router_logits, router_topk

    if h.dim() != 2 or router.dim() != 2 or h.shape[1] != router.shape[1]:
        raise ValueError(f"moe_route: h [T, D] and router [E, D] expected, got {tuple(h.shape)} and "
                         f"{tuple(router.shape)}")
    if not 1 <= top_k <= router.shape[0]:
        raise ValueError(f"moe_route: top_k = {top_k} must be in 1..E = {router.shape[0]}")
    if bias is not None and tuple(bias.shape) != (router.shape[0],):
        raise ValueError(f"moe_route: bias must be [E] = [{router.shape[0]}], got {tuple(bias.shape)}")
    if (h.shape[0] <= ROUTER_LOGITS_MAX_T or batch_invariant()) and h.stride(1) == 1 and router.dtype == torch.float32 \
            and router.is_contiguous() and h.dtype in (torch.bfloat16, torch.float16, torch.float32):
        logits = router_logits(h, router)  # decode: one launch, h read as it is
    else:
        logits = h.float() @ router.float().t()
    return router_topk(logits, None if bias is None else bias.float(), top_k, scaling)


_GROUP_TRITON_MAX = 4096  # pairs; the Triton grouping does O(n * (E + 64)) work per program


def moe_group(index: torch.Tensor, num_experts: int, method: str = "torch"
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the T*k (token, expert) pairs by expert, on the device, without host syncs.

    Args:
        index: int64 [T, k] (values in 0..E-1; each row's experts distinct, as top-k gives).
        num_experts: E.
        method: "torch" (sort + cumsum + scatters: ~20 small kernels) or "triton" (one launch
            of ``_moe_group_kernel``; used for T*k <= 4096, else torch).
    Returns:
        perm int32 [T*k]: pair numbers ``p = t * k + j`` sorted by expert (ties by p);
        slot_expert int32 [S]: the distinct chosen experts in increasing order, then -1;
        slot_start int32 [S]: first position in ``perm`` of each slot's pairs (0 for unused);
        slot_count int32 [S]: pairs per slot (0 for unused);
    with S = min(E, T*k). Both methods give identical results.
    Raises: ValueError for an unknown method.
    """
    n = index.numel()
    dev = index.device
    s = min(num_experts, n)
    if method not in ("torch", "triton"):
        raise ValueError(f"moe_group: method {method!r}; expected 'torch' or 'triton'")
    if method == "triton" and n <= _GROUP_TRITON_MAX:
        from ._moe_triton import _moe_group_kernel

        flat = index.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        perm = torch.empty(n, dtype=torch.int32, device=dev)
        slots = torch.empty(3, s, dtype=torch.int32, device=dev)
        bi = 64
        _moe_group_kernel[(-(-n // bi),)](flat, perm, slots[0], slots[1], slots[2], n, s, BI=bi, BJ=32,
                                          EP=max(16, triton_next_pow2(num_experts)),
                                          SP=max(16, triton_next_pow2(s)), num_warps=4,
                                          **pdl_args(dev))
        return perm, slots[0], slots[1], slots[2]
    flat = index.reshape(-1).to(torch.int64)
    ar = torch.arange(n, device=dev, dtype=torch.int64)
    key, order = torch.sort(flat * n + ar)  # keys are distinct: order is the stable sort by expert
    se = key // n
    new = torch.ones(n, dtype=torch.bool, device=dev)
    new[1:] = se[1:] != se[:-1]
    slot = torch.cumsum(new.to(torch.int64), 0) - 1  # [n], values in 0..S-1
    slot_expert = torch.full((s,), -1, dtype=torch.int64, device=dev).scatter_(0, slot, se)
    slot_start = torch.full((s,), n, dtype=torch.int64, device=dev).scatter_reduce_(0, slot, ar, "amin")
    slot_count = torch.zeros(s, dtype=torch.int64, device=dev).scatter_add_(0, slot, torch.ones_like(ar))
    slot_start = torch.where(slot_count > 0, slot_start, torch.zeros_like(slot_start))
    return (order.to(torch.int32), slot_expert.to(torch.int32), slot_start.to(torch.int32),
            slot_count.to(torch.int32))


def triton_next_pow2(v: int) -> int:
    """Smallest power of two >= v (v >= 1)."""
    return 1 << (v - 1).bit_length()


# ---------------------------------------------------------------------------------------
# reference


def _check_moe_args(x, index, weight, gate_up: ExpertBank, down: ExpertBank, fn: str) -> None:
    if not isinstance(gate_up, ExpertBank) or not isinstance(down, ExpertBank):
        raise ValueError(f"{fn}: gate_up and down must be ExpertBanks")
    if gate_up.interleave <= 0:
        raise ValueError(f"{fn}: gate_up must be a fused gate/up bank (fuse_gate_up), got interleave = 0")
    e, i2, d = gate_up.e, gate_up.n, gate_up.k
    if (down.e, down.n, down.k) != (e, d, i2 // 2) or down.interleave:
        raise ValueError(f"{fn}: down must be a plain bank [E, D, I] = [{e}, {d}, {i2 // 2}], got "
                         f"[{down.e}, {down.n}, {down.k}] (interleave {down.interleave})")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != d or x.shape[0] < 1:
        raise ValueError(f"{fn}: x must be [T, {d}] with T >= 1, got {tuple(getattr(x, 'shape', ()))}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{fn}: x is {x.dtype}; expected bf16, fp16 or fp32")
    t = x.shape[0]
    if not isinstance(index, torch.Tensor) or index.dim() != 2 or index.shape[0] != t or index.dtype != torch.int64:
        raise ValueError(f"{fn}: index must be int64 [{t}, k], got "
                         f"{getattr(index, 'dtype', None)} {tuple(getattr(index, 'shape', ()))}")
    if not 1 <= index.shape[1] <= e:
        raise ValueError(f"{fn}: top-k = {index.shape[1]} must be in 1..E = {e}")
    if (not isinstance(weight, torch.Tensor) or tuple(weight.shape) != tuple(index.shape)
            or not weight.is_floating_point()):
        raise ValueError(f"{fn}: weight must be float [{t}, {index.shape[1]}], got "
                         f"{getattr(weight, 'dtype', None)} {tuple(getattr(weight, 'shape', ()))}")
    for what, dev in (("index", index.device), ("weight", weight.device), ("gate_up", gate_up.device),
                      ("down", down.device)):
        if dev != x.device:
            raise ValueError(f"{fn}: x on {x.device}, {what} on {dev}")


def moe_decode_ref(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, gate_up: ExpertBank,
                   down: ExpertBank, limit: float | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch twin of :func:`moe_decode` (same arguments and result), in fp32.

    For each distinct chosen expert e (host loop, syncs): ``h = x[rows].float() @ Wgu_e^T``
    (fp32 dequantized weights), gate/up de-interleaved, ``a = swiglu(g, u, limit)``,
    ``y[rows] += weight[rows, j] * (a @ Wd_e^T)``; cast to x.dtype at the end.
    Dequantizes only the chosen experts.
    """
    _check_moe_args(x, index, weight, gate_up, down, "moe_decode_ref")
    from .fused import swiglu_torch as swiglu

    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(index).tolist():
        rows, slot = (index == e).nonzero(as_tuple=True)
        h = x[rows].float() @ dequantize_expert(gate_up, e).T
        g, u = _deinterleave(h, gate_up.interleave)
        a = swiglu(g, u, limit)
        y[rows] += (a @ dequantize_expert(down, e).T) * weight[rows, slot, None].float()
    if out is not None:
        out.copy_(y)
        return out
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------
# launch configuration and the kernels


@dataclass(frozen=True)
class MoeDecodeConfig:
    """Launch parameters.

    gate+up kernel: ``ba`` act columns per program (2 * ba weight rows), ``bk1`` columns of D
    per loop step, ``nc`` tokens per chunk (1, 2 or 4; chunks of 2 and 1 finish a slot).
    down kernel: ``bn`` rows of D per program, ``bk2`` columns of I per step, ``split_k``.
    ``f16``: fp16x2 path for nvfp4 and fp8 (memra/kernels/gemv.py; fp8 needs D and I multiples
    of 16; ignored for other formats); ``prefetch``: next weight tile
    loaded before the current one is used (registers; Triton's pipelining of the weight loads
    through shared memory instead, cp.async, measured 1.4-1.6x slower at the flagship shape, T = 1
    and 2, H100: benchmarks/results/issue14/moe-stages-sweep-h100.json, and was removed);
    ``prefetch_tail``: the same for the chunks of fewer than ``nc`` tokens that finish a slot
    (None: ``prefetch``);
    ``num_warps`` for both kernels; ``group``: how the
    pairs are grouped by expert (:func:`moe_group`: "triton", one launch, the default: checked on
    the H200 in a CUDA graph and 40 µs faster per call at T = 1 than "torch", ~20 small kernels);
    ``combine``: "sum" (default) the down kernel stores per-pair fp32 rows [T*k, D] and one
    launch sums each token's k rows in order j = 0..k-1 (+ ``add``) and casts: deterministic,
    and a token's result does not depend on the other tokens of the step (batch invariance;
    split_k is then 1); "atomic": fp32 atomic adds into [T, D] (the order of a token's k terms
    varies from run to run).
    ``maxnreg1`` / ``maxnreg2``: registers per thread the gate+up / down kernel may use (ptxas
    ``-maxrregcount``, Triton's ``maxnreg``; None: ptxas chooses). Fewer registers let more
    programs share an SM (65536 registers each; ``benchmarks/sass_census.py`` prints the
    registers, blocks per SM and spill loads in the K loop of each cap, compiled for sm_90 on
    the CPU); a cap below what the kernel needs spills to local memory. Integers 24..255.
    ``xvec``: the nvfp4 fp16x2 path reads each 16-element sub-block of activations with 16-byte
    vector loads (2 for bf16 x, 4 for the fp32 act rows of the down kernel) instead of 16 scalar
    loads (ncu: 26 % of the gate+up kernel's long-scoreboard stalls wait on those loads at T = 1;
    benchmarks/results/issue14/h100-ncu-stalls-gemv-t1-*). Used where the rows are 16-byte
    aligned and x is bf16 or fp32 (a kernel whose rows are not falls back to scalar loads); the
    same bits either way.
    ``prefetch_depth``: 1 or 2; with 2 (and ``prefetch``), the nvfp4 fp16x2 path loads codes and
    scales two K steps ahead where the block divides K (ptxas sinks a one-step prefetch to the end
    of the loop body). The same bits either way.
    """

    ba: int = 32
    bk1: int = 512
    nc: int = 4
    bn: int = 64
    bk2: int = 256
    split_k: int = 1
    f16: bool = True
    prefetch: bool = True
    prefetch_tail: bool | None = None
    num_warps: int = 4
    group: str = "triton"
    combine: str = "sum"
    maxnreg1: int | None = None
    maxnreg2: int | None = None
    xvec: bool = False
    prefetch_depth: int = 1


def default_moe_config(fmt: str, t: int, topk: int, e: int, i: int, d: int) -> MoeDecodeConfig:
    """Defaults (H200 sweep at the flagship shape, memra/bench/moe_census.py, and ptxas register
    counts): nvfp4 uses the fp16x2 path; at T = 1 (one token per slot) 32 act columns (64 weight
    rows) x 512 per gate+up program and 64 rows x 256 per down program with prefetch (168 / 95
    registers); at T >= 2 chunks of up to 2 tokens and no prefetch (168 / 128 registers; no
    spill in the K loops: ``python3 benchmarks/sass_census.py --caps``, Triton 3.6; with prefetch or 4-token
    chunks these tiles spill and ran 14 % slower at T = 2).
    fp8 (D, I multiples of 16): the fp16x2 path, 16 act columns (32 weight rows) x 256 codes per
    gate+up program, 64 rows x 256 per down program (H200 A/B at the flagship shape,
    benchmarks/results/issue14/fp8-moe-ab-h200.json: with 32 act columns 44.9 vs 67.9 µs for the
    fp32 path at T = 1, 83.4 vs 118.8 at 2, 140.8 vs 266.0 at 4; 16 act columns 43.6, 76.5, 140.4). Other formats: fp32 FMAs on 8 act columns (16 rows) x 256
    and 16 rows x 256, as gemv's CUDA-core defaults, chunks of up to 4 tokens.
    nvfp4 takes the 16-byte activation loads (``xvec``; H100, flagship shape: 48.5 -> 46.5 µs at
    T = 1, 89.9 -> 82.2 at 2, 158.6 -> 148.1 at 4, benchmarks/results/issue14/h100-moe-xvec-sweep-14c566a.json)."""
    if fmt == "nvfp4":
        nc = 1 if t == 1 else 2
        ba, bk1, bn, bk2, pf = 32, 512, 64, 256, t == 1
    elif fmt == "fp8" and d % 16 == 0 and i % 16 == 0:  # fp16x2 path (benchmarks/fp8_moe_ab.py)
        nc = 1 if t == 1 else 2
        ba, bk1, bn, bk2, pf = 16, 256, 64, 256, t == 1
    else:
        nc = 1 if t == 1 else (2 if t == 2 else 4)
        ba, bk1, bn, bk2, pf = 8, 256, 16, 256, True
    while bk1 > _GS[fmt] and (bk1 > d or d % bk1):
        bk1 //= 2
    while bk2 > _GS[fmt] and (bk2 > i or i % bk2):
        bk2 //= 2
    if fmt == "nvfp4":
        bk1, bk2 = max(bk1, 32), max(bk2, 32)
    while ba > 1 and ba > i:
        ba //= 2
    f16 = fmt == "nvfp4" or (fmt == "fp8" and d % 16 == 0 and i % 16 == 0)
    return MoeDecodeConfig(ba=ba, bk1=bk1, nc=nc, bn=bn, bk2=bk2, split_k=1, f16=f16, prefetch=pf, xvec=fmt == "nvfp4")


def wait_for(stream: torch.cuda.Stream | None, device: torch.device) -> None:
    """Make the current CUDA stream of ``device`` wait for the work queued so far on ``stream``
    (a join; a no-op for None). moe_decode / moe_prefill call it just before they first read
    ``add``, so a producer of ``add`` on another stream overlaps their routed-expert kernels."""
    if stream is not None:
        torch.cuda.current_stream(device).wait_stream(stream)


def _xv(on: bool) -> dict:
    # the XV constexpr; left out when off, so the default launches keep their cache keys
    return {"XV": True} if on else {}


def _maxnreg(regs: int | None) -> dict:
    # Triton's launch option; left out when None, so uncapped launches keep their cache keys
    return {} if regs is None else {"maxnreg": regs}


def _xvec(cfg: MoeDecodeConfig, bank: ExpertBank, x: torch.Tensor, asm: bool) -> bool:
    """Whether a kernel reading activations ``x`` (rows of x.stride(0) elements) with ``bank``'s
    codes takes the 16-byte activation loads (MoeDecodeConfig.xvec): nvfp4 on the fp16x2 path
    with inline PTX, x bf16 or fp32 with 16-byte aligned rows."""
    return (cfg.xvec and asm and cfg.f16 and bank.fmt == "nvfp4" and x.dtype in (torch.bfloat16, torch.float32)
            and x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0)


def _kernels():
    from ._moe_triton import _moe_down_kernel, _moe_gate_up_kernel

    return _moe_gate_up_kernel, _moe_down_kernel


def moe_decode(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, gate_up: ExpertBank,
               down: ExpertBank, limit: float | None, out: torch.Tensor | None = None,
               config: MoeDecodeConfig | None = None, add: torch.Tensor | None = None,
               add_stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """Routed experts of one MoE layer: ``y[t] = sum_j weight[t, j] * down_e(swiglu(gate_e x[t], up_e x[t], limit))``,
    ``e = index[t, j]``, each distinct chosen expert's weights read once (module docstring).

    Args:
        x: [T, D] bf16 (fp16 / fp32 also accepted), any T >= 1 (tuned for 1..64; larger T is
            correct but slow: each program loops over its expert's tokens).
        index: int64 [T, k], experts of each token (distinct within a row, as top-k gives).
        weight: float [T, k] routing weights (used in fp32).
        gate_up: fused bank [E, 2I, D] from :func:`fuse_gate_up`; down: bank [E, D, I], same device.
        limit: SwiGLU clamp, ``min(silu(g), limit) * clamp(u, -limit, limit)``; None: no clamp.
        out: optional [T, D] tensor of x's dtype, written in full.
        config: launch parameters (default :func:`default_moe_config`); extension beyond the
            shared API, for benchmarks.
        add: optional [T, D] tensor added to the result (the MoE layer passes its shared
            expert's output): by the combine launch in the default "sum" combine, or as the
            starting value the down kernel accumulates onto in the "atomic" one.
        add_stream: the CUDA stream that produces ``add``, if not the current one: the current
            stream waits for it (:func:`wait_for`) just before ``add`` is first read, i.e. after
            both routed-expert kernels in the "sum" combine (they overlap its producer) and
            before the down kernel in the "atomic" one (only the grouping and the gate+up kernel
            overlap it).

    Returns: y [T, D] in x.dtype (``out`` if given). No host syncs: CUDA-graph capturable
    (scratch buffers are allocated per call from the caching allocator).

    Raises: ValueError on shape / dtype / device mismatches or an invalid config.
    """
    _check_moe_args(x, index, weight, gate_up, down, "moe_decode")
    t, d = x.shape
    topk = index.shape[1]
    e, i2 = gate_up.e, gate_up.n
    i = i2 // 2
    if out is not None and (tuple(out.shape) != (t, d) or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"moe_decode: out must be {x.dtype} [{t}, {d}] on {x.device}")
    cfg = config or default_moe_config(gate_up.fmt, t, topk, e, i, d)
    for b, bk in ((gate_up, cfg.bk1), (down, cfg.bk2)):
        gs = _GS[b.fmt]
        if bk % gs or bk & (bk - 1) or (b.fmt == "nvfp4" and cfg.f16 and bk < 32):
            raise ValueError(f"moe_decode: block {bk} must be a power of two, a multiple of {gs} for {b.fmt} "
                             f"(>= 32 for the nvfp4 fp16x2 path)")
    if (cfg.nc not in (1, 2, 4) or cfg.ba & (cfg.ba - 1) or cfg.bn & (cfg.bn - 1) or cfg.split_k < 1
            or cfg.group not in ("torch", "triton") or cfg.combine not in ("sum", "atomic")
            or any(r is not None and (type(r) is not int or not 24 <= r <= 255) for r in (cfg.maxnreg1, cfg.maxnreg2))
            or cfg.prefetch_depth not in (1, 2) or type(cfg.xvec) is not bool):
        raise ValueError(f"moe_decode: invalid config {cfg}")
    if x.stride(1) != 1 or x.stride(0) != d:
        x = x.contiguous()
    perm, slot_e, slot_start, slot_cnt = moe_group(index, e, cfg.group)
    s = slot_e.shape[0]
    wflat = weight.reshape(-1).float().contiguous()
    act = torch.empty(t * topk, i, dtype=torch.float32, device=x.device)
    if add is not None and tuple(add.shape) != (t, d):
        raise ValueError(f"moe_decode: add must be [{t}, {d}], got {tuple(add.shape)}")
    atomic = cfg.combine == "atomic"
    if atomic:  # the down kernel accumulates into y32: zeros, or ``add`` (e.g. the shared expert's output)
        wait_for(add_stream, x.device)
        y32 = torch.zeros(t, d, dtype=torch.float32, device=x.device) if add is None else add.float().contiguous()
        if add is not None and y32.data_ptr() == add.data_ptr():
            y32 = y32.clone()
    else:  # per-pair rows, each written once by the down kernel
        y32 = torch.empty(t * topk, d, dtype=torch.float32, device=x.device)
    k1, k2 = _kernels()
    asm = not interpret_mode()

    def strides(b: ExpertBank, h2: bool):
        sc = b.scale if b.scale is not None else b.data
        sw_e, sw_n = b.data.stride(0), b.data.stride(1)
        if h2:  # codes read as 8-byte words
            sw_e, sw_n = sw_e // 8, sw_n // 8
        return sc, sw_e, sw_n, sc.stride(0), sc.stride(1)

    has_limit = limit is not None
    pf_tail = cfg.prefetch if cfg.prefetch_tail is None else bool(cfg.prefetch_tail)
    pf = 2 if cfg.prefetch and cfg.prefetch_depth == 2 else cfg.prefetch  # PREFETCH: True, or 2 steps ahead
    pf_tail = 2 if pf_tail and cfg.prefetch_depth == 2 else pf_tail
    lim = float(limit) if has_limit else 0.0

    for b, kk in ((gate_up, d), (down, i)):
        if b.fmt == "fp8" and cfg.f16 and (kk % 16 or b.data.stride(1) % 16):
            raise ValueError(f"moe_decode: the fp8 fp16x2 path (f16=True) reads 16-code units; K = {kk} and the row "
                             f"stride {b.data.stride(1)} must be multiples of 16 (use f16=False)")
    h2a = gate_up.fmt in ("nvfp4", "fp8") and cfg.f16
    sc, swe, swn, sse, ssn = strides(gate_up, h2a)
    bk1 = cfg.bk1
    k1[(-(-i // cfg.ba), s)](
        x, gate_up.data, sc, act, perm, slot_e, slot_start, slot_cnt,
        topk, i, d, x.stride(0), swe, swn, sse, ssn, lim,
        FMT=_FMT_ID[gate_up.fmt], BA=cfg.ba, U=gate_up.interleave, G=bk1 // _GS[gate_up.fmt],
        GS=_GS[gate_up.fmt], NC=cfg.nc, EVEN_K=(d % bk1 == 0), ASM=asm, F16=h2a, PREFETCH=pf,
        PREFETCH_TAIL=pf_tail, HAS_LIMIT=has_limit, num_warps=cfg.num_warps, **_maxnreg(cfg.maxnreg1),
        **_xv(_xvec(cfg, gate_up, x, asm)), **pdl_args(x.device))

    h2b = down.fmt in ("nvfp4", "fp8") and cfg.f16
    sc, swe, swn, sse, ssn = strides(down, h2b)
    bk2 = cfg.bk2
    steps = -(-i // bk2)
    split = min(cfg.split_k, steps) if atomic else 1
    k_per_split = -(-steps // split) * bk2
    split = -(-i // k_per_split)
    k2[(-(-d // cfg.bn), s, split)](
        act, down.data, sc, y32, perm, wflat, slot_e, slot_start, slot_cnt,
        topk, d, i, k_per_split, swe, swn, sse, ssn,
        FMT=_FMT_ID[down.fmt], BN=cfg.bn, G=bk2 // _GS[down.fmt], GS=_GS[down.fmt], NC=cfg.nc,
        EVEN_K=(i % bk2 == 0), ASM=asm, F16=h2b, PREFETCH=pf, PREFETCH_TAIL=pf_tail, ATOMIC=atomic,
        num_warps=cfg.num_warps, **_maxnreg(cfg.maxnreg2), **_xv(_xvec(cfg, down, act, asm)),
        **pdl_args(x.device))
    if not atomic:
        from ._moe_prefill_triton import _moe_combine_kernel

        y = out if out is not None and out.stride(1) == 1 else torch.empty(t, d, dtype=x.dtype, device=x.device)
        wait_for(add_stream, x.device)
        a = y32 if add is None else (add if add.stride(1) == 1 else add.contiguous())
        bd = 512
        _moe_combine_kernel[(t, -(-d // bd))](y32, a, y, d, y32.stride(0), a.stride(0), y.stride(0), TOPK=topk,
                                               BD=bd, HAS_ADD=add is not None, num_warps=4,
                                               **pdl_args(x.device))
        if out is not None and y.data_ptr() != out.data_ptr():
            out.copy_(y)
            return out
        return y
    if out is not None:
        out.copy_(y32)
        return out
    return y32 if x.dtype == torch.float32 else y32.to(x.dtype)
