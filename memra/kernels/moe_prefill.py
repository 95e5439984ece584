"""Routed-expert (MoE) prefill: a grouped GEMM over (token, expert) pairs sorted by expert.

Same math as :func:`memra.kernels.moe_decode.moe_decode` (STEP35.md "SwiGLU clamp", "combine";
memra/layers/moe.py ``RoutedExperts.forward``, memra/kernels/fused.py ``swiglu_torch``)::

    y[t] = sum_j weight[t, j] * down_e(swiglu(gate_e x[t], up_e x[t], limit))  (+ add[t]),  e = index[t, j]
    swiglu(g, u, limit) = min(silu(g), limit) * clamp(u, -limit, limit)         (limit None: silu(g) * u)

for prefill chunks (T = 512..4096 tokens, top-8 of E = 288 experts, D = 4096, I = 1280 in
Step-3.5-Flash), where each expert meets tens to ~1000 tokens and the work is tensor-core
matmuls rather than weight-streaming GEMVs. The expert weights are the :class:`ExpertBank`
layouts of :mod:`memra.kernels.moe_decode` (bf16, fp8 128x128 blocks, nvfp4, q8_0), read in
their stored format and dequantized inside the kernels. The standard "sorted by expert,
padded to BLOCK_M" scheme of vLLM's ``fused_moe`` / SGLang (ideas only, own code):

1. :func:`moe_align` (torch ops on the device, no host sync): the P = T*k pairs, numbered
   ``p = t * k + j``, are sorted by expert (ties by p); each expert's run is padded to a
   multiple of ``block_m`` with the invalid id P. ``sorted_ids`` has the worst-case length
   ``P_pad = num_blocks * block_m``, ``num_blocks = ceil((P + min(E, P) * (block_m - 1)) / block_m)``,
   and ``block_expert[b]`` is the expert of row block b (-1 past the used blocks: those
   programs exit at once). Shapes depend only on (T, k, E, block_m): CUDA-graph capturable.
2. kernel A (gate+up, ``_moe_gate_up_kernel``), grid num_blocks x ceil(I / block_n): a program
   gathers the x rows of its BLOCK_M pairs (token = p // k), multiplies them with block_n gate
   rows and the block_n matching up rows of its expert (the fused bank's rows are interleaved
   gate/up in units of ``gate_up.interleave`` rows: act column j's gate row is
   ``(j // u) * 2u + j % u``, its up row that + u; so any block_n works, whole units or not),
   two ``tl.dot`` per K step with fp32 accumulators, and writes ``act[pos] = swiglu(g, u, limit)``
   for its sorted positions (act [P_pad, I]; padding rows are never written nor read).
3. kernel B (down, ``_moe_down_kernel``), grid num_blocks x ceil(D / block_n_down): ``act[pos] @
   W_down_e^T`` times the pair's routing weight, then the combine over k, ``combine=``:
   - ``"atomic"`` (default): fp32 atomic adds into y32 [T, D], zeroed or initialised from
     ``add``; the summation order of a token's k terms varies from run to run (fp32 rounding);
   - ``"sum"``: per-pair fp32 rows [T*k, D] (each written exactly once, no zeroing), then
     ``view(T, k, D).sum(1)`` (+ add) in torch: deterministic, 2 x T*k*D*4 extra bytes.
   Then one cast to x's dtype.

Dot operands (per format; ``CDT`` = x's dtype, bf16 on the GPU; fp32 x gives fp32 operands
with IEEE (non-TF32) dots, exact weights):
- bf16: the weights as they are. nvfp4: codes decoded to E2M1 * UE4M3 * 2^-8 (exact in fp16 and
  bf16: at most 6 significant bits, magnitudes 2^-18..11.25; the accumulator is multiplied by 2^8;
  ``swap_ab`` decodes E2M1 * UE4M3 unscaled). q8_0: code * d rounded to CDT (relative
  error <= 2^-9 per weight in bf16, as gemv's tensor-core path).
- fp8, ``fp8_act=False``: E4M3 codes converted to CDT (exact), the 128x128 block scale applied
  to each 128-K step's fp32 product.
- fp8, ``fp8_act=True`` (default for fp8 when D and I are multiples of 128): the FP8 block
  recipe of DeepSeek-V3 (technical report, arXiv 2412.19437, "FP8 training": fine-grained
  quantization, 1x128 activation tiles and 128x128 weight blocks, fp32 promotion every 128 K):
  x is quantized to E4M3 per 1x128 group with an fp32 scale ``s = max(amax, 1e-10) / 448``
  (``_act_quant_kernel``), kernel A's epilogue quantizes act the same way (block_n a multiple
  of 128), and both GEMMs ``tl.dot`` E4M3 x E4M3 on Hopper FP8 tensor cores, one product per
  128-K step (block_k divides 128) scaled by the activation scale of the row and the weight
  block scale of the column, accumulated in fp32. Activation quantization costs ~2-3 % relative
  error per GEMM (3 mantissa bits); :func:`moe_prefill_ref` with ``fp8_act=True`` emulates it
  exactly (same groups, same rounding), for tight tests.

Kernel details that matter for speed (H200, measured): fp8 tiles whose rows lie in one 128-row
scale block load one block scale per K step and fold it with the activation scale into one FMA
per accumulator element (``SCALAR_S``: the gate+up loop went from 343 to 215 SASS instructions,
no spills; kernel A at T = 4096, each tuned: 1.97 -> 1.57 ms); nvfp4 weights are decoded by parity
(``_nvfp4_split_tile``: a code byte holds element 2i in its low nibble and 2i + 1 in its high one, so
the even and odd halves of a tile come straight out of the byte tile, each multiplied with x's
even or odd columns in its own dot; with bf16 or fp16 x, decode and scale are one packed asm per 4
bytes in that dtype, with fp32 x fp32 arithmetic): 44 % fewer SASS instructions per kernel-A loop
step than decoding to the natural order (tl.join + reshape: byte permutes and an fp16 -> bf16
conversion per weight), 25 % less time on the issue-bound multi-token decode path (H200,
memra/kernels/NOTES.md); ``swap_ab`` (transposed products,
the dequantized tile as wgmma's register operand) is available for the non-fp8 formats but lost
every nvfp4 tuning point (the bf16 entries were tuned before it existed). Launch configurations come from the H200 tuning table
(:data:`TUNED_TABLE`, written by ``memra bench moe-grouped --tune``, :mod:`memra.bench.moe_tune`).

Verified on the CPU under the Triton interpreter (tests/test_kernels_moe_prefill.py) and on the
H200 at the flagship shape (tests marked ``gpu``: T = 512 and 4096, skewed and uniform routing
with experts that get no rows, nvfp4 / fp8 / bf16, both combines, swap_ab, CUDA-graph capture; max
relative error <= 1e-2 vs :func:`moe_prefill_ref`, fp8 vs its exact emulation of the recipe).
Speed: ``memra bench moe-grouped`` (benchmarks/results/moe-grouped-h200.json).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .gemv import interpret_mode
from .moe_decode import ExpertBank, _check_moe_args, _deinterleave, dequantize_expert, wait_for
from .pdl import pdl_args

__all__ = [
    "MoePrefillConfig",
    "default_prefill_config",
    "tuned_prefill_config",
    "tuned_table",
    "table_key",
    "TUNED_TABLE",
    "moe_align",
    "grouped_decode_config",
    "GROUPED_DECODE_MAX_T",
    "moe_prefill",
    "moe_prefill_ref",
    "quantize_act_fp8_ref",
    "align_sizes",
    "sm90_compile_report",
]

_FMT_ID = {"bf16": 0, "fp8": 1, "nvfp4": 2, "q8_0": 3}
# block_k multiple of: the scale groups; for nvfp4 32, as the parity decode's two dots take K = block_k / 2 and
# Triton's dot needs K >= 16 on sm_90
_BK_UNIT = {"bf16": 16, "fp8": 16, "nvfp4": 32, "q8_0": 32}
FP8_MAX = 448.0


# ---------------------------------------------------------------------------------------
# pair alignment


def align_sizes(n_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(P_pad, num_blocks) of :func:`moe_align`: the worst case over all routings of n_pairs
    pairs onto num_experts experts (at most min(E, n_pairs) experts are non-empty, each wasting
    at most block_m - 1 padding rows)."""
    nb = -(-(n_pairs + min(num_experts, n_pairs) * (block_m - 1)) // block_m)
    return nb * block_m, nb


ALIGN_TRITON_MAX = 4096  # pairs: the one-launch alignment does O(n * (E + BI)) work per program


def moe_align(index: torch.Tensor, num_experts: int, block_m: int, method: str = "torch"
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the (token, expert) pairs by expert and pads each expert's run to whole row blocks.

    Args:
        index: int64 [T, k], values in 0..E-1 (not checked: out-of-range values are undefined
            behaviour, as in the kernels), any device.
        num_experts: E.
        block_m: rows per block (>= 1).
        method: "torch" (about 15 small torch kernels) or "triton" (one launch of
            ``_moe_align_kernel``, for decode-size calls; used when T*k <= :data:`ALIGN_TRITON_MAX`
            and E <= 4096, else torch). Both give identical results.

    Returns:
        sorted_ids int32 [P_pad]: pair numbers ``p = t * k + j`` grouped by expert in increasing
            expert order, ties by p; each expert's run starts at a multiple of block_m and is
            followed by padding entries equal to P = T*k up to the next multiple; the tail after
            the last used block is P too.
        block_expert int32 [num_blocks]: the expert of each row block; -1 for the blocks past
            the used ones.
        num_blocks_used int32 [1] (a device tensor: no host sync).
    with (P_pad, num_blocks) = :func:`align_sizes` (shapes independent of the routing values).
    About 15 small torch kernels (sort, scatters, cumsums, searchsorted); no host syncs, so
    CUDA-graph capturable.

    Raises: ValueError for a non-2-D / non-integer index, E < 1, block_m < 1 or an unknown method.
    """
    if not isinstance(index, torch.Tensor) or index.dim() != 2 or index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"moe_align: index must be int64/int32 [T, k], got {getattr(index, 'dtype', None)} "
                         f"{tuple(getattr(index, 'shape', ()))}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"moe_align: num_experts = {num_experts} and block_m = {block_m} must be >= 1")
    if method not in ("torch", "triton"):
        raise ValueError(f"moe_align: method {method!r}; expected 'torch' or 'triton'")
    dev = index.device
    n = index.numel()
    p_pad, nb = align_sizes(n, num_experts, block_m)
    if method == "triton" and n <= ALIGN_TRITON_MAX and num_experts <= 4096 and block_m & (block_m - 1) == 0:
        from ._moe_prefill_triton import _moe_align_kernel

        flat = index.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        sorted_ids = torch.empty(p_pad, dtype=torch.int32, device=dev)
        block_expert = torch.empty(nb, dtype=torch.int32, device=dev)
        used = torch.empty(1, dtype=torch.int32, device=dev)
        bi = 64
        _moe_align_kernel[(-(-n // bi),)](flat, sorted_ids, block_expert, used, n, nb, num_experts, BM=block_m,
                                          BI=bi, BJ=32, EP=max(16, 1 << (num_experts - 1).bit_length()), NBC=16,
                                          num_warps=4)
        return sorted_ids, block_expert, used
    flat = index.reshape(-1).to(torch.int64)
    ar = torch.arange(n, device=dev, dtype=torch.int64)
    key, order = torch.sort(flat * n + ar)  # distinct keys: the stable sort by expert
    se = key // n  # expert of each sorted pair
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    dest = pad_start[se] + (ar - cnt_start[se])
    sorted_ids = torch.full((p_pad,), n, dtype=torch.int32, device=dev).scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(nb, device=dev, dtype=torch.int64) * block_m
    be = torch.searchsorted(pad_end, starts, right=True)  # first expert whose padded run ends past the start
    block_expert = torch.where(be < num_experts, be, torch.full_like(be, -1)).to(torch.int32)
    used = (pad_end[-1:] // block_m).to(torch.int32)
    return sorted_ids, block_expert, used


# ---------------------------------------------------------------------------------------
# references


def quantize_act_fp8_ref(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-1x128-group E4M3 quantization of activations (the FP8 block recipe, DeepSeek-V3
    report), the torch twin of the kernels' ``_quant_groups``.

    Args: v float [R, C], C a multiple of 128 (used in fp32).
    Returns: (codes float8_e4m3fn [R, C], scales fp32 [R, C // 128]) with
        ``s = max(amax of the group, 1e-10) / 448`` and ``code = e4m3_rne(clamp(v / s, -448, 448))``;
        ``codes.float() * s`` (broadcast per group) dequantizes.
    Raises: ValueError if C is not a multiple of 128.
    """
    if v.dim() != 2 or v.shape[1] % 128:
        raise ValueError(f"quantize_act_fp8_ref: expected [R, C] with C a multiple of 128, got {tuple(v.shape)}")
    r, c = v.shape
    g = v.float().reshape(r, c // 128, 128)
    s = g.abs().amax(-1).clamp(min=1e-10) / FP8_MAX
    q = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(r, c), s


def dequantize_act_fp8_ref(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 [R, C] values of per-1x128-group E4M3 codes ``q`` [R, C] with fp32 scales ``s``
    [R, C // 128] (the inverse of :func:`quantize_act_fp8_ref` up to its rounding)."""
    r, c = q.shape
    return (q.float().reshape(r, c // 128, 128) * s.float()[..., None]).reshape(r, c)


def _fp8_roundtrip(v: torch.Tensor) -> torch.Tensor:
    return dequantize_act_fp8_ref(*quantize_act_fp8_ref(v))


def moe_prefill_ref(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, gate_up: ExpertBank,
                    down: ExpertBank, limit: float | None, add: torch.Tensor | None = None,
                    config: MoePrefillConfig | None = None, fp8_act: bool = False) -> torch.Tensor:
    """Plain torch twin of :func:`moe_prefill`, in fp32 (host loop over the chosen experts, syncs).

    Default (``fp8_act=False``): exactly :func:`memra.kernels.moe_decode.moe_decode_ref` (fp32
    dequantized weights, fp32 products) plus ``add``. ``fp8_act=True`` with an fp8 bank emulates
    the kernels' FP8 block recipe: x (for an fp8 gate_up bank) and act (for an fp8 down bank)
    are quantized per 1x128 group by :func:`quantize_act_fp8_ref` and dequantized before their
    fp32 GEMM. ``config`` is accepted for signature parity and ignored.

    Returns: y [T, D] in x.dtype. Raises: ValueError as :func:`moe_prefill`.
    """
    _check_moe_args(x, index, weight, gate_up, down, "moe_prefill_ref")
    from .fused import swiglu_torch as swiglu

    t, d = x.shape
    if add is not None and tuple(add.shape) != (t, d):
        raise ValueError(f"moe_prefill_ref: add must be [{t}, {d}], got {tuple(add.shape)}")
    xf = x.float()
    if fp8_act and gate_up.fmt == "fp8":
        xf = _fp8_roundtrip(xf)
    y = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    for e in torch.unique(index).tolist():
        rows, slot = (index == e).nonzero(as_tuple=True)
        h = xf[rows] @ dequantize_expert(gate_up, e).T
        g, u = _deinterleave(h, gate_up.interleave)
        a = swiglu(g, u, limit)
        if fp8_act and down.fmt == "fp8":
            a = _fp8_roundtrip(a)
        y[rows] += (a @ dequantize_expert(down, e).T) * weight[rows, slot, None].float()
    if add is not None:
        y += add.float()
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------
# launch configuration


@dataclass(frozen=True)
class MoePrefillConfig:
    """Launch parameters of the two grouped GEMMs.

    block_m: pair rows per row block (both kernels; :func:`moe_align`'s padding unit; >= 16).
    block_n: act columns per kernel-A program (it reads block_n gate + block_n up rows);
        a multiple of 128 for the fp8 recipe (whole activation quantization groups).
    block_k: K (= D) step of kernel A. block_n_down / block_k_down: D rows per kernel-B program
        and its K (= I) step (None: block_n / block_k).
    All blocks powers of two >= 16; block_k a multiple of 32 for q8_0; fp8: block_k(_down)
    divides 128 (one weight-scale block per step).
    num_warps, num_stages: kernel A (and kernel B unless num_warps_down / num_stages_down are
    set). group_m: row blocks per column sweep (L2 reuse), both kernels.
    fp8_act: fp8 banks use the FP8 block recipe (E4M3 x E4M3 dots, activations quantized per
        1x128 group); False: E4M3 codes converted to x's dtype (exact weights, no activation
        rounding beyond x's dtype). Ignored for other formats.
    combine: "atomic" (fp32 atomics into [T, D]) or "sum" (per-pair fp32 rows, then
        ``_moe_combine_kernel``: each token's k rows summed in order j = 0..k-1, plus ``add``,
        cast; deterministic and batch-invariant: a token's result depends only on its own row).
    align: how the pairs are aligned (:func:`moe_align`): "torch", "triton" (one launch; for
        decode-size calls the torch version's ~15 launches cost more than the GEMMs), or "auto"
        (default): triton up to :data:`ALIGN_TRITON_MAX` pairs, else torch.
    swap_ab / swap_ab_down (None: swap_ab): kernel A / B computes the transposed product
    ``W x^T`` (weight tile as the MMA's first operand, read by wgmma from registers right after
    the in-kernel dequantization; pair rows as the MMA's N, 16..256); not for fp8 banks.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    block_n_down: int | None = None
    block_k_down: int | None = None
    fp8_act: bool = True
    combine: str = "atomic"
    num_warps_down: int | None = None
    num_stages_down: int | None = None
    swap_ab: bool = False
    swap_ab_down: bool | None = None
    align: str = "auto"


TUNED_TABLE = Path(__file__).with_name("moe_prefill_tuned.json")


def table_key(fmt: str, topk: int, e: int, i: int, d: int) -> str:
    """Key of one (format, shape) in :data:`TUNED_TABLE`."""
    return f"{fmt} e={e} k={topk} d={d} i={i}"


@functools.lru_cache(maxsize=1)
def tuned_table() -> dict:
    """The tile configurations tuned on the H200 (``memra bench moe-grouped --tune``), from
    :data:`TUNED_TABLE`: {"device", "commit", "method", "configs": {table_key: [entry, ...]}},
    each entry {"t", "routing", "config": MoePrefillConfig fields, "us": measured times,
    "default_us": the heuristic config's times}. {} when the file is absent.
    Raises: ValueError if the file is not valid JSON of that form."""
    if not TUNED_TABLE.exists():
        return {}
    try:
        table = json.loads(TUNED_TABLE.read_text())
    except json.JSONDecodeError as ex:
        raise ValueError(f"{TUNED_TABLE}: not valid JSON: {ex}") from None
    if not isinstance(table, dict) or not isinstance(table.get("configs"), dict):
        raise ValueError(f"{TUNED_TABLE}: expected an object with a 'configs' object")
    names = set(MoePrefillConfig.__dataclass_fields__)
    for key, entries in table["configs"].items():
        for en in entries if isinstance(entries, list) else [None]:
            ok = (isinstance(en, dict) and isinstance(en.get("t"), int) and en["t"] >= 1
                  and isinstance(en.get("config"), dict) and set(en["config"]) <= names)
            if not ok:
                raise ValueError(f"{TUNED_TABLE}: entry {en!r} of {key!r} is not {{'t': int >= 1, 'config': "
                                 f"MoePrefillConfig fields}}")
    return table


def tuned_prefill_config(fmt: str, t: int, topk: int = 8, e: int = 288, i: int = 1280,
                         d: int = 4096) -> MoePrefillConfig | None:
    """The tuned configuration for this format and shape whose token count is nearest to ``t``
    (in log2), or None when the table has none. Tuned at T = 512, 2048, 4096 on skewed routing:
    block_m follows the rows per expert, so a T between two tuned points takes the nearer."""
    entries = tuned_table().get("configs", {}).get(table_key(fmt, topk, e, i, d))
    if not entries:
        return None
    best = min(entries, key=lambda en: abs(math.log2(en["t"]) - math.log2(max(t, 1))))
    return MoePrefillConfig(**best["config"])


def default_prefill_config(fmt: str, t: int, topk: int = 8, e: int = 288, i: int = 1280,
                           d: int = 4096, tuned: bool = True) -> MoePrefillConfig:
    """The launch configuration :func:`moe_prefill` uses: with ``tuned``, the H200 tuning
    table's entry for this format and shape (:func:`tuned_prefill_config`) when there is one;
    otherwise these heuristic Hopper defaults (the tuning's starting point): block_m from the
    mean rows per expert (16 / 32 / 64 / 128, to bound the padding of a few hundred tokens over
    288 experts), block_k 128, kernel A 64 act columns (128 weight rows), kernel B 128 x 128,
    4 warps, 3 stages; the fp8 recipe (when D and I are multiples of 128) with kernel A at 128
    act columns (its act quantization needs whole 128-groups), block_k 64, block_m <= 64,
    8 warps, 4 stages. Blocks are shrunk for tiny shapes (tests) so that they do not exceed D
    or I. ``tuned=False``: always the heuristic (the tuner's baseline)."""
    if fmt not in _FMT_ID:
        raise ValueError(f"default_prefill_config: unknown format {fmt!r}; expected one of {tuple(_FMT_ID)}")
    if tuned:
        cfg = tuned_prefill_config(fmt, t, topk, e, i, d)
        if cfg is not None:
            return cfg
    mean = t * topk / max(1, min(e, t * topk))
    bm = 16 if mean <= 16 else 32 if mean <= 32 else 64 if mean <= 128 else 128
    fp8_act = fmt == "fp8" and d % 128 == 0 and i % 128 == 0
    if fp8_act:
        bm = min(bm, 64)
    bn = 128 if fp8_act else 64
    warps = 8 if (fp8_act or bm >= 128) else 4

    def fit(b: int, lim: int) -> int:
        while b > 16 and b > lim:
            b //= 2
        return b

    bk = fit(64 if fp8_act else 128, d)  # fp8 recipe kernel A: block_k 128 spills 16 B at 255 registers
    bk2 = fit(128, i)
    if fmt == "q8_0":
        bk, bk2 = max(bk, 32), max(bk2, 32)
    return MoePrefillConfig(block_m=bm, block_n=bn if fp8_act else fit(bn, i), block_k=bk, num_warps=warps,
                            num_stages=4 if fp8_act else 3, group_m=8, block_n_down=fit(128, d), block_k_down=bk2,
                            fp8_act=fp8_act)


GROUPED_DECODE_MAX_T = 256  # tokens: up to here the MoE layer's multi-token calls use grouped_decode_config


def grouped_decode_config(fmt: str, t: int, topk: int = 8, e: int = 288, i: int = 1280,
                          d: int = 4096, x_dtype: torch.dtype = torch.bfloat16) -> MoePrefillConfig:
    """The launch configuration of the multi-token decode path (2..:data:`GROUPED_DECODE_MAX_T`
    tokens: speculative verify steps, batched decode): the grouped GEMMs of :func:`moe_prefill`
    with 16-row pair blocks (at T <= 256 an expert meets a few tokens, so one block holds them and
    each chosen expert's weights are read once per step), the one-launch alignment, the
    deterministic per-pair combine (``combine="sum"``: batch-invariant) and exact fp8 weights
    (``fp8_act=False``: no activation rounding, as the single-token kernel). Tiles from the H200
    sweep of ``python -m memra.bench.moe_census --curve`` (memra/kernels/NOTES.md). ``x_dtype``: the
    activations' dtype; float32 keeps the narrower nvfp4 tiles (the wide ones' fp32 operands in shared
    memory would need 254 KB a program on sm_90, past the H200's 227 KB)."""
    if fmt not in _FMT_ID:
        raise ValueError(f"grouped_decode_config: unknown format {fmt!r}; expected one of {tuple(_FMT_ID)}")

    def fit(b: int, lim: int) -> int:
        while b > 16 and b > lim:
            b //= 2
        return b

    # H200 sweeps (nvfp4, T = 2..256, `python -m memra.bench.moe_census --curve`): 4 warps, 3 stages, no
    # swap_ab (1.5x slower at every T; 8 warps 1.1x, 4 stages 1.2x). Since the parity decode
    # (_nvfp4_split_tile): 128 act columns per kernel-A program and 128 rows per kernel-B program (260 vs
    # 271 us at T = 8, 922 vs 999 at 64, against 64 x 64), and 256 K per step in both (398 vs 425 us at
    # T = 16, 868 vs 935 at 64, against 128). One tile for every T keeps a token's result independent of
    # the step's size. Other formats keep 64 x 64 and 128 K (not re-swept).
    wide = fmt == "nvfp4" and x_dtype != torch.float32
    bk = 256 if wide else 128
    if fmt == "q8_0":
        bk = max(32, fit(bk, d))
    return MoePrefillConfig(block_m=16, block_n=fit(128 if wide else 64, i), block_k=fit(bk, d),
                            num_warps=4, num_stages=3, group_m=1, block_n_down=fit(128 if wide else 64, d),
                            block_k_down=max(32 if fmt == "q8_0" else 16, fit(256 if wide else 128, i)),
                            fp8_act=False, combine="sum", swap_ab=False, align="triton")


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def _validate(cfg: MoePrefillConfig, gate_up: ExpertBank, down: ExpertBank, f8: bool) -> tuple[int, int]:
    bn2 = cfg.block_n_down or cfg.block_n
    bk2 = cfg.block_k_down or cfg.block_k
    for name, v in (("block_m", cfg.block_m), ("block_n", cfg.block_n), ("block_k", cfg.block_k),
                    ("block_n_down", bn2), ("block_k_down", bk2)):
        if not _pow2(v) or v < 16:
            raise ValueError(f"moe_prefill: {name} = {v} must be a power of two >= 16")
    for bank, bk, what in ((gate_up, cfg.block_k, "block_k"), (down, bk2, "block_k_down")):
        if bk % _BK_UNIT[bank.fmt] or (bank.fmt == "fp8" and 128 % bk):
            raise ValueError(f"moe_prefill: {what} = {bk} for {bank.fmt} must be a multiple of "
                             f"{_BK_UNIT[bank.fmt]}" + (" and divide 128" if bank.fmt == "fp8" else ""))
    if (cfg.combine not in ("atomic", "sum") or cfg.align not in ("torch", "triton", "auto") or cfg.group_m < 1 or cfg.num_warps < 1 or cfg.num_stages < 1
            or (cfg.num_warps_down or 1) < 1 or (cfg.num_stages_down or 1) < 1):
        raise ValueError(f"moe_prefill: invalid config {cfg}")
    for bank, sw, what in ((gate_up, cfg.swap_ab, "swap_ab"),
                           (down, cfg.swap_ab if cfg.swap_ab_down is None else cfg.swap_ab_down, "swap_ab_down")):
        if sw and bank.fmt == "fp8":
            raise ValueError(f"moe_prefill: {what} is not implemented for fp8 banks (their 128-K block scales "
                             f"scale the product's rows and columns)")
    if cfg.swap_ab and f8:
        raise ValueError("moe_prefill: swap_ab is not implemented when kernel A writes act for the fp8 down "
                         "recipe (E4M3 codes + 1x128 scales); use swap_ab=False or fp8_act=False")
    if f8 and cfg.block_n % 128:
        raise ValueError(f"moe_prefill: the fp8 recipe quantizes act in 1x128 groups inside kernel A: block_n = "
                         f"{cfg.block_n} must be a multiple of 128 (or fp8_act=False)")
    return bn2, bk2


_CDT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _scalar_scale(bank: ExpertBank, block_rows: int) -> bool:
    """fp8: every weight tile of ``block_rows`` rows (block_n act columns of the fused bank, or
    block_n_down rows of down) lies in one 128-row scale block, so the kernel loads one scale
    per tile and K step instead of one per row: the tile is aligned, at most 128 rows, and the
    gate/up interleave unit is a multiple of 128."""
    return bank.fmt == "fp8" and 128 % block_rows == 0 and bank.interleave % 128 == 0


def moe_prefill(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, gate_up: ExpertBank,
                down: ExpertBank, limit: float | None, add: torch.Tensor | None = None,
                config: MoePrefillConfig | None = None, add_stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """Routed experts of one MoE layer for many tokens (module docstring): grouped GEMMs over the
    (token, expert) pairs sorted by expert, weights dequantized inside the kernels.

    Args:
        x: [T, D] bf16 (GPU; fp16 / fp32 also accepted: the dot operands are in x's dtype,
            fp32 with IEEE dots; on the CPU interpreter use fp16 / fp32, its bf16 dot is wrong).
        index: int64 [T, k] experts of each token (distinct within a row, as top-k gives).
        weight: float [T, k] routing weights (used in fp32).
        gate_up: fused bank [E, 2I, D] from :func:`memra.kernels.moe_decode.fuse_gate_up`;
        down: bank [E, D, I]; same device as x.
        limit: SwiGLU clamp (None: no clamp).
        add: optional [T, D] tensor added to the result (e.g. the shared expert's output; not
            modified).
        config: launch parameters (default :func:`default_prefill_config`).
        add_stream: the CUDA stream that produces ``add``, if not the current one: the current
            stream waits for it just before ``add`` is first read: after kernel B in the default
            "sum" combine (so kernels A and B overlap its producer), before kernel B in the
            "atomic" one (which accumulates onto a copy of ``add``; only moe_align and kernel A
            overlap), as :func:`memra.kernels.moe_decode.moe_decode`.

    Returns: y [T, D] in x.dtype. No host syncs; every shape depends only on (T, k, E, D, I,
    config), so moe_align + both kernels can be captured in a CUDA graph (scratch from the
    caching allocator).

    Raises: ValueError on shape / dtype / device mismatches (as moe_decode) or an invalid
    config (non-power-of-two blocks, block_k not fitting the format's scale groups, the fp8
    recipe with block_n not a multiple of 128 or D, I not multiples of 128).
    """
    p = prefill_launches(x, index, weight, gate_up, down, limit, add, config, add_stream)
    p["gate_up"]()
    p["down"]()
    return p["out"]


def prefill_launches(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, gate_up: ExpertBank,
                     down: ExpertBank, limit: float | None, add: torch.Tensor | None = None,
                     config: MoePrefillConfig | None = None, add_stream: torch.cuda.Stream | None = None) -> dict:
    """:func:`moe_prefill` as separately callable launches (what it runs, and what
    ``memra bench moe-grouped`` times per projection). Arguments and errors as :func:`moe_prefill`.

    Runs :func:`moe_align` once and allocates the scratch; returns {"gate_up": the fp8 activation
    quantization (fp8 recipe) + kernel A; "down": kernel B + the combine, filling "out" (y [T, D]
    in x.dtype); "align": re-runs moe_align (for its time only); "ids", "block_expert", "config"}.
    The closures launch GPU work without host syncs; call gate_up then down.
    """
    _check_moe_args(x, index, weight, gate_up, down, "moe_prefill")
    t, d = x.shape
    topk = index.shape[1]
    e, i = gate_up.e, gate_up.n // 2
    if add is not None and (tuple(add.shape) != (t, d) or add.device != x.device):
        raise ValueError(f"moe_prefill: add must be [{t}, {d}] on {x.device}, got {tuple(add.shape)} on "
                         f"{add.device}")
    cfg = config or default_prefill_config(gate_up.fmt, t, topk, e, i, d)
    f8in = cfg.fp8_act and gate_up.fmt == "fp8"
    f8dn = cfg.fp8_act and down.fmt == "fp8"
    if (f8in or f8dn) and (d % 128 or i % 128):
        raise ValueError(f"moe_prefill: the fp8 recipe needs D = {d} and I = {i} multiples of 128 (or fp8_act=False)")
    bn2, bk2 = _validate(cfg, gate_up, down, f8dn)
    if x.stride(1) != 1:
        x = x.contiguous()
    dev = x.device
    n = t * topk
    bm = cfg.block_m
    align_method = cfg.align if cfg.align != "auto" else ("triton" if n <= ALIGN_TRITON_MAX else "torch")
    ids, bexp, _ = moe_align(index, e, bm, align_method)
    num_m = bexp.shape[0]
    wflat = weight.reshape(-1).float().contiguous()
    cdt = x.dtype
    ieee = cdt == torch.float32
    exact = interpret_mode()
    import triton.language as tl

    from ._moe_prefill_triton import _act_quant_kernel, _moe_combine_kernel, _moe_down_kernel, _moe_gate_up_kernel

    tl_cdt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[cdt]
    # x operand: E4M3 codes + per-1x128 scales (fp8 recipe) or x itself
    if f8in:
        xq = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=dev)
        xs = torch.empty(t, d // 128, dtype=torch.float32, device=dev)
        xa, xsa, sxs = xq, xs, xs.stride(0)
    else:
        xa, xsa, sxs = x, x, 0
    # act scratch: E4M3 codes + per-1x128 scales for the fp8 down recipe, else x's dtype
    if f8dn:
        act = torch.empty(ids.shape[0], i, dtype=torch.float8_e4m3fn, device=dev)
        act_s = torch.empty(ids.shape[0], i // 128, dtype=torch.float32, device=dev)
        sas = act_s.stride(0)
    else:
        act = torch.empty(ids.shape[0], i, dtype=cdt, device=dev)
        act_s, sas = act, 0
    atomic = cfg.combine == "atomic"
    acc = torch.empty(t if atomic else n, d, dtype=torch.float32, device=dev)
    y = acc if (cdt == torch.float32 and atomic) else torch.empty(t, d, dtype=cdt, device=dev)
    lim = float(limit) if limit is not None else 0.0

    def wargs(b: ExpertBank):
        sc = b.scale if b.scale is not None else b.data
        return sc, b.data.stride(0), b.data.stride(1), sc.stride(0), sc.stride(1)

    def align():
        moe_align(index, e, bm, align_method)

    def gate_up_launch():
        if f8in:
            bt = 16
            _act_quant_kernel[(-(-t // bt), d // 128)](x, xq, xs, t, x.stride(0), xq.stride(0), xs.stride(0),
                                                      BT=bt, EXACT=exact, num_warps=4, **pdl_args(x.device))
        sc, swe, swn, sse, ssn = wargs(gate_up)
        _moe_gate_up_kernel[(num_m * -(-i // cfg.block_n),)](
            xa, xsa, gate_up.data, sc, act, act_s, ids, bexp,
            n, topk, i, d, num_m,
            xa.stride(0), sxs, swe, swn, sse, ssn, act.stride(0), sas, lim,
            FMT=_FMT_ID[gate_up.fmt], BM=bm, BA=cfg.block_n, BK=cfg.block_k, U=gate_up.interleave,
            GROUP_M=cfg.group_m, CDT=tl_cdt, F8IN=f8in, F8OUT=f8dn, HAS_LIMIT=limit is not None,
            EVEN_K=(d % cfg.block_k == 0), IEEE=ieee and not f8in, EXACT=exact,
            SCALAR_S=_scalar_scale(gate_up, cfg.block_n), SWAP=cfg.swap_ab, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)

    def down_launch():
        if atomic:  # kernel B adds into acc: zeros, or ``add`` (copied: add itself is not modified)
            if add is None:
                acc.zero_()
            else:
                wait_for(add_stream, dev)
                acc.copy_(add)
        sc, swe, swn, sse, ssn = wargs(down)
        _moe_down_kernel[(num_m * -(-d // bn2),)](
            act, act_s, down.data, sc, acc, ids, bexp, wflat,
            n, topk, d, i, num_m,
            act.stride(0), sas, swe, swn, sse, ssn, acc.stride(0),
            FMT=_FMT_ID[down.fmt], BM=bm, BN=bn2, BK=bk2, GROUP_M=cfg.group_m, CDT=tl_cdt, F8=f8dn, ATOMIC=atomic,
            EVEN_K=(i % bk2 == 0), IEEE=ieee and not f8dn, SCALAR_S=_scalar_scale(down, bn2),
            SWAP=cfg.swap_ab if cfg.swap_ab_down is None else cfg.swap_ab_down, ASM=not exact,
            num_warps=cfg.num_warps_down or cfg.num_warps,
            num_stages=cfg.num_stages_down or cfg.num_stages)
        if atomic:
            if y.data_ptr() != acc.data_ptr():
                y.copy_(acc)
        else:
            bd = 512
            wait_for(add_stream, dev)
            a = acc if add is None else (add if add.stride(1) == 1 else add.contiguous())
            _moe_combine_kernel[(t, -(-d // bd))](acc, a, y, d, acc.stride(0), a.stride(0), y.stride(0),
                                                   TOPK=topk, BD=bd, HAS_ADD=add is not None, num_warps=4,
                                                   **pdl_args(y.device))

    return dict(align=align, gate_up=gate_up_launch, down=down_launch, out=y, ids=ids, block_expert=bexp, config=cfg)


# ---------------------------------------------------------------------------------------
# compile-only check for the H200 (no GPU needed)


def sm90_compile_report(fmt: str, t: int, config: MoePrefillConfig | None = None, topk: int = 8, e: int = 288,
                        d: int = 4096, i: int = 1280, x_dtype: str = "bf16") -> dict:
    """Compiles both kernels for sm_90 (Hopper) on any machine (Triton's bundled ptxas; no GPU)
    with the argument specializations a real launch at this shape gets (16-byte-aligned
    pointers, ints divisible by 16 marked so), and reports per kernel: ``regs``, ``stack``
    (bytes of local memory per thread: > 0 means register spills), ``smem`` (bytes),
    ``wgmma`` / ``cp_async`` (whether the PTX uses Hopper warp-group MMAs and asynchronous
    copies, i.e. whether Triton pipelined the K loop), ``nan_dropping_minmax`` (PTX ``min.f32`` /
    ``max.f32``, which return the other operand of a NaN: the SwiGLU clamp and the activation
    quantization must use ``min.NaN`` / ``max.NaN`` to keep a NaN, as torch does). For screening tile configurations
    before spending GPU time; it says nothing about speed.

    Needs ``TRITON_INTERPRET`` unset when memra.kernels._moe_prefill_triton was imported (the
    interpreter replaces the JIT functions). Uses Triton internals (``ASTSource``, ``GPUTarget``,
    the bundled ``cuobjdump``) as of Triton 3.6.

    Raises: ValueError for an invalid config or under the interpreter; RuntimeError if the
    compile fails (the message is Triton's, or :func:`memra.kernels.sm90.compile_sm90`'s for an
    argument it cannot classify); subprocess.CalledProcessError if Triton's cuobjdump fails.
    """
    import re

    import triton.language as tl

    from . import _moe_prefill_triton as K
    from .sm90 import compile_sm90, resources

    if not hasattr(K._moe_gate_up_kernel, "arg_names") or interpret_mode():
        raise ValueError("sm90_compile_report: the kernels were imported under TRITON_INTERPRET=1; run it in a "
                         "process without the interpreter")
    cfg = config or default_prefill_config(fmt, t, topk, e, i, d)
    f8 = cfg.fp8_act and fmt == "fp8"
    bn2 = cfg.block_n_down or cfg.block_n
    bk2 = cfg.block_k_down or cfg.block_k
    n = t * topk
    _, nb = align_sizes(n, e, cfg.block_m)
    wptr, sptr = {"bf16": ("*bf16", None), "fp8": ("*fp8e4nv", "*fp32"), "nvfp4": ("*u8", "*u8"),
                  "q8_0": ("*i8", "*fp16")}[fmt]
    sptr = sptr or wptr
    cdt = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[x_dtype]
    xp = "*fp8e4nv" if f8 else f"*{x_dtype}"

    def strides(rows: int, cols: int) -> tuple[int, int, int, int]:
        per_row = {"bf16": cols, "fp8": cols, "nvfp4": cols // 2, "q8_0": cols}[fmt]
        srow = {"bf16": per_row, "fp8": -(-cols // 128), "nvfp4": cols // 16, "q8_0": cols // 32}[fmt]
        srows = -(-rows // 128) if fmt == "fp8" else rows
        return rows * per_row, per_row, srows * srow, srow

    we, wn, se, sn = strides(2 * i, d)
    a_sig = dict(x_ptr=xp, xs_ptr="*fp32" if f8 else xp, w_ptr=wptr, ws_ptr=sptr, act_ptr=xp,
                 as_ptr="*fp32" if f8 else xp, ids_ptr="*i32", bexp_ptr="*i32")
    a_int = dict(n_pairs=n, topk=topk, I=i, K=d, num_m=nb, stride_x=d, stride_xs=d // 128 if f8 else 0,
                 stride_we=we, stride_wn=wn, stride_se=se, stride_sn=sn, stride_a=i,
                 stride_as=i // 128 if f8 else 0)
    a_const = dict(FMT=_FMT_ID[fmt], BM=cfg.block_m, BA=cfg.block_n, BK=cfg.block_k, U=128 if fmt == "fp8" else 16,
                   GROUP_M=cfg.group_m, CDT=cdt, F8IN=f8, F8OUT=f8, HAS_LIMIT=True, EVEN_K=d % cfg.block_k == 0,
                   IEEE=x_dtype == "fp32" and not f8, EXACT=False,
                   SCALAR_S=fmt == "fp8" and 128 % cfg.block_n == 0, SWAP=cfg.swap_ab)
    we, wn, se, sn = strides(d, i)
    b_sig = dict(a_ptr=xp, as_ptr="*fp32" if f8 else xp, w_ptr=wptr, ws_ptr=sptr, y_ptr="*fp32", ids_ptr="*i32",
                 bexp_ptr="*i32", wt_ptr="*fp32")
    b_int = dict(n_pairs=n, topk=topk, N=d, K=i, num_m=nb, stride_a=i, stride_as=i // 128 if f8 else 0,
                 stride_we=we, stride_wn=wn, stride_se=se, stride_sn=sn, stride_y=d)
    b_const = dict(FMT=_FMT_ID[fmt], BM=cfg.block_m, BN=bn2, BK=bk2, GROUP_M=cfg.group_m, CDT=cdt, F8=f8,
                   ATOMIC=cfg.combine == "atomic", EVEN_K=i % bk2 == 0, IEEE=x_dtype == "fp32" and not f8,
                   SCALAR_S=fmt == "fp8" and 128 % bn2 == 0,
                   SWAP=cfg.swap_ab if cfg.swap_ab_down is None else cfg.swap_ab_down, ASM=True)
    out = {}
    opts = {"gate_up": dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
            "down": dict(num_warps=cfg.num_warps_down or cfg.num_warps,
                         num_stages=cfg.num_stages_down or cfg.num_stages)}
    for name, fn, ptrs, ints, const in (("gate_up", K._moe_gate_up_kernel, a_sig, a_int, a_const),
                                        ("down", K._moe_down_kernel, b_sig, b_int, b_const)):
        try:
            k = compile_sm90(fn, ptrs, ints, const, floats={"limit"}, **opts[name])
        except Exception as exc:  # noqa: BLE001 - Triton raises several types
            raise RuntimeError(f"sm90_compile_report: {name} kernel failed to compile for {fmt}, {cfg}: {exc}") from exc
        regs, stack = resources(k)
        ptx = k.asm["ptx"]
        out[name] = dict(regs=regs, stack=stack, smem=int(k.metadata.shared), wgmma="wgmma" in ptx,
                         cp_async="cp.async" in ptx, nan_dropping_minmax=len(re.findall(r"\b(?:min|max)\.f32\s", ptx)))
    return out
