"""``memra bench moe-grouped``: the rate probe of the prefill grouped MoE GEMM
(:mod:`memra.kernels.moe_prefill`), the Python twin of the original system's ``moe-sk-repro``
(shared/seeds/002), at the flagship shape (E = 288 experts, top-8, D = 4096, I = 1280, one GPU).

For each token count T (default 512, 2048, 4096), expert format and routing it reports:
- the routing: active experts (of 288), max and mean rows per active expert, and the tile
  padding ratio (rows processed / real rows, each active expert's rows rounded up to the
  config's ``block_m``; also at 128 rows, the original's tile, ``pad128``);
- correctness first: :func:`moe_prefill` against :func:`moe_prefill_ref` on the same inputs
  (max-abs error / max-abs reference, pass at <= 1e-2; fp8 against the reference's exact
  emulation of the FP8 block recipe), and the split launch below against the whole call;
- time in CUDA graphs (:func:`memra.bench.common.cuda_graph_us`, CUDA events, median of
  ``--reps`` replays of ``inner`` back-to-back calls) of gate+up and of down SEPARATELY,
  plus ``moe_align`` and the whole :func:`moe_prefill` call. ``moe_prefill`` has no
  per-projection entry point, so :func:`prefill_parts` re-issues its launches (same kernels,
  same arguments, same scratch layout) as three closures: align, gate+up (the fp8 recipe's
  activation quantization + kernel A), down (zeroing the fp32 accumulator + kernel B + the
  cast to bf16). Its output is compared with ``moe_prefill``'s;
- per projection: FLOPs (gate+up 2 * P * 2I * D, down 2 * P * D * I, P = T * k real pairs),
  TFLOP/s, bytes (the weights of the active experts as stored + activations, each tensor once:
  gate+up reads x bf16 and writes act, down reads act and writes y bf16; act in the kernels'
  scratch dtype, bf16, or E4M3 codes + fp32 1x128 scales for the fp8 recipe), the roofline
  ``max(FLOPs / matmul ceiling, bytes / copy bandwidth)`` and % of it (roofline / time);
  and the layer total (gate+up + down, and with align);
- ceilings measured in the same run: bf16 ``torch.mm`` 8192^3; FP8 ``torch._scaled_mm``
  8192^3 (row-wise scales, or tensor-wise when row-wise is refused: the JSON says which);
  device-to-device copy (:func:`memra.bench.common.copy_bandwidth`). The matmul ceiling used
  is the FP8 one for fp8 banks under the FP8 block recipe (E4M3 x E4M3 dots), else bf16
  (nvfp4 and q8_0 are dequantized to bf16 dot operands inside the kernels: Hopper has no FP4
  tensor cores);
- the library baseline ``torch._grouped_mm`` (bf16, when torch has it) on the same sorted
  pairs: gate+up [P, D] x [E, D, 2I] and down [P, I] x [E, I, D] with per-expert offsets, the
  gathered activation rows prepared outside the timing (no SwiGLU, no routing weights, no
  combine: plain grouped GEMMs, bf16 weights).

Routing (:func:`skewed_routing`): the original's production distribution at 4096 tokens,
``[moe-sk-form] n_active=284, max_m=934`` (seed 002's receipt), reproduced with per-token
sampling WITHOUT replacement (the k experts of a token are distinct, as top-k gives; the
original's probe drew each pair independently) from fixed expert popularities
``w_r = exp(-SPAN * (r / (E - 1)) ** GAMMA)`` for popularity rank r (rank -> expert id by a
seeded permutation), i.e. Plackett-Luce / Gumbel-top-k: ``top_k(log w + Gumbel noise)``.
SPAN sets the hot/cold ratio (hence the experts that see no token), GAMMA the head's shape
(hence the hottest expert's rows). :func:`fit_skew` fitted them on the CPU, deterministically
(seeds 0..7, common random numbers, nested bisection: SPAN for a mean of 284 active experts
at each GAMMA, GAMMA for a mean hottest expert of 934 rows; 17 s): SPAN = 6.4025,
GAMMA = 0.8054. Achieved (E = 288, k = 8; seed 0, the default / mean over seeds 0..7 / range
over seeds 0..31; padding of seed 0 at 64- and 128-row tiles):

| T    | pairs | active               | max rows                | mean rows/active | pad64 | pad128 |
| ---- | ----- | -------------------- | ----------------------- | ---------------- | ----- | ------ |
| 512  |  4096 | 222 / 225.4 / 217-238 | 124 / 118.0 / 109-135  | 18.5             | 3.75  | 6.94   |
| 2048 | 16384 | 268 / 272.4 / 266-279 | 466 / 463.9 / 442-506  | 61.1             | 1.75  | 2.62   |
| 4096 | 32768 | 284 / 284.0 / 281-287 | 918 / 934.0 / 907-997  | 115.4            | 1.37  | 1.82   |

(seed 0 at 4096: 4 experts with zero rows; the hottest has 2.8 % of the pairs, 22 % of the
tokens, 8x the mean. The default block_m is 16 at T = 512: padding 1.54.) Uniform routing
(:func:`uniform_routing`, the same sampler with equal popularities), seed 0: 288 active at
every T, max 27 / 79 / 143 rows, padding 1.41 / 1.30 / 1.17 at the default block_m.

Command (H200): ``memra bench moe-grouped --t 512,2048,4096 --formats fp8,nvfp4,bf16
--routing skewed,uniform --reps 5 --json-out benchmarks/results/moe-grouped-h200.json``
(results and what bounds each format: memra/kernels/NOTES.md, "Prefill"). ``--tune`` first
re-tunes the tile table (:mod:`memra.bench.moe_tune`).

Wiring (for cli.py): ``add_moe_grouped_args(subparser)`` and ``run_from_args(namespace)``, or
``main(argv)``; ``python -m memra.bench.moe_grouped [args]`` works without the CLI.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, fields, replace

import torch

# the shared bench helpers; the routing, formats and accounting names are also this bench's API (__all__)
from .common import (
    CHECK_TOL,
    FLAGSHIP,
    FORMATS,
    SKEW_GAMMA,
    SKEW_SPAN,
    SKEW_TARGET,
    commit,
    copy_bandwidth,
    cuda_graph_us,
    eager_us,
    expert_nbytes,
    fit_skew,
    matmul_ceilings,
    padded_rows,
    projection_costs,
    random_bank,
    random_moe,
    require_cuda,
    routing_stats,
    routing_weights,
    skewed_routing,
    uniform_routing,
    write_json,
)
from .common import rel_err as _rel

__all__ = [
    "FLAGSHIP", "SKEW_SPAN", "SKEW_GAMMA", "FORMATS", "ROUTINGS",
    "skewed_routing", "uniform_routing", "routing_weights", "routing_stats", "padded_rows", "fit_skew",
    "expert_nbytes", "projection_costs", "roofline_us",
    "matmul_ceilings", "prefill_parts", "grouped_mm_inputs", "run_moe_grouped",
    "add_moe_grouped_args", "run_from_args", "main",
]

ROUTINGS = ("skewed", "uniform")
SPLIT_TOL = 5e-3  # split launch vs moe_prefill (fp32 atomic order, one bf16 rounding)


# ---------------------------------------------------------------------------------------
# accounting (routing, banks, projection costs and ceilings: memra.bench.common)


def roofline_us(flops: float, nbytes: float, flops_per_s: float, bytes_per_s: float) -> tuple[float, str]:
    """(µs, bound) of ``max(flops / flops_per_s, nbytes / bytes_per_s)``; bound "flops" or "bytes"."""
    if flops_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError("roofline_us: ceilings must be > 0")
    a, b = flops / flops_per_s * 1e6, nbytes / bytes_per_s * 1e6
    return (a, "flops") if a >= b else (b, "bytes")


# ---------------------------------------------------------------------------------------
# GPU


def prefill_parts(x, index, weight, gate_up, down, limit, config) -> dict:
    """:func:`memra.kernels.moe_prefill.prefill_launches` (the launches moe_prefill runs, callable
    one by one): {"align", "gate_up", "down", "out", "ids", "block_expert", "config"}."""
    from ..kernels.moe_prefill import prefill_launches

    return prefill_launches(x, index, weight, gate_up, down, limit, None, config)


def _inner(us_est: float, graph_us: float, max_inner: int) -> int:
    return max(2, min(max_inner, math.ceil(graph_us / max(us_est, 1.0))))


def _check_run_args(ts, fmt: str, routing: str) -> tuple[int, ...]:
    if fmt not in FORMATS:
        raise ValueError(f"moe-grouped: unknown format {fmt!r}; expected one of {FORMATS}")
    if routing not in ROUTINGS:
        raise ValueError(f"moe-grouped: unknown routing {routing!r}; expected one of {ROUTINGS}")
    ts = tuple(ts)
    if not ts or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in ts):
        raise ValueError(f"moe-grouped: token counts must be integers >= 1, got {ts!r}")
    return ts


def _config_for(fmt: str, t: int, shape: dict, overrides: dict | None):
    from ..kernels.moe_prefill import MoePrefillConfig, default_prefill_config

    cfg = default_prefill_config(fmt, t, shape["top_k"], shape["e"], shape["i"], shape["d"])
    if overrides:
        names = {f.name for f in fields(MoePrefillConfig)}
        bad = sorted(set(overrides) - names)
        if bad:
            raise ValueError(f"moe-grouped: unknown config keys {bad}; expected some of {sorted(names)}")
        cfg = replace(cfg, **overrides)
    return cfg


def run_moe_grouped(ts=(512, 2048, 4096), fmt: str = "nvfp4", routing: str = "skewed", *, seed: int = 0,
                    reps: int = 10, graph_us: float = 20000.0, max_inner: int = 50, limit: float | None = 7.0,
                    check: bool = True, baseline: bool = True, config: dict | None = None,
                    ceilings: dict | None = None, copy_bw: float | None = None, shape: dict | None = None,
                    banks=None, baseline_banks=None) -> dict:
    """Measures the grouped MoE GEMM for each T in ``ts`` at one format and routing (module
    docstring) on the current CUDA GPU. ``ceilings`` (:func:`matmul_ceilings`) and ``copy_bw``
    (bytes/s) are measured here when not given; ``banks`` / ``baseline_banks``: (gate_up, down)
    to reuse (else random_moe(fmt, seed=seed) / bf16 random banks). ``config``: MoePrefillConfig
    fields overriding the defaults (e.g. {"block_m": 128}).

    Returns a JSON-able dict {fmt, routing, shape, ceilings, copy_bytes_per_s, rows: one per T}.
    Raises: ValueError for a bad fmt / routing / ts / config key; RuntimeError without CUDA.
    """
    ts = _check_run_args(ts, fmt, routing)
    if not torch.cuda.is_available():
        raise RuntimeError("memra bench moe-grouped needs a CUDA GPU")
    from ..kernels.moe_prefill import moe_prefill, moe_prefill_ref

    shape = dict(shape or FLAGSHIP)
    e, k, d, i = shape["e"], shape["top_k"], shape["d"], shape["i"]
    for t in ts:  # config keys are checked before any GPU work
        _config_for(fmt, t, shape, config)
    dev = torch.device("cuda")
    if ceilings is None:
        ceilings = matmul_ceilings()
    if copy_bw is None:
        copy_bw = copy_bandwidth()
    gu, dn = banks if banks is not None else random_moe(fmt, dev, seed=seed, e=e, d=d, i=i)[:2]
    has_gmm = hasattr(torch, "_grouped_mm")
    if baseline and has_gmm and baseline_banks is None:
        if fmt == "bf16":
            baseline_banks = (gu, dn)
        else:
            g = torch.Generator(device=dev).manual_seed(seed + 7)
            baseline_banks = (random_bank("bf16", e, 2 * i, d, dev, g), random_bank("bf16", e, d, i, dev, g))
    rows = []
    for t in ts:
        cfg = _config_for(fmt, t, shape, config)
        index_cpu = (skewed_routing if routing == "skewed" else uniform_routing)(t, e, k, seed)
        st = routing_stats(index_cpu, e, cfg.block_m)
        index = index_cpu.to(dev)
        weight = routing_weights(t, k, seed).to(dev)
        gx = torch.Generator(device=dev).manual_seed(seed + 1000 + t)
        x = (torch.randn(t, d, device=dev, generator=gx) * 0.5).to(torch.bfloat16)
        f8 = cfg.fp8_act and fmt == "fp8"
        row = dict(t=t, fmt=fmt, routing=routing, config=asdict(cfg), **st)
        err = None
        try:
            y = moe_prefill(x, index, weight, gu, dn, limit, config=cfg)
            parts = prefill_parts(x, index, weight, gu, dn, limit, cfg)
            parts["gate_up"]()
            parts["down"]()
            torch.cuda.synchronize()
            row["split_vs_call_rel"] = _rel(parts["out"], y)
            row["split_ok"] = row["split_vs_call_rel"] <= SPLIT_TOL
            if check:
                r = moe_prefill_ref(x.float(), index, weight, gu, dn, limit, fp8_act=f8)
                row["rel_err"] = _rel(y, r)
                row["ref"] = "moe_prefill_ref(fp8_act=True): exact emulation of the FP8 block recipe" if f8 \
                    else "moe_prefill_ref (fp32, exact dequantized weights)"
                row["correct"] = bool(torch.isfinite(y).all()) and row["rel_err"] <= CHECK_TOL
                del r
            del y
            times = {}
            for name, fn in (("align", parts["align"]), ("gate_up", parts["gate_up"]), ("down", parts["down"]),
                             ("call", lambda x=x, index=index, weight=weight, cfg=cfg: moe_prefill(x, index, weight, gu, dn, limit, config=cfg))):
                inner = _inner(eager_us(fn), graph_us, max_inner)
                times[name] = cuda_graph_us([fn], reps, inner)
                times[name + "_inner"] = inner
        except Exception as ex:  # a launch / capture failure is reported in the row, not fatal
            err = f"{type(ex).__name__}: {str(ex)[:400]}"
            row.update(error=err, correct=False)
            torch.cuda.synchronize()
            rows.append(row)
            print(f"  {fmt} {routing} T={t}: ERROR {err}", flush=True)
            continue
        costs = projection_costs(fmt, t, st["pairs"], st["active"], d, i, f8)
        mm = ceilings["fp8_flops_per_s"] if f8 and ceilings.get("fp8_flops_per_s") else ceilings["bf16_flops_per_s"]
        row["matmul_ceiling"] = "fp8 torch._scaled_mm" if f8 and ceilings.get("fp8_flops_per_s") else "bf16 torch.mm"
        if f8 and not ceilings.get("fp8_flops_per_s"):
            row["matmul_ceiling"] += " (fp8 ceiling unavailable: " + str(ceilings.get("fp8_error")) + ")"
        for proj in ("gate_up", "down"):
            c = costs[proj]
            us = times[proj]
            roof, bound = roofline_us(c["flops"], c["bytes"], mm, copy_bw)
            row[proj] = dict(us=us, inner=times[proj + "_inner"], tflops=c["flops"] / (us * 1e-6) / 1e12,
                             flops=c["flops"], bytes=c["bytes"], weight_bytes=c["weight_bytes"],
                             act_bytes=c["act_bytes"], roofline_us=roof, bound=bound, pct_roofline=100.0 * roof / us)
        lay_roof = row["gate_up"]["roofline_us"] + row["down"]["roofline_us"]
        lay_us = row["gate_up"]["us"] + row["down"]["us"]
        row["layer"] = dict(us=lay_us, us_with_align=lay_us + times["align"], align_us=times["align"],
                            call_us=times["call"], roofline_us=lay_roof, pct_roofline=100.0 * lay_roof / lay_us,
                            pct_roofline_call=100.0 * lay_roof / times["call"],
                            tflops=(costs["gate_up"]["flops"] + costs["down"]["flops"]) / (lay_us * 1e-6) / 1e12)
        if baseline and has_gmm:
            row["grouped_mm"] = _baseline(x, index, baseline_banks, st, copy_bw, ceilings["bf16_flops_per_s"], reps,
                                          graph_us, max_inner)
        elif baseline:
            row["grouped_mm"] = dict(error="torch has no _grouped_mm")
        rows.append(row)
        _print_row(row)
        del parts, x
        torch.cuda.empty_cache()
    return dict(fmt=fmt, routing=routing, shape=shape, seed=seed, ceilings=ceilings, copy_bytes_per_s=copy_bw,
                rows=rows)


def grouped_mm_inputs(x: torch.Tensor, index: torch.Tensor, num_experts: int, i: int, seed: int = 99):
    """Inputs of the torch._grouped_mm baseline: the pairs sorted by expert (ties by pair number
    p = t * k + j, as moe_align), a_gu = x rows of the sorted pairs [P, D], a_dn random [P, i] in
    x's dtype, offs int32 [E] (cumulative row ends per expert, repeated for empty experts),
    counts int64 [E]."""
    k = index.shape[1]
    flat = index.reshape(-1).to(torch.int64)
    n = flat.numel()
    order = torch.sort(flat * n + torch.arange(n, device=flat.device)).indices
    counts = torch.bincount(flat, minlength=num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a_gu = x[order // k].contiguous()
    g = torch.Generator(device=x.device).manual_seed(seed)
    a_dn = (torch.randn(n, i, device=x.device, generator=g) * 0.5).to(x.dtype)
    return a_gu, a_dn, offs, counts


def _baseline(x, index, bbanks, st, copy_bw, bf16_flops, reps, graph_us, max_inner) -> dict:
    """torch._grouped_mm (bf16) on the pairs sorted by expert: gate+up [P, D] x [E, D, 2I] and
    down [P, I] x [E, I, D]; gathers untimed. Checked on the hottest expert's rows."""
    gu, dn = bbanks
    d = x.shape[1]
    i2 = gu.n
    a_gu, a_dn, offs, counts = grouped_mm_inputs(x, index, gu.e, i2 // 2)
    out = {}
    p = index.numel()
    try:
        for name, a, bank, n_out in (("gate_up", a_gu, gu, i2), ("down", a_dn, dn, d)):
            b = bank.data.transpose(-2, -1)  # [E, K, N], column-major per expert
            fn = lambda a=a, b=b: torch._grouped_mm(a, b, offs=offs)  # noqa: E731
            yv = fn()
            hot = int(counts.argmax())
            lo = int(offs[hot - 1]) if hot > 0 else 0
            ref = a[lo:int(offs[hot])].float() @ bank.data[hot].float().T
            inner = _inner(eager_us(fn), graph_us, max_inner)
            us = cuda_graph_us([fn], reps, inner)
            flops = 2.0 * p * a.shape[1] * n_out
            nbytes = st["active"] * bank.expert_nbytes + a.numel() * 2 + p * n_out * 2
            roof, bound = roofline_us(flops, nbytes, bf16_flops, copy_bw)
            out[name] = dict(us=us, inner=inner, tflops=flops / (us * 1e-6) / 1e12, bytes=nbytes, roofline_us=roof,
                             bound=bound, pct_roofline=100.0 * roof / us,
                             hot_expert_rel_err=_rel(yv[lo:int(offs[hot])], ref))
            del yv
        out["note"] = ("torch._grouped_mm bf16, rows pre-gathered by expert (untimed), no SwiGLU / routing "
                       "weights / combine; bytes = active experts' bf16 weights + A read + C written")
    except Exception as ex:
        out["error"] = f"{type(ex).__name__}: {str(ex)[:400]}"
        torch.cuda.synchronize()
    return out


# ---------------------------------------------------------------------------------------
# output


_HDR = (f"{'fmt':>5} {'routing':>7} {'T':>5} {'act':>4} {'max':>5} {'mean':>6} {'pad':>5} {'bm':>4} {'rel err':>8} "
        f"{'gu us':>8} {'gu TF/s':>7} {'gu %rf':>6} {'dn us':>8} {'dn TF/s':>7} {'dn %rf':>6} "
        f"{'layer us':>9} {'%rf':>5} {'call us':>8} {'gmm gu':>7} {'gmm dn':>7}")


def _print_row(r: dict, header: bool = False) -> None:
    if header:
        print(_HDR)
    if "error" in r:
        print(f"{r['fmt']:>5} {r['routing']:>7} {r['t']:>5} ERROR {r['error']}")
        return
    gmm = r.get("grouped_mm") or {}
    gg = gmm.get("gate_up", {}).get("us", float("nan"))
    gd = gmm.get("down", {}).get("us", float("nan"))
    ok = "" if r.get("correct", True) and r.get("split_ok", True) else " FAIL"
    print(f"{r['fmt']:>5} {r['routing']:>7} {r['t']:>5} {r['active']:>4} {r['max_rows']:>5} {r['mean_rows']:>6.1f} "
          f"{r['padding_ratio']:>5.2f} {r['block_m']:>4} {r.get('rel_err', float('nan')):>8.1e} "
          f"{r['gate_up']['us']:>8.1f} {r['gate_up']['tflops']:>7.1f} {r['gate_up']['pct_roofline']:>6.1f} "
          f"{r['down']['us']:>8.1f} {r['down']['tflops']:>7.1f} {r['down']['pct_roofline']:>6.1f} "
          f"{r['layer']['us']:>9.1f} {r['layer']['pct_roofline']:>5.1f} {r['layer']['call_us']:>8.1f} "
          f"{gg:>7.1f} {gd:>7.1f}{ok}", flush=True)


def print_table(res: dict) -> None:
    """Aligned summary of :func:`run_bench`'s result: one line per (format, routing, T)."""
    c = res["ceilings"]
    fp8 = f"{c['fp8_flops_per_s'] / 1e12:.0f} ({c['fp8_scaling']})" if c.get("fp8_flops_per_s") else "n/a"
    print(f"\nmoe-grouped on {res['machine']['gpu']}: ceilings bf16 mm {c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, "
          f"fp8 scaled_mm {fp8} TFLOP/s, D2D copy {res['copy_bytes_per_s'] / 1e12:.3f} TB/s; "
          f"commit {res['commit']}")
    print("us per call in CUDA graphs; %rf = roofline / time; pad = padded rows / rows at block_m; "
          "gmm = torch._grouped_mm bf16 baseline")
    first = True
    for run in res["runs"]:
        for r in run["rows"]:
            _print_row(r, header=first)
            first = False


def _parse_list(v: str, what: str, allowed=None) -> list[str]:
    items = [s.strip() for s in v.split(",") if s.strip()]
    if not items:
        raise SystemExit(f"memra bench moe-grouped: {what}: empty list")
    if allowed is not None:
        for s in items:
            if s not in allowed:
                raise SystemExit(f"memra bench moe-grouped: {what}: unknown value {s!r}; expected some of {allowed}")
    return items


def parse_args_checked(a: argparse.Namespace) -> dict:
    """Validates the parsed CLI arguments (no GPU needed). Returns dict(ts, formats, routings,
    config). Raises: SystemExit with a message for a bad value."""
    ts = []
    for v in _parse_list(a.t, "--t"):
        if not v.isdigit() or int(v) < 1:
            raise SystemExit(f"memra bench moe-grouped: --t: {v!r} is not an integer >= 1")
        ts.append(int(v))
    formats = _parse_list(a.formats, "--formats", FORMATS)
    routings = _parse_list(a.routing, "--routing", ROUTINGS)
    config = None
    if a.config:
        try:
            config = json.loads(a.config)
        except json.JSONDecodeError as e:
            raise SystemExit(f"memra bench moe-grouped: --config is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise SystemExit("memra bench moe-grouped: --config must be a JSON object of MoePrefillConfig fields")
        from ..kernels.moe_prefill import MoePrefillConfig

        names = {f.name for f in fields(MoePrefillConfig)}
        bad = sorted(set(config) - names)
        if bad:
            raise SystemExit(f"memra bench moe-grouped: --config: unknown keys {bad}; expected some of {sorted(names)}")
    for name in ("reps",):
        if getattr(a, name) < 1:
            raise SystemExit(f"memra bench moe-grouped: --{name} must be >= 1")
    if getattr(a, "tune_workers", None) is not None and a.tune_workers < 1:
        raise SystemExit("memra bench moe-grouped: --tune-workers must be >= 1")
    if (getattr(a, "tune_only", False) or getattr(a, "tune_out", None)) and not getattr(a, "tune", False):
        raise SystemExit("memra bench moe-grouped: --tune-only and --tune-out need --tune")
    return dict(ts=tuple(ts), formats=formats, routings=routings, config=config)


def run_bench(a: argparse.Namespace) -> dict:
    """All (format, routing) runs for parsed arguments; the result dict written as JSON
    (bench, date, machine, versions, commit, ceilings, copy bandwidth, method, runs)."""
    p = parse_args_checked(a)
    require_cuda("moe-grouped")
    import triton

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    t0 = time.time()
    copy_bw = copy_bandwidth()
    ceil = matmul_ceilings()
    print(f"device {props.name}: D2D copy {copy_bw / 1e12:.3f} TB/s, bf16 mm {ceil['bf16_flops_per_s'] / 1e12:.0f} "
          f"TFLOP/s, fp8 scaled_mm "
          f"{(ceil['fp8_flops_per_s'] or float('nan')) / 1e12:.0f} TFLOP/s "
          f"({ceil['fp8_scaling'] or ceil['fp8_error']})",
          flush=True)
    print(_HDR, flush=True)
    runs = []
    bbanks = None  # bf16 banks of the torch._grouped_mm baseline, made once for the non-bf16 formats
    for fmt in p["formats"]:
        banks = random_moe(fmt, dev, seed=a.seed)[:2]
        if fmt == "bf16":
            base = banks
        elif not a.no_baseline and hasattr(torch, "_grouped_mm"):
            if bbanks is None:
                g = torch.Generator(device=dev).manual_seed(a.seed + 7)
                e, d, i = FLAGSHIP["e"], FLAGSHIP["d"], FLAGSHIP["i"]
                bbanks = (random_bank("bf16", e, 2 * i, d, dev, g), random_bank("bf16", e, d, i, dev, g))
            base = bbanks
        else:
            base = None
        for routing in p["routings"]:
            runs.append(run_moe_grouped(p["ts"], fmt, routing, seed=a.seed, reps=a.reps, graph_us=a.graph_us,
                                        limit=a.limit, check=not a.no_check, baseline=not a.no_baseline,
                                        config=p["config"], ceilings=ceil, copy_bw=copy_bw, banks=banks,
                                        baseline_banks=base))
        del banks, base
        torch.cuda.empty_cache()
    return dict(
        bench="memra bench moe-grouped (prefill grouped MoE GEMM; seeds 002 moe-sk-repro)",
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        machine=dict(gpu=props.name, sms=props.multi_processor_count, memory_bytes=props.total_memory,
                     host=platform.node(), python=platform.python_version()),
        versions=dict(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda),
        commit=commit(), ceilings=ceil, copy_bytes_per_s=copy_bw,
        routing=dict(skew_span=SKEW_SPAN, skew_gamma=SKEW_GAMMA, target=SKEW_TARGET, seed=a.seed,
                     note="per-token sampling without replacement, weights exp(-span (rank/(E-1))^gamma)"),
        method=dict(timing="CUDA graph of `inner` back-to-back calls, CUDA events, median of reps replays",
                    reps=a.reps, graph_us=a.graph_us, limit=a.limit,
                    gate_up="act quantization (fp8 recipe) + kernel A (gate+up, SwiGLU clamp)",
                    down="zero fp32 accumulator + kernel B (down, routing weights, atomic combine) + cast",
                    bytes="active experts' weights as stored + x bf16 + act (scratch dtype) + y bf16, once each",
                    roofline="max(FLOPs / matmul ceiling, bytes / D2D copy bandwidth), ceilings from this run",
                    check_tol=CHECK_TOL, split_tol=SPLIT_TOL),
        runs=runs, elapsed_s=time.time() - t0)


def add_moe_grouped_args(p: argparse.ArgumentParser) -> None:
    """Add ``memra bench moe-grouped``'s options to ``p``."""
    p.add_argument("--t", default="512,2048,4096", help="comma list of token counts per prefill chunk")
    p.add_argument("--formats", default="nvfp4,fp8,bf16", help=f"comma list of expert formats: {','.join(FORMATS)}")
    p.add_argument("--routing", default="skewed,uniform", help="comma list of skewed,uniform")
    p.add_argument("--config", default=None,
                   help='JSON object of MoePrefillConfig fields overriding the defaults, e.g. \'{"block_m": 128}\'')
    p.add_argument("--reps", type=int, default=10, help="graph replays per measurement (median)")
    p.add_argument("--graph-us", type=float, default=20000.0, help="target µs of work per graph replay")
    p.add_argument("--limit", type=float, default=7.0, help="SwiGLU clamp")
    p.add_argument("--seed", type=int, default=0, help="routing, weights and activations")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with moe_prefill_ref")
    p.add_argument("--no-baseline", action="store_true", help="skip torch._grouped_mm")
    p.add_argument("--json-out", default=None, help="write the result JSON here")
    p.add_argument("--tune", action="store_true",
                   help="first tune the tile configurations for --formats at --t on skewed routing "
                        "(memra/bench/moe_tune.py) and write them to --tune-out; the bench then uses them "
                        "when they went to the table moe_prefill reads (no --tune-out)")
    p.add_argument("--tune-out", default=None,
                   help="tuning table to write; when not given, the one moe_prefill reads "
                        "(memra/kernels/moe_prefill_tuned.json, checked in)")
    p.add_argument("--tune-workers", type=int, default=None, help="processes compiling candidates in parallel")
    p.add_argument("--tune-only", action="store_true", help="with --tune: skip the bench afterwards")


def run_from_args(a: argparse.Namespace) -> int:
    """Run for parsed arguments (:func:`add_moe_grouped_args`): table and JSON. Returns 1 if any
    correctness check failed or a point errored, else 0. Raises: SystemExit with a message for a
    bad argument or without a CUDA GPU."""
    if getattr(a, "tune", False):
        from ..kernels.moe_prefill import TUNED_TABLE
        from .moe_tune import run_tune

        p = parse_args_checked(a)
        run_tune(p["ts"], p["formats"], a.tune_out or TUNED_TABLE, seed=a.seed, workers=a.tune_workers)
        if a.tune_only:
            return 0
    res = run_bench(a)
    print_table(res)
    if a.json_out:
        write_json(a.json_out, res)
    ok = all(r.get("correct", True) and r.get("split_ok", True) and "error" not in r
             for run in res["runs"] for r in run["rows"])
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``memra bench moe-grouped [args]`` (``python -m memra.bench.moe_grouped``)."""
    p = argparse.ArgumentParser(prog="memra bench moe-grouped", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_moe_grouped_args(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
