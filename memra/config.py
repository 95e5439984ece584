"""The normalised model description.

Every checkpoint format (GGUF metadata today; HF ``config.json`` for the flagship) is
turned into one :class:`ModelConfig`. Quantities that can differ between layers
(attention kind, head counts, RoPE) live in a per-layer :class:`LayerConfig`, so models
with heterogeneous layers (Gemma 3 local/global, Step-3.5 sliding/full with different
head counts) need no special cases in the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RopeScaling", "LayerConfig", "ModelConfig", "ConfigError"]


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


@dataclass
class ModelConfig:
    """Normalised description of a decoder-only language model.

    Attributes:
        arch: architecture name in memra's model registry (``llama``, ``qwen2``, ``gemma3``).
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
        }

    # ------------------------------------------------------------------ GGUF
    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str], where: str = "") -> "ModelConfig":
        """Build the config from GGUF metadata (llama.cpp's ``{arch}.*`` keys).

        Args:
            meta: metadata as returned by :func:`memra.io.gguf.read_metadata`.
            tensor_names: names of the tensors in the file (decides tied output, biases).
            where: file name for error messages.

        Raises:
            ConfigError: unsupported architecture, or a required key missing / of the wrong type.

        Source: llama.cpp ``llama-model.cpp`` (``llm_load_hparams``) and ``gguf-py``
        constants for key names; Gemma 3 layer pattern as hard-coded by llama.cpp
        (every 6th layer global, sliding window from metadata).
        """
        arch = meta.get("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise ConfigError(
                f"{where}: architecture {arch!r} is not supported (supported: {', '.join(sorted(_GGUF_ARCHS))})"
            )

        def get(key: str, typ: type | tuple = (int, float), default: Any = _MISSING) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                if default is _MISSING:
                    raise ConfigError(f"{where}: required metadata key {full!r} is missing")
                return default
            v = meta[full]
            if not isinstance(v, typ) or isinstance(v, bool) and typ is not bool:
                raise ConfigError(f"{where}: metadata key {full!r} = {v!r} has the wrong type")
            return v

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

        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            toks = meta.get("tokenizer.ggml.tokens")
            if not isinstance(toks, list):
                raise ConfigError(f"{where}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
            vocab = len(toks)
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


_MISSING = object()
_GGUF_ARCHS = {"llama", "qwen2", "gemma3"}
