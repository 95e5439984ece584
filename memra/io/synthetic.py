"""Deterministic random Step-3.5 checkpoints, on disk in the real formats or straight in memory.

``memra convert synth --geometry {tiny,full,<json>} --format FMT --seed N --out PATH`` writes:

==============  ================================================================================
format          what is written
==============  ================================================================================
``hf-bf16``     HF directory: hub-format ``config.json`` + bf16 safetensors (stacked experts).
``hf-fp8``      as hf-bf16, routed experts FP8 E4M3 + fp32 ``weight_scale_inv`` per 128x128 tile
                (``quantization_config``: fp8, ``weight_block_size`` [128, 128]), the rest bf16.
``gguf-q8_0``   llama.cpp-style ``step35`` GGUF: routed expert banks Q8_0, norms / router bias /
``gguf-nvfp4``  ``rope_freqs`` f32 (norms stored as 1 + w), every other weight bf16; a minimal
                gpt2-style tokenizer (byte alphabet + merges) in the metadata.
``gguf-q4_k``   as gguf-q8_0 with Q4_K expert banks (memra's simple min/max Q4_K encoder,
                :func:`memra.quant.dequant.quantize_q4_k`; needs hidden and expert_inter
                multiples of 256, so not the ``tiny`` geometry as is).
==============  ================================================================================

Weights (all derived from the seed and the tensor's hub name, so any tensor can be made
alone, on any device): embeddings N(0, 1); linear weights N(0, 1 / in_features); zero-centred
norm weights w ~ U(-0.3, 0.3) (multiplier 1 + w); router weights N(0, 1 / hidden); router
bias skewed so a few experts are hot and the rest form a long tail (a per-layer random
permutation of ``HOT * exp(-rank / (DECAY * E)) + N(0, 0.05)``: at 288 experts top-8 the hottest
expert takes ~4% of the (token, expert) pairs, ~11x the mean). Every value is
bf16-representable, so bf16 files and the fp32 reference hold the same numbers. With these
scales the residual stream's RMS stays O(1..10) through the layers (tests check it).

:func:`build_model` makes the same model without a file (``device`` chooses where the random
numbers are drawn: CPU and CUDA generators give different streams, so a model built on the
GPU matches files written on the CPU only in distribution).

Source: shared/STEP35.md (geometry, layouts), shared/FORMATS.md (formats).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["GEOMETRIES", "FORMATS", "SynthError", "load_geometry", "cut_geometry", "hub_config", "model_config", "tensor_shapes",
           "synth_tensor", "synth_tensors", "write_synthetic", "build_model", "gguf_tokenizer_metadata",
           "MemoryCheckpoint"]


class SynthError(ValueError):
    """Bad geometry, unknown or unsupported format."""


FORMATS = ("hf-bf16", "hf-fp8", "gguf-q8_0", "gguf-nvfp4", "gguf-q4_k")

#: Geometries. ``full`` is the official Step-3.5-Flash checkpoint (STEP35.md "Geometry");
#: ``tiny`` keeps every feature (dense + MoE layers, sliding + full attention with different
#: head counts, partial llama3-scaled RoPE, clamps, MTP) at CPU-test size, with every
#: dimension a multiple of 64 so Q8_0 and NVFP4 blocks fit.
GEOMETRIES: dict[str, dict[str, Any]] = {
    "full": dict(hidden=4096, layers=45, mtp_layers=3, vocab=128896, heads_full=64, heads_swa=96, kv_heads=8,
                 head_dim=128, window=512, full_every=4, dense_layers=3, dense_inter=11264, experts=288, top_k=8,
                 expert_inter=1280, shared_inter=1280, routed_scale=3.0, theta_full=5e6, theta_swa=1e4,
                 partial_full=0.5, llama3=dict(factor=2.0, low_freq_factor=1.0, high_freq_factor=32.0,
                                               original_max_position_embeddings=131072),
                 clamp_layers=[43, 44], clamp_exp=7.0, clamp_shexp=16.0, eps=1e-5, context=262144,
                 bos=0, eos=[1, 2, 128007]),
    "tiny": dict(hidden=256, layers=6, mtp_layers=2, vocab=512, heads_full=4, heads_swa=8, kv_heads=2,
                 head_dim=64, window=8, full_every=4, dense_layers=3, dense_inter=384, experts=16, top_k=4,
                 expert_inter=128, shared_inter=128, routed_scale=3.0, theta_full=5e6, theta_swa=1e4,
                 partial_full=0.5, llama3=dict(factor=2.0, low_freq_factor=1.0, high_freq_factor=32.0,
                                               original_max_position_embeddings=64),
                 clamp_layers=[4, 5], clamp_exp=1.0, clamp_shexp=2.0, eps=1e-5, context=4096, bos=0, eos=[1, 2]),
}

HOT = 0.2  # router bias of the hottest expert (sigmoid scores are in (0, 1))
DECAY = 0.25  # bias falls by e per DECAY * num_experts ranks: a few hot experts, a long tail


def load_geometry(spec: str | dict) -> dict[str, Any]:
    """A geometry dict from a name in :data:`GEOMETRIES`, a JSON file path, or a dict.

    A JSON file / dict may give only some keys; the rest come from ``tiny``.

    Raises:
        SynthError: unknown name, unreadable file, unknown keys or inconsistent values.
    """
    if isinstance(spec, dict):
        over = spec
    elif spec in GEOMETRIES:
        return dict(GEOMETRIES[spec])
    else:
        p = Path(spec)
        if not p.is_file():
            raise SynthError(f"geometry {spec!r} is neither one of {sorted(GEOMETRIES)} nor a JSON file")
        try:
            over = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise SynthError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(over, dict):
            raise SynthError(f"{p}: expected a JSON object of geometry keys")
    unknown = set(over) - set(GEOMETRIES["tiny"]) - {"tokenizer"}  # "tokenizer": from with_vocabulary
    if unknown:
        raise SynthError(f"unknown geometry keys {sorted(unknown)} (known: {sorted(GEOMETRIES['tiny'])})")
    g = dict(GEOMETRIES["tiny"]) | dict(over)
    if not (isinstance(g["layers"], int) and g["layers"] >= 1):
        raise SynthError(f"layers = {g['layers']!r} must be an integer >= 1")
    if not (isinstance(g["mtp_layers"], int) and g["mtp_layers"] >= 0):
        raise SynthError(f"mtp_layers = {g['mtp_layers']!r} must be an integer >= 0")
    if not 0 <= g["dense_layers"] <= g["layers"]:
        raise SynthError(f"dense_layers = {g['dense_layers']} must be in [0, layers = {g['layers']}]")
    if g["top_k"] > g["experts"]:
        raise SynthError(f"top_k = {g['top_k']} exceeds experts = {g['experts']}")
    return g


def cut_geometry(g: dict, layers: int | None = None, dense_layers: int | None = None,
                 mtp_layers: int | None = None) -> dict[str, Any]:
    """Geometry ``g`` cut to ``layers`` decoder layers (``dense_layers`` of them leading dense ones,
    ``mtp_layers`` MTP layers; None keeps ``g``'s value). The SwiGLU-clamped layers keep their
    place at the end of the decoder: ``full``'s clamps on its last two layers (43, 44) become the
    cut's last two, so a cut still runs a clamped layer.

    Raises: SynthError naming the flag values that contradict each other."""
    new = dict(g)
    for k, v in (("layers", layers), ("dense_layers", dense_layers), ("mtp_layers", mtp_layers)):
        if v is not None:
            new[k] = v
    if layers is not None and dense_layers is None and g["dense_layers"] > layers:
        raise SynthError(f"--layers {layers} is fewer than the geometry's {g['dense_layers']} leading dense layers: "
                         f"pass --dense-layers N with N <= {layers}")
    shift = new["layers"] - g["layers"]
    new["clamp_layers"] = [c + shift for c in g["clamp_layers"] if 0 <= c + shift < new["layers"]]
    return load_geometry(new)


def _types(g: dict) -> list[str]:
    n, m = g["layers"], g["mtp_layers"]
    return ["full_attention" if i % g["full_every"] == 0 else "sliding_attention" for i in range(n)] \
        + ["sliding_attention"] * m


def hub_config(g: dict, fp8: bool = False) -> dict[str, Any]:
    """The hub-format ``config.json`` of geometry ``g`` (per-layer lists carry the MTP entries last).

    ``fp8`` adds ``quantization_config`` (fp8, 128x128 blocks). Source: STEP35.md
    "Checkpoint layouts" (hub keys).
    """
    n, m = g["layers"], g["mtp_layers"]
    types = _types(g)
    cfg = {
        "architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5",
        "hidden_size": g["hidden"], "intermediate_size": g["dense_inter"], "num_hidden_layers": n,
        "vocab_size": g["vocab"], "num_attention_heads": g["heads_full"], "num_attention_groups": g["kv_heads"],
        "head_dim": g["head_dim"],
        "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": g["heads_swa"],
                                    "num_attention_groups": g["kv_heads"], "head_dim": g["head_dim"]},
        "layer_types": types, "sliding_window": g["window"],
        "rope_theta": [g["theta_full"] if t == "full_attention" else g["theta_swa"] for t in types],
        "partial_rotary_factors": [g["partial_full"] if t == "full_attention" else 1.0 for t in types],
        "rope_scaling": {"rope_type": "llama3", **g["llama3"]}, "yarn_only_types": ["full_attention"],
        "use_moe": True, "moe_num_experts": g["experts"], "moe_top_k": g["top_k"],
        "moe_intermediate_size": g["expert_inter"], "share_expert_dim": g["shared_inter"],
        "moe_layers_enum": ",".join(str(i) for i in range(g["dense_layers"], n)),
        "moe_router_activation": "sigmoid", "moe_router_scaling_factor": g["routed_scale"],
        "use_moe_router_bias": True, "need_fp32_gate": True, "norm_expert_weight": True,
        "use_head_wise_attn_gate": True, "use_qk_norm": True, "zero_centered": True, "att_impl_type": "GQA",
        "swiglu_limits": [g["clamp_exp"] if i in g["clamp_layers"] else 0.0 for i in range(n + m)],
        "swiglu_limits_shared": [g["clamp_shexp"] if i in g["clamp_layers"] else 0.0 for i in range(n + m)],
        "num_nextn_predict_layers": m, "rms_norm_eps": g["eps"], "max_position_embeddings": g["context"],
        "tie_word_embeddings": False, "bos_token_id": g["bos"], "eos_token_id": list(g["eos"]),
        "torch_dtype": "bfloat16",
    }
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    return cfg


def model_config(g: dict):
    """:class:`memra.config.ModelConfig` of geometry ``g`` (through :func:`hub_config`)."""
    from ..config import ModelConfig

    return ModelConfig.from_hf_config(hub_config(g), where="synthetic geometry")


def tensor_shapes(g: dict) -> dict[str, tuple[int, ...]]:
    """Hub name -> torch-order shape of every tensor of geometry ``g`` (stacked experts)."""
    D, V, Dh, KV = g["hidden"], g["vocab"], g["head_dim"], g["kv_heads"]
    E, Ie, Is, Id = g["experts"], g["expert_inter"], g["shared_inter"], g["dense_inter"]
    n = g["layers"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,),
                                       "lm_head.weight": (V, D)}
    for i, t in enumerate(_types(g)):
        p = f"model.layers.{i}."
        H = g["heads_full"] if t == "full_attention" else g["heads_swa"]
        out |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                p + "self_attn.q_proj.weight": (H * Dh, D), p + "self_attn.k_proj.weight": (KV * Dh, D),
                p + "self_attn.v_proj.weight": (KV * Dh, D), p + "self_attn.g_proj.weight": (H, D),
                p + "self_attn.o_proj.weight": (D, H * Dh), p + "self_attn.q_norm.weight": (Dh,),
                p + "self_attn.k_norm.weight": (Dh,)}
        if g["dense_layers"] <= i < n:
            out |= {p + "moe.gate.weight": (E, D), p + "moe.router_bias": (E,),
                    p + "moe.gate_proj.weight": (E, Ie, D), p + "moe.up_proj.weight": (E, Ie, D),
                    p + "moe.down_proj.weight": (E, D, Ie)}
            if Is:
                out |= {p + "share_expert.gate_proj.weight": (Is, D), p + "share_expert.up_proj.weight": (Is, D),
                        p + "share_expert.down_proj.weight": (D, Is)}
        else:
            out |= {p + "mlp.gate_proj.weight": (Id, D), p + "mlp.up_proj.weight": (Id, D),
                    p + "mlp.down_proj.weight": (D, Id)}
        if i >= n:
            out |= {p + "enorm.weight": (D,), p + "hnorm.weight": (D,), p + "eh_proj.weight": (D, 2 * D),
                    p + "transformer.shared_head.norm.weight": (D,),
                    p + "transformer.shared_head.output.weight": (V, D)}
    return out


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def synth_tensor(name: str, shape: tuple[int, ...], seed: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The random bf16 tensor named ``name`` (hub name) of ``shape``; see the module docstring for
    the distributions. Deterministic in (seed, name, device type); never all zeros."""
    dev = torch.device(device)
    gen = _generator(seed, name, dev)
    if name.endswith("norm.weight"):
        t = (torch.rand(shape, generator=gen, device=dev) - 0.5) * 0.6
    elif name.endswith("moe.router_bias"):
        (E,) = shape
        rank = torch.randperm(E, generator=gen, device=dev).float()
        t = HOT * torch.exp(-rank / max(E * DECAY, 1.0)) + 0.05 * torch.randn(E, generator=gen, device=dev)
    elif name == "model.embed_tokens.weight":
        t = torch.randn(shape, generator=gen, device=dev)
    else:  # linear weights [.., out, in], router included
        t = torch.randn(shape, generator=gen, device=dev) * shape[-1] ** -0.5
    return t.to(torch.bfloat16)


def synth_tensors(g: dict, seed: int, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(hub name, bf16 tensor) for every tensor of geometry ``g``, one at a time."""
    for name, shape in tensor_shapes(g).items():
        yield name, synth_tensor(name, shape, seed, device)


def _is_routed(name: str) -> bool:
    return ".moe." in name and name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight"))


def rope_freq_factors(g: dict) -> torch.Tensor:
    """llama.cpp ``rope_freqs``: fp32 [widest rotary width / 2] (over every layer, MTP included:
    head_dim when any layer slides) divisors of the full layers' inverse frequencies: llama3 scaling
    computed over the rot = head_dim * partial_full rotary dims, padded with 1.0 past rot / 2,
    as llama.cpp's converter writes it (``conversion/step3.py``)."""
    from ..config import RopeScaling
    from ..layers.rope import inv_frequencies

    l3 = g["llama3"]
    sc = RopeScaling("llama3", l3["factor"], l3["low_freq_factor"], l3["high_freq_factor"],
                     l3["original_max_position_embeddings"])
    rot = int(g["head_dim"] * g["partial_full"])
    f = inv_frequencies(g["theta_full"], rot) / inv_frequencies(g["theta_full"], rot, sc)
    widest = max(rot if t == "full_attention" else g["head_dim"] for t in _types(g))
    return torch.cat([f, torch.ones(widest // 2 - rot // 2, dtype=f.dtype)])


# ----------------------------------------------------------------------------- tokenizer
def vocabulary_metadata(g: dict) -> dict[str, Any]:
    """The GGUF ``tokenizer.*`` metadata of geometry ``g``: the vocabulary taken from a real
    model by :func:`with_vocabulary`, else memra's tiny byte-level BPE
    (:func:`gguf_tokenizer_metadata`)."""
    return g.get("tokenizer") or gguf_tokenizer_metadata(g["vocab"], g["bos"], g["eos"][0])


def with_vocabulary(g: dict, gguf_path: str | Path) -> dict[str, Any]:
    """Geometry ``g`` with the vocabulary of a real GGUF model (its ``tokenizer.*`` keys, size,
    bos and eos): e.g. smollm2-135m's, whose pre-tokenizer llama.cpp's converter recognises
    (it identifies BPE vocabularies by the hash of their tokenization of a test text, so no
    synthetic vocabulary can pass it).

    Raises:
        SynthError: the file has no usable vocabulary (no tokens, no bos or eos id).
    """
    from .gguf import read_metadata

    meta = {k: v for k, v in read_metadata(gguf_path).items() if k.startswith("tokenizer.")}
    tokens = meta.get("tokenizer.ggml.tokens")
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    if not isinstance(tokens, list) or not tokens or not isinstance(bos, int) or not isinstance(eos, int):
        raise SynthError(f"{gguf_path}: needs tokenizer.ggml.tokens and bos/eos token ids to lend its vocabulary")
    return dict(g, vocab=len(tokens), bos=bos, eos=[eos], tokenizer=meta)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order (the standard byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def gguf_tokenizer_metadata(vocab: int, bos: int = 0, eos: int = 1) -> dict[str, Any]:
    """A minimal valid gpt2-style (byte-level BPE) GGUF tokenizer of exactly ``vocab`` tokens.

    Tokens: 3 control tokens (``<s>``, ``</s>``, ``<|im_end|>``; bos/eos ids as given), the 256
    byte-alphabet characters, then merged tokens built from pairs of existing tokens (space-led
    letters, letter pairs, ...), each with its merge ``"a b"`` whose parts are tokens.

    Raises:
        SynthError: ``vocab`` < 259 or bos/eos out of range.
    """
    specials = ["<s>", "</s>", "<|im_end|>"]
    if vocab < len(specials) + 256:
        raise SynthError(f"vocab = {vocab} is too small for a byte-level vocabulary (needs >= 259)")
    if not (0 <= bos < 3 and 0 <= eos < 3):
        raise SynthError("bos / eos must be one of the 3 control tokens (ids 0..2)")
    alpha = _byte_alphabet()
    tokens = specials + alpha
    have = set(tokens)
    merges: list[str] = []
    sp = alpha[ord(" ")]  # 'Ġ'
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    base = [sp + c for c in letters]  # level 1: space + letter
    pairs = [(sp, c) for c in letters]
    pairs += [(a, b) for a in "etaoinshrdlucmfwypvbgkjqxz" for b in "etaoinshrdlucmfwypvbgkjqxz"]
    level = base
    while len(tokens) < vocab:
        for a, b in pairs:
            if len(tokens) >= vocab:
                break
            if a + b in have or a not in have or b not in have:
                continue
            tokens.append(a + b)
            have.add(a + b)
            merges.append(f"{a} {b}")
        pairs = [(x, c) for x in level for c in letters]  # next level: longer space-led words
        level = [x + c for x in level for c in letters]
    types = [3, 3, 3] + [1] * (vocab - 3)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": bos, "tokenizer.ggml.eos_token_id": eos,
            "tokenizer.ggml.add_bos_token": True}


# ----------------------------------------------------------------------------- writers
def _gguf_metadata(g: dict) -> dict[str, Any]:
    """``step35.*`` keys as :meth:`memra.config.ModelConfig.from_gguf` reads them (see its
    ``_step35_from_gguf`` docstring for memra's choices)."""
    n, m = g["layers"], g["mtp_layers"]
    types = _types(g)
    p = "step35."
    return {
        "general.name": "memra synthetic step35",
        p + "block_count": n + m, p + "context_length": g["context"], p + "embedding_length": g["hidden"],
        p + "feed_forward_length": g["dense_inter"],
        p + "attention.head_count": [g["heads_full"] if t == "full_attention" else g["heads_swa"] for t in types],
        p + "attention.head_count_kv": [g["kv_heads"]] * (n + m),
        p + "attention.key_length": g["head_dim"], p + "attention.value_length": g["head_dim"],
        p + "attention.layer_norm_rms_epsilon": float(g["eps"]),
        p + "attention.sliding_window": g["window"],
        p + "attention.sliding_window_pattern": [t == "sliding_attention" for t in types],
        p + "rope.freq_base": float(g["theta_full"]), p + "rope.freq_base_swa": float(g["theta_swa"]),
        # llama.cpp's step35 convention (memra.config._step35_from_gguf, "Rotary widths"): the
        # full layers rotate half of dimension_count, the sliding layers dimension_count_swa
        p + "rope.dimension_count": 2 * int(g["head_dim"] * g["partial_full"]),
        p + "rope.dimension_count_swa": g["head_dim"],
        p + "expert_count": g["experts"], p + "expert_used_count": g["top_k"],
        p + "expert_feed_forward_length": g["expert_inter"],
        p + "expert_shared_feed_forward_length": g["shared_inter"],
        p + "expert_weights_scale": float(g["routed_scale"]), p + "expert_weights_norm": True,
        p + "expert_gating_func": 2,
        p + "leading_dense_block_count": g["dense_layers"], p + "nextn_predict_layers": m,
        p + "swiglu_clamp_exp": [float(g["clamp_exp"]) if i in g["clamp_layers"] else 0.0 for i in range(n + m)],
        p + "swiglu_clamp_shexp": [float(g["clamp_shexp"]) if i in g["clamp_layers"] else 0.0
                                   for i in range(n + m)],
    } | vocabulary_metadata(g)


def _quantize_gguf(t: torch.Tensor, fmt: str, name: str):
    from ..quant.dequant import quantize_nvfp4, quantize_q4_k, quantize_q8_0
    from ..quant.tensor import QTensor
    from ..quant.types import QType

    qt, fn = {"gguf-q8_0": (QType.Q8_0, quantize_q8_0), "gguf-nvfp4": (QType.NVFP4, quantize_nvfp4),
              "gguf-q4_k": (QType.Q4_K, quantize_q4_k)}[fmt]
    raw = fn(t.float())
    return QTensor(name, qt, tuple(t.shape), raw.reshape(-1, raw.shape[-1]).contiguous())


def gguf_tensor(name: str, t: torch.Tensor, fmt: str):
    """(GGUF name, stored tensor) of hub tensor ``name`` in GGUF format ``fmt``: routed experts
    packed (QTensor), norms as fp32 1 + w, router bias fp32, everything else bf16."""
    from ..models.step3p5 import gguf_tensor_name, is_norm_weight

    gname = gguf_tensor_name(name)
    if gname is None:
        raise SynthError(f"tensor {name!r} has no step35 GGUF name")
    if _is_routed(name):
        return gname, _quantize_gguf(t, fmt, gname)
    if is_norm_weight(name):
        return gname, t.float() + 1.0
    if name.endswith("router_bias"):
        return gname, t.float()
    return gname, t.to(torch.bfloat16)


def write_synthetic(geometry: str | dict, fmt: str, seed: int, out: str | Path,
                    expert_codes: str = "quantized") -> Path:
    """Write a random Step-3.5 checkpoint of ``geometry`` in ``fmt`` (see :data:`FORMATS`) to ``out``.

    HF formats: ``out`` is a directory (created), one ``model.safetensors`` (+ index if over
    2 GiB: shards of about 2 GiB). GGUF formats: ``out`` is the file.
    ``expert_codes``: ``"quantized"`` (routed experts are the bf16 draws quantized to ``fmt``)
    or, for ``gguf-nvfp4`` only, ``"random"``: codes and scales drawn directly
    (:func:`random_nvfp4`; seconds instead of the quantizer's minutes per GB at full size).

    Returns:
        ``Path(out)``.
    Raises:
        SynthError: unknown format or geometry; expert dimensions (hidden, expert_inter) that
            are not whole blocks of the format (32 Q8_0, 64 NVFP4, 256 Q4_K).
    """
    if fmt not in FORMATS:
        raise SynthError(f"unknown format {fmt!r} (supported: {', '.join(FORMATS)})")
    if expert_codes not in ("quantized", "random") or (expert_codes == "random" and fmt != "gguf-nvfp4"):
        raise SynthError(f"expert_codes {expert_codes!r}: 'quantized', or 'random' with gguf-nvfp4 (got {fmt})")
    g = load_geometry(geometry)
    _check_blocks(g, fmt)
    out = Path(out)
    if fmt.startswith("hf-"):
        return _write_hf(g, fmt, seed, out)
    from ..models.step3p5 import gguf_tensor_name
    from .gguf_writer import write_gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    def make(item):
        name, shape = item
        if expert_codes == "random" and _is_routed(name):
            gname = gguf_tensor_name(name)
            return gname, random_nvfp4(gname, shape, seed)
        return gguf_tensor(name, synth_tensor(name, shape, seed), fmt)

    # each tensor has its own generator, so drawing them on several threads (torch releases the GIL)
    # gives the same file; a full-size file's draws take minutes on one thread
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        tensors = dict(pool.map(make, tensor_shapes(g).items()))
    tensors["rope_freqs.weight"] = rope_freq_factors(g)
    return write_gguf(out, "step35", _gguf_metadata(g), tensors)


_BLOCK = {"gguf-q8_0": 32, "gguf-nvfp4": 64, "gguf-q4_k": 256, "q8_0": 32, "nvfp4": 64, "q4_k": 256}


def _check_blocks(g: dict, fmt: str) -> None:
    b = _BLOCK.get(fmt)
    if b is None:
        return
    bad = [k for k in ("hidden", "expert_inter") if g[k] % b]
    if bad:
        raise SynthError(f"{fmt}: expert banks are quantized along hidden and expert_inter, which must be "
                         f"multiples of the {b}-weight block; {', '.join(f'{k} = {g[k]}' for k in bad)} "
                         f"are not (pass a geometry JSON with e.g. expert_inter = {b * -(-g['expert_inter'] // b)})")


def _write_hf(g: dict, fmt: str, seed: int, out: Path, shard_bytes: int = 2 << 30) -> Path:
    from safetensors.torch import save_file

    from ..quant.fp8 import quantize_fp8_block
    from .tokenizer import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hub_config(g, fp8=fmt == "hf-fp8"), indent=1))
    # the same vocabulary the GGUF formats carry, as tokenizer.json; tokenizer_config.json names
    # its class as the hub's files do (transformers' AutoTokenizer, and so llama.cpp's
    # converter, need it: a step3p5 config.json is no class transformers 4.x knows)
    meta = vocabulary_metadata(g)
    tok = Tokenizer.from_gguf_metadata(meta)
    tok.backend.save(str(out / "tokenizer.json"))
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.id_to_token(g["bos"]),
            "eos_token": tok.id_to_token(g["eos"][0]), "add_bos_token": tok.add_bos,
            "model_max_length": g["context"]}
    if tok.chat_template is not None:
        tcfg["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in synth_tensors(g, seed):
        if fmt == "hf-fp8" and _is_routed(name):
            q = quantize_fp8_block(t.float(), name=name)
            part = {name: q.codes, name + "_scale_inv": q.scale_inv}
        else:
            part = {name: t}
        nb = sum(x.numel() * x.element_size() for x in part.values())
        if size + nb > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1] |= part
        size += nb
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"))
        return out
    weight_map = {}
    for s, part in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(out / fname))
        weight_map |= {k: fname for k in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


# ----------------------------------------------------------------------------- in memory
class MemoryCheckpoint:
    """A checkpoint held in memory with the :class:`~memra.io.safetensors.SafetensorsCheckpoint`
    surface the Step-3.5 loader uses (``tensor``, ``in``, ``infos``, ``path``, ``config``).

    ``tensors``: hub name -> plain torch tensor (kept in its dtype: bf16/fp16/fp32) or an
    already-packed QTensor / FP8BlockTensor.
    """

    def __init__(self, tensors: dict[str, Any], config: dict[str, Any], path: str = "<memory>"):
        self.tensors, self.config, self.path = tensors, config, Path(path)
        self.infos = {k: tuple(v.shape) for k, v in tensors.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str, shape: tuple[int, ...] | None = None, *, why: str = ""):
        """The tensor as QTensor (plain) or its packed form. Raises CheckpointError: missing / wrong shape."""
        from ..io.gguf import CheckpointError
        from ..quant.tensor import _PLAIN_DTYPES, QTensor

        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}" + (f" (needed for {why})" if why else ""))
        if shape is not None and tuple(shape) != tuple(t.shape):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}"
                                  + (f" from the config ({why})" if why else ""))
        if isinstance(t, torch.Tensor):
            qt = {v: k for k, v in _PLAIN_DTYPES.items()}[t.dtype]
            return QTensor(name, qt, tuple(t.shape), t)
        return t


def build_model(geometry: str | dict, seed: int, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, expert_format: str = "bf16"):
    """The synthetic Step-3.5 model of ``geometry`` / ``seed`` built in memory (no file).

    Args:
        device: where the random numbers are drawn and the tensors live.
        dtype: compute dtype of the model.
        expert_format: routed experts kept as ``bf16`` (the hf-bf16 file's numbers), ``fp8``
            (the hf-fp8 file's numbers), ``q8_0``, ``nvfp4`` or ``q4_k`` (the GGUF files' expert
            numbers).

    Returns:
        :class:`memra.models.step3p5.Step35ForCausalLM` (eval). On CPU with ``bf16`` its logits
        equal those of loading ``write_synthetic(geometry, "hf-bf16", seed, ...)``.

    Note: the current model keeps dense copies of the routed experts (its CPU path), so a
    ``full`` model needs ~392 GB in ``dtype`` bf16 whatever ``expert_format`` is.

    Raises:
        SynthError: unknown geometry or expert format.
    """
    from ..models.step3p5 import Step35ForCausalLM
    from ..quant.fp8 import quantize_fp8_block

    if expert_format not in ("bf16", "fp8", "q8_0", "nvfp4", "q4_k"):
        raise SynthError(f"expert_format {expert_format!r} (supported: bf16, fp8, q8_0, nvfp4, q4_k)")
    g = load_geometry(geometry)
    _check_blocks(g, expert_format)
    tensors: dict[str, Any] = {}
    for name, t in synth_tensors(g, seed, device):
        if _is_routed(name) and expert_format == "fp8":
            t = quantize_fp8_block(t.float(), name=name)
        elif _is_routed(name) and expert_format != "bf16":
            t = _quantize_gguf(t, "gguf-" + expert_format, name)
        tensors[name] = t
    cfg = hub_config(g)
    config = model_config(g)
    with torch.no_grad():
        return Step35ForCausalLM.from_hf(MemoryCheckpoint(tensors, cfg), config, dtype).eval()


def describe(g: dict) -> str:
    """One line naming the geometry's main sizes (for CLI output)."""
    return (f"hidden {g['hidden']}, {g['layers']} layers ({g['dense_layers']} dense) + {g['mtp_layers']} MTP, "
            f"{g['experts']} experts top-{g['top_k']} x {g['expert_inter']}, vocab {g['vocab']}")



# ----------------------------------------------------------------------------- in GPU memory
def random_nvfp4(name: str, shape: tuple[int, ...], seed: int, device: str | torch.device = "cpu"):
    """A random ggml NVFP4 :class:`~memra.quant.tensor.QTensor` of ``shape`` (last dim a
    multiple of 64) drawn directly in packed form on ``device``: uniform random 4-bit codes,
    and per 16-weight sub-block a UE4M3 scale byte drawn among the 3 codes nearest to the one
    that gives the weights an RMS of ``in_features ** -0.5`` (as the linear weights of
    :func:`synth_tensor`). Used for full-size models, where quantizing bf16 draws would cost
    minutes. Never all zeros."""
    from ..quant.dequant import NVFP4_KVALUES, ue4m3_half_table
    from ..quant.tensor import QTensor
    from ..quant.types import QType

    dev = torch.device(device)
    k = shape[-1]
    if k % 64:
        raise SynthError(f"{name}: NVFP4 needs the last dimension a multiple of 64, got {shape}")
    rows = 1
    for s in shape[:-1]:
        rows *= s
    kv = torch.tensor(NVFP4_KVALUES, dtype=torch.float64)
    rms_codes = float(kv.pow(2).mean().sqrt())
    table = ue4m3_half_table(torch.device("cpu")).double()
    target = k ** -0.5 / rms_codes
    ok = torch.arange(1, 127)  # finite, non-zero scale codes
    best = int(ok[(table[ok] - target).abs().argmin()])
    gen = _generator(seed, name, dev)
    nblocks = rows * (k // 64)
    data = torch.empty(nblocks, 36, dtype=torch.uint8, device=dev)
    data[:, 4:] = torch.randint(0, 256, (nblocks, 32), generator=gen, device=dev, dtype=torch.uint8)
    data[:, :4] = (best - 1 + torch.randint(0, 3, (nblocks, 4), generator=gen, device=dev)).clamp(1, 126).to(
        torch.uint8)
    return QTensor(name, QType.NVFP4, tuple(shape), data.view(rows, (k // 64) * 36))


class SynthCheckpoint:
    """The synthetic checkpoint of geometry ``g`` made tensor by tensor on request (nothing is
    held), with :class:`MemoryCheckpoint`'s surface. Routed experts come as ``expert_format``:
    ``"bf16"`` (the :func:`synth_tensor` draws) or ``"nvfp4"`` (:func:`random_nvfp4`).

    Made on a CUDA device, the model loaders keep every weight there in its format
    (memra/layers/linear.py), so a full-size model is built in GPU memory without a host copy.
    """

    def __init__(self, g: dict, seed: int, device: str | torch.device, expert_format: str = "nvfp4"):
        if expert_format not in ("bf16", "nvfp4"):
            raise SynthError(f"expert_format {expert_format!r} (supported here: bf16, nvfp4)")
        self.g, self.seed, self.device, self.expert_format = g, seed, torch.device(device), expert_format
        self.shapes = tensor_shapes(g)
        self.config, self.path = hub_config(g), Path("<synthetic>")
        self.infos = dict(self.shapes)

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def tensor(self, name: str, shape: tuple[int, ...] | None = None, *, why: str = ""):
        from ..io.gguf import CheckpointError
        from ..quant.tensor import QTensor
        from ..quant.types import QType

        if name not in self.shapes:
            raise CheckpointError(f"{self.path}: missing tensor {name!r}" + (f" (needed for {why})" if why else ""))
        s = self.shapes[name]
        if shape is not None and tuple(shape) != tuple(s):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {s}, expected {tuple(shape)}")
        if _is_routed(name) and self.expert_format == "nvfp4":
            return random_nvfp4(name, s, self.seed, self.device)
        return QTensor(name, QType.BF16, tuple(s), synth_tensor(name, s, self.seed, self.device))


def build_gpu_model(geometry: str | dict, seed: int, device: str | torch.device = "cuda",
                    expert_format: str = "nvfp4", progress: bool = False):
    """The synthetic Step-3.5 model of ``geometry`` built directly in GPU memory: routed experts
    as ``expert_format`` expert banks (memra/kernels/moe_decode.py), every other weight bf16
    (:func:`synth_tensor` draws), compute in bf16. The ``full`` geometry with NVFP4 experts
    holds ~122 GB (without its MTP layers: pass a geometry with ``mtp_layers=0`` to leave them out).

    Raises: SynthError (geometry / format), ValueError (not a CUDA device).
    """
    from ..models.step3p5 import Step35ForCausalLM

    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"build_gpu_model: expected a CUDA device, got {dev} (use build_model on the CPU)")
    g = load_geometry(geometry)
    _check_blocks(g, expert_format)
    with torch.no_grad():
        model = Step35ForCausalLM.from_hf(SynthCheckpoint(g, seed, dev, expert_format), model_config(g),
                                          torch.bfloat16, progress=progress)
    return model.to_gpu(dev)
