"""Llama-family decoders: Llama 2/3 (incl. SmolLM2) and Qwen2.

Touvron et al. 2023 (Llama 2), Meta 2024 (Llama 3); Qwen2 = Llama with biases on the
q/k/v projections (Qwen2 technical report). Reference: transformers ``LlamaModel`` /
``Qwen2Model``. Per layer::

    h = x + o_proj(attention(rope(q), rope(k), v))      q, k, v = proj(rmsnorm(x))
    y = h + down(silu(gate(rmsnorm(h))) * up(rmsnorm(h)))
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LayerConfig, ModelConfig
from ..layers.activations import GatedMLP
from ..layers.attention import Attention
from ..layers.fused_decode import DecoderLayer
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from .base import CausalLM, GGUFWeights, register_model

__all__ = ["LlamaForCausalLM", "load_attention", "load_mlp", "unpermute_gguf_qk"]


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
    return Attention(i, lc, qkv, o, scale, qn, kn)  # [T, hidden] -> [T, hidden]


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
    return GatedMLP(gate_up, down, c.hidden_act)  # SwiGLU (Llama, Qwen2) or GeGLU (Gemma 3)


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
        """Pre-norm decoder layer on the residual stream (:class:`~memra.models.base.CausalLM`)."""

        def __init__(self, attn: Attention, mlp: GatedMLP, attn_norm: RMSNorm, ffn_norm: RMSNorm):
            super().__init__()
            self.attn, self.mlp, self.attn_norm, self.ffn_norm = attn, mlp, attn_norm, ffn_norm

        def forward(self, x, residual, cos, sin, kv):
            h, residual = self.attn_norm.add(x, residual)                      # x += pending; h = rmsnorm(x)
            h2, residual = self.ffn_norm.add(self.attn(h, cos, sin, kv), residual)  # x += attn(h)
            return self.mlp(h2), residual                                      # pending: mlp(rmsnorm(x))

    def native_decoder_layers(self) -> list[DecoderLayer] | None:
        """Every layer for the fused native CPU decode step, or None unless each is this class's
        Layer on native CPU linears (no q/k norms, no head gate, full attention, SwiGLU, biases on
        q/k/v only)."""
        out = []
        for layer, lc in zip(self.layers, self.config.layers):
            if type(layer) is not self.Layer or type(layer.mlp) is not GatedMLP or type(layer.attn) is not Attention:
                return None
            a, m = layer.attn, layer.mlp
            lins = (a.qkv, a.o, m.gate_up, m.down)
            if (a.q_norm is not None or a.gated or lc.sliding_window is not None or m.act != "silu" or m.part_sizes
                    or any(type(q) is not Linear or q.kernel != "native" for q in lins)
                    or any(q.bias is not None for q in lins[1:])):
                return None
            for q in lins:
                q.build()
            out.append(DecoderLayer(layer.attn_norm.weight, layer.attn_norm.eps, a.qkv.native, a.qkv._bias32,
                                    a.o.native, layer.ffn_norm.weight, layer.ffn_norm.eps, m.gate_up.native,
                                    m.down.native, lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.rotary_dim,
                                    a.scale, m.limit, a.index))
        return out

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
