"""The mixture-of-experts layer: sigmoid router, top-k routed SwiGLU experts, unscaled shared expert.

Math (STEP35.md "router", "SwiGLU clamp", "combine")::

    s = sigmoid(h Wr^T)                 fp32 [T, E]
    chosen = top-k of s + bias          the bias only chooses
    w = s[chosen] / sum(s[chosen]) * routed_scaling_factor
    y = sum_j w_j E_{chosen_j}(h) + S(h)     E_e(h) = down_e(swiglu(gate_e h, up_e h, limit))

How it runs is chosen here, per call:

- CPU (reference): router logits by torch in fp32 and memra/kernels/fused.py ``router_topk_ref``;
  a loop over the experts chosen at least once, each one's dense weights used once on all its
  tokens; the shared expert added after (exact in fp32).
- GPU: router logits by cuBLAS + the fused top-k kernel (memra/kernels/moe_decode.py
  ``moe_route``); routed experts kept packed in their checkpoint format as expert banks and run
  by the single-token GEMV kernels (memra/kernels/moe_decode.py, each chosen expert read once per
  step) for T <= :data:`MOE_DECODE_MAX_T` tokens, by the grouped tensor-core GEMMs of
  memra/kernels/moe_prefill.py above (``grouped_decode_config`` up to ``GROUPED_DECODE_MAX_T``
  tokens: 16-row pair blocks, deterministic combine; the prefill tiles beyond); the routed sum
  includes the shared expert's output (``add``), which runs on a second CUDA stream while the
  router and the routed experts run (:attr:`MoE.overlap_shared`; with the default deterministic
  "sum" combine both routed-expert kernels overlap it, with the "atomic" combine only the
  grouping and the first kernel do).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import moe_decode as decode_kernels
from ..kernels import moe_prefill as prefill_kernels
from ..kernels.batch_invariant import batch_invariant
from ..kernels.fused import router_topk_ref, swiglu_torch
from ..kernels.moe_decode import fuse_gate_up, moe_route, pack_expert_bank
from .activations import GatedMLP
from .device import KernelLayer

__all__ = ["MOE_DECODE_MAX_T", "MoE", "RoutedExperts"]

# GPU: up to this many tokens through moe_decode's GEMV kernels, more through the grouped tensor-core
# GEMMs. The crossover measured on the H200 (NVFP4 experts, flagship shape, uniform routing, `python -m
# memra.bench.moe_census --curve`, benchmarks/results/moe-curve-h200-final.json, after the grouped kernels
# decoded NVFP4 by parity): GEMV faster at T = 1, 2 (83.9 vs 99.2 us at 2), a tie at 4 (155.4 vs 151.5),
# grouped faster from 8 (291.8 vs 246.7 us; 557.3 vs 398.6 at 16); both paths read each chosen expert once
# per call and combine deterministically.
MOE_DECODE_MAX_T = 4


class RoutedExperts(KernelLayer):
    """``E`` SwiGLU experts applied to the tokens routed to them.

    Args:
        gate, up: per-expert weights [I, D] (lists of E packed tensors) or one stacked
            packed tensor [E, I, D] (QTensor or FP8BlockTensor); down likewise [E, D, I].
        limit: SwiGLU clamp of this layer's routed experts (None: none).
        dtype: compute dtype; the CPU path keeps dense copies ``w_gate_up`` [E, 2I, D] and
            ``w_down`` [E, D, I] next to the packed ``qweights``, built on first use or by
            :meth:`build`.

    forward(x [T, D], index int64 [T, k], weight fp32 [T, k], add [T, D] or None) -> [T, D]
    (+ ``add``). CPU: ``tokens_per_expert`` (int64 [E]) holds the counts of the last call; the
    GPU paths keep none (they would cost two launches per layer per step).
    """

    def __init__(self, gate, up, down, limit: float | None, dtype: torch.dtype):
        super().__init__()
        self.qweights = (gate, up, down)
        self.limit = limit

        first = gate[0] if isinstance(gate, list) else gate
        if (first.codes if hasattr(first, "codes") else first.data).device.type == "cuda":
            self.to_gpu(None)  # weights already in GPU memory become expert banks in place, never dense
            return

        self.dtype = dtype
        self.num_experts = len(down) if isinstance(down, list) else down.shape[0]
        self.tokens_per_expert: torch.Tensor | None = None
        # The CPU path's dense copies, built by build() (CPU loads call it) or on first CPU use; a
        # model loaded for a GPU never builds them (dequantizing 288 NVFP4 experts on the host was
        # most of a GPU load's time).
        self.register_buffer("w_gate_up", None, persistent=False)
        self.register_buffer("w_down", None, persistent=False)

    def build(self) -> RoutedExperts:
        """Build the CPU path's dense copies ``w_gate_up`` [E, 2I, D] and ``w_down`` [E, D, I] in the
        compute dtype from the packed ``qweights`` now (otherwise done on first CPU use; never on
        the kernel path). Returns self."""
        if self.kernels or self.w_gate_up is not None:
            return self

        def dense(w) -> torch.Tensor:
            return torch.stack([p.dequantize(self.dtype) for p in w]) if isinstance(w, list) else w.dequantize(self.dtype)

        gate, up, down = self.qweights
        self.w_gate_up = torch.cat([dense(gate), dense(up)], dim=1)
        self.w_down = dense(down)
        return self

    def to_gpu(self, device: torch.device | str | None, dtype: torch.dtype = torch.bfloat16) -> None:
        """Move the experts to a CUDA ``device`` (None: where they are) in place, kept in their
        checkpoint format as expert banks (memra/kernels/moe_decode.py: gate and up fused and
        row-interleaved); the dense host copies are dropped. ``dtype`` is the activations'
        (the banks keep their format)."""
        gate, up, down = self.qweights
        self.qweights = ()
        gu = fuse_gate_up(pack_expert_bank(gate, "gate"), pack_expert_bank(up, "up"))
        del gate, up
        self.gate_up_bank = gu if device is None else gu.to(device)
        dn = pack_expert_bank(down, "down")
        self.down_bank = dn if device is None else dn.to(device)
        self.num_experts = self.down_bank.e
        self.tokens_per_expert = None
        for name in ("w_gate_up", "w_down"):
            if hasattr(self, name):
                delattr(self, name)
        self.kernels = True

    @classmethod
    def from_banks(cls, gate_up, down, limit: float | None) -> RoutedExperts:
        """GPU experts over already packed banks (``fuse_gate_up`` output [E, 2I, D] and
        down [E, D, I], memra/kernels/moe_decode.py), e.g. synthetic full-size ones."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.qweights, self.limit = (), limit
        self.gate_up_bank, self.down_bank = gate_up, down
        self.num_experts = down.e
        self.tokens_per_expert = None
        self.kernels = True
        return self

    @property
    def on_gpu(self) -> bool:
        return self.kernels

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                add: torch.Tensor | None = None, add_stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Routed experts' sum [T, D] (+ ``add`` [T, D] if given; ``add_stream``: the CUDA stream
        that produces ``add``, joined just before ``add`` is read, GPU only)."""
        if self.kernels:
            t = x.shape[0]
            invariant = batch_invariant()  # one path and one tile for every T (memra/kernels/batch_invariant.py)
            if t <= MOE_DECODE_MAX_T and not invariant:
                return decode_kernels.moe_decode(x, index, weight, self.gate_up_bank, self.down_bank, self.limit,
                                                 add=add, add_stream=add_stream)
            cfg = None
            if t <= prefill_kernels.GROUPED_DECODE_MAX_T or invariant:
                b = self.gate_up_bank
                cfg = prefill_kernels.grouped_decode_config(b.fmt, t, index.shape[1], b.e, b.n // 2, b.k, x.dtype)
                if t > prefill_kernels.GROUPED_DECODE_MAX_T:  # how pairs are aligned does not change their sums
                    cfg = dataclasses.replace(cfg, align="auto")
            return prefill_kernels.moe_prefill(x, index, weight, self.gate_up_bank, self.down_bank, self.limit,
                                               add=add, config=cfg, add_stream=add_stream)
        self.build()
        out = torch.zeros_like(x)
        counts = torch.bincount(index.flatten(), minlength=self.num_experts)
        self.tokens_per_expert = counts
        for e in counts.nonzero().flatten().tolist():
            rows, slot = (index == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], self.w_gate_up[e]).chunk(2, dim=-1)
            y = F.linear(swiglu_torch(gate, up, self.limit), self.w_down[e])
            # rows are distinct (top-k picks an expert at most once per token); indexed += rather than
            # index_add_, which on CPU enters an OpenMP region even for a few rows (ms per call under load)
            out[rows] += y * weight[rows, slot, None].to(y.dtype)
        return out if add is None else out + add


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU for the shared expert (created on first use)."""
    device = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class MoE(KernelLayer):
    """Sigmoid-routed top-k experts plus an unscaled shared expert (module docstring).

    Args:
        router: fp32 [E, D]; bias: fp32 [E] or None (used only to choose the top-k).
        experts: :class:`RoutedExperts`; shared: :class:`~memra.layers.activations.GatedMLP` or None.
        top_k: experts per token; scaling: ``moe_router_scaling_factor`` (routed only).
    forward(h2 [T, D]) -> [T, D].
    """

    #: GPU: the shared expert on a second CUDA stream, concurrently with the router, the grouping and
    #: both routed-expert kernels (same kernels, same order of additions: bit-identical to one stream,
    #: tests/test_gpu_engine.py; captured into CUDA graphs as a fork and a join before the combine that
    #: adds its output). Measured (``memra bench decode --shared-overlap on|off``, one call each): H100,
    #: 24 flagship layers, this join: 4.625 -> 4.459-4.483 ms at batch 1, 17.61 -> 17.55 at 64; H200, 45
    #: layers, the earlier join before the routed experts: 6.867 -> 6.688 at 1, 31.54 -> 31.20 at 64.
    overlap_shared: bool = True

    def __init__(self, router: torch.Tensor, bias: torch.Tensor | None, experts: RoutedExperts,
                 shared: GatedMLP | None, top_k: int, scaling: float):
        super().__init__()
        self.register_buffer("router", router.float(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)
        self.experts, self.shared, self.top_k, self.scaling = experts, shared, top_k, scaling

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chosen experts int64 [T, k] and their weights fp32 [T, k] (sum to ``scaling`` per token)."""
        if self.kernels:
            return moe_route(h, self.router, self.bias, self.top_k, self.scaling)
        return router_topk_ref(h.float() @ self.router.t(), self.bias, self.top_k, self.scaling)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.kernels:
            y = self.experts(h, *self.route(h))
            return y if self.shared is None else y + self.shared(h)
        if self.shared is not None and self.overlap_shared and h.is_cuda:
            return self._forward_overlapped(h)
        index, weight = self.route(h)
        shared = None if self.shared is None else self.shared(h)
        return self.experts(h, index, weight, shared)  # the routed combine adds ``shared``

    def _forward_overlapped(self, h: torch.Tensor) -> torch.Tensor:
        """forward with the shared expert on a side stream (fork), joined just before the
        routed combine that adds its output (``add_stream``). Buffers are safe without
        record_stream: ``h`` (read by the side stream) is held by the caller past the join; the
        side stream's own buffers return to its pool, and every later use of that stream starts
        behind another fork (it waits for this stream, which has joined it). An error after the
        fork (out of memory, a kernel that fails to compile) still joins the side stream before it
        propagates, so no later work on this stream races the shared expert."""
        main, side = torch.cuda.current_stream(h.device), _side_stream(h.device)
        side.wait_stream(main)
        try:
            with torch.cuda.stream(side):
                shared = self.shared(h)
            index, weight = self.route(h)
            return self.experts(h, index, weight, shared, side)
        except BaseException:
            try:
                main.wait_stream(side)
            except Exception:  # noqa: BLE001 (a failed join must not hide the error that caused it)
                pass
            raise

    @property
    def tokens_per_expert(self) -> torch.Tensor | None:
        return self.experts.tokens_per_expert
