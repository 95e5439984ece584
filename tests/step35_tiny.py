"""A tiny random Step-3.5 checkpoint in the hub layout, and transformers' model on the same weights.

Geometry: hidden 256, 8 decoder layers (0-2 dense, 3-7 MoE: 16 experts, top-4, expert
intermediate 96 so FP8 tiles are partial), full attention at i % 4 == 0 (layers 0 and 4:
4 query heads, partial RoPE 0.5, theta 5e6, llama3 scaling) and sliding attention elsewhere
(8 query heads, window 8, theta 1e4), 2 KV heads of 32 dims, SwiGLU clamps on the last two
layers, 3 MTP layers (checkpoint layers 8-10, sliding, dense). Every weight is random and
non-trivial: norm weights w ~ U(-0.5, 0.5) (multiplier 1 + w), a skewed router bias.

``tensors`` are fp32 holding bf16-representable values, so a bf16 checkpoint and the fp32
reference hold identical numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

N_LAYERS, N_MTP, D, VOCAB, E, TOPK, I_EXP, I_SHARED, I_DENSE = 8, 3, 256, 512, 16, 4, 96, 128, 320
H_FULL, H_SWA, KV, HD, WINDOW = 4, 8, 2, 32, 8
TYPES = (["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(N_LAYERS)]
         + ["sliding_attention"] * N_MTP)  # MTP layers are sliding (STEP35.md)


def hub_config(**over) -> dict:
    """The hub-format config.json of the tiny model (per-layer lists carry the 3 MTP entries last)."""
    total = N_LAYERS + N_MTP
    cfg = {
        "architectures": ["Step3p5ForCausalLM"], "model_type": "step3p5",
        "hidden_size": D, "intermediate_size": I_DENSE, "num_hidden_layers": N_LAYERS, "vocab_size": VOCAB,
        "num_attention_heads": H_FULL, "num_attention_groups": KV, "head_dim": HD,
        "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": H_SWA,
                                    "num_attention_groups": KV, "head_dim": HD},
        "layer_types": list(TYPES), "sliding_window": WINDOW,
        "rope_theta": [5e6 if t == "full_attention" else 1e4 for t in TYPES],
        "partial_rotary_factors": [0.5 if t == "full_attention" else 1.0 for t in TYPES],
        "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
                         "original_max_position_embeddings": 64},
        "yarn_only_types": ["full_attention"],
        "use_moe": True, "moe_num_experts": E, "moe_top_k": TOPK, "moe_intermediate_size": I_EXP,
        "share_expert_dim": I_SHARED, "moe_layers_enum": ",".join(str(i) for i in range(3, N_LAYERS)),
        "moe_router_activation": "sigmoid", "moe_router_scaling_factor": 3.0, "use_moe_router_bias": True,
        "need_fp32_gate": True, "norm_expert_weight": True, "use_head_wise_attn_gate": True, "use_qk_norm": True,
        "zero_centered": True, "att_impl_type": "GQA",
        "swiglu_limits": [0.0] * (N_LAYERS - 2) + [0.8, 0.8] + [0.0] * N_MTP,
        "swiglu_limits_shared": [0.0] * (N_LAYERS - 2) + [1.5, 1.5] + [0.0] * N_MTP,
        "num_nextn_predict_layers": N_MTP, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": [1, 2], "torch_dtype": "bfloat16",
    }
    assert len(cfg["layer_types"]) == total
    cfg.update(over)
    return cfg


def make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Hub-layout tensors (stacked experts, MTP layers 8-10), fp32 with bf16-exact values."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=None):
        s = shape[-1] ** -0.5 if scale is None else scale
        return (torch.randn(*shape, generator=g) * s).bfloat16().float()

    def nw(n):  # zero-centred norm weight w (multiplier 1 + w)
        return (torch.rand(n, generator=g) - 0.5).bfloat16().float()

    t = {"model.embed_tokens.weight": r(VOCAB, D, scale=1.0), "model.norm.weight": nw(D),
         "lm_head.weight": r(VOCAB, D)}
    for i in range(N_LAYERS + N_MTP):
        p = f"model.layers.{i}."
        H = H_FULL if TYPES[i] == "full_attention" else H_SWA
        t |= {p + "self_attn.q_proj.weight": r(H * HD, D), p + "self_attn.k_proj.weight": r(KV * HD, D),
              p + "self_attn.v_proj.weight": r(KV * HD, D), p + "self_attn.o_proj.weight": r(D, H * HD),
              p + "self_attn.g_proj.weight": r(H, D), p + "self_attn.q_norm.weight": nw(HD),
              p + "self_attn.k_norm.weight": nw(HD), p + "input_layernorm.weight": nw(D),
              p + "post_attention_layernorm.weight": nw(D)}
        if 3 <= i < N_LAYERS:
            skew = torch.linspace(0.35, -0.35, E)  # early experts favoured: routing stats are uneven
            t |= {p + "moe.gate.weight": r(E, D, scale=1.5 * D ** -0.5),
                  p + "moe.router_bias": (skew + 0.1 * torch.randn(E, generator=g)).bfloat16().float(),
                  p + "moe.gate_proj.weight": r(E, I_EXP, D), p + "moe.up_proj.weight": r(E, I_EXP, D),
                  p + "moe.down_proj.weight": r(E, D, I_EXP),
                  p + "share_expert.gate_proj.weight": r(I_SHARED, D),
                  p + "share_expert.up_proj.weight": r(I_SHARED, D),
                  p + "share_expert.down_proj.weight": r(D, I_SHARED)}
        else:
            t |= {p + "mlp.gate_proj.weight": r(I_DENSE, D), p + "mlp.up_proj.weight": r(I_DENSE, D),
                  p + "mlp.down_proj.weight": r(D, I_DENSE)}
        if i >= N_LAYERS:
            t |= {p + "enorm.weight": nw(D), p + "hnorm.weight": nw(D), p + "eh_proj.weight": r(D, 2 * D),
                  p + "transformer.shared_head.norm.weight": nw(D),
                  p + "transformer.shared_head.output.weight": r(VOCAB, D)}
    return t


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights with experts under per-expert names ``moe.experts.N.{gate,up,down}_proj.weight``."""
    out = {}
    for k, v in tensors.items():
        if ".moe." in k and k.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            p, proj = k.split(".moe.")
            for e in range(v.shape[0]):
                out[f"{p}.moe.experts.{e}.{proj}"] = v[e].clone()
        else:
            out[k] = v
    return out


def write_checkpoint(d: Path, tensors: dict[str, torch.Tensor], config: dict | None = None,
                     dtype: torch.dtype = torch.bfloat16, shards: int = 1) -> Path:
    """Write ``config.json`` and the tensors (float ones cast to ``dtype``; fp8 codes and fp32
    scales kept) as one ``model.safetensors`` or ``shards`` files with an index."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or hub_config(), indent=1))
    conv = {k: (v if v.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv") else v.to(dtype)).contiguous()
            for k, v in tensors.items()}
    if shards == 1:
        save_file(conv, str(d / "model.safetensors"))
        return d
    names = sorted(conv)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: conv[n] for n in names[s::shards]}
        save_file(part, str(d / fname))
        weight_map |= {n: fname for n in part}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def write_llm_dir(d: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> Path:
    """A directory ``LLM(d)`` loads: the checkpoint plus a word-level tokenizer ("w5" is id 5;
    <s> = 0 is bos, </s> = 1 and <|eot|> = 2 are eos)."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers

    write_checkpoint(d, tensors, dtype=dtype)
    vocab = {"<s>": 0, "</s>": 1, "<|eot|>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = HFTok(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<s>", "</s>", "<|eot|>"])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                          "add_bos_token": True}))
    return d


def reference_model(tensors: dict[str, torch.Tensor], config: dict | None = None):
    """transformers' ``Step3p7TextModel`` (fp32, eager attention) built from the hub config and
    loaded with ``tensors`` (hub names mapped to transformers' names by hand)."""
    from transformers.models.step3p7 import Step3p7TextConfig, Step3p7TextModel

    cfg = {k: v for k, v in (config or hub_config()).items() if k not in ("architectures", "model_type", "torch_dtype")}
    tc = Step3p7TextConfig(**cfg)
    tc._attn_implementation = "eager"
    model = Step3p7TextModel(tc).float().eval()
    sd = {}
    for k, v in tensors.items():
        if not k.startswith("model.layers.") and k != "lm_head.weight":
            sd[k.removeprefix("model.")] = v
            continue
        if k == "lm_head.weight":
            continue
        i = int(k.split(".")[2])
        if i >= N_LAYERS:
            continue  # MTP layers: transformers' text model has none
        k = k.removeprefix("model.")
        p = f"layers.{i}."
        if ".moe.gate_proj." in k:
            sd[p + "mlp.experts.gate_up_proj"] = torch.cat([v, tensors[f"model.{p}moe.up_proj.weight"]], dim=1)
        elif ".moe.up_proj." in k:
            continue
        elif ".moe.down_proj." in k:
            sd[p + "mlp.experts.down_proj"] = v
        elif ".moe.gate.weight" in k:
            sd[p + "mlp.gate.weight"] = v
        elif ".moe.router_bias" in k:
            sd[p + "mlp.gate.e_score_correction_bias"] = v
        else:
            sd[k.replace(".share_expert.", ".mlp.shared_experts.")] = v
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model


def greedy_alone_vs_batch(tmp_path: Path, n: int = 16, max_tokens: int = 48) -> list[tuple[int, int]]:
    """Issue 14's batch-invariance check on the GPU: ``n`` random prompts (1-39 tokens after bos)
    decoded greedily by the tiny model (seed 3) together in one batch, then each alone. Returns
    (prompt, first differing token) for every prompt whose tokens differ."""
    import random

    from memra.engine.llm import LLM
    from memra.engine.sampling import SamplingParams

    d = write_llm_dir(tmp_path / "tiny", make_tensors(3))
    g = random.Random(1)
    prompts = [[0] + [g.randrange(3, VOCAB) for _ in range(g.randrange(1, 40))] for _ in range(n)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm = LLM(str(d), device="cuda", max_model_len=256, max_num_seqs=n)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    return [(i, next(j for j, (x, y) in enumerate(zip(u, v)) if x != y))
            for i, (u, v) in enumerate(zip(alone, together)) if u != v]
