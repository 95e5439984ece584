"""``memra bench census``: the decode-kernel census (shared/seeds/003, decode-kernel-census)
in Python, for memra's weight-resident decode linear kernels (:mod:`memra.kernels.gemv`).

For each weight format x serving shape x decode width T it reports:
- µs per call: CUDA-graph replay of many back-to-back calls timed with CUDA events,
  median of ``--reps`` replays (graphs, as the decode step will run; no host launch cost).
  Each graph cycles through enough copies of the weight that the bytes it touches are
  several times the 60 MB L2 (no L2-resident weights), on random data (never zeros).
- TB/s achieved: (weight bytes + activation bytes read + output bytes written) / time.
- % of the device-to-device copy bandwidth measured in the same run (torch ``copy_`` of a
  >= 1 GiB buffer; bytes read + bytes written), the ceiling a streaming kernel can reach.
- ms per token: µs x calls per decode step (the layer count that has the shape: 12 full and
  33 sliding attention layers, 42 MoE layers with a shared expert, 3 dense layers, 1 head).
- correctness: every measured (format, shape, T) is first compared with the torch reference
  (``decode_linear_ref``) on fresh random inputs; the relative error is in the JSON.

Shapes (shared/STEP35.md; TP2 = the per-card halves): fused QKV + head gate (full layers 64
heads, sliding layers 96), o_proj, shared expert gate+up / down, dense MLP gate+up / down,
LM head, and the stacked gate+up of 8 routed experts (what a top-8 step reads per layer).

Then the MoE selected-expert curve (shared/seeds moe-sel-census; ``--moe-t``, default T = 1, 2, 4, 8;
memra/bench/moe_census.py): :func:`~memra.kernels.moe_decode.moe_decode` (gate+up with the
SwiGLU clamp, down with the routing weights, each distinct expert read once) at the flagship's
288 experts top-8, random routing: µs per call, µs per (token, expert) pair, distinct experts
read, TB/s, % of copy bandwidth, the ratio to T = 1, and the router's µs.

``--tune`` first sweeps a small candidate list of launch configurations per (format, shape,
T) and keeps the fastest (written with ``--table-out``; memra/kernels/gemv_configs.json is
the table the kernels load).

Output: an aligned table on stdout, JSON (machine, torch/triton versions, commit, ceilings,
every row), a PNG roofline chart if matplotlib is importable.

Wiring (for cli.py): ``add_census_args(subparser)`` and ``run_from_args(namespace)``, or
``main(argv)``; ``python -m memra.bench.census [args]`` works without the CLI.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .common import commit, copy_bandwidth, cuda_graph_us, require_cuda, write_json

__all__ = ["main", "run_from_args", "add_census_args", "run_census", "SHAPES", "shapes_for"]

HIDDEN = 4096
N_LAYERS = 45

# name, N, K, calls per decode step (TP1), note. TP2 halves the split dimension per card.
def shapes_for(tp: int) -> list[dict]:
    """The flagship's decode linear shapes at tensor parallel ``tp`` (1 or 2), per card.

    q/gate columns split by heads, k/v by KV heads, o_proj and down by their input.
    """
    if tp not in (1, 2):
        raise ValueError(f"census shapes: tp must be 1 or 2, got {tp}")
    d, hd, kv = HIDDEN, 128, 8
    rows = []

    def add(name, n, k, calls, what):
        rows.append(dict(name=f"{name}", tp=tp, n=n, k=k, calls=calls, what=what))

    for kind, heads, layers in (("full", 64, 12), ("swa", 96, 33)):
        h = heads // tp
        add(f"qkvg_{kind}", h * hd + 2 * (kv // tp) * hd + h, d, layers,
            f"q {h * hd} + k,v {kv // tp * hd} + gate {h} (fused, {layers} layers)")
        add(f"o_{kind}", d, h * hd, layers, f"o_proj {h}x128 -> {d} ({layers} layers)")
    add("shexp_gu", 2 * 1280 // tp, d, 42, "shared expert gate+up (42 MoE layers)")
    add("shexp_down", d, 1280 // tp, 42, "shared expert down (42 MoE layers)")
    add("dense_gu", 2 * 11264 // tp, d, 3, "dense MLP gate+up (3 layers)")
    add("dense_down", d, 11264 // tp, 3, "dense MLP down (3 layers)")
    add("head", 128896 // tp, d, 1, "LM head (once per token)")
    add("moe_gu_x8", 8 * 2 * 1280 // tp, d, 42, "8 routed experts' gate+up stacked (42 layers)")
    return rows


SHAPES = shapes_for(1) + shapes_for(2)


def _candidates(fmt: str, t: int):
    """Launch configurations tried by ``--tune``: CUDA-core FMA tiles (T <= 4), tensor-core
    tiles (any T), and cuBLAS for bf16."""
    from ..kernels.gemv import GemvConfig

    out = []
    fma = {  # (bn, bk, num_warps): the winners of a wider sweep on the H200 (2026-11-30)
        "bf16": [(8, 256, 4), (16, 256, 4), (16, 512, 8)],
        "fp8": [(16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 512, 8)],
        "nvfp4": [(8, 512, 4), (16, 512, 4), (32, 512, 4), (64, 512, 8)],
        "q8_0": [(16, 256, 4), (8, 256, 4), (16, 512, 8), (32, 256, 4)],
    }[fmt]
    dot = [(32, 128, 4, 3), (64, 128, 4, 3)]
    if t > 16:  # x tile [BT, bk] bf16 rivals the weight tile: taller weight tiles amortise its loads
        dot += [(128, 128, 8, 3), (128, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3), (256, 64, 8, 3)]
    if t <= 2 and fmt == "nvfp4":  # fp16x2 sub-block sums (f16); the fp32 path won only at tiny shapes
        out += [GemvConfig(bn, bk, s, False, nw, 2, f16=True, prefetch=True) for bn, bk, nw in
                [(64, 512, 4), (128, 256, 4), (32, 512, 4)] for s in (1, 2, 4)]
        out += [GemvConfig(128, 256, 2, False, 4, 2, f16=True),
                GemvConfig(64, 256, 4, False, 4, 2, f16=True, prefetch=True)]
        out += [GemvConfig(8, 512, s, False, 4, 2) for s in (1, 2, 4)]  # fp32 path: kept at the shared-expert shapes
    elif t <= 2:
        out += [GemvConfig(bn, bk, s, False, nw, 2, prefetch=pf) for bn, bk, nw in fma for s in (1, 2, 4, 8)
                for pf in (False, True)]
    elif t <= 4:
        out += [GemvConfig(bn, bk, s, False, nw, 2, prefetch=pf) for bn, bk, nw in fma[:2] for s in (1, 4)
                for pf in (False, True)]
    if t <= 4 and fmt == "fp8":  # fp16x2 unit sums (f16): 64-128 rows x 256 codes, next tile prefetched
        out += [GemvConfig(bn, bk, s, False, nw, 2, f16=True, prefetch=pf) for bn, bk, nw, pf in
                [(64, 256, 4, True), (128, 128, 4, True), (128, 256, 8, True), (32, 512, 4, True), (64, 256, 4, False),
                 (32, 256, 4, False)] for s in (1, 2, 4)]
    out += [GemvConfig(bn, bk, s, True, nw, st) for bn, bk, nw, st in dot for s in (1, 2, 4)] if t > 2 else []
    if fmt == "bf16":
        out.append(GemvConfig(16, 128, 1, True, 4, 2, library=True))
    return out


def _random_weight(fmt: str, n: int, k: int, gen, device):
    """Random packed weight (never zeros): codes uniform over their range, scales in a
    moderate range so that outputs stay O(1) for unit activations."""
    import torch

    from ..kernels.gemv import DecodeWeight

    if fmt == "bf16":
        data = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        return DecodeWeight(fmt, n, k, data, None, "bf16")
    if fmt == "fp8":
        data = (torch.randn(n, k, generator=gen, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen, device=device) * 1e-3 + 1e-4
        return DecodeWeight(fmt, n, k, data, scale, "fp8")
    if fmt == "q8_0":
        data = torch.randint(-127, 128, (n, k), generator=gen, device=device, dtype=torch.int8)
        scale = (torch.rand(n, k // 32, generator=gen, device=device) * 3e-4 + 1e-5).to(torch.float16)
        return DecodeWeight(fmt, n, k, data, scale, "q8_0")
    if fmt == "nvfp4":
        data = torch.randint(0, 256, (n, k // 2), generator=gen, device=device, dtype=torch.uint8)
        # UE4M3 bytes 0x08..0x2f: 2^-6 .. ~0.9 (ggml half-scale): weights up to ~11
        scale = torch.randint(0x08, 0x30, (n, k // 16), generator=gen, device=device, dtype=torch.uint8)
        return DecodeWeight(fmt, n, k, data, scale, "nvfp4")
    raise ValueError(f"census: unknown format {fmt!r}")


def _calls(ws, x, y, yb, cfg):
    """One callable per weight copy: the Triton kernel into fp32 ``y``, or for a library
    config cuBLAS into bf16 ``yb`` (its native output)."""
    import torch

    from ..kernels import gemv

    if cfg.library:
        return [lambda w=w: torch.mm(x, w.data.t(), out=yb) for w in ws]
    return [lambda w=w: gemv.decode_linear(x, w, config=cfg, out=y) for w in ws]


def _tolerance(fmt: str, cfg) -> float:
    # fp32 FMAs over exact weights: summation order only (nvfp4 f16: fp16 sub-block sums).
    # Dot path: bf16 operands, exact
    # for bf16/nvfp4 weights and fp8 codes (block scale applied to the fp32 product),
    # q8_0 weights rounded to bf16 (<= 2^-9 each). cuBLAS: bf16 output (2^-9 relative).
    if cfg.library:
        return 1e-2
    if fmt in ("nvfp4", "fp8") and cfg.f16 and not cfg.dot:  # fp16 sums of 16 products (nvfp4: <= 6.4e-4)
        return 2e-3
    if not cfg.dot or fmt != "q8_0":
        return 1e-4
    return 5e-3


def run_census(a: argparse.Namespace) -> dict:
    """Measure every (format, shape, T) point selected by ``a`` on the current CUDA GPU.

    Each point is checked against the torch reference on random weights first, then timed by
    CUDA-graph replay with weight copies rotated past L2. Returns the result dict written as JSON
    (machine, versions, commit, copy-bandwidth ceiling in TB/s, one row per point with µs per
    call, TB/s, % of copy bandwidth and ms per token).

    Raises:
        SystemExit: no CUDA device, or an unknown format or shape name.
    """
    import torch
    import triton

    from ..kernels import gemv

    require_cuda("census")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    for f in formats:
        if f not in gemv.FORMATS:
            raise SystemExit(f"memra bench census: unknown format {f!r}; expected some of {gemv.FORMATS}")
    ts = [int(v) for v in a.t.split(",")]
    tps = [int(v) for v in a.tp.split(",")]
    want = None if a.shapes == "all" else set(a.shapes.split(","))
    shapes = [s for tp in tps for s in shapes_for(tp) if want is None or s["name"] in want]

    t_start = time.time()
    copy_bw = copy_bandwidth()
    print(f"device {props.name}, {props.multi_processor_count} SMs; D2D copy {copy_bw / 1e12:.3f} TB/s "
          f"(read + write, 2 GiB)", flush=True)
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed)
    rows: list[dict] = []
    table: dict[str, dict] = {}
    baseline_rows: list[dict] = []
    for shp in shapes:
        n, k = shp["n"], shp["k"]
        for fmt in formats:
            w0 = _random_weight(fmt, n, k, gen, dev)
            wbytes = w0.nbytes
            ncopies = max(1, math.ceil(a.rotate_bytes / wbytes))
            ws = [w0] + [_random_weight(fmt, n, k, gen, dev) for _ in range(ncopies - 1)]
            for t in ts:
                x = torch.randn(t, k, generator=gen, device=dev).to(torch.bfloat16)
                y = torch.empty(t, n, device=dev, dtype=torch.float32)
                yb = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
                io_bytes = t * k * 2 + t * n * 4
                inner = max(ncopies, min(a.max_inner, math.ceil(a.graph_us * 1e-6 * copy_bw / (wbytes + io_bytes))))
                cands = _candidates(fmt, t) if a.tune else [gemv.pick_config(fmt, n, k, t, dev)]
                best = None
                tried = []
                for cfg in cands:
                    steps = -(-k // cfg.bk)
                    if cfg.split_k > 1 and steps < 2 * cfg.split_k:
                        continue
                    try:
                        us = cuda_graph_us(_calls(ws, x, y, yb, cfg), a.tune_reps if a.tune else a.reps, inner)
                    except Exception as e:  # a config the compiler rejects is skipped, and said
                        print(f"  skip {fmt} {shp['name']} T={t} {cfg}: {type(e).__name__}: {str(e)[:200]}",
                              flush=True)
                        continue
                    tried.append((us, cfg))
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best is None:
                    raise SystemExit(f"census: no configuration ran for {fmt} {shp} T={t}")
                cfg = best[1]
                if a.tune:  # re-time the winner with the full repetition count
                    us = cuda_graph_us(_calls(ws, x, y, yb, cfg), a.reps, inner)
                else:
                    us = best[0]
                # correctness on fresh inputs with the chosen config
                xc = torch.randn(t, k, generator=gen, device=dev).to(torch.bfloat16)
                yk = gemv.decode_linear(xc, w0, config=cfg)
                yr = gemv.decode_linear_ref(xc, w0)
                rel = float((yk - yr).abs().max() / yr.abs().max().clamp_min(1e-30))
                ok = bool(torch.isfinite(yk).all()) and rel <= _tolerance(fmt, cfg)
                tot = wbytes + io_bytes
                tbs = tot / (us * 1e-6) / 1e12
                row = dict(shape=shp["name"], tp=shp["tp"], n=n, k=k, fmt=fmt, t=t, us=us,
                           weight_bytes=wbytes, io_bytes=io_bytes, tbs=tbs,
                           pct_copy=100.0 * tot / (us * 1e-6) / copy_bw,
                           calls_per_token=shp["calls"], ms_per_token=us * shp["calls"] / 1000.0,
                           rel_err=rel, correct=ok, config=asdict(cfg), copies=ncopies, inner=inner,
                           kernel="cuBLAS torch.mm (bf16 out)" if cfg.library else "triton",
                           tried=len(tried))
                rows.append(row)
                table[f"{fmt}:{n}:{k}:{gemv._bucket_t(t)}"] = asdict(cfg)
                print(f"{shp['name']:>11} tp{shp['tp']} {n:>6}x{k:<6} {fmt:>5} T={t:<2} {us:9.2f} us "
                      f"{tbs:5.2f} TB/s {row['pct_copy']:5.1f}% {row['ms_per_token']:7.3f} ms/tok "
                      f"err {rel:.1e}{'' if ok else ' FAIL'}  {cfg.bn}x{cfg.bk} s{cfg.split_k} "
                      f"{'cublas' if cfg.library else 'dot' if cfg.dot else 'fma'}{'+pf' if cfg.prefetch else ''} w{cfg.num_warps}", flush=True)
                del x, y
            del ws, w0
            torch.cuda.empty_cache()
        if a.baseline and "bf16" in formats:  # torch / cuBLAS bf16 GEMV at the same shape
            wt = [(torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
                  for _ in range(max(1, math.ceil(a.rotate_bytes / (2 * n * k))))]
            for t in ts:
                x = torch.randn(t, k, generator=gen, device=dev).to(torch.bfloat16)
                yb = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
                tot = 2 * n * k + t * k * 2 + t * n * 2
                inner = max(len(wt), min(a.max_inner, math.ceil(a.graph_us * 1e-6 * copy_bw / tot)))
                us = cuda_graph_us([lambda w=w, x=x, yb=yb: torch.mm(x, w.t(), out=yb) for w in wt], a.reps, inner)
                baseline_rows.append(dict(shape=shp["name"], tp=shp["tp"], n=n, k=k, fmt="bf16", t=t, us=us,
                                          tbs=tot / (us * 1e-6) / 1e12, pct_copy=100.0 * tot / (us * 1e-6) / copy_bw,
                                          kernel="torch.mm (cuBLAS)"))
            del wt
            torch.cuda.empty_cache()
    result = dict(
        bench="memra bench census (decode linear kernels)",
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        machine=dict(gpu=props.name, sms=props.multi_processor_count, memory_bytes=props.total_memory,
                     host=platform.node(), python=platform.python_version()),
        versions=dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda),
        commit=commit(),
        ceilings=dict(d2d_copy_bytes_per_s=copy_bw, d2d_copy_note="torch copy_ of 2 GiB, bytes read + written"),
        method=dict(timing="CUDA graph of `inner` back-to-back calls cycling through `copies` weight copies "
                           "(> L2), CUDA events, median of reps replays", reps=a.reps,
                    bytes="weight bytes (codes + scales) + x bf16 + y fp32", tuned=bool(a.tune)),
        rows=rows, baseline=baseline_rows, elapsed_s=time.time() - t_start,
    )
    if a.table_out:
        write_config_table(a.table_out, table, props.name,
                           f"tuned by `memra bench census --tune` on {props.name} ({result['date']}); "
                           "key fmt:N:K:T-bucket (T rounded up to 1, 2, 4, 8, 16, 32, 64)")
    return result


def write_config_table(path: str | Path, configs: dict[str, dict], device: str, note: str) -> None:
    """Write a launch-configuration table (the form of memra/kernels/gemv_configs.json): ``note``,
    ``device`` and ``configs`` keyed ``"fmt:N:K:T"`` (sorted, one entry per line, so diffs stay
    readable)."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(configs.items()))
    Path(path).write_text(f'{{\n "note": {json.dumps(note)},\n "device": {json.dumps(device)},\n'
                          f' "configs": {{\n{body}\n }}\n}}\n')


def print_table(res: dict) -> None:
    """Aligned summary: one line per (shape, tp, format, T)."""
    cbw = res["ceilings"]["d2d_copy_bytes_per_s"] / 1e12
    print(f"\ncensus on {res['machine']['gpu']}: D2D copy {cbw:.3f} TB/s; torch {res['versions']['torch']}, "
          f"triton {res['versions']['triton']}, commit {res['commit']}")
    hdr = f"{'shape':<11} {'tp':>2} {'N x K':>13} {'fmt':>5} {'T':>2} {'us/call':>9} {'TB/s':>5} " \
          f"{'%copy':>6} {'calls':>5} {'ms/tok':>7} {'ok':>3}"
    print(hdr)
    print("-" * len(hdr))
    for r in res["rows"]:
        print(f"{r['shape']:<11} {r['tp']:>2} {str(r['n']) + 'x' + str(r['k']):>13} {r['fmt']:>5} {r['t']:>2} "
              f"{r['us']:9.2f} {r['tbs']:5.2f} {r['pct_copy']:6.1f} {r['calls_per_token']:>5} "
              f"{r['ms_per_token']:7.3f} {'yes' if r['correct'] else 'NO':>3}")
    if res.get("baseline"):
        print("\nbaseline torch.mm (cuBLAS) bf16:")
        for r in res["baseline"]:
            print(f"{r['shape']:<11} {r['tp']:>2} {str(r['n']) + 'x' + str(r['k']):>13} {'bf16':>5} {r['t']:>2} "
                  f"{r['us']:9.2f} {r['tbs']:5.2f} {r['pct_copy']:6.1f}")
    # decode-step totals per format at T=1 (the shapes of one TP configuration)
    for tp in sorted({r["tp"] for r in res["rows"]}):
        for fmt in sorted({r["fmt"] for r in res["rows"]}):
            sel = [r for r in res["rows"] if r["tp"] == tp and r["fmt"] == fmt and r["t"] == 1
                   and r["shape"] != "moe_gu_x8"]
            if sel:
                ms = sum(r["ms_per_token"] for r in sel)
                floor = sum((r["weight_bytes"] + r["io_bytes"]) * r["calls_per_token"] for r in sel) / (cbw * 1e12) * 1e3
                print(f"tp{tp} {fmt:>5} T=1 non-routed linear layers: {ms:.3f} ms/token "
                      f"(copy-bandwidth floor {floor:.3f} ms, {100 * floor / ms:.1f}%)")


def plot(res: dict, path: str) -> str:
    """PNG: achieved TB/s against bytes per call, per format, with the copy ceiling."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # matplotlib is optional
        return f"no PNG: matplotlib not importable ({type(e).__name__})"
    cbw = res["ceilings"]["d2d_copy_bytes_per_s"] / 1e12
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, tsel in zip(axes, (1, 8)):
        for fmt, mk in zip(("bf16", "fp8", "nvfp4", "q8_0"), "os^D"):
            pts = [r for r in res["rows"] if r["fmt"] == fmt and r["t"] == tsel]
            if pts:
                ax.scatter([(r["weight_bytes"] + r["io_bytes"]) / 1e6 for r in pts], [r["tbs"] for r in pts],
                           marker=mk, label=fmt)
        ax.axhline(cbw, color="k", ls="--", lw=1, label=f"D2D copy {cbw:.2f} TB/s")
        ax.axhline(0.8 * cbw, color="gray", ls=":", lw=1, label="80% of copy")
        ax.set_xscale("log")
        ax.set_xlabel("bytes per call (MB, log)")
        ax.set_title(f"decode linear kernels, T = {tsel}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("achieved TB/s")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"memra census on {res['machine']['gpu']} ({res['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"PNG written to {path}"


def add_census_args(p: argparse.ArgumentParser) -> None:
    """Add ``memra bench census``'s options to ``p``."""
    p.add_argument("--formats", default="bf16,fp8,nvfp4,q8_0", help="comma list of bf16,fp8,nvfp4,q8_0")
    p.add_argument("--tp", default="1,2", help="tensor-parallel shapes: comma list of 1,2")
    p.add_argument("--t", default="1,2,4,8,16", help="decode widths (columns), each 1..64")
    p.add_argument("--shapes", default="all", help="comma list of shape names, or all")
    p.add_argument("--tune", action="store_true", help="sweep launch configurations and keep the fastest")
    p.add_argument("--table-out", default=None, help="write the tuned configuration table (JSON) here")
    p.add_argument("--json-out", default=None, help="write the census JSON here")
    p.add_argument("--png-out", default=None, help="write the roofline chart here (needs matplotlib)")
    p.add_argument("--reps", type=int, default=15, help="graph replays per measurement (median)")
    p.add_argument("--tune-reps", type=int, default=5, help="graph replays per candidate when tuning")
    p.add_argument("--graph-us", type=float, default=1000.0, help="target µs of work per graph replay")
    p.add_argument("--max-inner", type=int, default=400, help="most calls captured in one graph")
    p.add_argument("--rotate-bytes", type=float, default=240e6,
                   help="weight copies per measurement cover at least this many bytes (> L2)")
    p.add_argument("--baseline", action="store_true", help="also time torch.mm (cuBLAS) for bf16")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and activations")
    p.add_argument("--moe-t", default="1,2,4,8",
                   help="MoE selected-expert curve (memra/bench/moe_census.py): token counts, or '' to skip")
    p.add_argument("--moe-formats", default="nvfp4", help="routed-expert formats of the MoE curve")


def run_from_args(a: argparse.Namespace) -> int:
    """Run the census for parsed arguments (:func:`add_census_args`): table, PNG, JSON.
    Returns the exit status (1 if any kernel disagreed with its reference).

    Raises: SystemExit with a message for a bad --t / --formats value or without a CUDA GPU.
    """
    for v in a.t.split(","):
        if not v.strip().isdigit() or not 1 <= int(v) <= 64:
            raise SystemExit(f"memra bench census: --t: {v!r} is not an integer in 1..64")
    res = run_census(a)
    print_table(res)
    if a.moe_t:
        from .moe_census import moe_sel_census, print_moe_table

        ts = tuple(int(v) for v in a.moe_t.split(","))
        res["moe_sel"] = []
        for fmt in a.moe_formats.split(","):
            m = moe_sel_census(ts, fmt, reps=a.reps)
            print_moe_table(m)
            res["moe_sel"].append(m)
    if a.png_out:
        res["png"] = plot(res, a.png_out)
        print(res["png"])
    if a.json_out:
        write_json(a.json_out, res)
    moe_ok = all(r.get("correct", True) for m in res.get("moe_sel", []) for r in m["rows"])
    return 0 if all(r["correct"] for r in res["rows"]) and moe_ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``memra bench census [args]`` (``python -m memra.bench.census``)."""
    p = argparse.ArgumentParser(prog="memra bench census", description=__doc__.split("\n\n")[0])
    add_census_args(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
