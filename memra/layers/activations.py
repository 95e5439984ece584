"""Gated MLPs and their gate activations: SwiGLU (Shazeer 2020) with Step-3.5's optional clamp,
and GeGLU with tanh-approximated GELU (Gemma).

:class:`GatedMLP` is the one dense MLP (and shared expert) layer: ``down(act(x Wgate) * (x Wup))``
with gate and up fused in one projection. On the CPU the activation is plain torch
(:func:`swiglu`: memra/kernels/fused.py ``swiglu_torch``, in the activation dtype); on the GPU
SwiGLU is one fused launch (memra/kernels/fused.py ``swiglu``, fp32 math, one rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.fused import swiglu as fused_swiglu
from ..kernels.fused import swiglu_torch
from .device import KernelLayer
from .linear import Linear

__all__ = ["ACTIVATIONS", "GatedMLP", "gelu_tanh", "swiglu"]

swiglu = swiglu_torch  # min(silu(gate), limit) * clamp(up, -limit, limit); limit None: silu(gate) * up


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


class GatedMLP(KernelLayer):
    """down(act(gate) * up) with ``gate_up`` one Linear whose output rows are [gate (I) | up (I)].

    Args:
        gate_up: Linear [2I, D]; down: Linear [D, I].
        act: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
        limit: SwiGLU clamp (STEP35.md "SwiGLU clamp"), None for none; only with ``act="silu"``.
        part_sizes: a tensor-parallel shard's canonical parts of I (memra/parallel/shard.py): the
            activation then runs on each part's columns separately, so that each call has the same
            shape at every TP size (torch's vectorised loops round their scalar tails differently:
            one call over 4 parts and 4 calls over one are not bit-identical otherwise).
    forward(x [T, D]) -> [T, D].

    Raises: ValueError for an unknown activation or a clamp on a non-SiLU gate.
    """

    def __init__(self, gate_up: Linear, down: Linear, act: str = "silu", limit: float | None = None,
                 part_sizes: list[int] | None = None):
        super().__init__()
        self.part_sizes = part_sizes
        if act not in ACTIVATIONS:
            raise ValueError(f"GatedMLP: unknown activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
        if limit is not None and act != "silu":
            raise ValueError(f"GatedMLP: a clamp (limit={limit}) is defined for SwiGLU only, not {act!r}")
        self.gate_up, self.down, self.act, self.limit = gate_up, down, act, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels and self.act == "silu":
            return self.down(fused_swiglu(self.gate_up(x), self.limit))
        if self.act == "silu" and not self.part_sizes and isinstance(self.gate_up, Linear) and \
                self.gate_up.native_rows(x):
            return self.down(self.gate_up.swiglu(x, self.limit))  # SwiGLU fused into the native GEMV
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        if self.part_sizes and len(self.part_sizes) > 1:
            return self.down(torch.cat([self._act(g, u) for g, u in zip(gate.split(self.part_sizes, -1),
                                                                        up.split(self.part_sizes, -1))], -1))
        return self.down(self._act(gate, up))

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.act == "silu":
            return swiglu_torch(gate, up, self.limit)
        return ACTIVATIONS[self.act](gate) * up
