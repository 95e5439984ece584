"""``memra bench prefill``: the flagship's prefill throughput on one GPU for one chunk (4096 tokens
by default), against its FLOP / byte roofline, with the per-phase split, and the time to first
token (TTFT) of a prompt through the engine.

The model (Step-3.5-Flash geometry by default; its MTP layers left out) is built directly in
GPU memory on synthetic weights (memra/io/synthetic.py ``build_gpu_model``: routed experts as
``--expert-format`` expert banks, NVFP4 or bf16, everything else bf16, random values never
zeros). NVFP4 experts hold ~2.5 GB per MoE layer: all 45 layers fit one H200; bf16 experts
(~9 GB per layer) do not: ``--layers N`` keeps the first N decoder layers, and the output and
the JSON say that the model was cut (``layers`` / ``layers_full`` / ``cut``).

Measured, in this order, in one run:

- ceilings: device-to-device copy bandwidth (memra.bench.common.copy_bandwidth), bf16
  ``torch.mm`` and FP8 ``torch._scaled_mm`` at 8192^3 (memra.bench.common.matmul_ceilings),
  and fp32 ``torch.mm`` at 4096^3 (the router's fp32 logits; TF32 as torch is set, off by default);
- the chunk: ``--chunk`` random token ids at positions ``--prefix`` .. ``--prefix + chunk - 1``
  over a :class:`~memra.engine.kv_cache.PagedKVCache` sized for prefix + chunk (blocks of 16,
  physical blocks shuffled, the prefix's K/V random bf16), exactly as the engine runs a
  prefill chunk: ``hidden = model(ids, positions, PagedBatch(cache, [SeqChunk(prefix, T,
  [table] * groups)]))`` then ``model.logits(hidden[-1:])``, eagerly (no CUDA graph: the
  engine runs prefill eagerly), timed with CUDA events, median of ``--reps`` after warm-up
  calls. The PagedBatch (slot mappings, block tables, sequence offsets: nothing that a call changes; the
  chunk's K/V are rewritten to the same slots each call) is built once outside the timing.
  Reported: ms per chunk and tokens/s;
- the phase split: on the inputs of one real (unfused) forward of the chunk, each phase's
  modules over all layers are run alone and timed (eager, CUDA events, median of ``--reps``):
  attention = input norm + fused QKV/gate projection + q/k norm + RoPE + paged attention (the
  PagedBatch's, whichever kernel it uses) + head gate + output projection; router = fp32
  logits + top-k; routed experts (moe_prefill's grouped GEMM above 64 tokens); shared experts;
  dense MLPs; head = final norm over the chunk + LM head on the last row. The post-attention
  norms and the residual adds are in no phase (the whole chunk fuses them into its norms).
  Their sum is printed next to the whole chunk. The same forward's routing gives the distinct
  experts each MoE layer activates (used by the roofline);
- TTFT: an :class:`~memra.engine.engine.LLMEngine` over the same model in GPU memory
  (``max_num_batched_tokens`` = ``--chunk``, a KV cache of just the blocks one prompt needs,
  prefix caching off, eager: a 1-token request never decodes), a prompt of ``--ttft-prompt``
  random token ids, greedy, ``max_tokens=1``; wall time from ``add_request`` to the step that
  returns the first token (``engine.step()`` loop; the token reaches the host, which
  synchronizes). Run twice on different prompts; the second is reported (the first pays
  compilation / autotuning), with the engine steps the prompt took.

Roofline of the chunk (:func:`prefill_roofline`, a pure function of the config, T, prefix,
expert format, active experts and ceilings): a sum over pieces, each piece's floor
``max(FLOPs / matmul ceiling, bytes / copy bandwidth)`` taken per GEMM (per layer) and summed:

- attention projections, per layer the qkvg GEMM [T, D] x [D, H*Dh + 2*KV*Dh + H] and the o GEMM
  [T, H*Dh] x [H*Dh, D]: FLOPs 2*T*in*out, bytes = bf16 weights + bf16 input and output; bf16
  ceiling;
- attention core, per layer: FLOPs 4 * Dh * H * (sum over the chunk's queries of the keys each
  sees: position p sees p + 1 keys, a sliding layer at most ``sliding_window``); bytes = the
  K and V read (every key some query sees, once: prefix + T, a sliding layer's from
  ``prefix - window + 1`` on) + the chunk's K and V written + q read + o written, bf16; bf16 ceiling;
- router, per MoE layer: fp32 logits [T, D] x [D, E] (FLOPs 2*T*D*E; bytes fp32 weights + the
  bf16 input + fp32 logits); the fp32 ceiling when measured, else bf16 (then a looser floor);
- routed experts, per MoE layer: memra.bench.common.projection_costs (gate+up and down:
  FLOPs 2 * T * top_k * 3 * I * D in all, bytes = the ACTIVE experts' weights as stored +
  activations); active experts = the distinct experts the model's own router chose for the
  chunk's real hidden states, per layer (measured; the JSON also gives, for comparison, the
  count of memra.bench.common.skewed_routing at T, the original's production skew);
  ceiling FP8 for fp8 experts (FP8 block recipe, E4M3 x E4M3 dots), else bf16 (NVFP4 is
  dequantized to bf16 dot operands: Hopper has no FP4 tensor cores);
- shared experts and dense MLPs: two bf16 GEMMs each (gate+up D -> 2I, down I -> D), bf16 ceiling;
- LM head on the last token only (bf16 weights, [1, D] x [D, V]); embedding gather (T rows read
  and written).
Norms, RoPE, the head gate and the SwiGLU activations are taken as fused into their neighbours
(no floor of their own). % of roofline = roofline ms / measured ms; per phase the measured ms
is printed next to that phase's floor.

Command (H200): ``memra bench prefill --json-out benchmarks/results/prefill_h200.json``
(NVFP4, all 45 layers, 4096-token chunk at prefix 0, TTFT of a 4096-token prompt).

Wiring (for cli.py): ``add_prefill_args(subparser)`` and ``run_from_args(namespace)``, or
``main(argv)``; ``python -m memra.bench.prefill [args]`` works without the CLI.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

from .common import (
    FORMATS,
    add_batch_invariant_arg,
    apply_batch_invariant,
    commit,
    copy_bandwidth,
    cuda_graph_us,
    eager_us,
    matmul_ceilings,
    phase_fns,
    projection_costs,
    require_cuda,
    routing_stats,
    skewed_routing,
    write_json,
)
from .common import median_ms as _time  # median ms of eager GPU calls, CUDA events (tests patch pf._time)

__all__ = ["EXPERT_FORMATS", "visible_keys", "keys_read", "gemm_cost", "prefill_roofline", "check_args",
           "chunk_inputs", "run_prefill_bench", "print_table", "add_prefill_args", "run_from_args", "main",
           "benchmark_prefill_attention"]

#: routed-expert formats ``build_gpu_model`` can make in GPU memory (synthetic.SynthCheckpoint)
EXPERT_FORMATS = ("nvfp4", "bf16")
PHASES = ("embed", "attention", "router", "routed_experts", "shared_experts", "dense_mlp", "head")


# ---------------------------------------------------------------------------------------
# accounting (pure, CPU)


def visible_keys(t: int, prefix: int, window: int | None) -> int:
    """Sum over the chunk's queries (positions prefix .. prefix + t - 1) of the keys each sees
    under causal attention: position p sees p + 1 keys, or min(p + 1, window) in a sliding layer
    (key j visible to query p iff p - window < j <= p). Raises: ValueError for t < 1, prefix < 0
    or window < 1."""
    _check_tp(t, prefix)
    if window is not None and window < 1:
        raise ValueError(f"visible_keys: window = {window} must be >= 1 (or None)")
    full = t * prefix + t * (t + 1) // 2  # sum of p + 1
    if window is None:
        return full
    # positions p with p + 1 <= window see p + 1 keys, the rest see window
    lo, hi = prefix, prefix + t  # p in [lo, hi)
    cut = min(max(window, lo), hi)  # p < cut: p + 1 <= window
    under = (cut - lo) * (lo + 1 + cut) // 2  # sum of p + 1 for p in [lo, cut)
    return under + (hi - cut) * window


def keys_read(t: int, prefix: int, window: int | None) -> int:
    """Distinct keys (cached + new) the chunk's queries see at all: prefix + t, a sliding layer's
    from position ``prefix - window + 1`` on."""
    _check_tp(t, prefix)
    lo = 0 if window is None else max(0, prefix - window + 1)
    return prefix + t - lo


def gemm_cost(t: int, k: int, n: int, weight_bytes: int | None = None, in_bytes: int = 2,
              out_bytes: int = 2) -> dict:
    """FLOPs and bytes of [t, k] x [k, n]: flops 2*t*k*n; bytes = weights (``weight_bytes``, default
    bf16 2*k*n) + input t*k*in_bytes + output t*n*out_bytes."""
    w = 2 * k * n if weight_bytes is None else weight_bytes
    return dict(flops=2.0 * t * k * n, bytes=w + t * k * in_bytes + t * n * out_bytes)


def _check_tp(t: int, prefix: int) -> None:
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise ValueError(f"chunk tokens t = {t!r} must be an integer >= 1")
    if not isinstance(prefix, int) or isinstance(prefix, bool) or prefix < 0:
        raise ValueError(f"prefix = {prefix!r} must be an integer >= 0")


class _Piece:
    """Accumulates ops of one roofline piece: FLOPs, bytes and the sum of per-op floors (ms)."""

    def __init__(self, phase: str, ceiling: str, flops_per_s: float, bw: float):
        self.phase, self.ceiling, self.fps, self.bw = phase, ceiling, flops_per_s, bw
        self.flops = self.bytes = self.ms = 0.0
        self.ops = 0

    def add(self, flops: float, nbytes: float) -> None:
        self.flops += flops
        self.bytes += nbytes
        self.ms += max(flops / self.fps, nbytes / self.bw) * 1e3
        self.ops += 1

    def as_dict(self) -> dict:
        f_ms, b_ms = self.flops / self.fps * 1e3, self.bytes / self.bw * 1e3
        return dict(phase=self.phase, ceiling=self.ceiling, ops=self.ops, flops=self.flops, bytes=self.bytes,
                    flops_ms=f_ms, bytes_ms=b_ms, ms=self.ms, bound="flops" if f_ms >= b_ms else "bytes")


def prefill_roofline(config, t: int, prefix: int = 0, *, expert_format: str, active_experts,
                     bf16_flops_per_s: float, copy_bytes_per_s: float, fp8_flops_per_s: float | None = None,
                     fp32_flops_per_s: float | None = None) -> dict:
    """The roofline of one prefill chunk of ``t`` tokens after ``prefix`` cached tokens (module
    docstring for the pieces).

    Args:
        config: a step35 :class:`memra.config.ModelConfig`, or a synthetic geometry (name or dict,
            memra/io/synthetic.py; its MTP layers are not counted).
        expert_format: routed experts as stored: one of memra.bench.common.FORMATS.
        active_experts: distinct experts each MoE layer runs: one int for all, or one per MoE layer
            (each in 0 .. min(E, t * top_k)).
        bf16_flops_per_s, fp8_flops_per_s, fp32_flops_per_s: matmul ceilings (FLOP/s); fp8 is used
            for fp8 experts (bf16 if None), fp32 for the router logits (bf16 if None);
        copy_bytes_per_s: the byte ceiling (device-to-device copy, bytes/s).

    Returns: JSON-able dict: ``pieces`` {name: {phase, ceiling, ops, flops, bytes, flops_ms, bytes_ms,
    ms (sum of the per-op floors), bound}} for embed, attn_proj, attn_core, router, routed_experts,
    shared_experts, dense_mlp, lm_head; ``phases`` {phase: floor ms} (phases: embed, attention =
    attn_proj + attn_core, router, routed_experts, shared_experts, dense_mlp, head = lm_head);
    ``total_ms``, ``total_flops``, ``total_bytes``, ``tok_s`` (t / total), ``t``, ``prefix``,
    ``expert_format``, ``expert_ceiling`` ("fp8" or "bf16"), ``router_ceiling``, ``active_experts``
    (the per-layer list).

    Raises: ValueError for t < 1, prefix < 0, an unknown format, a non-step35 config, ceilings
    <= 0, or an active-experts figure of the wrong length or out of range.
    """
    _check_tp(t, prefix)
    if expert_format not in FORMATS:
        raise ValueError(f"prefill_roofline: unknown expert format {expert_format!r}; expected one of {FORMATS}")
    for name, v in (("bf16_flops_per_s", bf16_flops_per_s), ("copy_bytes_per_s", copy_bytes_per_s),
                    ("fp8_flops_per_s", fp8_flops_per_s), ("fp32_flops_per_s", fp32_flops_per_s)):
        if v is not None and not v > 0:
            raise ValueError(f"prefill_roofline: {name} = {v!r} must be > 0")
    if isinstance(config, (str, dict)):
        from ..io.synthetic import load_geometry, model_config

        config = model_config(load_geometry(config))
    if getattr(config, "arch", None) != "step35":
        raise ValueError(f"prefill_roofline: expected a step35 config, got {getattr(config, 'arch', config)!r}")
    D, V = config.hidden_size, config.vocab_size
    moe = config.moe
    moe_layers = [i for i, lc in enumerate(config.layers) if lc.mlp == "moe"]
    cap = min(moe.num_experts, t * moe.top_k) if moe else 0
    if isinstance(active_experts, int) and not isinstance(active_experts, bool):
        active = [active_experts] * len(moe_layers)
    else:
        active = [int(a) for a in active_experts]
        if len(active) != len(moe_layers):
            raise ValueError(f"prefill_roofline: {len(active)} active-expert counts for {len(moe_layers)} MoE layers")
    bad = [a for a in active if not 0 <= a <= cap]
    if bad:
        raise ValueError(f"prefill_roofline: active experts {bad[0]} out of range 0..{cap} "
                         f"(min(E, t * top_k))")

    bw = copy_bytes_per_s
    fp8 = expert_format == "fp8" and fp8_flops_per_s is not None
    exp_fps = fp8_flops_per_s if fp8 else bf16_flops_per_s
    r_fps = fp32_flops_per_s or bf16_flops_per_s
    pieces = {
        "embed": _Piece("embed", "bytes", bf16_flops_per_s, bw),
        "attn_proj": _Piece("attention", "bf16", bf16_flops_per_s, bw),
        "attn_core": _Piece("attention", "bf16", bf16_flops_per_s, bw),
        "router": _Piece("router", "fp32" if fp32_flops_per_s else "bf16", r_fps, bw),
        "routed_experts": _Piece("routed_experts", "fp8" if fp8 else "bf16", exp_fps, bw),
        "shared_experts": _Piece("shared_experts", "bf16", bf16_flops_per_s, bw),
        "dense_mlp": _Piece("dense_mlp", "bf16", bf16_flops_per_s, bw),
        "lm_head": _Piece("head", "bf16", bf16_flops_per_s, bw),
    }
    pieces["embed"].add(0.0, 2 * t * D * 2)
    for lc in config.layers:
        H, KV, Dh, W = lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.sliding_window
        qkvg = gemm_cost(t, D, H * Dh + 2 * KV * Dh + H)
        o = gemm_cost(t, H * Dh, D)
        pieces["attn_proj"].add(qkvg["flops"], qkvg["bytes"])
        pieces["attn_proj"].add(o["flops"], o["bytes"])
        kv_bytes = 2 * KV * Dh * 2 * (keys_read(t, prefix, W) + t)  # K and V read, the chunk's written
        pieces["attn_core"].add(4.0 * Dh * H * visible_keys(t, prefix, W), kv_bytes + 2 * t * H * Dh * 2)
        if lc.mlp == "dense":
            gu, dn = gemm_cost(t, D, 2 * config.intermediate_size), gemm_cost(t, config.intermediate_size, D)
            pieces["dense_mlp"].add(gu["flops"], gu["bytes"])
            pieces["dense_mlp"].add(dn["flops"], dn["bytes"])
    for a in active:
        E, k, Ie, Is = moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.shared_intermediate_size
        r = gemm_cost(t, D, E, weight_bytes=4 * D * E, in_bytes=2, out_bytes=4)
        pieces["router"].add(r["flops"], r["bytes"])
        c = projection_costs(expert_format, t, t * k, a, D, Ie, fp8_act=True)
        for part in ("gate_up", "down"):
            pieces["routed_experts"].add(c[part]["flops"], c[part]["bytes"])
        if Is:
            gu, dn = gemm_cost(t, D, 2 * Is), gemm_cost(t, Is, D)
            pieces["shared_experts"].add(gu["flops"], gu["bytes"])
            pieces["shared_experts"].add(dn["flops"], dn["bytes"])
    head = gemm_cost(1, D, V)
    pieces["lm_head"].add(head["flops"], head["bytes"])

    out = {name: p.as_dict() for name, p in pieces.items()}
    phases = {ph: 0.0 for ph in PHASES}
    for p in out.values():
        phases[p["phase"]] += p["ms"]
    total = sum(p["ms"] for p in out.values())
    return dict(t=t, prefix=prefix, expert_format=expert_format, expert_ceiling="fp8" if fp8 else "bf16",
                router_ceiling=pieces["router"].ceiling, active_experts=active, pieces=out, phases=phases,
                total_ms=total, total_flops=sum(p["flops"] for p in out.values()),
                total_bytes=sum(p["bytes"] for p in out.values()), tok_s=t / total * 1e3)


# ---------------------------------------------------------------------------------------
# arguments


def check_args(a: argparse.Namespace) -> None:
    """Validate parsed arguments (:func:`add_prefill_args`). Raises: SystemExit with a message
    naming the option."""
    checks = (("--chunk", a.chunk, 1), ("--prefix", a.prefix, 0), ("--reps", a.reps, 1),
              ("--ttft-prompt", a.ttft_prompt, 1))
    for opt, v, lo in checks:
        if v < lo:
            raise SystemExit(f"memra bench prefill: {opt} = {v} must be >= {lo}")
    if a.layers is not None and a.layers < 1:
        raise SystemExit(f"memra bench prefill: --layers = {a.layers} must be >= 1")
    if a.expert_format not in EXPERT_FORMATS:
        raise SystemExit(f"memra bench prefill: --expert-format {a.expert_format!r} is not supported in GPU memory "
                         f"(supported: {', '.join(EXPERT_FORMATS)})")


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    """Add ``memra bench prefill``'s options to ``p`` (help strings without bare percent signs)."""
    p.add_argument("--geometry", default="full", help="synthetic geometry (memra/io/synthetic.py GEOMETRIES or JSON)")
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N decoder layers (None: all; bf16 experts need a cut on one H200)")
    p.add_argument("--expert-format", default="nvfp4", choices=list(EXPERT_FORMATS),
                   help="routed experts' format in GPU memory (everything else bf16)")
    p.add_argument("--chunk", type=int, default=4096, help="tokens of the timed prefill chunk")
    p.add_argument("--prefix", type=int, default=0,
                   help="tokens already in the KV cache before the chunk (4096: a long prompt's second chunk)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per measurement (median)")
    p.add_argument("--seed", type=int, default=0, help="weights, token ids, KV contents")
    p.add_argument("--ttft-prompt", type=int, default=4096, help="prompt tokens of the engine TTFT measurement")
    p.add_argument("--no-ttft", action="store_true", help="skip the engine TTFT measurement")
    add_batch_invariant_arg(p)
    p.add_argument("--json-out", default=None, help="write the result JSON here")


# ---------------------------------------------------------------------------------------
# GPU


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _fp32_ceiling(m: int = 4096) -> dict:
    """fp32 ``torch.mm`` at m^3 (the router's logits run so), CUDA graph timing."""
    import torch

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    a = torch.randn(m, m, device=dev, generator=gen)
    b = torch.randn(m, m, device=dev, generator=gen)
    c = torch.empty(m, m, device=dev)
    us = cuda_graph_us([lambda: torch.mm(a, b, out=c)], 5, 3)
    return dict(m=m, fp32_us=us, fp32_flops_per_s=2.0 * m ** 3 / (us * 1e-6),
                allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32))


def benchmark_prefill_attention(t: int = 4096, prefix: int = 0, h: int = 64, kv: int = 8, d: int = 128,
                                window: int | None = None, reps: int = 20, seed: int = 0,
                                **launch) -> dict:
    """Times :func:`memra.kernels.attention_prefill.paged_prefill_attention` on random bf16 inputs
    on the GPU (for tuning the kernel; not used by ``memra bench prefill``): one sequence of ``t``
    new tokens after ``prefix`` cached ones, block size 16, shuffled physical blocks, gate on.

    Returns a JSON-able dict: shape, ``us`` per call (CUDA events, mean over ``reps`` back-to-back
    eager calls after a warm-up: :func:`memra.bench.common.eager_us`), ``flops`` = 4 * D * H *
    (sum over the queries of their visible keys), ``tflops``, ``rel_err`` (max |out - ref| /
    max |ref| against :func:`~memra.kernels.attention_prefill.paged_prefill_attention_ref` in
    fp32) and, for ``window=None, prefix=0``, ``sdpa_us`` / ``sdpa_tflops`` of torch
    ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on contiguous
    [1, H, T, D] tensors (no gate) as the baseline. ``launch``: keywords of the kernel
    (block_m, block_n, num_warps, num_stages).

    Raises: RuntimeError without CUDA.
    """
    import torch

    from ..kernels.attention_prefill import paged_prefill_attention, paged_prefill_attention_ref

    if not torch.cuda.is_available():
        raise RuntimeError("benchmark_prefill_attention needs a CUDA GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    bs = 16
    L = prefix + t
    pages = -(-L // bs)
    n_blocks = pages + 8
    dt = torch.bfloat16
    kc = torch.randn(n_blocks, bs, kv, d, device=dev, dtype=dt, generator=gen)
    vc = torch.randn(n_blocks, bs, kv, d, device=dev, dtype=dt, generator=gen)
    table = torch.randperm(n_blocks, device=dev, generator=gen)[:pages].int()[None, :]
    q = torch.randn(t, h, d, device=dev, dtype=dt, generator=gen)
    gate = torch.randn(t, h, device=dev, dtype=dt, generator=gen)
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    sl = torch.tensor([L], dtype=torch.int32, device=dev)
    scale = d ** -0.5
    pos = torch.arange(prefix, L, dtype=torch.float64)
    vis = pos + 1 if window is None else torch.clamp(pos + 1, max=window)
    flops = 4.0 * d * h * float(vis.sum())
    out = torch.empty_like(q)

    def run():
        paged_prefill_attention(q, kc, vc, table, cu, sl, window, scale, gate=gate, out=out, max_q_len=t, **launch)

    def timed(fn) -> float:
        return eager_us(fn, inner=reps)

    us = timed(run)
    res = dict(t=t, prefix=prefix, h=h, kv=kv, d=d, window=window, us=us, flops=flops, tflops=flops / us * 1e-6)
    ref = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), table, cu, sl, window, scale,
                                      gate=gate.float())
    res["rel_err"] = float((out.float() - ref).abs().max() / ref.abs().max())
    del ref
    if window is None and prefix == 0:
        import torch.nn.functional as F

        qs = q.transpose(0, 1)[None].contiguous()
        blk = table[0].long()[torch.arange(t, device=dev) // bs]
        slot = torch.arange(t, device=dev) % bs
        ks = kc[blk, slot].transpose(0, 1)[None].contiguous()
        vs = vc[blk, slot].transpose(0, 1)[None].contiguous()
        sdpa_us = timed(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                               enable_gqa=h != kv))
        res.update(sdpa_us=sdpa_us, sdpa_tflops=flops / sdpa_us * 1e-6)
    return res


def chunk_inputs(model, t: int, prefix: int, seed: int, device, block_size: int = 16):
    """A prefill chunk's inputs as the engine makes them: a :class:`PagedKVCache` of the model's
    KV groups sized for ``prefix + t`` tokens (one spare block; the sequence's blocks a seeded
    permutation of the physical ones), every K/V slot random (the prefix's K/V stand for
    earlier chunks; the chunk's own slots are overwritten by each call), the
    :class:`PagedBatch` of ``SeqChunk(prefix, t, [table] * groups)``, ``t`` random token ids
    (int64, 3 .. vocab - 1) and positions prefix .. prefix + t - 1 on ``device``.
    Returns (cache, kv, ids, positions). Raises: ValueError for t < 1 or prefix < 0."""
    import torch

    from ..engine.block_manager import kv_groups
    from ..engine.kv_cache import PagedBatch, PagedKVCache, SeqChunk

    _check_tp(t, prefix)
    dev = torch.device(device)
    config = model.config
    groups = kv_groups(config)
    per_seq = -(-(prefix + t) // block_size)
    dtype = getattr(model, "dtype", torch.bfloat16)
    cache = PagedKVCache(groups, [per_seq + 1] * len(groups), block_size, dtype, device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    for kv_t in cache.k + cache.v:
        if kv_t is not None:
            kv_t.copy_(torch.randn(kv_t.shape, generator=gen, device=dev, dtype=torch.float32).to(dtype))
    table = torch.randperm(per_seq + 1, generator=torch.Generator().manual_seed(seed))[:per_seq].tolist()
    kv = PagedBatch(cache, [SeqChunk(prefix, t, [table] * len(groups))])
    ids = torch.randint(3, config.vocab_size, (t,), generator=torch.Generator().manual_seed(seed + 2)).to(dev)
    pos = torch.arange(prefix, prefix + t, device=dev)
    return cache, kv, ids, pos


def run_prefill_bench(a: argparse.Namespace) -> dict:
    """Build, measure, account; return the JSON-able result (module docstring; keys listed in
    :func:`print_table`). Raises: SystemExit for bad arguments, without a CUDA GPU, or when the
    model cannot fit the GPU (names ``--layers``)."""
    import torch

    check_args(a)
    require_cuda("prefill")
    invariant = apply_batch_invariant(a)
    from ..io.synthetic import build_gpu_model, load_geometry, model_config
    from ..roofline import step35_bytes

    dev = torch.device("cuda")
    g = load_geometry(a.geometry) | {"mtp_layers": 0}
    layers_full = g["layers"]
    if a.layers:
        if a.layers > layers_full:
            raise SystemExit(f"memra bench prefill: --layers {a.layers} > the geometry's {layers_full} layers")
        g["layers"] = a.layers
        g["clamp_layers"] = [i for i in g["clamp_layers"] if i < a.layers]
        g["dense_layers"] = min(g["dense_layers"], a.layers)
    cut = g["layers"] < layers_full
    need = step35_bytes(model_config(g))["resident"][a.expert_format]["total_without_mtp"]
    free, total_mem = torch.cuda.mem_get_info()
    if need > 0.93 * free:
        per_layer = need / g["layers"]
        raise SystemExit(f"memra bench prefill: {g['layers']} layers with {a.expert_format} experts need "
                         f"~{need / 1e9:.0f} GB of weights, the GPU has {free / 1e9:.0f} GB free; pass "
                         f"--layers {max(1, int(0.8 * free / per_layer))} (or fewer)")

    copy_bw = copy_bandwidth()
    ceil = matmul_ceilings()
    ceil.update(_fp32_ceiling())
    print(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, fp8 "
          f"{(ceil['fp8_flops_per_s'] or 0) / 1e12:.0f} TFLOP/s, fp32 {ceil['fp32_flops_per_s'] / 1e12:.0f} TFLOP/s",
          flush=True)

    t0 = time.perf_counter()
    model = build_gpu_model(g, a.seed, dev, a.expert_format, progress=sys.stderr.isatty())
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    config = model.config
    print(f"built {a.geometry} ({config.num_layers} of {layers_full} layers{', CUT' if cut else ''}, experts "
          f"{a.expert_format}) in {build_s:.0f} s, {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated",
          flush=True)

    T, prefix = a.chunk, a.prefix
    st = dict(zip(("cache", "kv", "ids", "pos"), chunk_inputs(model, T, prefix, a.seed, dev)))
    out: dict = {}

    def chunk():
        hidden = model(st["ids"], st["pos"], st["kv"])
        out["logits"] = model.logits(hidden[-1:])

    with torch.inference_mode():
        t0 = time.perf_counter()
        chunk()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        chunk_ms = _time(chunk, a.reps)
        finite = bool(torch.isfinite(out["logits"]).all())
    peak = torch.cuda.max_memory_allocated()
    print(f"chunk T={T} at prefix {prefix}: {chunk_ms:.2f} ms, {T / chunk_ms * 1e3:.0f} tok/s "
          f"(first call {first_s:.1f} s)", flush=True)

    phases, distinct = _phases(model, st["ids"], st["pos"], st["kv"], a.reps)
    print(f"phases: {', '.join(f'{k} {v:.2f}' for k, v in phases.items())} (sum {sum(phases.values()):.2f} ms)",
          flush=True)
    moe = config.moe
    skewed = None
    if moe and distinct:
        skewed = routing_stats(skewed_routing(T, moe.num_experts, moe.top_k, a.seed), moe.num_experts)["active"]
    roof = prefill_roofline(config, T, prefix, expert_format=a.expert_format, active_experts=distinct,
                            bf16_flops_per_s=ceil["bf16_flops_per_s"], copy_bytes_per_s=copy_bw,
                            fp8_flops_per_s=ceil["fp8_flops_per_s"], fp32_flops_per_s=ceil["fp32_flops_per_s"])
    st.clear()  # the chunk's KV cache: free it for the engine's
    torch.cuda.empty_cache()

    ttft = None
    if not a.no_ttft:
        try:
            ttft = _ttft(model, a)
        except Exception as e:  # noqa: BLE001 - keep the chunk results, say what failed
            import traceback

            traceback.print_exc()
            ttft = {"error": f"{type(e).__name__}: {e}"}

    return {
        "machine": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
        "batch_invariant": invariant,
        "geometry": a.geometry, "layers": config.num_layers, "layers_full": layers_full, "cut": cut,
        "expert_format": a.expert_format, "chunk": T, "prefix": prefix, "seed": a.seed, "reps": a.reps,
        "build_seconds": build_s, "gpu_memory_bytes": total_mem, "peak_allocated_bytes": peak,
        "copy_bandwidth_Bps": copy_bw, "ceilings": ceil,
        "chunk_ms": chunk_ms, "tok_s": T / chunk_ms * 1e3, "first_call_seconds": first_s, "logits_finite": finite,
        "phases_ms": phases, "phases_sum_ms": sum(phases.values()),
        "active_experts_per_layer": distinct,
        "active_experts_mean": statistics.mean(distinct) if distinct else 0,
        "skewed_routing_active": skewed,
        "roofline": roof, "roofline_ms": roof["total_ms"], "roofline_tok_s": roof["tok_s"],
        "pct_of_roofline": 100 * roof["total_ms"] / chunk_ms,
        "ttft": ttft,
    }


def _phases(model, ids, pos, kv, reps: int) -> tuple[dict[str, float], list[int]]:
    """ms per phase (each phase's modules over all layers, run alone, eager) on the inputs of one
    real unfused forward (:func:`memra.bench.common.phase_fns`), and the distinct experts each
    MoE layer routed the chunk to."""
    import torch

    fns, hidden, distinct = phase_fns(model, ids, pos, kv)
    with torch.inference_mode():
        def embed():
            model.embed(ids)

        def head():
            model.logits(model.norm(hidden)[-1:])

        res = {}
        for name, fn in [("embed", embed)] + list(fns.items()) + [("head", head)]:
            res[name] = _time(fn, reps, warm=1)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res, distinct


def _ttft(model, a: argparse.Namespace, device: str = "cuda") -> dict:
    """Time to first token of a ``--ttft-prompt`` prompt through an LLMEngine over ``model`` on
    ``device`` (module docstring); the second of two runs on different random prompts. Uses
    ``a.ttft_prompt``, ``a.chunk`` (max_num_batched_tokens), ``a.seed``, ``a.geometry``."""
    import torch

    from ..engine.engine import EngineConfig, LLMEngine
    from ..engine.sampling import SamplingParams
    from ..io.synthetic import gguf_tokenizer_metadata
    from ..io.tokenizer import Tokenizer

    config = model.config
    n, bs = a.ttft_prompt, 16
    tok = Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(config.vocab_size))
    blocks = -(-(n + 1) // bs) + 1
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=f"synthetic:{a.geometry}", device=device, max_model_len=n + 1,
                                 max_num_seqs=1, max_num_batched_tokens=a.chunk, block_size=bs,
                                 kv_cache_blocks=blocks, enable_prefix_caching=False, enforce_eager=True),
                    model=model, tokenizer=tok)
    engine_s = time.perf_counter() - t0
    runs = []
    for r in range(2):
        ids = torch.randint(3, config.vocab_size, (n,), generator=torch.Generator().manual_seed(a.seed + 10 + r))
        params = SamplingParams(max_tokens=1, temperature=0.0)
        _sync()
        t0 = time.perf_counter()
        eng.add_request(f"ttft-{r}", ids.tolist(), params)
        steps, got = 0, None
        while eng.has_unfinished():
            events = eng.step()
            steps += 1
            if any(d.token_ids for ev in events for d in ev.deltas):
                _sync()
                got = time.perf_counter() - t0
                break
        if got is None:
            raise RuntimeError(f"the engine finished the request without a token after {steps} steps")
        while eng.has_unfinished():  # max_tokens=1: already finished; drain in case
            eng.step()
        runs.append(dict(ttft_s=got, steps=steps))
        print(f"TTFT run {r + 1}: {got * 1e3:.1f} ms for {n} prompt tokens in {steps} engine steps", flush=True)
    last = runs[-1]
    res = dict(prompt_tokens=n, max_num_batched_tokens=a.chunk, ttft_ms=last["ttft_s"] * 1e3, steps=last["steps"],
               prefill_tok_s=n / last["ttft_s"], first_run_ttft_ms=runs[0]["ttft_s"] * 1e3,
               engine_build_seconds=engine_s, kv_cache=eng.kv_cache_summary())
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------
# output


def print_table(res: dict) -> None:
    """The result as text: the chunk vs its roofline, phases measured vs their floors, TTFT.

    JSON keys (``run_prefill_bench``): machine, torch, commit, geometry, layers, layers_full, cut,
    expert_format, chunk, prefix, seed, reps, build_seconds, gpu_memory_bytes,
    peak_allocated_bytes, copy_bandwidth_Bps, ceilings (matmul_ceilings + fp32), chunk_ms, tok_s,
    first_call_seconds, logits_finite, phases_ms, phases_sum_ms, active_experts_per_layer,
    active_experts_mean, skewed_routing_active, roofline (:func:`prefill_roofline`), roofline_ms,
    roofline_tok_s, pct_of_roofline, ttft (None with --no-ttft; else prompt_tokens,
    max_num_batched_tokens, ttft_ms, steps, prefill_tok_s, first_run_ttft_ms,
    engine_build_seconds, kv_cache; or error).
    """
    c = res["ceilings"]
    roof = res["roofline"]
    cut = f" of {res['layers_full']} (CUT)" if res["cut"] else ""
    print(f"\nmemra bench prefill: {res['geometry']} ({res['layers']} layers{cut}, routed experts "
          f"{res['expert_format']}, other weights bf16), chunk {res['chunk']} at prefix {res['prefix']}, "
          f"{res['machine']}, commit {res['commit']}")
    print(f"ceilings: copy {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 {c['bf16_flops_per_s'] / 1e12:.0f}, "
          f"fp8 {(c['fp8_flops_per_s'] or 0) / 1e12:.0f}, fp32 {c['fp32_flops_per_s'] / 1e12:.0f} TFLOP/s; "
          f"routed experts at the {roof['expert_ceiling']} ceiling, active experts/layer "
          f"{res['active_experts_mean']:.1f} (skewed_routing at T: {res['skewed_routing_active']})")
    print(f"chunk: {res['chunk_ms']:.2f} ms = {res['tok_s']:.0f} tok/s; roofline {res['roofline_ms']:.2f} ms "
          f"({roof['total_flops'] / 1e12:.1f} TFLOP, {roof['total_bytes'] / 1e9:.1f} GB) = "
          f"{res['roofline_tok_s']:.0f} tok/s -> {res['pct_of_roofline']:.1f} pct of roofline; "
          f"logits finite: {res['logits_finite']}")
    print("| phase | measured ms | floor ms | floor / measured |")
    print("| --- | --- | --- | --- |")
    for ph, ms in res["phases_ms"].items():
        fl = roof["phases"].get(ph, 0.0)
        print(f"| {ph} | {ms:.2f} | {fl:.2f} | {100 * fl / ms if ms > 0 else float('nan'):.1f} pct |")
    print(f"| phase sum | {res['phases_sum_ms']:.2f} | {res['roofline_ms']:.2f} | |")
    print(f"| whole chunk | {res['chunk_ms']:.2f} | {res['roofline_ms']:.2f} | {res['pct_of_roofline']:.1f} pct |")
    print("| roofline piece | TFLOP | GB | flops ms | bytes ms | floor ms | bound |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, p in roof["pieces"].items():
        print(f"| {name} ({p['ceiling']}) | {p['flops'] / 1e12:.3f} | {p['bytes'] / 1e9:.3f} | {p['flops_ms']:.3f} | "
              f"{p['bytes_ms']:.3f} | {p['ms']:.3f} | {p['bound']} |")
    t = res["ttft"]
    if t is None:
        print("TTFT: skipped (--no-ttft)")
    elif "error" in t:
        print(f"TTFT: error: {t['error']}")
    else:
        print(f"TTFT ({t['prompt_tokens']}-token prompt through the engine, max_num_batched_tokens "
              f"{t['max_num_batched_tokens']}): {t['ttft_ms']:.1f} ms in {t['steps']} steps = "
              f"{t['prefill_tok_s']:.0f} tok/s (first run {t['first_run_ttft_ms']:.1f} ms)")


def run_from_args(a: argparse.Namespace) -> int:
    """Run for parsed arguments (:func:`add_prefill_args`): table and JSON. Returns 0 (1 when the
    logits were not finite). Raises: SystemExit for bad arguments or without a CUDA GPU."""
    res = run_prefill_bench(a)
    print_table(res)
    if a.json_out:
        write_json(a.json_out, res, "wrote")
    return 0 if res["logits_finite"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``memra bench prefill [args]`` (``python -m memra.bench.prefill``)."""
    p = argparse.ArgumentParser(prog="memra bench prefill", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_prefill_args(p)
    return run_from_args(p.parse_args(None if argv is None else list(argv)))


if __name__ == "__main__":
    sys.exit(main())
