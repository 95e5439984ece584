"""Step-3.5-Flash / Step-3.7-Flash text decoder (GGUF arch ``step35``), with its MTP layers.

Spec: shared/STEP35.md. Oracle: transformers ``Step3p7TextModel`` (``modeling_step3p7.py``),
which has no MTP forward. Per decoder layer (norms zero-centred, their 1 + w folded at load)::

    h  = rmsnorm(x)
    q, k, v, g = h Wq, h Wk, h Wv, h Wg           [T,H,Dh], [T,KV,Dh], [T,KV,Dh], [T,H]
    q, k = rope(qk_norm(q), qk_norm(k))           partial on full layers (rot = Dh/2, llama3-scaled)
    o = attention(q, k, v)                        GQA, causal; sliding layers see i - W < j <= i
    x = x + (o * sigmoid(g)[..., None]) Wo
    h2 = rmsnorm(x)
    x = x + swiglu(h2)                            layers 0-2 (and MTP layers): dense MLP
    x = x + sum_k w_k E_k(h2) + S(h2)             MoE layers: top-k routed experts + shared expert

Router (fp32): s = sigmoid(h2 Wr^T); the top-k of s + bias are chosen (the bias only
chooses); w = s[chosen] / sum(s[chosen]) * routed_scaling_factor; the shared expert S is
not scaled. SwiGLU with clamp ``limit``: a = min(silu(gate), limit), up = clamp(up, ±limit).

MTP step k uses MTP layer k: z = [rmsnorm(embed(tok)) ; rmsnorm(h_prev)] Wp^T, then a full
decoder layer, logits = head_k(rmsnorm(z)); h_prev is the main model's pre-final-norm hidden
state for k = 0 and MTP layer k-1's output z afterwards (chained).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import LayerConfig, ModelConfig
from ..io.gguf import CheckpointError, GGUFCheckpoint
from ..io.safetensors import SafetensorsCheckpoint
from ..layers.activations import GatedMLP, swiglu
from ..layers.attention import Attention, SelfContainedKV
from ..layers.linear import Embedding, Linear, head_logits
from ..layers.moe import MoE, RoutedExperts
from ..layers.norm import RMSNorm
from ..layers.rope import rope_cos_sin
from .base import CausalLM, HFWeights, LoadProgress, on_device, register_model

__all__ = ["Step35ForCausalLM", "Step35Layer", "MTPLayer", "swiglu", "gguf_tensor_name", "GGUFStep35Weights"]


class Step35Layer(nn.Module):
    """One Step-3.5 decoder layer (STEP35.md "per-layer forward"), on the residual stream of
    :class:`~memra.models.base.CausalLM`: ``(x, residual) -> (x', residual')``, the layer's output
    being ``x' + residual'``; every tensor [T, D].

    attn: gated GQA (:class:`~memra.layers.attention.Attention` with ``gated``); mlp: dense SwiGLU
    (:class:`~memra.layers.activations.GatedMLP`, layers 0-2 and MTP) or :class:`~memra.layers.moe.MoE`.
    """

    def __init__(self, attn: Attention, mlp: GatedMLP | MoE, attn_norm: RMSNorm, ffn_norm: RMSNorm):
        super().__init__()
        self.attn, self.mlp, self.attn_norm, self.ffn_norm = attn, mlp, attn_norm, ffn_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.attn_norm.add(x, residual)   # x = x + pending;  h = rmsnorm(x)        [T, D]
        o = self.attn(h, cos, sin, kv)                  # (attention(q, k, v) * sigmoid(g)) Wo      [T, D]
        h2, residual = self.ffn_norm.add(o, residual)   # x = x + o;        h2 = rmsnorm(x)       [T, D]
        return self.mlp(h2), residual                   # swiglu(h2) or sum_k w_k E_k(h2) + S(h2) [T, D]


class MTPLayer(nn.Module):
    """One multi-token-prediction layer (STEP35.md "MTP").

    forward(h_prev [T, D], emb [T, D], cos, sin, kv) -> z [T, D]:
    z = layer([enorm(emb) ; hnorm(h_prev)] Wp^T) (embedding half first).
    logits(z [.., D]) -> fp32 [.., V] = head(head_norm(z)) (its own head, not the main lm_head).
    """

    def __init__(self, enorm: RMSNorm, hnorm: RMSNorm, eh_proj: Linear, layer: Step35Layer, head_norm: RMSNorm,
                 head: Linear):
        super().__init__()
        self.enorm, self.hnorm, self.eh_proj, self.layer = enorm, hnorm, eh_proj, layer
        self.head_norm, self.head = head_norm, head

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv) -> torch.Tensor:
        z = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h_prev)], dim=-1))  # [T, 2D] -> [T, D]
        x, residual = self.layer(z, None, cos, sin, kv)
        return (x + residual).to(x.dtype)  # the CPU keeps the residual in fp32 (memra/layers/norm.py)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        return head_logits(self.head, self.head_norm(z))


@register_model("step35")
class Step35ForCausalLM(CausalLM):
    """Step-3.5-Flash decoder: sliding/full GQA with head gates, dense then MoE layers, MTP layers.

    ``forward(ids, positions, kv, prenorm=False)`` and ``logits`` as :class:`CausalLM`;
    :meth:`routing_stats` reports the last forward's tokens per expert; :meth:`draft`
    proposes tokens with the MTP layers. Build with :meth:`from_hf`.
    """

    def __init__(self, config: ModelConfig, embed: Embedding, layers: list[nn.Module], norm: RMSNorm,
                 lm_head: Linear, mtp: list[MTPLayer]):
        super().__init__(config, embed, layers, norm, lm_head)
        self.mtp = nn.ModuleList(mtp)

    # ------------------------------------------------------------------ routing statistics
    def routing_stats(self) -> dict[int, torch.Tensor]:
        """Tokens routed to each expert in the last forward: {layer index: int64 [num_experts]}
        for every MoE layer that has run (a token counts once per expert that chose it, so each
        vector sums to tokens * top_k)."""
        return {i: layer.mlp.tokens_per_expert for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, MoE) and layer.mlp.tokens_per_expert is not None}

    # ------------------------------------------------------------------ MTP
    def mtp_forward(self, j: int, h_prev: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                    kv=None) -> torch.Tensor:
        """MTP layer ``j`` over rows (h_prev [T, D], tokens int64 [T] at int64 ``positions`` [T]) -> z [T, D].
        Row r pairs h_prev[r] with the embedding of tokens[r]. ``kv``: the attention backend, whose
        layer slot ``j`` is this MTP layer's cache (memra/engine/speculative.py ``MTPProposer``);
        default: attention causal over the T rows only (:class:`SelfContainedKV`)."""
        lc = self.config.mtp_layers[j]
        cos, sin = rope_cos_sin(lc, positions, h_prev.dtype)
        return self.mtp[j](h_prev, self.embed(tokens), cos, sin, SelfContainedKV(positions) if kv is None else kv)

    @torch.no_grad()
    def draft(self, hidden: torch.Tensor, token: int | torch.Tensor, k: int, positions: torch.Tensor | None = None,
              return_logits: bool = False):
        """Draft ``k`` tokens greedily with the chained MTP layers (STEP35.md "MTP").

        Args:
            hidden: [D] or [T, D] main-model hidden states *before* the final norm
                (``forward(..., prenorm=True)``), one row per position.
            token: int, or int64 [T]: the token that follows each hidden row (for row r at
                position p, the token at p + 1). Drafting continues from the last row.
            k: tokens to draft, 1 <= k <= number of MTP layers; step j uses MTP layer j.
            positions: int64 [T] positions of the rows (default ``arange(T)``; RoPE is
                relative, so only their differences matter).
        Returns:
            int64 [k] drafted tokens (for a last row at position p: the tokens at p+2 .. p+k+1);
            with ``return_logits`` also the fp32 [k, vocab] logits of each step.

        Step j runs MTP layer j over all T rows with the previous step's output z as h_prev
        (step 0: ``hidden``) and the tokens shifted by one more position (the drafted token
        appended), so each MTP layer attends over the T-row context. No KV cache is kept.

        Raises:
            ValueError: the model has no MTP layers, ``k`` out of range, or shapes that disagree.
        """
        n = len(self.mtp)
        if n == 0:
            raise ValueError("this model has no MTP layers (num_nextn_predict_layers = 0)")
        if not 1 <= k <= n:
            raise ValueError(f"k = {k} must be in [1, {n}] (one draft step per MTP layer)")
        D = self.config.hidden_size
        h = hidden.reshape(-1, D) if hidden.dim() == 1 else hidden
        toks = torch.as_tensor(token, dtype=torch.int64).reshape(-1)
        if h.dim() != 2 or h.shape[1] != D or toks.shape[0] != h.shape[0]:
            raise ValueError(f"hidden {tuple(hidden.shape)} and token {tuple(toks.shape)} must be [T, {D}] and [T]")
        pos = torch.arange(h.shape[0]) if positions is None else positions.reshape(-1)
        if pos.shape[0] != h.shape[0]:
            raise ValueError(f"positions has {pos.shape[0]} entries, expected one per hidden row ({h.shape[0]})")
        out, all_logits = [], []
        for j in range(k):
            h = self.mtp_forward(j, h.to(self.dtype), toks, pos)
            logits = self.mtp[j].logits(h[-1])
            t = int(logits.argmax())
            out.append(t)
            all_logits.append(logits)
            toks = torch.cat([toks[1:], torch.tensor([t])])
        tokens = torch.tensor(out, dtype=torch.int64)
        return (tokens, torch.stack(all_logits)) if return_logits else tokens

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_hf(cls, ckpt: SafetensorsCheckpoint, config: ModelConfig, dtype: torch.dtype = torch.float32,
                progress: bool = False, device: torch.device | str | None = None) -> Step35ForCausalLM:
        """Build the model from a HF safetensors directory (STEP35.md "Checkpoint layouts").

        Experts may be stacked (``moe.gate_proj.weight`` [E, I, D]) or per expert
        (``moe.experts.N.gate_proj.weight`` [I, D]); bf16/fp16/fp32 or FP8 block-scaled.
        MTP layer j is ``model.layers.{num_layers + j}``.

        Raises:
            CheckpointError: a tensor (or expert, or FP8 scale) missing, a shape that
                contradicts the config (the message names the config values), or tensors the
                config does not account for.
        """
        return cls._build(HFWeights(ckpt, config, dtype, device), progress, device)

    @classmethod
    def from_gguf(cls, ckpt: GGUFCheckpoint, config: ModelConfig, dtype: torch.dtype = torch.float32,
                  progress: bool = False, device: torch.device | str | None = None) -> Step35ForCausalLM:
        """Build the model from a llama.cpp-style ``step35`` GGUF file (STEP35.md "GGUF").

        Tensor names are those of :func:`gguf_tensor_name`; routed experts are 3-D banks
        ``blk.N.ffn_{gate,up}_exps`` [E, I, D] and ``ffn_down_exps`` [E, D, I] (torch order);
        norm weights hold 1 + w (nothing is added at load); q/k rows are **not** permuted
        (llama.cpp runs step35 with NEOX rope, so its converter keeps HF row order).
        ``rope_freqs`` (llama3 factors) applies to the full-attention layers (:meth:`adjust_config`).
        MTP layer j is ``blk.{num_layers + j}`` with ``nextn.*`` tensors.

        Raises:
            CheckpointError: a tensor missing, a shape contradicting the config, or a tensor
                the config does not account for.
        """
        config = cls.adjust_config(ckpt, config)
        w = GGUFStep35Weights(ckpt, config, dtype, device)
        if "rope_freqs.weight" in ckpt:  # read by adjust_config
            w.used.add("rope_freqs.weight")
            w.loaded_bytes += ckpt.infos["rope_freqs.weight"].nbytes
        return cls._build(w, progress, device)

    @classmethod
    def adjust_config(cls, ckpt: GGUFCheckpoint, config: ModelConfig) -> ModelConfig:
        """Fold ``rope_freqs`` into the full-attention layers' (decoder and MTP) rope factors, as
        llama.cpp's step35 does: one shared f32 tensor of ``max_rotary / 2`` entries (max over
        every layer's rotary width, ``src/models/step35.cpp`` ``n_rot_max``), of which a
        full-attention layer uses the first ``rotary_dim / 2``; sliding layers use none
        (llama.cpp passes no factors to their ``ggml_rope_ext``). llama.cpp's converter pads
        the unused tail with 1.0.

        Raises:
            CheckpointError: ``rope_freqs.weight`` has another shape (the message names the
                rotary metadata it contradicts).
        """
        if "rope_freqs.weight" not in ckpt:
            return config
        import dataclasses

        every = config.layers + config.mtp_layers
        half = max(lc.rotary_dim for lc in every) // 2
        why = (f"max rotary width / 2 = {half}, from step35.rope.dimension_count(_swa): full layers rotate "
               f"{sorted({lc.rotary_dim for lc in every if lc.attention == 'full'})}, sliding layers "
               f"{sorted({lc.rotary_dim for lc in every if lc.attention == 'sliding'})} dims")
        f = ckpt.tensor("rope_freqs.weight", (half,), why=why).dequantize()

        def fold(lc: LayerConfig) -> LayerConfig:
            if lc.attention != "full":
                return lc
            return dataclasses.replace(lc, rope_freq_factors=tuple(float(x) for x in f[: lc.rotary_dim // 2]))

        return dataclasses.replace(config, layers=[fold(lc) for lc in config.layers],
                                   mtp_layers=[fold(lc) for lc in config.mtp_layers])

    @classmethod
    def _build(cls, w: HFWeights, progress: bool, device: torch.device | str | None = None) -> Step35ForCausalLM:
        """The model from a weights source that speaks HF tensor names (HF directly, GGUF mapped);
        with ``device`` each layer is moved to that GPU as soon as it is built (as
        :meth:`CausalLM.from_gguf`)."""
        config, dtype = w.config, w.dtype
        D, V, n = config.hidden_size, config.vocab_size, config.num_layers
        why = f"vocab_size={V}, hidden_size={D}"
        bar = LoadProgress(w, progress)
        emb_q = w.q("model.embed_tokens.weight", (V, D), why)
        embed = Embedding(emb_q, dtype)
        layers, mtp = [], []
        for i, lc in enumerate(config.layers):
            layers.append(on_device(_load_layer(w, i, i, lc), device, dtype))
            bar.step()
        for j, lc in enumerate(config.mtp_layers):
            mtp.append(on_device(_load_mtp_layer(w, n + j, j, lc), device, dtype))
            bar.step()
        norm = w.norm("model.norm", D, f"hidden_size={D}")
        head_q = emb_q if config.tie_word_embeddings else w.q("lm_head.weight", (V, D), why)
        bar.close()
        w.check_all_used()
        model = cls(config, embed, layers, norm, Linear(head_q, None, dtype), mtp).eval()
        return model if device is None else model.to_gpu(device, dtype)


def _load_attention(w: HFWeights, i: int, index: int, lc: LayerConfig) -> Attention:
    c, D, p = w.config, w.config.hidden_size, f"model.layers.{i}.self_attn."
    H, KV, Dh = lc.num_heads, lc.num_kv_heads, lc.head_dim
    why = (f"layer {i} ({lc.attention}): heads={H}, kv_heads={KV}, head_dim={Dh}, hidden_size={D}")
    qkvg = w.linear([p + "q_proj", p + "k_proj", p + "v_proj", p + "g_proj"], [H * Dh, KV * Dh, KV * Dh, H], D, why)
    o = w.linear([p + "o_proj"], [D], H * Dh, why)
    scale = c.attn_scale if c.attn_scale is not None else Dh ** -0.5
    return Attention(index, lc, qkvg, o, scale, w.norm(p + "q_norm", Dh, why), w.norm(p + "k_norm", Dh, why),
                     gated=True)


def _load_swiglu(w: HFWeights, p: str, inter: int, limit: float | None, why: str) -> GatedMLP:
    D = w.config.hidden_size
    gate_up = w.linear([p + "gate_proj", p + "up_proj"], [inter, inter], D, why)
    return GatedMLP(gate_up, w.linear([p + "down_proj"], [D], inter, why), "silu", limit)


def _load_experts(w: HFWeights, i: int, lc: LayerConfig) -> RoutedExperts:
    moe, D, p = w.config.moe, w.config.hidden_size, f"model.layers.{i}.moe."
    E, I = moe.num_experts, moe.expert_intermediate_size
    why = f"layer {i}: moe_num_experts={E}, moe_intermediate_size={I}, hidden_size={D}"
    if p + "gate_proj.weight" in w:
        parts = [w.q(p + f"{n}_proj.weight", shape, why)
                 for n, shape in (("gate", (E, I, D)), ("up", (E, I, D)), ("down", (E, D, I)))]
    elif p + "experts.0.gate_proj.weight" in w:
        parts = [[w.q(p + f"experts.{e}.{n}_proj.weight", shape, f"expert {e} of {why}") for e in range(E)]
                 for n, shape in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I)))]
    else:
        raise CheckpointError(f"{w.ckpt.path}: layer {i} is an MoE layer but has no routed expert weights: expected "
                              f"stacked {p + 'gate_proj.weight'!r} [E, I, D] or per-expert "
                              f"{p + 'experts.N.gate_proj.weight'!r} ({why})")
    return RoutedExperts(*parts, lc.swiglu_limit, w.dtype)


def _load_layer(w: HFWeights, i: int, index: int, lc: LayerConfig) -> Step35Layer:
    """Decoder layer ``i`` of the checkpoint (``index``: its slot in the KV cache object)."""
    c, D, p = w.config, w.config.hidden_size, f"model.layers.{i}."
    if lc.mlp == "moe":
        moe = c.moe
        E = moe.num_experts
        why = f"layer {i}: moe_num_experts={E}, hidden_size={D}"
        router = w.q(p + "moe.gate.weight", (E, D), why).dequantize(torch.float32)
        bias = w.vector(p + "moe.router_bias", E, why) if moe.router_bias else None
        shared = None
        if moe.shared_intermediate_size:
            shared = _load_swiglu(w, p + "share_expert.", moe.shared_intermediate_size, lc.swiglu_limit_shared,
                                  f"layer {i}: share_expert_dim={moe.shared_intermediate_size}, hidden_size={D}")
        mlp = MoE(router, bias, _load_experts(w, i, lc), shared, moe.top_k, moe.routed_scaling_factor)
    else:
        mlp = _load_swiglu(w, p + "mlp.", c.intermediate_size, lc.swiglu_limit_shared,
                           f"layer {i}: intermediate_size={c.intermediate_size}, hidden_size={D}")
    why = f"hidden_size={D}"
    return Step35Layer(_load_attention(w, i, index, lc), mlp, w.norm(p + "input_layernorm", D, why),
                       w.norm(p + "post_attention_layernorm", D, why))


def _load_mtp_layer(w: HFWeights, i: int, j: int, lc: LayerConfig) -> MTPLayer:
    """MTP layer ``j`` stored as checkpoint layer ``i`` (= num_hidden_layers + j)."""
    D, V, p = w.config.hidden_size, w.config.vocab_size, f"model.layers.{i}."
    why = f"MTP layer {j}: hidden_size={D}, vocab_size={V}"
    return MTPLayer(
        enorm=w.norm(p + "enorm", D, why), hnorm=w.norm(p + "hnorm", D, why),
        eh_proj=w.linear([p + "eh_proj"], [D], 2 * D, why),
        layer=_load_layer(w, i, j, lc),
        head_norm=w.norm(p + "transformer.shared_head.norm", D, why),
        head=w.linear([p + "transformer.shared_head.output"], [V], D, why))


# ---------------------------------------------------------------------- GGUF names
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.g_proj.weight": "attn_gate.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "moe.gate.weight": "ffn_gate_inp.weight", "moe.router_bias": "exp_probs_b.bias",
    "moe.gate_proj.weight": "ffn_gate_exps.weight", "moe.up_proj.weight": "ffn_up_exps.weight",
    "moe.down_proj.weight": "ffn_down_exps.weight",
    "share_expert.gate_proj.weight": "ffn_gate_shexp.weight", "share_expert.up_proj.weight": "ffn_up_shexp.weight",
    "share_expert.down_proj.weight": "ffn_down_shexp.weight",
    "enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight",
    "eh_proj.weight": "nextn.eh_proj.weight", "transformer.shared_head.norm.weight": "nextn.shared_head_norm.weight",
    "transformer.shared_head.output.weight": "nextn.shared_head_head.weight",
}


def gguf_tensor_name(hf_name: str) -> str | None:
    """The llama.cpp ``step35`` GGUF name of a hub-layout tensor, or None if it has none.

    ``model.layers.N.<suffix>`` -> ``blk.N.<gguf suffix>`` (MTP layers keep their index
    N >= num_hidden_layers); stacked experts map to the 3-D ``*_exps`` banks; per-expert
    names (``moe.experts.E.*``) and FP8 ``*_scale_inv`` have no GGUF name. Source: STEP35.md
    "GGUF" (names to verify against llama.cpp's ``llama-arch.cpp`` / converter).
    """
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    if not hf_name.startswith("model.layers."):
        return None
    i, _, suffix = hf_name.removeprefix("model.layers.").partition(".")
    g = _GGUF_LAYER.get(suffix)
    return None if g is None else f"blk.{i}.{g}"


def is_norm_weight(hf_name: str) -> bool:
    """True for the zero-centred RMSNorm weights (stored as w in HF, as 1 + w in GGUF)."""
    return hf_name.endswith(("norm.weight", "layernorm.weight"))


class GGUFStep35Weights(HFWeights):
    """:class:`HFWeights` over a ``step35`` GGUF file: hub names are translated with
    :func:`gguf_tensor_name`, and norms are used as stored (GGUF holds 1 + w).

    Lets the Step-3.5 layer loaders serve both formats with one code path.
    """

    def __init__(self, ckpt: GGUFCheckpoint, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        self.ckpt, self.config, self.dtype, self.device = ckpt, config, dtype, device
        self.used: set[str] = set()
        self.loaded_bytes = 0

    def __contains__(self, name: str) -> bool:
        g = gguf_tensor_name(name)
        return g is not None and g in self.ckpt

    def q(self, name: str, shape: tuple[int, ...], why: str):
        g = gguf_tensor_name(name)
        if g is None:
            raise CheckpointError(f"{self.ckpt.path}: tensor {name!r} has no step35 GGUF name")
        t = self.ckpt.tensor(g, shape, why=why, device=self.device)
        self.loaded_bytes += t.nbytes
        self.used.add(g)
        return t

    def norm(self, name: str, n: int, why: str, zero_centred: bool = True) -> RMSNorm:
        """RMSNorm whose multiplier is the stored weight (llama.cpp's converter already added 1)."""
        return RMSNorm(self.vector(name + ".weight", n, why), self.config.rms_norm_eps)
