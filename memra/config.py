"""The normalised model description.

Every checkpoint format (GGUF metadata; HF ``config.json`` for the Step-3.5 flagship) is
turned into one :class:`ModelConfig`. Quantities that can differ between layers
(attention kind, head counts, RoPE) live in a per-layer :class:`LayerConfig`, so models
with heterogeneous layers (Gemma 3 local/global, Step-3.5 sliding/full with different
head counts) need no special cases in the engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RopeScaling", "LayerConfig", "MoEConfig", "ModelConfig", "ConfigError", "step35_rope_dimension_counts"]


class ConfigError(ValueError):
    """A configuration value is missing, malformed or contradicts the weights."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    kind: ``"linear"`` (positions divided by ``factor``) or ``"llama3"`` (Meta's
    wavelength-dependent scaling, Llama 3.1 report; transformers
    ``_compute_llama3_parameters``).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class LayerConfig:
    """What one decoder layer looks like.

    Attributes:
        attention: ``"full"`` or ``"sliding"``.
        num_heads / num_kv_heads / head_dim: attention geometry (GQA when kv < heads).
        sliding_window: for sliding layers, key j is visible to query i iff
            ``i - sliding_window < j <= i``; None for full layers.
        rope_theta: RoPE base.
        rotary_dim: how many leading dims of each head are rotated (== head_dim unless partial).
        rope_scaling: frequency scaling or None.
        rope_freq_factors: optional per-frequency divisors read from a checkpoint tensor
            (llama.cpp ``rope_freqs``), length rotary_dim // 2; overrides rope_scaling.
        mlp: ``"dense"`` (gated MLP of ``ModelConfig.intermediate_size``) or ``"moe"``
            (routed experts + shared expert, ``ModelConfig.moe``).
        swiglu_limit: SwiGLU clamp of the routed experts of this layer (Step-3.5
            ``swiglu_limits``); None means no clamp.
        swiglu_limit_shared: SwiGLU clamp of the shared expert / dense MLP of this layer
            (Step-3.5 ``swiglu_limits_shared``); None means no clamp.
    """

    attention: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    rope_theta: float
    rotary_dim: int
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    mlp: str = "dense"
    swiglu_limit: float | None = None
    swiglu_limit_shared: float | None = None


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-Experts geometry and routing (STEP35.md "MoE", "router", "combine").

    Attributes:
        num_experts: routed experts per MoE layer.
        top_k: experts chosen per token.
        expert_intermediate_size: intermediate width of each routed expert (SwiGLU).
        shared_intermediate_size: intermediate width of the always-on shared expert; 0 = none.
        routed_scaling_factor: multiplier of the (renormalised) routing weights; applies to
            routed experts only, never to the shared expert.
        router_bias: the router has a per-expert bias added to the sigmoid scores for the
            top-k choice only (never to the weights).
    """

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_intermediate_size: int
    routed_scaling_factor: float
    router_bias: bool = True


@dataclass
class ModelConfig:
    """Normalised description of a decoder-only language model.

    Attributes:
        arch: architecture name in memra's model registry (``llama``, ``qwen2``, ``gemma3``, ``step35``).
        vocab_size, hidden_size, intermediate_size: sizes.
        layers: one :class:`LayerConfig` per decoder layer.
        rms_norm_eps: epsilon of every RMSNorm.
        hidden_act: ``"silu"`` or ``"gelu_tanh"`` (gate activation of the gated MLP).
        attention_bias: q/k/v projections carry biases (qwen2).
        qk_norm: per-head RMSNorm of q and k before RoPE (gemma3).
        attn_scale: softmax scale (``head_dim ** -0.5`` unless the model says otherwise).
        embedding_scale: multiplier applied to token embeddings (gemma3: sqrt(hidden)).
        tie_word_embeddings: the LM head reuses the embedding matrix.
        max_position_embeddings: context length the model was trained for.
        bos_token_id / eos_token_ids: from the checkpoint's tokenizer metadata.
        name: human-readable model name.
        attn_head_gate: attention output of head i is multiplied by sigmoid(h Wg^T)[i]
            (Step-3.5 head-wise gate, computed from the normed layer input h).
        moe: routed-expert geometry for layers whose ``LayerConfig.mlp == "moe"``.
        mtp_layers: multi-token-prediction layers (Step-3.5: 3, chained), after the decoder layers.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: list[LayerConfig]
    rms_norm_eps: float
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    attn_scale: float | None = None
    embedding_scale: float = 1.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    attn_head_gate: bool = False
    moe: MoEConfig | None = None
    mtp_layers: list[LayerConfig] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def summary(self) -> dict[str, Any]:
        """A small dict for printing (``memra inspect``)."""
        kinds = [lc.attention for lc in self.layers]
        return {
            "arch": self.arch,
            "name": self.name,
            "layers": self.num_layers,
            "hidden": self.hidden_size,
            "intermediate": self.intermediate_size,
            "heads": sorted({lc.num_heads for lc in self.layers}),
            "kv_heads": sorted({lc.num_kv_heads for lc in self.layers}),
            "head_dim": self.layers[0].head_dim,
            "full_layers": kinds.count("full"),
            "sliding_layers": kinds.count("sliding"),
            "vocab": self.vocab_size,
            "context": self.max_position_embeddings,
            "tied_embeddings": self.tie_word_embeddings,
            **({"moe_layers": sum(lc.mlp == "moe" for lc in self.layers), "experts": self.moe.num_experts,
                "experts_per_token": self.moe.top_k, "expert_intermediate": self.moe.expert_intermediate_size}
               if self.moe else {}),
            **({"mtp_layers": len(self.mtp_layers)} if self.mtp_layers else {}),
        }

    # ------------------------------------------------------------------ GGUF
    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str], where: str = "") -> ModelConfig:
        """Build the config from GGUF metadata (llama.cpp's ``{arch}.*`` keys).

        Args:
            meta: metadata as returned by :func:`memra.io.gguf.read_metadata`.
            tensor_names: names of the tensors in the file (decides tied output, biases).
            where: file name for error messages.

        Raises:
            ConfigError: unsupported architecture, or a required key missing / of the wrong type.

        Source: llama.cpp ``llama-model.cpp`` (``llm_load_hparams``) and ``gguf-py``
        constants for key names; Gemma 3 layer pattern as hard-coded by llama.cpp
        (every 6th layer global, sliding window from metadata). Arch ``step35`` (per-layer
        head counts, sliding pattern and clamps; MoE and MTP keys) is read by
        ``_step35_from_gguf``, whose docstring lists the keys and memra's choices.
        """
        arch = meta.get("general.architecture")
        if arch == "step35":
            return _step35_from_gguf(meta, tensor_names, where)
        if arch not in _GGUF_ARCHS:
            raise ConfigError(
                f"{where}: architecture {arch!r} is not supported (supported: {', '.join(sorted(_GGUF_ARCHS))})"
            )

        get = _gguf_getter(meta, f"{arch}.", where, default_type=(int, float))

        hidden = int(get("embedding_length", int))
        n_layers = int(get("block_count", int))
        n_heads = int(get("attention.head_count", int))
        n_kv = int(get("attention.head_count_kv", int, n_heads))
        head_dim = int(get("attention.key_length", int, hidden // n_heads if n_heads else 0))
        if int(get("attention.value_length", int, head_dim)) != head_dim:
            raise ConfigError(f"{where}: {arch}.attention.value_length differs from key_length (unsupported)")
        rot = int(get("rope.dimension_count", int, head_dim))
        theta = float(get("rope.freq_base", (int, float), 10000.0))
        eps = float(get("attention.layer_norm_rms_epsilon", (int, float)))
        ctx = int(get("context_length", int, 4096))
        for name, v in [("embedding_length", hidden), ("block_count", n_layers), ("attention.head_count", n_heads),
                        ("attention.head_count_kv", n_kv), ("attention.key_length", head_dim)]:
            if v <= 0:
                raise ConfigError(f"{where}: {arch}.{name} = {v} must be positive")
        if n_heads % n_kv:
            raise ConfigError(f"{where}: head_count {n_heads} is not a multiple of head_count_kv {n_kv}")
        if rot > head_dim or rot % 2:
            raise ConfigError(f"{where}: rope.dimension_count {rot} must be even and <= head dim {head_dim}")
        scaling = None
        stype = meta.get(f"{arch}.rope.scaling.type")
        if stype == "linear":
            scaling = RopeScaling("linear", float(get("rope.scaling.factor", (int, float))))
        elif stype not in (None, "none"):
            raise ConfigError(f"{where}: rope scaling type {stype!r} is not supported (supported: linear; "
                              "llama3 scaling comes from the rope_freqs tensor)")

        vocab = _gguf_vocab_size(meta, f"{arch}.", where)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        common = dict(
            arch=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", int)),
            rms_norm_eps=eps,
            tie_word_embeddings="output.weight" not in tensor_names,
            max_position_embeddings=ctx,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
            name=str(meta.get("general.name", "")),
        )
        if arch in ("llama", "qwen2"):
            layer = LayerConfig("full", n_heads, n_kv, head_dim, None, theta, rot, scaling)
            return cls(layers=[layer] * n_layers, attention_bias="blk.0.attn_q.bias" in tensor_names, **common)
        # gemma3: 5 local (sliding, theta 10000, no scaling) then 1 global layer (llama.cpp hard-codes this).
        window = int(get("attention.sliding_window", int))
        layers = []
        for i in range(n_layers):
            if (i + 1) % 6 == 0:
                layers.append(LayerConfig("full", n_heads, n_kv, head_dim, None, theta, rot, scaling))
            else:
                layers.append(LayerConfig("sliding", n_heads, n_kv, head_dim, window, 10000.0, rot, None))
        return cls(
            layers=layers,
            hidden_act="gelu_tanh",
            qk_norm=True,
            attn_scale=head_dim ** -0.5,  # query_pre_attn_scalar == head_dim for the released Gemma 3 sizes
            embedding_scale=math.sqrt(hidden),
            **common,
        )

    # ------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], where: str = "config.json") -> ModelConfig:
        """Build the config from a Hugging Face ``config.json`` (as a dict).

        Accepted forms (``model_type``):
          * ``step3p5``: the hub format of Step-3.5-Flash (``num_attention_groups``,
            ``attention_other_setting``, ``moe_layers_enum``, per-layer lists padded with
            the MTP layers' entries, ``rope_scaling`` + ``yarn_only_types``), or
            transformers' normalised ``Step3p7TextConfig.to_dict()`` (``num_key_value_heads``,
            ``num_sliding_attention_heads``, ``mlp_layer_types``/``mtp_mlp_layer_types``,
            ``layer_types``/``mtp_layer_types``, ``rope_parameters`` per layer type);
          * ``step3p7``: the multimodal wrapper; its ``text_config`` (either form above) is used.

        Raises:
            ConfigError: unsupported ``model_type``; a required key missing, of the wrong
                type or out of range; two spellings of one value that disagree (e.g.
                ``num_attention_groups`` vs ``num_key_value_heads``); a feature memra does not
                implement (e.g. ``moe_router_activation`` other than sigmoid). The message
                names ``where`` and the key.

        Source: shared/STEP35.md ("Geometry", "Checkpoint layouts"); transformers
        ``Step3p7TextConfig.__post_init__`` for the mapping of the hub keys.
        """
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
        mt = cfg.get("model_type")
        if mt == "step3p7":
            text = cfg.get("text_config")
            if not isinstance(text, Mapping):
                raise ConfigError(f"{where}: model_type 'step3p7' needs a 'text_config' object")
            tmt = text.get("model_type", "step3p5")
            if tmt != "step3p5":
                raise ConfigError(f"{where}: text_config.model_type is {tmt!r}, expected 'step3p5'")
            return _step35_from_hf(text, f"{where}: text_config")
        if mt == "step3p5":
            return _step35_from_hf(cfg, where)
        raise ConfigError(f"{where}: model_type {mt!r} is not supported (supported: step3p5, step3p7)")


def _step35_from_hf(c: Mapping[str, Any], where: str) -> ModelConfig:
    """Step-3.5 text config (hub or transformers-normalised form) -> ModelConfig. See from_hf_config."""

    def get(key: str, typ: type | tuple = int, default: Any = _MISSING, src: Mapping | None = None) -> Any:
        d = c if src is None else src
        v = d.get(key)
        if v is None:
            if default is _MISSING:
                raise ConfigError(f"{where}: required key {key!r} is missing")
            return default
        allowed = typ if isinstance(typ, tuple) else (typ,)
        if not isinstance(v, typ) or isinstance(v, bool) and bool not in allowed:
            raise ConfigError(f"{where}: key {key!r} = {v!r} has the wrong type (expected {_tname(typ)})")
        return v

    def alias(keys: tuple[str, ...], typ: type | tuple = int, default: Any = _MISSING) -> Any:
        found = [(k, get(k, typ)) for k in keys if c.get(k) is not None]
        if len({repr(v) for _, v in found}) > 1:
            raise ConfigError(f"{where}: contradictory values " + ", ".join(f"{k}={v!r}" for k, v in found))
        if found:
            return found[0][1]
        if default is _MISSING:
            raise ConfigError(f"{where}: required key {keys[0]!r} is missing (also accepted: {', '.join(keys[1:])})")
        return default

    def positive(key: str, v: int | float) -> Any:
        if v <= 0:
            raise ConfigError(f"{where}: {key} = {v} must be positive")
        return v

    def require_flag(key: str, want: Any, what: str) -> None:
        if key in c and c[key] is not None and c[key] != want:
            raise ConfigError(
                f"{where}: {key} = {c[key]!r} is not supported (memra implements {key} = {want!r}: {what})")

    n = positive("num_hidden_layers", get("num_hidden_layers"))
    m = alias(("num_nextn_predict_layers", "num_mtp_layers"), int, 0)
    if m < 0:
        raise ConfigError(f"{where}: num_nextn_predict_layers = {m} must be >= 0")
    total = n + m
    D = positive("hidden_size", get("hidden_size"))
    V = positive("vocab_size", get("vocab_size"))
    eps = positive("rms_norm_eps", float(get("rms_norm_eps", (int, float))))
    H = positive("num_attention_heads", get("num_attention_heads"))
    KV = positive("num_key_value_heads", alias(("num_key_value_heads", "num_attention_groups")))
    hd = positive("head_dim", get("head_dim"))

    # Features memra implements exactly one way; other values are refused, not ignored.
    require_flag("use_qk_norm", True, "per-head q/k RMSNorm")
    require_flag("use_head_wise_attn_gate", True, "head-wise sigmoid gate")
    require_flag("zero_centered", True, "RMSNorm weights stored as w, applied as 1 + w")
    require_flag("moe_router_activation", "sigmoid", "sigmoid router scores")
    require_flag("norm_expert_weight", True, "top-k weights renormalised to sum 1")
    require_flag("attention_bias", False, "no q/k/v/o biases")
    require_flag("mlp_bias", False, "no MLP biases")
    require_flag("att_impl_type", "GQA", "grouped-query attention")
    require_flag("use_bidirectional_attention", False, "causal attention")
    if c.get("hidden_act") not in (None, "silu", "swigluoai"):
        raise ConfigError(f"{where}: hidden_act = {c['hidden_act']!r} is not supported (SwiGLU: silu)")
    if isinstance(c.get("use_rope_layers"), list) and not all(c["use_rope_layers"]):
        raise ConfigError(f"{where}: use_rope_layers turns RoPE off on some layers, which memra does not support")

    # Sliding layers may differ in head count (and, in principle, KV heads / head_dim).
    other = get("attention_other_setting", dict, {})
    H_swa = alias(("num_sliding_attention_heads",), int, other.get("num_attention_heads", H))
    if "num_attention_heads" in other and other["num_attention_heads"] != H_swa:
        raise ConfigError(f"{where}: contradictory values num_sliding_attention_heads={H_swa} and "
                          f"attention_other_setting.num_attention_heads={other['num_attention_heads']}")
    KV_swa = get("num_attention_groups", int, KV, src=other)
    hd_swa = get("head_dim", int, hd, src=other)
    for key, v in (("num_sliding_attention_heads", H_swa), ("attention_other_setting.num_attention_groups", KV_swa),
                   ("attention_other_setting.head_dim", hd_swa)):
        positive(key, v)
    for key, h, kv in (("num_attention_heads", H, KV), ("num_sliding_attention_heads", H_swa, KV_swa)):
        if h % kv:
            raise ConfigError(f"{where}: {key} = {h} is not a multiple of the KV head count {kv}")

    def per_layer(key: str, mtp_key: str | None, typ: type | tuple, default: Any = _MISSING) -> list | None:
        """A per-layer list of n or n + m entries (hub lists carry the MTP layers' entries last)."""
        v = get(key, list, None if default is not _MISSING else _MISSING)
        if v is None:
            return None
        for i, x in enumerate(v):
            if x is not None and (not isinstance(x, typ) or isinstance(x, bool)):
                raise ConfigError(f"{where}: {key}[{i}] = {x!r} has the wrong type (expected {_tname(typ)})")
        if len(v) == total:
            return list(v)
        if len(v) == n:
            extra = get(mtp_key, list, None) if mtp_key else None
            if extra is not None:
                if len(extra) != m:
                    raise ConfigError(f"{where}: {mtp_key} has {len(extra)} entries, expected "
                                      f"num_nextn_predict_layers = {m}")
                return list(v) + list(extra)
            return list(v) + [_MISSING] * m
        raise ConfigError(f"{where}: {key} has {len(v)} entries, expected num_hidden_layers = {n}"
                          + (f" or num_hidden_layers + num_nextn_predict_layers = {total}" if m else ""))

    types = per_layer("layer_types", "mtp_layer_types", str)
    for i, t in enumerate(types):
        if t is _MISSING:
            raise ConfigError(f"{where}: layer_types has {n} entries but num_nextn_predict_layers = {m}: the MTP "
                              f"layers' types are missing (expected {total} entries, or mtp_layer_types)")
        if t not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"{where}: layer_types[{i}] = {t!r} (supported: full_attention, sliding_attention)")
    window = None
    if "sliding_attention" in types:
        window = positive("sliding_window", get("sliding_window"))

    # MLP kind per layer: mlp_layer_types (+ mtp_mlp_layer_types) or moe_layers_enum.
    if c.get("mlp_layer_types") is not None:
        kinds = per_layer("mlp_layer_types", "mtp_mlp_layer_types", str)
        for i, k in enumerate(kinds):
            if k is _MISSING:
                raise ConfigError(f"{where}: mlp_layer_types has {n} entries but the MTP layers' kinds are "
                                  "missing (mtp_mlp_layer_types)")
            if k not in ("dense", "sparse"):
                raise ConfigError(f"{where}: mlp_layer_types[{i}] = {k!r} (supported: dense, sparse)")
        moe_set = {i for i, k in enumerate(kinds) if k == "sparse"}
    elif c.get("moe_layers_enum") is not None:
        raw = c["moe_layers_enum"]
        items = raw.split(",") if isinstance(raw, str) else raw
        try:
            moe_set = {int(str(x).strip()) for x in items if str(x).strip()}
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: moe_layers_enum = {raw!r} is not a list of layer indices") from None
        bad = sorted(i for i in moe_set if not 0 <= i < total)
        if bad:
            raise ConfigError(f"{where}: moe_layers_enum names layer {bad[0]}, outside [0, {total})")
    else:
        raise ConfigError(f"{where}: required key 'moe_layers_enum' (or 'mlp_layer_types') is missing")

    moe = None
    if moe_set:
        moe = MoEConfig(
            num_experts=positive("moe_num_experts",
                                 alias(("n_routed_experts", "moe_num_experts", "num_local_experts"))),
            top_k=positive("moe_top_k", alias(("num_experts_per_tok", "moe_top_k"))),
            expert_intermediate_size=positive("moe_intermediate_size", get("moe_intermediate_size")),
            shared_intermediate_size=alias(("share_expert_dim", "share_expert_dims")),
            routed_scaling_factor=float(get("moe_router_scaling_factor", (int, float))),
            router_bias=bool(get("use_moe_router_bias", bool, True)),
        )
        if moe.top_k > moe.num_experts:
            raise ConfigError(f"{where}: moe_top_k = {moe.top_k} exceeds moe_num_experts = {moe.num_experts}")
        if moe.shared_intermediate_size < 0:
            raise ConfigError(f"{where}: share_expert_dim = {moe.shared_intermediate_size} must be >= 0")

    rope = _step35_rope(c, where, types, per_layer, get)

    def limits(key: str) -> list[float | None]:
        v = per_layer(key, None, (int, float), None)
        if v is None:
            return [None] * total
        out = []
        for i, x in enumerate(v):
            if x is _MISSING or x is None or x == 0:
                out.append(None)  # transformers' normalised config drops the MTP entries: no clamp known
            elif x < 0:
                raise ConfigError(f"{where}: {key}[{i}] = {x} must be >= 0 (0 or null: no clamp)")
            else:
                out.append(float(x))
        return out

    lim, lim_shared = limits("swiglu_limits"), limits("swiglu_limits_shared")
    layers = []
    for i in range(total):
        full = types[i] == "full_attention"
        heads, kv, d = (H, KV, hd) if full else (H_swa, KV_swa, hd_swa)
        theta, factor, scaling = rope[i]
        rot = int(d * factor)
        if rot <= 0 or rot > d or rot % 2:
            raise ConfigError(f"{where}: layer {i}: partial rotary factor {factor} gives {rot} rotary dims of "
                              f"head_dim {d} (must be even, in (0, head_dim])")
        layers.append(LayerConfig(
            attention="full" if full else "sliding", num_heads=heads, num_kv_heads=kv, head_dim=d,
            sliding_window=None if full else window, rope_theta=theta, rotary_dim=rot, rope_scaling=scaling,
            mlp="moe" if i in moe_set else "dense", swiglu_limit=lim[i], swiglu_limit_shared=lim_shared[i]))

    scalar = get("query_pre_attn_scalar", (int, float), hd)
    if hd_swa != hd and "query_pre_attn_scalar" not in c:
        scalar = None  # per-layer head_dim ** -0.5
    eos = get("eos_token_id", (int, list), None)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
        raise ConfigError(f"{where}: eos_token_id = {eos!r} must be an int or a list of ints")
    name = c.get("_name_or_path") or ""
    return ModelConfig(
        arch="step35",
        vocab_size=V,
        hidden_size=D,
        intermediate_size=positive("intermediate_size", get("intermediate_size")),
        layers=layers[:n],
        rms_norm_eps=eps,
        hidden_act="silu",
        qk_norm=True,
        attn_scale=None if scalar is None else float(scalar) ** -0.5,
        tie_word_embeddings=bool(get("tie_word_embeddings", bool, False)),
        max_position_embeddings=positive("max_position_embeddings", get("max_position_embeddings")),
        bos_token_id=get("bos_token_id", int, None),
        eos_token_ids=eos_ids,
        name=str(name),
        attn_head_gate=True,
        moe=moe,
        mtp_layers=layers[n:],
    )


def _step35_rope(c, where, types, per_layer, get) -> list[tuple[float, float, RopeScaling | None]]:
    """(theta, partial rotary factor, scaling) per layer, from ``rope_parameters`` (per layer type,
    transformers' form) or from ``rope_theta`` / ``partial_rotary_factors`` / ``rope_scaling`` /
    ``yarn_only_types`` (hub form; scaling on full-attention layers only unless yarn_only_types says
    otherwise, as transformers applies ``rope_scaling`` to ``full_attention`` only)."""

    def scaling_from(d: Mapping, key: str) -> RopeScaling | None:
        kind = d.get("rope_type", d.get("type", "default"))
        if kind in (None, "default"):
            return None
        if kind != "llama3":
            raise ConfigError(f"{where}: {key} rope_type {kind!r} is not supported (supported: default, llama3)")
        try:
            return RopeScaling("llama3", float(d["factor"]), float(d["low_freq_factor"]), float(d["high_freq_factor"]),
                               int(d["original_max_position_embeddings"]))
        except KeyError as e:
            raise ConfigError(f"{where}: {key} (llama3) lacks {e.args[0]!r}") from None
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {key} has a non-numeric llama3 parameter: {dict(d)!r}") from None

    rp = c.get("rope_parameters")
    if isinstance(rp, Mapping) and rp and all(isinstance(rp.get(t), Mapping) for t in set(types)):
        out = []
        for t in types:
            d = rp[t]
            if not isinstance(d.get("rope_theta"), (int, float)):
                raise ConfigError(f"{where}: rope_parameters[{t!r}] lacks a numeric 'rope_theta'")
            out.append((float(d["rope_theta"]), float(d.get("partial_rotary_factor", 1.0)),
                        scaling_from(d, f"rope_parameters[{t!r}]")))
        return out
    if rp is not None and not ("rope_theta" in c):
        raise ConfigError(f"{where}: rope_parameters = {rp!r} does not give parameters for every layer type "
                          f"{sorted(set(types))} and there is no rope_theta")
    raw = c.get("rope_theta")
    if raw is None:
        raise ConfigError(f"{where}: required key 'rope_theta' (or 'rope_parameters') is missing")
    if isinstance(raw, list):
        thetas = per_layer("rope_theta", None, (int, float))
    elif isinstance(raw, (int, float)) and not isinstance(raw, bool):
        thetas = [raw] * len(types)
    else:
        raise ConfigError(f"{where}: rope_theta = {raw!r} must be a number or a per-layer list")
    factors = per_layer("partial_rotary_factors", None, (int, float), None) or [1.0] * len(types)
    scaling_dict = get("rope_scaling", dict, None)
    scaling = scaling_from(scaling_dict, "rope_scaling") if scaling_dict else None
    scaled_types = get("yarn_only_types", list, ["full_attention"])
    out = []
    for i, t in enumerate(types):
        if thetas[i] is _MISSING or factors[i] is _MISSING:
            key = "rope_theta" if thetas[i] is _MISSING else "partial_rotary_factors"
            raise ConfigError(f"{where}: {key} has no entry for MTP layer {i}")
        out.append((float(thetas[i]), float(factors[i]), scaling if t in scaled_types else None))
    return out


def _step35_from_gguf(meta: Mapping[str, Any], tensor_names: set[str], where: str) -> ModelConfig:
    """Step-3.5 config from GGUF metadata (arch ``step35``; see :meth:`ModelConfig.from_gguf`).

    Keys (all under ``step35.``; names from shared/STEP35.md "GGUF", **verify against
    llama.cpp's source**):

    * scalars ``block_count`` (decoder layers **plus** the ``nextn_predict_layers`` MTP
      layers, which are stored last as ``blk.{n..n+m-1}``: memra's choice, following
      llama.cpp's GLM-4.5 / DeepSeek nextn convention), ``embedding_length``,
      ``feed_forward_length`` (dense MLP), ``context_length``, ``attention.key_length``
      (head_dim; default embedding_length / head_count[0]), ``attention.value_length``,
      ``attention.layer_norm_rms_epsilon``, ``attention.sliding_window``,
      ``rope.freq_base`` (full layers), ``rope.freq_base_swa`` (sliding layers),
      ``rope.dimension_count`` / ``rope.dimension_count_swa``: see "Rotary widths" below,
      ``expert_count``, ``expert_used_count``,
      ``expert_feed_forward_length``, ``expert_shared_feed_forward_length``,
      ``expert_weights_scale`` (routed scaling, 3.0), ``expert_weights_norm`` (must be true),
      ``expert_gating_func`` (optional; 2 = sigmoid, the only one accepted),
      ``leading_dense_block_count`` (decoder layers < it are dense, the rest MoE; MTP layers
      are dense), ``nextn_predict_layers``;
    * per-layer arrays of ``block_count`` entries: ``attention.head_count``,
      ``attention.head_count_kv`` (a scalar is accepted too), ``attention.sliding_window_pattern``
      (bool or int per layer, true/1 = sliding: memra's choice of polarity),
      ``swiglu_clamp_exp`` / ``swiglu_clamp_shexp`` (0 = no clamp).

    Rotary widths, as llama.cpp of 2026-10 reads them (``src/llama-model.cpp`` sets
    ``n_rot_full = rope.dimension_count``, default ``attention.key_length``, and
    ``n_rot_swa = rope.dimension_count_swa``, default that same unhalved value; then
    ``src/models/step35.cpp`` halves ``n_rot_full`` in code, "full_attention layer only use
    half of the RoPE dimensions"). So the full-attention layers rotate
    ``rope.dimension_count / 2`` dims and the sliding layers ``rope.dimension_count_swa``
    (or ``rope.dimension_count``) dims. llama.cpp's converter writes neither key, which gives
    the checkpoint's 0.5 / 1.0 partial rotary factors; memra's writer writes both, in this
    same convention (:func:`step35_rope_dimension_counts`).

    llama3 RoPE scaling of the full layers is not in the metadata: it comes from the
    ``rope_freqs`` tensor (folded in by the model loader: llama.cpp stores one tensor of
    max-rotary-width / 2 factors and a full layer uses its first rotary_dim / 2). Norm
    weights are stored as 1 + w.

    Raises:
        ConfigError: a key missing, of the wrong type or length, or out of range.
    """
    p = "step35."

    get = _gguf_getter(meta, p, where, default_type=int)

    def positive(key: str, v):
        if v <= 0:
            raise ConfigError(f"{where}: {p}{key} = {v} must be positive")
        return v

    total = positive("block_count", get("block_count"))
    m = get("nextn_predict_layers", int, 0)
    if not 0 <= m < total:
        raise ConfigError(f"{where}: {p}nextn_predict_layers = {m} must be in [0, block_count = {total})")
    n = total - m

    def arr(key: str, typ: type | tuple, default: Any = _MISSING, scalar_ok: bool = False) -> list:
        full = p + key
        v = meta.get(full)
        if v is None:
            if default is _MISSING:
                raise ConfigError(f"{where}: required metadata key {full!r} (array of block_count = {total}) "
                                  "is missing")
            return [default] * total
        if scalar_ok and isinstance(v, (int, float)) and not isinstance(v, bool):
            return [v] * total
        if not isinstance(v, list) or len(v) != total:
            raise ConfigError(f"{where}: metadata key {full!r} must be an array of block_count = {total} entries, "
                              f"got {v if not isinstance(v, list) else f'{len(v)} entries'}")
        for i, x in enumerate(v):
            if not isinstance(x, typ):
                raise ConfigError(f"{where}: {full}[{i}] = {x!r} has the wrong type (expected {_tname(typ)})")
        return list(v)

    D = positive("embedding_length", get("embedding_length"))
    heads = arr("attention.head_count", int)
    kv_heads = arr("attention.head_count_kv", int, scalar_ok=True)
    swa = arr("attention.sliding_window_pattern", (bool, int))
    lim = arr("swiglu_clamp_exp", (int, float), 0.0)
    lim_sh = arr("swiglu_clamp_shexp", (int, float), 0.0)
    hd = positive("attention.key_length", get("attention.key_length", int, D // heads[0] if heads[0] else 0))
    if get("attention.value_length", int, hd) != hd:
        raise ConfigError(f"{where}: {p}attention.value_length differs from key_length (unsupported)")
    eps = positive("attention.layer_norm_rms_epsilon", float(get("attention.layer_norm_rms_epsilon", (int, float))))
    window = get("attention.sliding_window", int, None) if any(swa) else None
    if any(swa) and (window is None or window <= 0):
        raise ConfigError(f"{where}: {p}attention.sliding_window must be a positive int when any layer is sliding")
    theta = float(positive("rope.freq_base", get("rope.freq_base", (int, float))))
    theta_swa = float(positive("rope.freq_base_swa", get("rope.freq_base_swa", (int, float), theta)))
    # llama.cpp's step35 rotary convention (docstring, "Rotary widths"): the full layers rotate
    # half of rope.dimension_count; the sliding layers rope.dimension_count_swa, which
    # defaults to the *unhalved* rope.dimension_count.
    n_rot = get("rope.dimension_count", int, hd)
    rot_swa = get("rope.dimension_count_swa", int, n_rot)
    rot = n_rot // 2
    if n_rot <= 0 or n_rot % 4 or rot > hd:
        raise ConfigError(f"{where}: {p}rope.dimension_count = {n_rot} must be a positive multiple of 4 with "
                          f"half of it (the rotary dims of the full-attention layers, llama.cpp's step35 "
                          f"convention) at most head_dim = {hd}")
    if rot_swa <= 0 or rot_swa % 2 or rot_swa > hd:
        raise ConfigError(f"{where}: {p}rope.dimension_count_swa = {rot_swa} (the sliding layers' rotary dims"
                          + ("" if p + "rope.dimension_count_swa" in meta else f", from {p}rope.dimension_count")
                          + f") must be even and in (0, head_dim = {hd}]")
    for i, (h, kv) in enumerate(zip(heads, kv_heads)):
        if h <= 0 or kv <= 0 or h % kv:
            raise ConfigError(f"{where}: layer {i}: head_count {h} must be a positive multiple of "
                              f"head_count_kv {kv}")
    for key, v in (("swiglu_clamp_exp", lim), ("swiglu_clamp_shexp", lim_sh)):
        bad = [i for i, x in enumerate(v) if x < 0]
        if bad:
            raise ConfigError(f"{where}: {p}{key}[{bad[0]}] = {v[bad[0]]} must be >= 0 (0: no clamp)")

    moe = None
    dense_n = get("leading_dense_block_count", int, n)
    if not 0 <= dense_n <= n:
        raise ConfigError(f"{where}: {p}leading_dense_block_count = {dense_n} must be in [0, {n}]")
    if dense_n < n:
        if not get("expert_weights_norm", bool, True):
            raise ConfigError(f"{where}: {p}expert_weights_norm = false is not supported (Step-3.5 renormalises "
                              "the top-k weights)")
        gating = get("expert_gating_func", int, 2)
        if gating != 2:
            raise ConfigError(f"{where}: {p}expert_gating_func = {gating} is not supported (2 = sigmoid)")
        E = positive("expert_count", get("expert_count"))
        moe = MoEConfig(
            num_experts=E,
            top_k=positive("expert_used_count", get("expert_used_count")),
            expert_intermediate_size=positive("expert_feed_forward_length", get("expert_feed_forward_length")),
            shared_intermediate_size=get("expert_shared_feed_forward_length", int, 0),
            routed_scaling_factor=float(get("expert_weights_scale", (int, float), 1.0)),
            router_bias=any(f"blk.{i}.exp_probs_b.bias" in tensor_names for i in range(dense_n, n)),
        )
        if moe.top_k > E:
            raise ConfigError(f"{where}: {p}expert_used_count = {moe.top_k} exceeds expert_count = {E}")
    layers = []
    for i in range(total):
        sliding = bool(swa[i])
        layers.append(LayerConfig(
            attention="sliding" if sliding else "full", num_heads=heads[i], num_kv_heads=kv_heads[i], head_dim=hd,
            sliding_window=window if sliding else None, rope_theta=theta_swa if sliding else theta,
            rotary_dim=rot_swa if sliding else rot, rope_scaling=None,
            mlp="moe" if dense_n <= i < n else "dense",
            swiglu_limit=float(lim[i]) or None, swiglu_limit_shared=float(lim_sh[i]) or None))
    vocab = _gguf_vocab_size(meta, p, where)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch="step35", vocab_size=int(vocab), hidden_size=D,
        intermediate_size=positive("feed_forward_length", get("feed_forward_length")),
        layers=layers[:n], rms_norm_eps=eps, hidden_act="silu", qk_norm=True, attn_scale=None,
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=get("context_length", int, 4096),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=[int(eos)] if eos is not None else [],
        name=str(meta.get("general.name", "")), attn_head_gate=True, moe=moe, mtp_layers=layers[n:])



def step35_rope_dimension_counts(layers: list[LayerConfig]) -> dict[str, int]:
    """The ``step35.rope.dimension_count`` / ``_swa`` values that make llama.cpp (and memra's
    reader, :func:`_step35_from_gguf`) give these layers their rotary widths:
    ``dimension_count`` = 2 x the full layers' width (llama.cpp halves it for them),
    ``dimension_count_swa`` = the sliding layers' width.

    Raises:
        ConfigError: the full (or the sliding) layers do not share one rotary width.
    """
    def one(kind: str) -> int | None:
        widths = {lc.rotary_dim for lc in layers if lc.attention == kind}
        if len(widths) > 1:
            raise ConfigError(f"{kind} layers have different rotary widths {sorted(widths)}: a step35 GGUF "
                              "holds one per attention type")
        return widths.pop() if widths else None

    full, swa = one("full"), one("sliding")
    full = full if full is not None else swa
    return {"rope.dimension_count": 2 * full, "rope.dimension_count_swa": swa if swa is not None else full}


def _gguf_getter(meta: Mapping[str, Any], prefix: str, where: str, default_type: type | tuple):
    """``get(key, typ=default_type, default=required)`` over GGUF metadata keys ``prefix + key``.

    Raises ConfigError naming the key when it is missing (and required) or of the wrong
    type (a bool never counts as a number unless ``bool`` is asked for).
    """

    def get(key: str, typ: type | tuple = default_type, default: Any = _MISSING) -> Any:
        full = prefix + key
        if full not in meta:
            if default is _MISSING:
                raise ConfigError(f"{where}: required metadata key {full!r} is missing")
            return default
        v = meta[full]
        allowed = typ if isinstance(typ, tuple) else (typ,)
        if not isinstance(v, typ) or isinstance(v, bool) and bool not in allowed:
            raise ConfigError(f"{where}: metadata key {full!r} = {v!r} has the wrong type (expected {_tname(typ)})")
        return v

    return get


def _gguf_vocab_size(meta: Mapping[str, Any], prefix: str, where: str) -> int:
    """``{prefix}vocab_size``, else the length of ``tokenizer.ggml.tokens``.

    Raises:
        ConfigError: neither is present.
    """
    vocab = meta.get(prefix + "vocab_size")
    if vocab is None:
        toks = meta.get("tokenizer.ggml.tokens")
        if not isinstance(toks, list):
            raise ConfigError(f"{where}: neither {prefix}vocab_size nor tokenizer.ggml.tokens is present")
        vocab = len(toks)
    return int(vocab)

def _tname(typ: type | tuple) -> str:
    return " or ".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))


_MISSING = object()
_GGUF_ARCHS = {"llama", "qwen2", "gemma3", "step35"}
