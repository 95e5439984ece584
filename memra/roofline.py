"""Byte accounting of a Step-3.5 model from its config alone: parameters, resident bytes per
weight format, and the bytes one batch-1 decode step must read (the decode roofline's numerator).

Formats (shared/FORMATS.md): ``bf16`` every weight 2 bytes; ``fp8`` routed experts as FP8 E4M3
(1 byte) + one fp32 scale per 128x128 tile, the rest bf16; ``nvfp4`` routed experts in ggml
NVFP4 (36 bytes per 64 weights = 0.5625 B), the rest bf16. Norm weights, router and router bias
are counted as bf16 in every format (in GGUF files they are f32: a few MB at full size).

A batch-1 decode step reads: every attention projection (q, k, v, head gate g, o) and norm of
every decoder layer, the dense MLPs, every router, the top-k routed experts of each MoE layer
(a different set per layer, so k * 3 matrices each), the shared experts, one embedding row
and the whole LM head. MTP layers are listed separately (one draft step reads one MTP layer:
eh_proj, its decoder layer, its own head). The KV cache is listed separately too (it grows
with the context: ``context`` tokens, bf16 K and V, sliding layers read at most ``window``).

Source: shared/STEP35.md ("Geometry"), shared/GPU.md ("Roofline of the flagship").
"""

from __future__ import annotations

from typing import Any

from .config import LayerConfig, ModelConfig

__all__ = ["FORMAT_NAMES", "step35_bytes", "format_bytes_table"]

FORMAT_NAMES = ("bf16", "fp8", "nvfp4")
NVFP4_BYTES_PER_WEIGHT = 36 / 64
FP8_TILE = 128


def _attn_params(lc: LayerConfig, D: int) -> int:
    H, KV, Dh = lc.num_heads, lc.num_kv_heads, lc.head_dim
    return H * Dh * D + 2 * KV * Dh * D + H * D + D * H * Dh


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def step35_bytes(config: ModelConfig, context: int = 0) -> dict[str, Any]:
    """Parameters and bytes of a Step-3.5 model, split by part.

    Args:
        config: a ``step35`` :class:`ModelConfig` (from a GGUF file, a HF dir or a geometry).
        context: tokens in the KV cache for the ``kv_cache`` figures (0: none).

    Returns:
        dict with
        ``params``: {part: weights} for parts ``embed``, ``lm_head``, ``attention``, ``norms``,
        ``dense_mlp``, ``router``, ``routed_experts``, ``shared_experts``, ``mtp``;
        ``resident``: {format: {part: bytes}} (format in :data:`FORMAT_NAMES`), with ``total``
        and ``total_without_mtp``;
        ``decode``: {format: {part: bytes}} read by one batch-1 decode step of the main model
        (parts as above but ``routed_experts`` is the top-k, ``embed`` one row), with ``total``;
        ``mtp_step``: {format: bytes} read by one MTP draft step (MTP layer 0);
        ``kv_cache``: bytes of K and V read per decode step at ``context`` tokens (bf16).
        Units: weights and bytes (not GiB).

    Raises:
        ValueError: ``config`` is not a step35 config.
    """
    if config.arch != "step35":
        raise ValueError(f"byte accounting is implemented for step35 configs, got arch {config.arch!r}")
    D, V, moe = config.hidden_size, config.vocab_size, config.moe
    E, k = (moe.num_experts, moe.top_k) if moe else (0, 0)
    Ie, Is = (moe.expert_intermediate_size, moe.shared_intermediate_size) if moe else (0, 0)
    n_moe = sum(lc.mlp == "moe" for lc in config.layers)
    n_dense = config.num_layers - n_moe

    def layer_core(lc: LayerConfig) -> tuple[int, int, int]:
        """(attention, norms, dense MLP) weights of one layer (dense MLP only for dense layers)."""
        dense = 3 * D * config.intermediate_size if lc.mlp == "dense" else 0
        return _attn_params(lc, D), 2 * D + 2 * lc.head_dim, dense

    attn = sum(layer_core(lc)[0] for lc in config.layers)
    norms = sum(layer_core(lc)[1] for lc in config.layers) + D
    dense = sum(layer_core(lc)[2] for lc in config.layers)
    expert = 3 * D * Ie  # one routed expert: gate, up [Ie, D] and down [D, Ie]
    params = {
        "embed": V * D, "lm_head": 0 if config.tie_word_embeddings else V * D, "attention": attn, "norms": norms,
        "dense_mlp": dense, "router": n_moe * (E * D + E), "routed_experts": n_moe * E * expert,
        "shared_experts": n_moe * 3 * D * Is,
    }
    mtp_layer = []
    for lc in config.mtp_layers:
        a, nm, dn = layer_core(lc)
        mtp_layer.append(a + nm + dn + 2 * D * D + 3 * D + V * D)  # + eh_proj, enorm/hnorm/head norm, own head
    params["mtp"] = sum(mtp_layer)

    def routed_bytes(n_experts: int, fmt: str) -> float:
        w = n_experts * expert
        if fmt == "bf16":
            return 2 * w
        if fmt == "nvfp4":
            return w * NVFP4_BYTES_PER_WEIGHT
        tiles = 3 * _ceil(Ie, FP8_TILE) * _ceil(D, FP8_TILE)  # same tile count for gate, up and down
        return w + 4 * n_experts * tiles

    resident, decode, mtp_step = {}, {}, {}
    for fmt in FORMAT_NAMES:
        r = {p: 2 * v for p, v in params.items()}
        r["routed_experts"] = routed_bytes(n_moe * E, fmt)
        r["total_without_mtp"] = sum(v for p, v in r.items() if p != "mtp")
        r["total"] = r["total_without_mtp"] + r["mtp"]
        resident[fmt] = r
        d = {p: 2 * v for p, v in params.items() if p != "mtp"}
        d["embed"] = 2 * D
        d["routed_experts"] = routed_bytes(n_moe * k, fmt)
        d["total"] = sum(d.values())
        decode[fmt] = d
        mtp_step[fmt] = 2 * (mtp_layer[0] + D) if mtp_layer else 0  # + the embedding row of its token
    kv = 0
    for lc in config.layers:
        seen = context if lc.sliding_window is None else min(context, lc.sliding_window)
        kv += 2 * lc.num_kv_heads * lc.head_dim * 2 * seen
    return {"params": params, "param_total": sum(params.values()), "resident": resident, "decode": decode,
            "mtp_step": mtp_step, "kv_cache": kv, "context": context,
            "layers": {"dense": n_dense, "moe": n_moe, "mtp": len(config.mtp_layers)}}


def format_bytes_table(acct: dict[str, Any]) -> str:
    """The accounting of :func:`step35_bytes` as a plain-text table (GB = 1e9 bytes; MB below 1 GB)."""
    G, unit = (1e9, "GB") if acct["resident"]["bf16"]["total"] >= 1e9 else (1e6, "MB")
    p = acct["params"]
    parts = ["embed", "lm_head", "attention", "norms", "dense_mlp", "router", "routed_experts", "shared_experts"]
    lines = [f"parameters {acct['param_total'] / 1e9:.2f} B ({acct['layers']['dense']} dense + "
             f"{acct['layers']['moe']} MoE layers, {acct['layers']['mtp']} MTP layers)",
             f"{'part':<16}{'params (M)':>12}" + "".join(f"{'res ' + f:>11}" for f in FORMAT_NAMES)
             + "".join(f"{'dec ' + f:>11}" for f in FORMAT_NAMES) + f"   ({unit})"]
    for part in parts:
        lines.append(f"{part:<16}{p[part] / 1e6:>12.1f}"
                     + "".join(f"{acct['resident'][f][part] / G:>11.3f}" for f in FORMAT_NAMES)
                     + "".join(f"{acct['decode'][f][part] / G:>11.3f}" for f in FORMAT_NAMES))
    lines.append(f"{'total (no MTP)':<16}{(acct['param_total'] - p['mtp']) / 1e6:>12.1f}"
                 + "".join(f"{acct['resident'][f]['total_without_mtp'] / G:>11.3f}" for f in FORMAT_NAMES)
                 + "".join(f"{acct['decode'][f]['total'] / G:>11.3f}" for f in FORMAT_NAMES))
    lines.append(f"{'mtp':<16}{p['mtp'] / 1e6:>12.1f}"
                 + "".join(f"{acct['resident'][f]['mtp'] / G:>11.3f}" for f in FORMAT_NAMES)
                 + "".join(f"{acct['mtp_step'][f] / G:>11.3f}" for f in FORMAT_NAMES) + "   (dec: one draft step)")
    lines.append(f"{'total':<16}{acct['param_total'] / 1e6:>12.1f}"
                 + "".join(f"{acct['resident'][f]['total'] / G:>11.3f}" for f in FORMAT_NAMES))
    if acct["context"]:
        lines.append(f"KV cache read per decode step at {acct['context']} tokens (bf16): {acct['kv_cache'] / G:.3f} {unit}")
    return "\n".join(lines)


def per_rank_bytes(config: ModelConfig, acct: dict[str, Any], tp: int, ep: bool) -> dict[str, Any]:
    """Resident and per-decode-step bytes on the busiest rank of a TP ``tp`` (+ EP) run, from the
    accounting of :func:`step35_bytes`, following memra/parallel/shard.py's plan: query heads, the
    head gate, o_proj, dense MLPs, shared experts, embedding and LM head split ``tp`` ways (the
    largest share: ceil); KV heads split while there are enough (``ceil(KV / tp)``, else one,
    replicated); norms, routers and the MTP layers replicated; routed experts split by expert (EP)
    or along their width (TP), ``1 / tp`` of the bytes either way (EP at batch 1: the mean share of
    the top-k, ``k / tp`` experts; one rank may get more). KV cache read: the rank's KV heads.

    Returns {"tp", "ep", "resident": {format: {part: bytes}}, "decode": {format: {part: bytes}},
    "kv_cache"} with ``total`` in each. Raises ValueError for tp < 1."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size {tp} must be >= 1")
    D = config.hidden_size

    def share(n: int) -> float:
        return _ceil(n, tp) / n if n else 0.0

    attn_full = attn_rank = 0
    kv_rank = 0
    for lc in config.layers:
        H, KV, Dh = lc.num_heads, lc.num_kv_heads, lc.head_dim
        hr = _ceil(H, tp)
        kvr = _ceil(KV, tp) if tp <= KV else 1
        attn_full += _attn_params(lc, D)
        attn_rank += hr * Dh * D + 2 * kvr * Dh * D + hr * D + D * hr * Dh
        seen = acct["context"] if lc.sliding_window is None else min(acct["context"], lc.sliding_window)
        kv_rank += 2 * kvr * Dh * 2 * seen
    f_attn = attn_rank / attn_full if attn_full else 0.0
    split = {"attention": f_attn, "dense_mlp": share(config.intermediate_size),
             "shared_experts": share(config.moe.shared_intermediate_size) if config.moe else 0.0,
             "embed": share(config.vocab_size), "lm_head": share(config.vocab_size),
             "routed_experts": 1.0 / tp, "norms": 1.0, "router": 1.0, "mtp": 1.0}
    out: dict[str, Any] = {"tp": tp, "ep": ep, "resident": {}, "decode": {}, "kv_cache": kv_rank}
    for fmt in FORMAT_NAMES:
        r = {p: acct["resident"][fmt][p] * split[p] for p in split}
        r["total"] = sum(r.values())
        out["resident"][fmt] = r
        d = {p: acct["decode"][fmt][p] * split[p] for p in split if p != "mtp"}
        d["embed"] = acct["decode"][fmt]["embed"]  # the looked-up row is read on its owner only; ~ one row
        d["total"] = sum(d.values())
        out["decode"][fmt] = d
    return out


def format_per_rank_table(pr: dict[str, Any]) -> str:
    """:func:`per_rank_bytes` as a plain-text table (GB)."""
    parts = ["embed", "lm_head", "attention", "norms", "dense_mlp", "router", "routed_experts", "shared_experts", "mtp"]
    lines = [f"per rank at TP {pr['tp']}{' + EP' if pr['ep'] else ''} (busiest rank; GB)",
             f"{'part':<16}" + "".join(f"{'res ' + f:>11}" for f in FORMAT_NAMES)
             + "".join(f"{'dec ' + f:>11}" for f in FORMAT_NAMES)]
    for part in parts:
        lines.append(f"{part:<16}" + "".join(f"{pr['resident'][f][part] / 1e9:>11.3f}" for f in FORMAT_NAMES)
                     + "".join(f"{pr['decode'][f].get(part, 0.0) / 1e9:>11.3f}" for f in FORMAT_NAMES))
    lines.append(f"{'total':<16}" + "".join(f"{pr['resident'][f]['total'] / 1e9:>11.3f}" for f in FORMAT_NAMES)
                 + "".join(f"{pr['decode'][f]['total'] / 1e9:>11.3f}" for f in FORMAT_NAMES))
    if pr["kv_cache"]:
        lines.append(f"KV cache read per decode step on the rank (bf16): {pr['kv_cache'] / 1e9:.3f} GB")
    return "\n".join(lines)
