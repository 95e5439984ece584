"""Gemma 3 text decoder.

Gemma Team 2025, "Gemma 3 Technical Report"; reference: transformers ``Gemma3TextModel``.
Differences from Llama: embeddings scaled by sqrt(hidden); GeGLU MLP (tanh GELU);
zero-centred RMSNorm (GGUF stores 1 + w, llama.cpp's converter adds the 1) used four
times per layer (sandwich norms around attention and MLP); per-head q/k RMSNorm;
5 local layers (sliding window, RoPE base 10000) per global layer::

    h = x + post_attn_norm(attention(input_norm(x)))
    y = h + post_ffw_norm(mlp(pre_ffw_norm(h)))
"""

from __future__ import annotations

from torch import nn

from ..config import LayerConfig, ModelConfig
from .base import CausalLM, GGUFWeights, register_model
from .llama import load_attention, load_mlp

__all__ = ["Gemma3ForCausalLM"]


@register_model("gemma3")
class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 decoder (sandwich norms, GeGLU, local/global attention)."""

    class Layer(nn.Module):
        """Sandwich-norm decoder layer (the layers of memra/models/llama.py, four norms)."""

        def __init__(self, attn, mlp, input_norm, post_attn_norm, pre_ffw_norm, post_ffw_norm):
            super().__init__()
            self.attn, self.mlp = attn, mlp
            self.input_norm, self.post_attn_norm = input_norm, post_attn_norm
            self.pre_ffw_norm, self.post_ffw_norm = pre_ffw_norm, post_ffw_norm

        def forward(self, x, residual, cos, sin, kv):
            """Residual-stream form (:class:`~memra.models.base.CausalLM`) of the sandwich above."""
            h, residual = self.input_norm.add(x, residual)                  # x += pending
            o = self.post_attn_norm(self.attn(h, cos, sin, kv))
            h2, residual = self.pre_ffw_norm.add(o, residual)               # h = x + post_attn_norm(attn(..))
            return self.post_ffw_norm(self.mlp(h2)), residual               # pending: post_ffw_norm(mlp(..))

    @classmethod
    def build_layer(cls, w: GGUFWeights, i: int, lc: LayerConfig) -> nn.Module:
        D, p, why = w.config.hidden_size, f"blk.{i}.", f"hidden={w.config.hidden_size}"
        norms = [w.norm(p + n, D, why) for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")]
        return cls.Layer(load_attention(w, i, lc, permuted_qk=False), load_mlp(w, i), *norms)

    @classmethod
    def layer_tensor_suffixes(cls, config: ModelConfig) -> list[str]:
        return ["attn_norm.weight", "post_attention_norm.weight", "ffn_norm.weight", "post_ffw_norm.weight",
                "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
                "attn_q_norm.weight", "attn_k_norm.weight"] + [f"attn_{n}.weight" for n in "qkv"]
