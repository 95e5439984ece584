"""Attention: the torch reference, the attention-backend interface, and the attention layer.

Visibility (the one rule every attention path here follows): key at position j is
visible to a query at position i iff ``j <= i`` and, on sliding-window layers,
``i - window < j`` (the query's own token included; Gemma 3 / Step-3.5 convention,
transformers ``sliding_window_overlay``).

A model's attention layer never sees the KV-cache layout. It calls its step's attention
backend, ``kv.attend(layer, q, k, v, window, scale[, gate])``, which stores the step's keys and
values and attends over everything the queries may see. The engine picks the backend per step:

- :class:`memra.engine.kv_cache.ContiguousKVCache`: one sequence, contiguous per layer (torch);
- :class:`memra.engine.kv_cache.PagedBatch`: the serving engine's paged cache for a mixed
  step, torch SDPA over gathered pages on the CPU or the paged Triton flash kernel on the GPU;
- :class:`memra.engine.cuda_graph.DecodeKV`: the paged decode kernel, the view that CUDA graphs
  of decode steps capture;
- :class:`SelfContainedKV`: a pass over a self-contained sequence (MTP drafting), no cache.

A backend whose ``fuses_gate`` is True takes Step-3.5's head gate and applies it in its
epilogue; otherwise :class:`Attention` applies it after the call.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..config import LayerConfig
from ..kernels import cpu_native
from ..kernels.norm_rope import qk_norm_rope, rope_torch
from .device import KernelLayer
from .linear import Linear
from .norm import RMSNorm

#: Rows up to which RoPE on the CPU takes the native kernel (fp32 math, one rounding).
NATIVE_ROPE_MAX_ROWS = 16

__all__ = ["Attention", "AttentionBackend", "SelfContainedKV", "attention", "decode_attention", "visibility_mask"]


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean mask [Tq, Tk]: True where key ``k_pos[j]`` is visible to query ``q_pos[i]``."""
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    return allowed


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              window: int | None, scale: float) -> torch.Tensor:
    """Attention of queries over keys/values of one sequence.

    Args:
        q: [Tq, H, D]; k, v: [Tk, KV, D] with H a multiple of KV (grouped-query attention).
        q_pos: int64 [Tq] absolute positions of the queries; k_pos: int64 [Tk] of the keys.
        window: sliding window in tokens, or None for full causal attention.
        scale: softmax scale (usually D ** -0.5).
    Returns:
        [Tq, H, D] in q's dtype.
    """
    if q.shape[0] == 1 and q.device.type == "cpu":
        qp = int(q_pos[0])
        lo = 0 if window is None else qp - window + 1
        if int(k_pos[-1]) <= qp and int(k_pos[0]) >= lo:  # every key visible: no mask
            return decode_attention(q, k[None], v[None], None, scale)  # [1, H, D]
    mask = None
    if not (q.shape[0] == 1 and window is None and int(k_pos[-1]) <= int(q_pos[0])):
        mask = visibility_mask(q_pos, k_pos, window)
    k, v = k.to(q.dtype), v.to(q.dtype)  # a CPU cache stores fp32 (memra/engine/kv_cache.py kv_storage_dtype)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """One query per sequence over its keys: the decode step's attention on the CPU.

    Args:
        q: [B, H, D]; k, v: [B, L, KV, D] (H a multiple of KV: grouped-query attention).
        valid: bool [B, L], True where the key is visible (None: all are).
        scale: softmax scale.
    Returns [B, H, D] in q's dtype.

    Batched matmuls (one per query head of a KV group, batched over sequences and KV heads) and a
    softmax, in fp32 whatever the cache dtype: at one query torch's CPU SDPA costs 2-5x more
    (``memra bench cpu``, issue 19), and bf16 matmuls on these CPUs are slower than fp32 ones at
    these sizes. Same math as :func:`attention` (softmax of q k^T * scale over the visible keys,
    times v).
    """
    B, H, D = q.shape
    L, KV = k.shape[1], k.shape[2]
    G = H // KV
    qg = torch.mul(q.reshape(B * KV, G, D).float(), scale)
    kt = k.float().transpose(1, 2).reshape(B * KV, L, D).transpose(1, 2)  # a view at B = 1: [B KV, D, L]
    vt = v.float().transpose(1, 2).reshape(B * KV, L, D)
    # one GEMM per query head of a group (M = 1): a GEMM's rounding depends on its M, and a tensor-
    # parallel rank holds fewer heads per KV head than one rank does (bit-identical TP, issue 17)
    s = torch.cat([torch.bmm(qg[:, g:g + 1], kt) for g in range(G)], dim=1)  # [B KV, G, L]
    if valid is not None:
        s.view(B, KV, G, L).masked_fill_(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.cat([torch.bmm(p[:, g:g + 1], vt) for g in range(G)], dim=1)  # [B KV, G, D]
    return o.view(B, H, D).to(q.dtype)


class AttentionBackend(Protocol):
    """What an attention layer calls (see the module docstring).

    ``attend(layer, q [T, H, D], k [T, KV, D], v [T, KV, D], window, scale, gate=None)`` writes
    this step's k, v for decoder (or MTP) layer slot ``layer`` and returns [T, H, D] in q's dtype,
    row t attending over the keys its position may see. ``gate`` [T, H] is passed only when
    ``fuses_gate`` is True: the output is then multiplied by sigmoid(gate).
    """

    fuses_gate: bool

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
               scale: float, gate: torch.Tensor | None = None) -> torch.Tensor: ...


class SelfContainedKV:
    """The backend of a pass over a self-contained sequence: each layer attends over the keys and
    values of this pass only (causal, windowed), at int64 ``positions`` [T]. Torch; no cache.
    Used by MTP drafting without a KV cache."""

    fuses_gate = False

    def __init__(self, positions: torch.Tensor):
        self.positions = positions

    def attend(self, layer: int, q, k, v, window: int | None, scale: float) -> torch.Tensor:
        return attention(q, k, v, self.positions, self.positions, window, scale)


class Attention(KernelLayer):
    """Grouped-query attention with RoPE (partial or full), optional per-head q/k RMSNorm and an
    optional head-wise sigmoid output gate (Step-3.5).

    Args:
        index: the layer's slot in the attention backend (decoder layer i, or MTP layer j).
        lc: its geometry (heads, KV heads, head_dim, sliding_window).
        qkv: one Linear whose output rows are [q (H*Dh) | k (KV*Dh) | v (KV*Dh)] and, with
            ``gated``, [| g (H)] after them.
        o: output projection [hidden, H*Dh].
        scale: softmax scale.
        q_norm, k_norm: per-head RMSNorm over Dh (both or neither).
        gated: the head gate: o_h *= sigmoid(g_h) before ``o`` (STEP35.md "head-wise gate").
    forward(h [T, hidden], cos, sin [T, rotary_dim], kv backend) -> [T, hidden].

    CPU: q/k norms, then RoPE on q and k heads in one call (:func:`memra.layers.rope.apply_rope`).
    GPU: both in one fused launch (memra/kernels/norm_rope.py ``qk_norm_rope``); the gate is fused
    into the attention kernel when the backend takes it (``fuses_gate``).
    """

    def __init__(self, index: int, lc: LayerConfig, qkv: Linear, o: Linear, scale: float,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, gated: bool = False):
        super().__init__()
        if (q_norm is None) != (k_norm is None):
            raise ValueError(f"attention layer {index}: q_norm and k_norm come together (got one)")
        self.index, self.lc, self.scale, self.gated = index, lc, scale, gated
        self.qkv, self.o, self.q_norm, self.k_norm = qkv, o, q_norm, k_norm
        H, KV, Dh = lc.num_heads, lc.num_kv_heads, lc.head_dim
        self.sizes = [H * Dh, KV * Dh, KV * Dh] + ([H] if gated else [])

    def norm_rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, Dh], k [T, KV, Dh] -> their q/k norms (if any) and RoPE, same shapes."""
        qn, kn = self.q_norm, self.k_norm
        if self.kernels:
            return qk_norm_rope(q, k, None if qn is None else qn.weight, None if kn is None else kn.weight,
                                1e-6 if qn is None else qn.eps, cos, sin)
        if qn is None and q.is_cpu and q.shape[0] <= NATIVE_ROPE_MAX_ROWS and q.dtype in (torch.bfloat16, torch.float32) \
                and cpu_native.enabled():  # (torch on a GPU, e.g. tensor-parallel shards, takes rope_torch)
            H, D = q.shape[1], q.shape[2]
            if k.data_ptr() == q.data_ptr() + H * D * q.element_size() and k.stride() == q.stride():
                # k's heads follow q's in the qkv row: both in one call
                cpu_native.rope_(q.as_strided((q.shape[0], H + k.shape[1], D), q.stride()), cos, sin)
                return q, k
            return cpu_native.rope_(q, cos, sin), cpu_native.rope_(k, cos, sin)  # in place (fresh qkv output)
        if qn is not None:
            q, k = qn(q), kn(k)
        H = q.shape[1]
        return rope_torch(torch.cat([q, k], dim=1), cos, sin).split([H, k.shape[1]], dim=1)  # one call for both

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: AttentionBackend) -> torch.Tensor:
        T, lc = h.shape[0], self.lc
        H, KV, Dh = lc.num_heads, lc.num_kv_heads, lc.head_dim
        q, k, v, *g = self.qkv(h).split(self.sizes, dim=-1)
        q, k = self.norm_rope(q.view(T, H, Dh), k.view(T, KV, Dh), cos, sin)
        v = v.view(T, KV, Dh)
        if g and getattr(kv, "fuses_gate", False):
            o = kv.attend(self.index, q, k, v, lc.sliding_window, self.scale, gate=g[0])
        else:
            o = kv.attend(self.index, q, k, v, lc.sliding_window, self.scale)  # [T, H, Dh]
            if g:
                o = o * torch.sigmoid(g[0])[..., None]
        return self.o(o.reshape(T, H * Dh))
