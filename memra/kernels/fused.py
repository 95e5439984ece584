"""Small fused decode kernels: SwiGLU with Step-3.5's clamp, and the MoE router's top-k.

At batch 1 a decode step is a few hundred small launches besides the weight-streaming
GEMVs; each unfused elementwise chain (silu, clamp, clamp, multiply; sigmoid, add, topk,
gather, sum, divide, scale) costs several launches of ~2-3 µs even inside a CUDA graph,
per layer. One launch each here.

- :func:`swiglu`: ``gu`` [T, 2I] (rows [gate (I) | up (I)], the fused gate_up projection's
  output) -> [T, I] = min(silu(gate), limit) * clamp(up, -limit, limit) (no clamp when
  ``limit`` is None), computed in fp32, rounded once to gu's dtype. Source: STEP35.md
  "SwiGLU clamp"; reference :func:`swiglu_ref` (:func:`swiglu_torch` in fp32).
- :func:`router_topk`: router logits fp32 [T, E] -> (index int64 [T, k], weight fp32 [T, k]):
  s = sigmoid(logits); the k largest s + bias are chosen (bias only chooses), in descending
  order; w = s[chosen] / sum(s[chosen]) * scaling. Source: STEP35.md "router"; reference
  :func:`router_topk_ref` (what memra/layers/moe.py routes with on the CPU). Ties (equal s + bias) resolve to
  the lower expert index.

- :func:`kv_write`: this step's K and V rows [B, KV, D] into the paged caches
  [num_blocks, block_size, KV, D] at flat slots [B] (block * block_size + offset), both in
  one launch (instead of two ``index_copy_``); reference :func:`kv_write_ref`.

All are capturable in CUDA graphs (no host synchronisation) and run under the Triton
interpreter for CPU tests.

Errors: ValueError naming the argument for shapes/dtypes that do not match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pdl import pdl_args
from .precompile import recording

__all__ = ["swiglu", "swiglu_ref", "swiglu_torch", "router_topk", "router_topk_ref", "kv_write", "kv_write_ref"]


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate) * up with Step-3.5's clamp, ``min(silu(gate), limit) * clamp(up, -limit, limit)``,
    in the inputs' dtype (each op rounded, as torch computes it); ``limit`` None: no clamp.
    Shapes broadcast. Source: STEP35.md "SwiGLU clamp"; Shazeer 2020 (GLU variants)."""
    a = F.silu(gate)
    if limit is not None:
        a = a.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return a * up


def swiglu_ref(gu: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Torch twin of :func:`swiglu`: :func:`swiglu_torch` in fp32 on gu's two halves, one rounding."""
    g, u = gu.float().chunk(2, dim=-1)
    return swiglu_torch(g, u, limit).to(gu.dtype)


def router_topk_ref(logits: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`router_topk` (as MoE.route after its logits)."""
    s = torch.sigmoid(logits.float())
    choice = s if bias is None else s + bias
    index = choice.topk(k, dim=-1).indices
    w = s.gather(1, index)
    return index, w / w.sum(dim=-1, keepdim=True) * scaling


def _np2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def swiglu(gu: torch.Tensor, limit: float | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused SwiGLU (see the module docstring). gu [T, 2I] (bf16/fp16/fp32, unit column stride)."""
    from ._fused_triton import _swiglu_kernel

    if gu.dim() != 2 or gu.shape[1] % 2 or gu.stride(1) != 1:
        raise ValueError(f"swiglu: gu must be [T, 2I] with unit column stride, got {tuple(gu.shape)}")
    if gu.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"swiglu: gu is {gu.dtype}; expected bf16, fp16 or fp32")
    t, i2 = gu.shape
    n = i2 // 2
    if out is not None and (tuple(out.shape) != (t, n) or out.dtype != gu.dtype or out.stride(1) != 1
                            or out.device != gu.device):
        raise ValueError(f"swiglu: out must be {gu.dtype} [{t}, {n}] on {gu.device} with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)}")
    y = out if out is not None else torch.empty(t, n, dtype=gu.dtype, device=gu.device)
    if t == 0:
        return y
    block = min(1024, _np2(n))
    _swiglu_kernel[(t, -(-n // block))](gu, y, n, gu.stride(0), y.stride(0),
                                        0.0 if limit is None else float(limit), HAS_LIMIT=limit is not None,
                                        BLOCK=block, num_warps=4, **pdl_args(gu.device))
    return y


def router_topk(logits: torch.Tensor, bias: torch.Tensor | None, k: int, scaling: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused sigmoid + biased top-k + renormalise + scale (see the module docstring).

    logits fp32 [T, E] (E <= 4096), bias fp32 [E] or None, 1 <= k <= E."""
    from ._fused_triton import _router_topk_kernel

    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"router_topk: logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= k <= e or e > 4096:
        raise ValueError(f"router_topk: need 1 <= k <= E <= 4096, got k={k}, E={e}")
    if bias is not None and (bias.shape != (e,) or bias.dtype != torch.float32):
        raise ValueError(f"router_topk: bias must be fp32 [{e}], got {bias.dtype} {tuple(bias.shape)}")
    logits = logits.contiguous()
    index = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    weight = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    if t == 0:
        return index, weight
    if recording():  # the launch below is skipped: torch paths downstream index with these ids
        index.zero_()
    block = _np2(e)
    # one warp up to 1024 experts: the k passes' max / argmin / sum reductions stay in warp shuffles
    _router_topk_kernel[(t,)](logits, logits if bias is None else bias, index, weight, e, float(scaling),
                              K=k, KP=_np2(k), BLOCK_E=block, HAS_BIAS=bias is not None,
                              num_warps=1 if block <= 1024 else 4, **pdl_args(logits.device))
    return index, weight


def router_logits_ref(h: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`router_logits`: fp32 ``h.float() @ router^T``."""
    return h.float() @ router.float().t()


#: Router logits of up to this many tokens take :func:`router_logits`; more take the cast + cuBLAS.
#: H200, flagship router (288 x 4096), µs per call in a CUDA graph (benchmarks/router_tune.py,
#: benchmarks/results/issue14/router-tune-h200.json), router_logits at its defaults vs cast + cuBLAS:
#: T = 1 3.30 vs 6.48, 2 3.93 vs 16.81, 4 5.82 vs 16.88, 8 8.61 vs 20.27, 16 14.24 vs 20.32,
#: 32 25.32 vs 16.64. One launch configuration for every T keeps a token's logits batch-invariant.
ROUTER_LOGITS_MAX_T = 16


def router_logits(h: torch.Tensor, router: torch.Tensor, block_e: int = 1, block_d: int | None = None,
                  num_warps: int = 8) -> torch.Tensor:
    """Router logits ``fp32(h) @ router^T`` in one launch, h read in its own dtype (no cast pass).

    Args:
        h: [T, D] bf16 / fp16 / fp32 (unit stride along D); router: fp32 [E, D], contiguous.
        block_e, block_d, num_warps: launch tuning (experts per program, D per loop step; default
            the power of two >= D up to 4096: one expert row per program, loaded at once).
    Returns:
        fp32 [T, E]. Each token's logits are summed in one fixed order (BLOCK_D-wide fp32 partial
        sums, then across them), so they do not depend on the other tokens of the launch (cuBLAS picks
        its kernel, and its summation order, by T). Math: STEP35.md "router" (``need_fp32_gate``).
    Raises:
        ValueError: shapes, dtypes or strides that do not match.
    """
    from ._fused_triton import _router_logits_kernel

    if h.dim() != 2 or router.dim() != 2 or h.shape[1] != router.shape[1]:
        raise ValueError(f"router_logits: h [T, D] and router [E, D] expected, got {tuple(h.shape)} and "
                         f"{tuple(router.shape)}")
    if router.dtype != torch.float32 or not router.is_contiguous():
        raise ValueError(f"router_logits: router must be a contiguous fp32 [E, D], got {router.dtype}")
    if h.dtype not in (torch.bfloat16, torch.float16, torch.float32) or h.stride(1) != 1:
        raise ValueError(f"router_logits: h must be bf16/fp16/fp32 with a unit stride along D, got {h.dtype} "
                         f"strides {h.stride()}")
    t, d = h.shape
    if t > 65535:
        raise ValueError(f"router_logits: {t} tokens in one call; at most 65535 (the launch grid's second "
                         f"dimension)")
    e = router.shape[0]
    out = torch.empty(t, e, dtype=torch.float32, device=h.device)
    block_d = block_d or min(4096, _np2(d))
    if t:
        _router_logits_kernel[(-(-e // block_e), t)](h, router, out, e, d, h.stride(0), BLOCK_E=block_e,
                                                     BLOCK_D=block_d, num_warps=num_warps, **pdl_args(h.device))
    return out


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Torch twin of :func:`kv_write`."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write k, v [B, KV, D] (rows may be strided views) to contiguous caches
    [num_blocks, block_size, KV, D] at int64 ``slots`` [B] (see the module docstring).

    Slot values are not range-checked (that would synchronise with the host): callers give
    slots inside the caches (the engine's block tables do).

    Raises: ValueError for shapes, dtypes or layouts that do not match."""
    from ._fused_triton import _kv_write_kernel

    if k.dim() != 3 or k_cache.dim() != 4 or slots.dtype != torch.int64:
        raise ValueError(f"kv_write: expected k, v [B, KV, D], caches [blocks, block_size, KV, D] and int64 slots, "
                         f"got {tuple(k.shape)}, {tuple(k_cache.shape)}, {slots.dtype}")
    b = k.shape[0]
    w = k.shape[1] * k.shape[2]
    if (k.shape != v.shape or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != tuple(k.shape[1:])
            or slots.shape != (b,)):
        raise ValueError(f"kv_write: k, v [B, KV, D] = {tuple(k.shape)}, {tuple(v.shape)}; caches "
                         f"{tuple(k_cache.shape)}; slots {tuple(slots.shape)} do not match")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("kv_write: the caches must be contiguous")
    if b == 0:
        return
    if k.stride(2) != 1 or k.stride(1) != k.shape[2]:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != v.shape[2]:
        v = v.contiguous()
    block = min(1024, _np2(w))
    _kv_write_kernel[(b, -(-w // block))](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), w,
                                          BLOCK=block, num_warps=4, **pdl_args(k.device))
