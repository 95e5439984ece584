"""Batch-invariant mode: a token's logits do not depend on which other tokens share its step.

By default memra picks kernels by the shape of each step: cuBLAS chooses its GEMM algorithm (and
with it the summation order) by the number of rows, the MoE layer takes the per-token GEMV kernels
up to 4 tokens and the grouped GEMMs above, the router takes cuBLAS above 16 tokens, and split-KV
decode attention splits a sequence's keys by the batch size. Each choice is exact to rounding, but
the roundings differ, so a greedy token can change with the batch it decodes in (vLLM, SGLang and
llama.cpp behave the same by default; vLLM has an opt-in batch-invariant mode).

``MEMRA_BATCH_INVARIANT=1`` (or :func:`set_batch_invariant`) makes every choice independent of
the step's shape, on the GPU (the CPU paths do not look at it):

- every linear layer (attention projections, shared expert, dense MLP, LM head, any format):
  :func:`invariant_linear`, one Triton GEMM with one tile shape for every T (bf16 weights read as
  they are; other formats dequantized to bf16 for the call, which costs a weight-sized buffer and
  a pass per call: this mode is for correctness, not speed);
- the router: :func:`memra.kernels.fused.router_logits` for every T (one fixed summation order);
- the routed experts: the grouped GEMMs (:func:`memra.kernels.moe_prefill.moe_prefill`) with one
  fixed configuration (16-row pair blocks, the per-pair fixed-order combine) for every T;
- attention: the paged prefill kernel with its key tiles aligned to multiples of BLOCK_N and
  walked through one masked code path (``aligned``, memra/kernels/attention_prefill.py), for
  prefill chunks and for decode rows alike (memra/engine/cuda_graph.py ``DecodeKV`` runs each
  decode row as a sequence of one query; padding rows anywhere get zeros). A query's online
  softmax then takes the same steps whichever queries share its launch, so its bits are the same
  as a decode row, a speculative verify row or a row of any prefill chunk (the split-KV decode
  kernel, whose splits follow the batch size, is not used);
- not yet: the parallel path (its shards call cuBLAS); the engine refuses it with the mode on a
  GPU.

Per-token kernels (norms, RoPE, K/V writes, SwiGLU, sampling) are invariant already. So a greedy
request decodes to the same tokens alone or in any batch, with CUDA graphs or eager steps, with
its prompt prefilled in any chunks or found in the prefix cache, and with MTP speculation or
without (verification then accepts exactly the tokens plain decoding would produce). The cost:
decode at batch 1 runs tensor-core tiles of 16 tokens and the linear layers lose cuBLAS (measure
with ``memra bench decode`` under ``MEMRA_BATCH_INVARIANT=1``). Checked by
tests/test_batch_invariant.py and tests/test_kernels_attention_prefill.py (aligned tiles) and, on
the GPU, by the tiny Step model's greedy tokens at batch 1 vs batch 16 and with graphs, eager
steps, chunks of 16 and MTP K = 1 and 3.

Why a tile computes a token's output the same way whatever else is in it: :func:`invariant_matmul`
puts the weights on the MMA's M side and the tokens on its N side (16 per tile); an MMA computes
each output element from its own row and column only, the K loop runs in one fixed order, and the
tile shape never changes, so neither the number of tokens nor their values reach another token's
sums.
"""

from __future__ import annotations

import torch

from .envflags import env_flag
from .pdl import pdl_args

__all__ = ["batch_invariant", "set_batch_invariant", "invariant_matmul", "invariant_matmul_ref",
           "invariant_linear", "INVARIANT_TILE"]

_OVERRIDE: list[bool | None] = [None]

#: (weight rows, tokens, K step) of :func:`invariant_matmul`'s one tile shape.
INVARIANT_TILE = (64, 16, 64)


def set_batch_invariant(enabled: bool | None) -> None:
    """Turn batch-invariant mode on or off from now on (None: back to ``MEMRA_BATCH_INVARIANT``).
    CUDA graphs keep the kernels they captured: set it before an engine starts."""
    _OVERRIDE[0] = enabled


def batch_invariant() -> bool:
    """True when batch-invariant mode is on (:func:`set_batch_invariant`, else
    ``MEMRA_BATCH_INVARIANT`` in the environment, off by default: :mod:`memra.kernels.envflags`).

    Raises: ValueError: the variable holds a value that is neither on nor off."""
    if _OVERRIDE[0] is not None:
        return _OVERRIDE[0]
    return env_flag("MEMRA_BATCH_INVARIANT", False)


def invariant_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`invariant_matmul`: x rounded to w's dtype (as the kernel feeds the MMA),
    ``x @ w^T`` in fp32, cast to x's dtype."""
    return (x.to(w.dtype).float() @ w.float().t()).to(x.dtype)


def invariant_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w^T with a summation order that does not depend on T or on the other rows of x.

    Args:
        x: [T, K] fp16 / bf16 / fp32, on w's device; rounded to w's dtype for the products (fp32
            activations lose their low bits here, unlike the default fp32 path: the GPU model runs
            bf16, where nothing is lost).
        w: [N, K] fp16 / bf16, unit stride along K.
    Returns: y [T, N] in x's dtype (fp32 accumulation). One launch (:data:`INVARIANT_TILE`), on the
    GPU; on the CPU only under the Triton interpreter (``TRITON_INTERPRET=1``).
    Raises: ValueError for mismatched shapes, dtypes or devices.
    """
    from .gemv import interpret_mode

    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"invariant_matmul: x [T, K] and w [N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if w.dtype not in (torch.float16, torch.bfloat16) or not x.is_floating_point():
        raise ValueError(f"invariant_matmul: w must be fp16/bf16 and x floating point, got {w.dtype} and {x.dtype}")
    if x.device != w.device or (x.device.type != "cuda" and not interpret_mode()):
        raise ValueError(f"invariant_matmul: x and w on one CUDA device (the CPU only under TRITON_INTERPRET=1), "
                         f"got {x.device} and {w.device}")
    from ._batch_invariant_triton import _bi_linear_kernel

    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    t, k = x.shape
    n = w.shape[0]
    y = torch.empty(t, n, device=x.device, dtype=x.dtype)
    if t == 0 or n == 0:
        return y
    bn, bt, bk = INVARIANT_TILE
    _bi_linear_kernel[(-(-n // bn), -(-t // bt))](x, w, y, t, n, k, x.stride(0), w.stride(0), y.stride(0),
                                                  BN=bn, BT=bt, BK=bk, num_warps=4, num_stages=3,
                                                  **pdl_args(x.device))
    return y


def invariant_linear(x: torch.Tensor, w) -> torch.Tensor:
    """:func:`invariant_matmul` on a packed GPU weight (:class:`memra.kernels.gemv.DecodeWeight`):
    bf16 codes as they are, any other format dequantized to bf16 for the call."""
    from .gemv import dequantize_packed

    dense = w.data if w.fmt == "bf16" else dequantize_packed(w).to(torch.bfloat16)
    return invariant_matmul(x, dense)
