"""Tensor and expert parallelism on torch.distributed (gloo on the CPU, NCCL on GPUs).

- :mod:`.group`: the process group of a run (:class:`ParallelContext`) and its collectives;
- :mod:`.plan`: the canonical partition of every sharded dimension and the checks that refuse a
  split that would cut a quantization block;
- :mod:`.layers`: the parallel modules (column / row / vocab parallel linears, parallel MoE);
- :mod:`.shard`: :func:`shard_model`, which turns a loaded model into rank ``r``'s shard
  without touching the model files (the sharding plan lives here, not in memra/models).

Exactness by construction (the canonical order): every sharded dimension is cut into ``P``
canonical parts (``P`` = :attr:`ParallelContext.parts`, default 4, a multiple of every TP size
used), each rank at TP size N owning ``P / N`` consecutive parts. Every GEMM over a sharded
dimension is run per part, with the same shape at every TP size; a cross-rank sum is the sum
of the ``P`` per-part partials in part order (an all-reduce of the stacked partials, in which
each slot has one non-zero contributor, so the reduction itself adds only zeros: exact), and
the routed experts' combine sums each token's k terms in order j = 0..k-1. TP 1 with the same
``P`` therefore computes bit-for-bit what TP 2 and TP 4 compute (tests/test_parallel.py).
"""

from .group import ParallelContext
from .shard import shard_model

__all__ = ["ParallelContext", "shard_model"]
