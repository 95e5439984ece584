"""Llama-family decoders: Llama 2/3 (incl. SmolLM2) and Qwen2.

Touvron et al. 2023 (Llama 2), Meta 2024 (Llama 3); Qwen2 = Llama with biases on the
q/k/v projections (Qwen2 technical report). Reference: transformers ``LlamaModel`` /
``Qwen2Model``. Per layer::

    h = x + o_proj(attention(rope(q), rope(k), v))      q, k, v = proj(rmsnorm(x))
    y = h + down(silu(gate(rmsnorm(h))) * up(rmsnorm(h)))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LayerConfig, ModelConfig
from ..layers.activations import ACTIVATIONS
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rope import apply_rope
from .base import CausalLM, GGUFWeights, register_model

__all__ = ["Attention", "GatedMLP", "LlamaForCausalLM", "unpermute_gguf_qk"]


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE, optional per-head q/k RMSNorm.

    x [T, hidden] -> [T, hidden]. ``qkv`` is the fused projection whose output rows are
    [q (H*D) | k (KV*D) | v (KV*D)].
    """

    def __init__(self, index: int, lc: LayerConfig, qkv: Linear, o: Linear, scale: float,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        super().__init__()
        self.index, self.lc, self.scale = index, lc, scale
        self.qkv, self.o = qkv, o
        self.q_norm, self.k_norm = q_norm, k_norm
        self.sizes = [lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv) -> torch.Tensor:
        T, lc = x.shape[0], self.lc
        q, k, v = self.qkv(x).split(self.sizes, dim=-1)
        q = q.view(T, lc.num_heads, lc.head_dim)
        k = k.view(T, lc.num_kv_heads, lc.head_dim)
        v = v.view(T, lc.num_kv_heads, lc.head_dim)
        if getattr(self, "gpu", False):  # fused q/k norm + RoPE (memra/kernels/norm_rope.py)
            from ..kernels.norm_rope import qk_norm_rope

            qn, kn = self.q_norm, self.k_norm
            q, k = qk_norm_rope(q, k, None if qn is None else qn.weight, None if kn is None else kn.weight,
                                1e-6 if qn is None else qn.eps, cos, sin)
            o = kv.attend(self.index, q, k, v, lc.sliding_window, self.scale)
            return self.o(o.reshape(T, lc.num_heads * lc.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # q and k heads rotated in one call (fewer ops per decode step)
        q, k = apply_rope(torch.cat([q, k], dim=1), cos, sin).split([lc.num_heads, lc.num_kv_heads], dim=1)
        o = kv.attend(self.index, q, k, v, lc.sliding_window, self.scale)
        return self.o(o.reshape(T, lc.num_heads * lc.head_dim))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); ``gate_up`` is fused with rows [gate (I) | up (I)]."""

    def __init__(self, gate_up: Linear, down: Linear, act: str):
        super().__init__()
        self.gate_up, self.down, self.act = gate_up, down, ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "gpu", False) and self.act is F.silu:
            from ..kernels.fused import swiglu

            return self.down(swiglu(self.gate_up(x), None))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def load_attention(w: GGUFWeights, i: int, lc: LayerConfig, permuted_qk: bool) -> Attention:
    """The attention block of layer ``i`` from ``blk.i.attn_*`` tensors."""
    c, D, p = w.config, w.config.hidden_size, f"blk.{i}."
    why = f"layer {i}: heads={lc.num_heads}, kv_heads={lc.num_kv_heads}, head_dim={lc.head_dim}, hidden={D}"
    qo, kvo = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
    qw = w.q(p + "attn_q.weight", (qo, D), why)
    kw = w.q(p + "attn_k.weight", (kvo, D), why)
    vw = w.q(p + "attn_v.weight", (kvo, D), why)
    if permuted_qk:
        qw, kw = unpermute_gguf_qk(qw, lc.num_heads), unpermute_gguf_qk(kw, lc.num_kv_heads)
    bias = None
    if c.attention_bias:
        bias = torch.cat([w.vector(p + f"attn_{n}.bias", s, why) for n, s in (("q", qo), ("k", kvo), ("v", kvo))])
    qkv = Linear([qw, kw, vw], bias, w.dtype)
    o = w.linear([p + "attn_output"], [D], qo, why)
    qn = kn = None
    if c.qk_norm:
        qn = w.norm(p + "attn_q_norm", lc.head_dim, why)
        kn = w.norm(p + "attn_k_norm", lc.head_dim, why)
    scale = c.attn_scale if c.attn_scale is not None else lc.head_dim ** -0.5
    return Attention(i, lc, qkv, o, scale, qn, kn)


def load_mlp(w: GGUFWeights, i: int) -> GatedMLP:
    """The gated MLP of layer ``i`` from ``blk.i.ffn_{gate,up,down}`` (gate and up fused).

    Raises:
        CheckpointError: a tensor is missing or its shape contradicts the config.
    """
    c, p = w.config, f"blk.{i}."
    why = f"hidden={c.hidden_size}, intermediate={c.intermediate_size}"
    I = c.intermediate_size
    gate_up = w.linear([p + "ffn_gate", p + "ffn_up"], [I, I], c.hidden_size, why)
    down = w.linear([p + "ffn_down"], [c.hidden_size], I, why)
    return GatedMLP(gate_up, down, c.hidden_act)


def unpermute_gguf_qk(t, n_heads: int):
    """Undo llama.cpp's q/k row permutation for the ``llama`` architecture.

    llama.cpp's converter reorders each head's rows from rotate-half order (h, half, i)
    to interleaved order (h, i, half) because its llama graph uses interleaved RoPE;
    this restores rotate-half order so one RoPE layout serves every model. Operates on
    packed rows (no dequantization). Source: llama.cpp ``convert_hf_to_gguf.py``
    ``LlamaModel.permute``; transformers ``reverse_permute_weights`` does the same.
    """
    rows = t.shape[0]
    hd = rows // n_heads
    # gguf row (h, i, half) holds hf row (h, half, i); pick for each hf row its gguf row.
    idx = torch.arange(rows).view(n_heads, hd // 2, 2).transpose(1, 2).reshape(-1)
    return t.permute_rows(idx)


@register_model("llama", "qwen2")
class LlamaForCausalLM(CausalLM):
    """Llama / Qwen2 decoder (pre-norm, SwiGLU)."""

    class Layer(nn.Module):
        """Pre-norm decoder layer: x [T, hidden] -> [T, hidden]."""

        def __init__(self, attn: Attention, mlp: GatedMLP, attn_norm: RMSNorm, ffn_norm: RMSNorm):
            super().__init__()
            self.attn, self.mlp, self.attn_norm, self.ffn_norm = attn, mlp, attn_norm, ffn_norm

        def forward(self, x, cos, sin, kv):
            x = x + self.attn(self.attn_norm(x), cos, sin, kv)
            return x + self.mlp(self.ffn_norm(x))

    @classmethod
    def build_layer(cls, w: GGUFWeights, i: int, lc: LayerConfig) -> nn.Module:
        D = w.config.hidden_size
        return cls.Layer(load_attention(w, i, lc, permuted_qk=w.config.arch == "llama"), load_mlp(w, i),
                         w.norm(f"blk.{i}.attn_norm", D, f"hidden={D}"), w.norm(f"blk.{i}.ffn_norm", D, f"hidden={D}"))

    @classmethod
    def layer_tensor_suffixes(cls, config: ModelConfig) -> list[str]:
        s = ["attn_norm.weight", "ffn_norm.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight",
             "ffn_down.weight"] + [f"attn_{n}.weight" for n in "qkv"]
        if config.attention_bias:
            s += [f"attn_{n}.bias" for n in "qkv"]
        return s
