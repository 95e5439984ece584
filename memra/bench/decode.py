"""``memra bench decode``: the flagship's whole decode step on one GPU, against its byte roofline.

The model (Step-3.5-Flash geometry by default; its MTP layers left out) is built directly in
GPU memory on synthetic weights (memra/io/synthetic.py ``build_gpu_model``: routed experts
NVFP4 expert banks, everything else bf16, random values never zeros). For each batch size B
the decode step (all layers, the LM head over the B rows) is captured in a CUDA graph with
B sequences of ``--context`` tokens whose KV cache holds random values, replayed, and timed
with CUDA events.

Byte roofline of a step: every weight the step reads once (attention projections, norms,
dense MLPs, routers, shared experts, LM head; the routed experts that the step's routing
actually selected, counted per layer as distinct experts x one expert's packed bytes) plus
the KV cache read (B sequences x ``--context`` tokens, sliding layers at most their window),
divided by the device-to-device copy bandwidth measured in the same run. The batch-1 figure
is cross-checked against the config-only accounting of memra/roofline.py.

Speculation (``--mtp K``): the model keeps K MTP layers, and for each batch size B the bench also
times the verify step (B sequences x (K + 1) query rows: the last token and K drafts, replayed
through the same decode CUDA graphs at batch B(K + 1)) and the MTP drafting of the step
(memra/engine/speculative.py ``MTPProposer.draft`` in steady state: every request consumes r =
accepted + 1 new hidden rows and drafts K tokens; timed for r = 1 .. K + 1, replaying its CUDA graphs
as the engine does, and eagerly in the same run for the ratio). Random weights accept
nothing, so the accepted length A (tokens per sequence per step, bonus included) is forced
(``--accepted``): effective tok/s = B x A / (verify + drafting at A), against plain decode's
B / step (drafting at a fractional A interpolates between its neighbouring r).

Per-phase split: each phase's modules over all layers are captured alone in their own CUDA
graph on the step's real inputs (attention = input norm + fused QKV/gate projection + q/k
norm + RoPE + paged attention + head gate + output projection; router = post-attention norm
+ fp32 router + top-k; routed experts; shared experts; dense MLPs; head = final norm + LM
head) and timed with CUDA events; their sum is printed next to the whole step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from .common import (
    add_batch_invariant_arg,
    apply_batch_invariant,
    commit,
    copy_bandwidth,
    median_ms,
    phase_fns,
    require_cuda,
    write_json,
)

__all__ = ["run_decode_bench", "add_decode_args", "run_from_args"]


def _graph(fn):
    """``fn`` captured in a CUDA graph (after two eager warm-up calls); returns the graph."""
    import torch

    fn()
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _weight_bytes(model) -> dict[str, int]:
    """Resident bytes of the model's weights by part (packed formats as stored)."""
    from ..layers.activations import GatedMLP
    from ..layers.linear import Linear
    from ..layers.moe import MoE, RoutedExperts

    out = {"attention": 0, "dense_mlp": 0, "shared_experts": 0, "routed_experts": 0, "router": 0,
           "lm_head": 0, "embed": 0, "norms": 0}

    def lin(m: Linear) -> int:
        return m.packed_weight.nbytes

    for layer in model.layers:
        a = layer.attn
        out["attention"] += lin(a.qkv) + lin(a.o)
        out["norms"] += 4 * (a.q_norm.weight.numel() + a.k_norm.weight.numel() + 2 * model.config.hidden_size)
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            e: RoutedExperts = mlp.experts
            out["routed_experts"] += e.gate_up_bank.nbytes + e.down_bank.nbytes
            out["router"] += mlp.router.numel() * 4 + (0 if mlp.bias is None else mlp.bias.numel() * 4)
            if mlp.shared is not None:
                out["shared_experts"] += lin(mlp.shared.gate_up) + lin(mlp.shared.down)
        elif isinstance(mlp, GatedMLP):
            out["dense_mlp"] += lin(mlp.gate_up) + lin(mlp.down)
    out["lm_head"] = lin(model.lm_head)
    out["embed"] = model.embed.rows.numel() * model.embed.rows.element_size()
    return out


def _kv_read_bytes(config, context: int, batch: int) -> int:
    """K and V bytes (bf16) the attention of one step reads for ``batch`` rows at ``context``
    tokens (the new token included)."""
    total = 0
    for lc in config.layers:
        seen = context if lc.sliding_window is None else min(context, lc.sliding_window)
        total += 2 * lc.num_kv_heads * lc.head_dim * 2 * seen
    return total * batch


def run_decode_bench(a: argparse.Namespace) -> dict:
    """Build, check, time; return the JSON-able result (see the module docstring)."""
    import torch

    from ..engine.block_manager import kv_groups
    from ..engine.cuda_graph import CudaGraphRunner
    from ..engine.kv_cache import PagedKVCache
    from ..io.synthetic import build_gpu_model, load_geometry
    from ..kernels.batch_invariant import batch_invariant
    from ..kernels.pdl import pdl_enabled, set_pdl
    from ..layers.moe import MoE
    from ..roofline import step35_bytes

    require_cuda("decode")
    dev = torch.device("cuda")
    if getattr(a, "shared_overlap", None) is not None:
        MoE.overlap_shared = a.shared_overlap == "on"
    if getattr(a, "pdl", None) is not None:
        set_pdl(a.pdl == "on")
    apply_batch_invariant(a)
    batches = [int(b) for b in a.batches.split(",")]
    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s", flush=True)

    g = load_geometry(a.geometry) | {"mtp_layers": a.mtp}
    if a.layers:
        g["layers"] = a.layers
        g["clamp_layers"] = [i for i in g["clamp_layers"] if i < a.layers]
    t0 = time.perf_counter()
    model = build_gpu_model(g, a.seed, dev, a.expert_format, progress=sys.stderr.isatty())
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    config = model.config
    wbytes = _weight_bytes(model)
    print(f"built {a.geometry} ({config.num_layers} layers, experts {a.expert_format}) in {build_s:.0f} s: "
          f"{sum(wbytes.values()) / 1e9:.1f} GB of weights, {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated",
          flush=True)
    accuracy = None
    if a.attention_weights == "fp8":
        accuracy = fp8_attention_accuracy(model, a.seed)
        print(f"FP8 attention weights ({accuracy['requantized']} weights): over {accuracy['tokens']} teacher-forced "
              f"tokens, top-1 agreement with bf16 {accuracy['top1_agreement']:.4f}, max |logit error| "
              f"{accuracy['max_abs_logit_error']:.4f} (logits up to {accuracy['max_abs_logit']:.2f})", flush=True)
        wbytes = _weight_bytes(model)
    acct = step35_bytes(config, a.context)
    fmt = "nvfp4" if a.expert_format == "nvfp4" else "bf16"

    bs = 16
    max_b = max(batches)
    per_seq = -(-(a.context + 1 + a.mtp) // bs)
    groups = kv_groups(config)
    cache = PagedKVCache(groups, [max_b * per_seq + 1] * len(groups), bs, torch.bfloat16, device=dev)
    gen = torch.Generator(device=dev).manual_seed(a.seed + 1)
    for t in cache.k + cache.v:
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16))
    perm = torch.randperm(max_b * per_seq, generator=torch.Generator().manual_seed(a.seed))
    tables = [perm[i * per_seq:(i + 1) * per_seq].tolist() for i in range(max_b)]

    verify_rows = sorted({b * (1 + a.mtp) for b in batches if b * (1 + a.mtp) <= 64}) if a.mtp else []
    runner = CudaGraphRunner(model, cache, max_b, per_seq, scratch_blocks=[max_b * per_seq] * len(groups),
                             buckets=sorted(set(batches) | set(verify_rows)))
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    print(f"captured {len(batches)} decode graphs in {capture_s:.1f} s", flush=True)

    results = []
    moe_layers = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]
    expert_bytes = 0
    if moe_layers:
        e0 = model.layers[moe_layers[0]].mlp.experts
        expert_bytes = (e0.gate_up_bank.nbytes + e0.down_bank.nbytes) // e0.num_experts
    for b in batches:
        try:
            results.append(_bench_batch(a, model, runner, cache, tables, groups, b, wbytes, expert_bytes, copy_bw))
            if a.mtp and b * (1 + a.mtp) in verify_rows:
                results[-1]["speculation"] = _bench_mtp(a, model, runner, tables, groups, b, results[-1]["step_ms"])
        except Exception as e:  # noqa: BLE001 - report it, go on with the other batch sizes
            import traceback

            traceback.print_exc()
            results.append({"batch": b, "error": f"{type(e).__name__}: {e}"})
    res = {
        "machine": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
        "geometry": a.geometry, "layers": config.num_layers, "expert_format": a.expert_format, "mtp": a.mtp,
        "attention_weights": a.attention_weights, "fp8_attention_accuracy": accuracy,
        "shared_expert_overlap": MoE.overlap_shared, "pdl": pdl_enabled(dev),
        "batch_invariant": batch_invariant(),
        "context": a.context, "seed": a.seed, "copy_bandwidth_Bps": copy_bw, "build_seconds": build_s,
        "capture_seconds": capture_s, "weight_bytes": wbytes, "weights_total_bytes": sum(wbytes.values()),
        "config_roofline_batch1": {"decode_bytes": acct["decode"][fmt]["total"], "kv_bytes": acct["kv_cache"],
                                   "floor_ms": (acct["decode"][fmt]["total"] + acct["kv_cache"]) / copy_bw * 1e3},
        "results": results,
    }
    return res


def fp8_attention_accuracy(model, seed: int, tokens: int = 256) -> dict:
    """Requantize ``model``'s attention projections to FP8 block (in place) and compare its logits
    with the bf16 ones over ``tokens`` random tokens, teacher-forced in one prefill: top-1 agreement
    and the largest absolute logit error."""
    import torch

    from ..engine.kv_cache import ContiguousKVCache

    dev = model.lm_head.packed_weight.data.device
    ids = torch.randint(3, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed + 3))
    ids, pos = ids.to(dev), torch.arange(tokens, device=dev)

    def logits():
        with torch.inference_mode():
            kv = ContiguousKVCache(model.config, tokens, torch.bfloat16, dev)
            return model.logits(model(ids, pos, kv))

    ref = logits()
    n = model.quantize_attention("fp8")
    got = logits()
    return {"tokens": tokens, "requantized": n,
            "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
            "max_abs_logit_error": float((ref - got).abs().max()), "max_abs_logit": float(ref.abs().max())}


def _bench_batch(a, model, runner, cache, tables, groups, b, wbytes, expert_bytes, copy_bw) -> dict:
    """One batch size: graph replay time, phases, distinct experts, byte floor."""
    import torch

    from ..engine.cuda_graph import DecodeKV

    config = model.config
    ids = torch.randint(3, config.vocab_size, (b,), generator=torch.Generator().manual_seed(b)).tolist()
    pos = [a.context] * b
    bt = [[tables[r]] * len(groups) for r in range(b)]
    logits = runner.run(ids, pos, bt)  # fills the static inputs
    torch.cuda.synchronize()
    finite = bool(torch.isfinite(logits).all())
    graph = runner.graphs[b]
    step_ms = median_ms(graph.replay, reps=a.reps)

    # distinct experts per MoE layer on this step's routing, and the phase split
    kv = DecodeKV(cache, [t[:b] for t in runner.tables], runner.seq_lens[:b], [s[:b] for s in runner.slots])
    phases, distinct = _phases(model, runner.ids[:b], runner.pos[:b], kv, a.reps)
    routed_read = sum(distinct) * expert_bytes
    step_bytes = (wbytes["attention"] + wbytes["dense_mlp"] + wbytes["shared_experts"] + wbytes["router"]
                  + wbytes["lm_head"] + wbytes["norms"] + b * 2 * config.hidden_size + routed_read
                  + _kv_read_bytes(config, a.context + 1, b))
    floor_ms = step_bytes / copy_bw * 1e3
    row = {"batch": b, "step_ms": step_ms, "tok_s": b / step_ms * 1e3, "step_bytes": step_bytes,
           "floor_ms": floor_ms, "roofline_tok_s": b / floor_ms * 1e3, "pct_of_roofline": 100 * floor_ms / step_ms,
           "distinct_experts_per_layer": statistics.mean(distinct) if distinct else 0,
           "routed_bytes": routed_read, "phases_ms": phases, "phases_sum_ms": sum(phases.values()),
           "logits_finite": finite}
    print(f"B={b}: {step_ms:.3f} ms/step, {row['tok_s']:.0f} tok/s; floor {floor_ms:.3f} ms "
          f"({step_bytes / 1e9:.2f} GB) -> {row['pct_of_roofline']:.1f}% of roofline; "
          f"phases {', '.join(f'{k} {v:.3f}' for k, v in phases.items())} (sum {row['phases_sum_ms']:.3f})",
          flush=True)
    return row


def _bench_mtp(a, model, runner, tables, groups, b: int, plain_ms: float) -> dict:
    """Speculation at batch ``b`` (module docstring): verify step, MTP drafting per r, effective tok/s."""
    import torch

    from ..engine.speculative import MTPProposer

    K, V, D = a.mtp, model.config.vocab_size, model.config.hidden_size
    gen = torch.Generator().manual_seed(b + 7)
    ids = torch.randint(3, V, (b * (K + 1),), generator=gen).tolist()
    pos = [a.context + j for _ in range(b) for j in range(K + 1)]
    bt = [[tables[r]] * len(groups) for r in range(b) for _ in range(K + 1)]
    logits = runner.run(ids, pos, bt)
    torch.cuda.synchronize()
    verify_ms = median_ms(runner.graphs[runner.bucket(len(ids))].replay, reps=a.reps)
    finite = bool(torch.isfinite(logits).all())

    class Seq:  # what MTPProposer reads of a request
        def __init__(self, toks):
            self.all_token_ids = toks

        @property
        def num_tokens(self):
            return len(self.all_token_ids)

    warm = 600  # rows of the first call: more than the MTP layers' window
    dev = runner.device

    def rows(n):
        return torch.randn(n, D, device=dev, dtype=torch.bfloat16)

    def drafting(graphs: bool) -> tuple[dict[int, float], int]:
        """ms per round by verified rows r (median), and the rounds' layers that replayed a graph."""
        reqs = [Seq(torch.randint(3, V, (a.context,), generator=gen).tolist()) for _ in range(b)]
        prop = MTPProposer(model, K, block_size=16, max_num_seqs=b,
                           max_model_len=a.context + 4 * (K + 1) * (a.reps + 8), max_num_batched_tokens=warm,
                           device=dev, graphs=graphs)
        room = {id(r): K for r in reqs}
        prop.draft(reqs, room, {id(r): (a.context - warm, rows(warm)) for r in reqs})  # base = context - warm
        ms = {}
        for r in range(1, K + 2):
            times = []
            for it in range(a.reps + 3):
                hidden = {}
                for q in reqs:
                    first = q.num_tokens - 1
                    q.all_token_ids = q.all_token_ids + torch.randint(3, V, (r,), generator=gen).tolist()
                    hidden[id(q)] = (first, rows(r + (K - (r - 1))))  # 1 + K rows computed, r verified
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = prop.draft(reqs, room, hidden)
                torch.cuda.synchronize()
                if it >= 3:
                    times.append((time.perf_counter() - t0) * 1e3)
            assert all(len(out[id(q)]) == K for q in reqs)
            ms[r] = statistics.median(times)
        n_graph = prop.num_graph_layers
        prop.release(set())
        del prop
        torch.cuda.empty_cache()
        return ms, n_graph

    draft_eager_ms, _ = drafting(False)
    draft_ms, graph_layers = drafting(True)
    eff = {}
    for acc in a.accepted:
        lo = min(max(int(acc), 1), K + 1)
        hi = min(lo + 1, K + 1)
        d = draft_ms[lo] + (acc - lo) * (draft_ms[hi] - draft_ms[lo])
        tok_s = b * acc / (verify_ms + d) * 1e3
        eff[str(acc)] = {"draft_ms": d, "step_ms": verify_ms + d, "tok_s": tok_s, "speedup": tok_s / (b / plain_ms * 1e3)}
    row = {"num_speculative_tokens": K, "verify_rows": len(ids), "verify_ms": verify_ms,
           "verify_over_plain": verify_ms / plain_ms, "draft_ms_by_rows": draft_ms,
           "draft_eager_ms_by_rows": draft_eager_ms, "draft_graph_layers": graph_layers, "effective": eff,
           "verify_logits_finite": finite}
    drafting = ", ".join(f"r={r} {v:.3f} (eager {draft_eager_ms[r]:.3f})" for r, v in draft_ms.items())
    effective = ", ".join(f"A={k} {v['tok_s']:.0f} tok/s ({v['speedup']:.2f}x)" for k, v in eff.items())
    print(f"B={b} MTP K={K}: verify {verify_ms:.3f} ms ({row['verify_over_plain']:.2f}x plain), drafting "
          f"{drafting} ms; effective {effective}", flush=True)
    return row


def _phases(model, ids, pos, kv, reps: int) -> tuple[dict[str, float], list[int]]:
    """ms per phase (each captured alone over all layers) and distinct experts per MoE layer."""
    import torch

    fns, hidden_last, distinct = phase_fns(model, ids, pos, kv)
    with torch.inference_mode():
        def head():
            model.logits(model.norm(hidden_last))

        out = {}
        for name, fn in list(fns.items()) + [("head", head)]:
            g = _graph(fn)
            out[name] = median_ms(g.replay, reps=reps)
            del g
    return out, distinct


def print_table(res: dict) -> None:
    """The result as a table (ms, tok/s, % of the byte roofline, phase split)."""
    bw = res["copy_bandwidth_Bps"] / 1e12
    attn = "attention FP8 block, " if res.get("attention_weights") == "fp8" else ""
    print(f"\nmemra bench decode: {res['geometry']} ({res['layers']} layers, routed experts {res['expert_format']}, "
          f"{attn}other weights bf16), context {res['context']}, {res['machine']}, copy {bw:.2f} TB/s, "
          f"commit {res['commit']}, PDL {'on' if res.get('pdl') else 'off'}, shared-expert overlap "
          f"{'on' if res.get('shared_expert_overlap') else 'off'}"
          + (", batch-invariant mode" if res.get("batch_invariant") else ""))
    cr = res["config_roofline_batch1"]
    print(f"config-only roofline at batch 1: {cr['decode_bytes'] / 1e9:.2f} GB weights + {cr['kv_bytes'] / 1e9:.3f} GB "
          f"KV -> {cr['floor_ms']:.3f} ms")
    hdr = ("| batch | ms/step | tok/s | GB read | floor ms | roofline tok/s | % of roofline | experts/layer "
           "| attention | router | routed | shared | dense | head | phase sum |")
    print(hdr)
    print("|" + " --- |" * (hdr.count("|") - 1))
    for r in res["results"]:
        if "error" in r:
            print(f"| {r['batch']} | error: {r['error']} |")
            continue
        p = r["phases_ms"]
        print(f"| {r['batch']} | {r['step_ms']:.3f} | {r['tok_s']:.0f} | {r['step_bytes'] / 1e9:.2f} | "
              f"{r['floor_ms']:.3f} | {r['roofline_tok_s']:.0f} | {r['pct_of_roofline']:.1f} | "
              f"{r['distinct_experts_per_layer']:.1f} | {p['attention']:.3f} | {p['router']:.3f} | "
              f"{p['routed_experts']:.3f} | {p['shared_experts']:.3f} | {p['dense_mlp']:.3f} | {p['head']:.3f} | "
              f"{r['phases_sum_ms']:.3f} |")
    spec = [r for r in res["results"] if "speculation" in r]
    if spec:
        accs = list(spec[0]["speculation"]["effective"])
        print(f"\nMTP K={res['mtp']} speculation (accepted length A forced: random weights accept nothing)")
        hdr = ("| batch | plain ms | verify ms | verify / plain | drafting r=1..K+1 ms: graphs (eager) | "
               + " | ".join(f"draft ms A={x}" for x in accs)
               + " | " + " | ".join(f"tok/s A={x} (x plain)" for x in accs) + " |")
        print(hdr)
        print("|" + " --- |" * (hdr.count("|") - 1))
        for r in spec:
            sp = r["speculation"]
            e = sp["effective"]
            dr = ", ".join(f"{v:.2f} ({sp['draft_eager_ms_by_rows'][k]:.2f})" for k, v in sp["draft_ms_by_rows"].items())
            print(f"| {r['batch']} | {r['step_ms']:.3f} | {sp['verify_ms']:.3f} | {sp['verify_over_plain']:.2f} | {dr} | "
                  + " | ".join(f"{e[x]['draft_ms']:.3f}" for x in accs) + " | "
                  + " | ".join(f"{e[x]['tok_s']:.0f} ({e[x]['speedup']:.2f})" for x in accs) + " |")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    """Add ``memra bench decode``'s options to ``p``."""
    p.add_argument("--geometry", default="full", help="synthetic geometry (memra/io/synthetic.py GEOMETRIES or JSON)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (None: all)")
    p.add_argument("--expert-format", default="nvfp4", choices=["nvfp4", "bf16"], help="routed experts' format")
    p.add_argument("--batches", default="1,4,16,64", help="decode batch sizes")
    p.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's KV cache")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights, tokens and KV contents")
    p.add_argument("--reps", type=int, default=30, help="timed replays per measurement (median)")
    p.add_argument("--attention-weights", default="bf16", choices=["bf16", "fp8"],
                   help="attention projections: bf16, or requantized to FP8 block 128x128 (then the bench also "
                        "reports the logits' agreement with bf16 over 256 tokens)")
    p.add_argument("--shared-overlap", choices=["on", "off"], default=None,
                   help="the shared expert on a second CUDA stream beside the router and the routed experts "
                        "(MoE.overlap_shared; default: that attribute's default, on)")
    p.add_argument("--pdl", choices=["on", "off"], default=None,
                   help="programmatic dependent launch of memra's Triton kernels (memra/kernels/pdl.py; default: "
                        "on where the GPU supports it, unless MEMRA_PDL=0)")
    add_batch_invariant_arg(p)
    p.add_argument("--mtp", type=int, default=0, help="MTP layers to keep and speculate with (0: none)")
    p.add_argument("--accepted", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.4, 4.0],
                   help="forced accepted lengths (tokens per sequence per step, bonus included)")
    p.add_argument("--json-out", default=None, help="write the result JSON here")


def run_from_args(a: argparse.Namespace) -> int:
    """Run for parsed arguments (:func:`add_decode_args`): table, and JSON with ``--json-out``.
    Returns 0. Raises: SystemExit without a CUDA GPU."""
    res = run_decode_bench(a)
    print_table(res)
    if a.json_out:
        write_json(a.json_out, res, "wrote")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``memra bench decode [args]`` (``python -m memra.bench.decode``)."""
    p = argparse.ArgumentParser(prog="memra bench decode", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_decode_args(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
