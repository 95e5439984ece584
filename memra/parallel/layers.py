"""Parallel modules: each holds rank r's canonical parts of one sharded weight (dense, in the
compute dtype; CPU path) and computes exactly what every other TP size computes for those parts
(the canonical order of :mod:`memra.parallel`).

- :class:`ColumnParallel`: output features split; one GEMM per block (a canonical part of a
  projection, or one KV head), outputs concatenated in block order; with ``full_out`` the
  ranks' outputs are exchanged so that every rank holds all of them (vocab-parallel LM head).
- :class:`RowParallel`: input features split; one partial GEMM per owned part into a stacked
  [P, ..., out] buffer, an exact all-reduce, then the P partials summed in part order.
- :class:`VocabParallelEmbedding`: rows of the table split; a lookup hits one rank.
- :class:`ParallelMoE`: STEP35.md "router" / "combine" with the routed experts split by
  expert (EP) or along their intermediate dimension (TP); each token's k terms summed in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fused import router_topk_ref, swiglu_torch
from .group import ParallelContext

__all__ = ["ColumnParallel", "RowParallel", "VocabParallelEmbedding", "ParallelMoE"]


def _map_tensors(fn, obj):
    """``obj`` with ``fn`` applied to every tensor in it (lists, tuples and dicts of them)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {key: _map_tensors(fn, o) for key, o in obj.items()}
    return obj


class _PartsModule(nn.Module):
    """A parallel module holds its weights in lists (one per canonical part, KV head or expert),
    which nn.Module does not see: ``_apply`` maps them too, so ``.to(device)`` moves a shard whole."""

    _tensor_attrs: tuple[str, ...] = ()

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        for name in self._tensor_attrs:
            setattr(self, name, _map_tensors(fn, getattr(self, name)))
        return self


class ColumnParallel(_PartsModule):
    """y = [x W_0^T (+ b_0) | x W_1^T (+ b_1) | ...] over this rank's blocks.

    Args:
        blocks: [(weight [n_i, K], bias [n_i] or None)] in output order, dense in the compute dtype.
        ctx: the parallel context.
        full_out: (out_features, offset) when every rank must end with the whole output
            [..., out_features], this rank's columns at ``offset`` (vocab-parallel LM head):
            exchanged by an exact all-reduce of the zero-padded outputs.
    forward(x [..., K]) -> [..., sum n_i] (or [..., out_features] with ``full_out``).
    """

    def __init__(self, blocks: list[tuple[torch.Tensor, torch.Tensor | None]], ctx: ParallelContext,
                 full_out: tuple[int, int] | None = None):
        super().__init__()
        self._tensor_attrs = ("weights", "biases")
        self.ctx, self.full_out = ctx, full_out
        self.weights = [w.clone() for w, _ in blocks]  # own storage: the unsharded weight can be freed
        self.biases = [None if b is None else b.clone() for _, b in blocks]
        self.dtype = self.weights[0].dtype
        self.in_features = self.weights[0].shape[1]
        self.out_features = sum(w.shape[0] for w in self.weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([F.linear(x, w, b) for w, b in zip(self.weights, self.biases)], dim=-1)
        if self.full_out is None:
            return y
        n, off = self.full_out
        full = y.new_zeros(1, *y.shape[:-1], n)
        full[0, ..., off:off + y.shape[-1]] = y
        return self.ctx.all_reduce_exact(full)[0]


class RowParallel(_PartsModule):
    """y = sum over the P canonical parts, in part order, of x_p W_p^T (+ bias once).

    Args:
        weights: this rank's parts [out, k_p] (dense), in part order; the input x [..., sum k_p]
            is their inputs concatenated in the same order.
        ctx: the parallel context (its ``owned_parts`` name the slots these parts fill).
        bias: optional [out], added after the sum.
    forward(x) -> [..., out], identical on every rank.
    """

    def __init__(self, weights: list[torch.Tensor], ctx: ParallelContext, bias: torch.Tensor | None = None):
        super().__init__()
        if len(weights) != len(ctx.owned_parts):
            raise ValueError(f"RowParallel: {len(weights)} weight parts for {len(ctx.owned_parts)} owned parts")
        self._tensor_attrs = ("weights", "bias")
        self.ctx, self.bias = ctx, bias
        self.weights = [w.clone(memory_format=torch.contiguous_format) for w in weights]
        self.sizes = [w.shape[1] for w in self.weights]
        self.dtype = self.weights[0].dtype
        self.out_features = self.weights[0].shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        stacked = x.new_zeros(self.ctx.parts, *lead, self.out_features)
        for p, xp, w in zip(self.ctx.owned_parts, x.split(self.sizes, dim=-1), self.weights):
            stacked[p] = F.linear(xp, w)
        self.ctx.all_reduce_exact(stacked)
        y = stacked[0]
        for p in range(1, self.ctx.parts):
            y = y + stacked[p]
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(_PartsModule):
    """Rows [offset, offset + n) of the embedding table on this rank; ids outside give zeros there,
    and the exact all-reduce leaves every rank with the looked-up row.

    Args: table [n, hidden] (dense, compute dtype), offset, vocab_size, ctx, scale (Gemma's
    sqrt(hidden), rounded to the dtype first as :class:`memra.layers.linear.Embedding`).
    Raises (forward): IndexError naming the first id outside [0, vocab_size).
    """

    def __init__(self, table: torch.Tensor, offset: int, vocab_size: int, ctx: ParallelContext, scale: float = 1.0):
        super().__init__()
        self._tensor_attrs = ("table",)
        self.table, self.offset, self.vocab_size, self.ctx, self.scale = table, offset, vocab_size, ctx, scale
        self.hidden = table.shape[1]
        self.dtype = table.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.vocab_size)][0].item()
            raise IndexError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        local = ids - self.offset
        hit = (local >= 0) & (local < self.table.shape[0])
        x = self.table.new_zeros(1, ids.numel(), self.hidden)
        x[0, hit] = self.table[local[hit]]
        x = self.ctx.all_reduce_exact(x)[0]
        if self.scale != 1.0:
            x = x * torch.tensor(self.scale, dtype=self.dtype)
        return x


class ParallelMoE(_PartsModule):
    """Sigmoid top-k routing (replicated router), routed SwiGLU experts split over the ranks, and
    the shared expert (a parallel GatedMLP or None): ``y = sum_{j=0..k-1} w_j E_{e_j}(h) + S(h)``,
    the sum over j in order.

    Args:
        router fp32 [E, D], bias fp32 [E] or None, top_k, scaling: as memra/layers/moe.py ``MoE``.
        experts: {expert id: (gate_up [2 * i_p..] parts, down parts)}: with ``ctx.expert_parallel``
            this rank's experts, each whole (gate_up [2I, D], down [D, I]: one part); otherwise
            every expert, each as this rank's canonical parts along I (per part: gate_up
            [2 i_p, D] = gate rows then up rows, down [D, i_p]).
        limit: SwiGLU clamp. shared: the shared expert or None. ctx: the parallel context.
    forward(h [T, D]) -> [T, D].
    """

    def __init__(self, router, bias, top_k: int, scaling: float, experts: dict, limit: float | None,
                 shared: nn.Module | None, ctx: ParallelContext, hidden: int):
        super().__init__()
        self._tensor_attrs = ("router", "bias", "experts")
        self.router, self.bias, self.top_k, self.scaling = router.float(), bias, top_k, scaling
        self.experts, self.limit, self.shared, self.ctx, self.hidden = experts, limit, shared, ctx, hidden

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return router_topk_ref(h.float() @ self.router.t(), self.bias, self.top_k, self.scaling)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        index, weight = self.route(h)
        t, k = index.shape
        ep = self.ctx.expert_parallel
        slots = 1 if ep else self.ctx.parts
        buf = h.new_zeros(slots, t, k, self.hidden)
        for e in torch.unique(index).tolist():
            if e not in self.experts:
                continue  # EP: another rank's expert
            rows, slot = (index == e).nonzero(as_tuple=True)
            x = h[rows]
            gate_ups, downs = self.experts[e]
            for p, gu, dn in zip([0] if ep else self.ctx.owned_parts, gate_ups, downs):
                g, u = F.linear(x, gu).chunk(2, dim=-1)
                y = F.linear(swiglu_torch(g, u, self.limit), dn)
                buf[p, rows, slot] = y * weight[rows, slot, None].to(y.dtype) if ep else y
        self.ctx.all_reduce_exact(buf.view(slots, -1) if ep else buf)
        pair = buf[0]
        if not ep:  # the I-parts of each pair in part order, then the routing weight
            for p in range(1, slots):
                pair = pair + buf[p]
            pair = pair * weight[..., None].to(pair.dtype)
        y = pair[:, 0]
        for j in range(1, k):
            y = y + pair[:, j]
        return y if self.shared is None else y + self.shared(h)

    @property
    def tokens_per_expert(self):
        return None
