"""Tiny random GGUF checkpoints of each supported architecture, in llama.cpp's layout.

Weights are drawn from a seeded generator at scales that keep activations O(1)
(never zeros). Layouts follow llama.cpp's converter: q/k rows permuted for ``llama``,
Gemma norm weights stored as 1 + w.
"""

from __future__ import annotations

import torch

from memra.io.gguf_writer import write_gguf

VOCAB = 96


def _permute_for_llamacpp(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # rotate-half rows (h, half, i) -> interleaved rows (h, i, half), as llama.cpp's converter does
    out, inp = w.shape
    return w.view(n_heads, 2, out // n_heads // 2, inp).transpose(1, 2).reshape(out, inp)


def tiny_gguf(path, arch: str, seed: int = 0, layers: int = 7, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
              head_dim: int = 16, ffn: int = 96, window: int = 5, theta: float = 10000.0):
    """Write a tiny ``arch`` model to ``path``; returns the path."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=None):
        s = scale if scale is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=g) * s

    def norm_w(n):
        w = 0.1 * torch.randn(n, generator=g)
        return (1.0 + w) if arch == "gemma3" else (1.0 + w)  # stored multiplier (gemma: 1 + w per llama.cpp)

    t = {"token_embd.weight": r(VOCAB, hidden, scale=1.0 if arch != "gemma3" else hidden ** -0.5),
         "output_norm.weight": norm_w(hidden)}
    if arch != "gemma3":
        t["output.weight"] = r(VOCAB, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        q, k = r(heads * head_dim, hidden), r(kv_heads * head_dim, hidden)
        if arch == "llama":
            q, k = _permute_for_llamacpp(q, heads), _permute_for_llamacpp(k, kv_heads)
        t[p + "attn_q.weight"], t[p + "attn_k.weight"] = q, k
        t[p + "attn_v.weight"] = r(kv_heads * head_dim, hidden)
        t[p + "attn_output.weight"] = r(hidden, heads * head_dim)
        t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"] = r(ffn, hidden), r(ffn, hidden)
        t[p + "ffn_down.weight"] = r(hidden, ffn)
        t[p + "attn_norm.weight"], t[p + "ffn_norm.weight"] = norm_w(hidden), norm_w(hidden)
        if arch == "qwen2":
            for n, s in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                t[p + f"attn_{n}.bias"] = r(s * head_dim, scale=0.5)
        if arch == "gemma3":
            t[p + "attn_q_norm.weight"], t[p + "attn_k_norm.weight"] = norm_w(head_dim), norm_w(head_dim)
            t[p + "post_attention_norm.weight"], t[p + "post_ffw_norm.weight"] = norm_w(hidden), norm_w(hidden)
    meta = {
        f"{arch}.context_length": 256, f"{arch}.embedding_length": hidden, f"{arch}.block_count": layers,
        f"{arch}.feed_forward_length": ffn, f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads, f"{arch}.rope.freq_base": theta,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.vocab_size": VOCAB,
        f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": ["<s>", "</s>", "a", "b", "ab"] + [f"x{i}" for i in range(VOCAB - 5)],
        "tokenizer.ggml.token_type": [3, 3] + [1] * (VOCAB - 2),
        "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
    }
    if arch in ("llama", "qwen2"):
        meta[f"{arch}.rope.dimension_count"] = head_dim
    if arch == "gemma3":
        meta[f"{arch}.attention.sliding_window"] = window
    return write_gguf(path, arch, meta, t)
