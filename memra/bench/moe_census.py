"""MoE decode census: the routed-expert kernels (memra/kernels/moe_decode.py) at the
Step-3.5-Flash flagship shape (E = 288 experts, top-8, D = 4096, I = 1280) on random
weights generated on the GPU and random routing (each token's 8 experts distinct, drawn
uniformly), timed in CUDA graphs.

Per T: µs per call (gate+up and down kernels, grouping and the output cast; also with the
one-launch Triton grouping, ``us_triton_group``, and with every token on the same 8 experts,
``us_same``: the marginal cost of a token when the weights are shared), µs per
(token, expert) pair, bytes read (distinct experts x bytes per expert), achieved TB/s and
% of the device-to-device copy bandwidth measured in the same run, the ratio to T = 1
(the issue's target: T = 2 <= 1.3x T = 1), and the relative error against
:func:`memra.kernels.moe_decode.moe_decode_ref` on one fresh routing; plus µs of
:func:`moe_route` (router GEMV + sigmoid + top-k).

Command (H200): ``python -m memra.bench.moe_census --fmt nvfp4 --t 1,2,4,8 --json-out moe.json``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from ..kernels.moe_decode import default_moe_config, moe_decode, moe_decode_ref, moe_route
from ..kernels.moe_prefill import grouped_decode_config, moe_prefill
from .common import FLAGSHIP, copy_bandwidth, cuda_graph_us, random_moe, random_routing


def moe_sel_census(ts=(1, 2, 4, 8), fmt: str = "nvfp4", device: str = "cuda", reps: int = 30, inner: int = 16,
                   routings: int = 8, limit: float | None = 7.0, check: bool = True) -> dict:
    """Times :func:`moe_decode` at the flagship shape for each T in ``ts`` (see module docstring).

    Returns a JSON-able dict: ``shape``, ``fmt``, ``copy_tbs`` (ceiling), ``route`` {t: µs},
    and ``rows``: one dict per T with us, us_per_pair, distinct (mean distinct experts per
    call), bytes, tbs, pct_copy, ratio_t1, rel_err, correct.
    """
    dev = torch.device(device)
    e, k, d, i = FLAGSHIP["e"], FLAGSHIP["top_k"], FLAGSHIP["d"], FLAGSHIP["i"]
    gu, dn, gen = random_moe(fmt, dev)
    per_expert = gu.expert_nbytes + dn.expert_nbytes
    copy_bw = copy_bandwidth()
    router = torch.randn(e, d, device=dev, generator=gen) * 0.02
    bias = torch.randn(e, device=dev, generator=gen) * 0.01
    rows, route = [], {}
    tol = 4e-3 if fmt == "nvfp4" else 1e-5  # nvfp4: see NVFP4_TOL in tests/test_kernels_moe.py
    for t in ts:
        xs, calls, distinct = [], [], []
        for _ in range(routings):
            x = (torch.randn(t, d, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
            idx, w = random_routing(t, e, k, dev, gen)
            y = torch.empty_like(x)
            distinct.append(int(torch.unique(idx).numel()))
            xs.append((x, idx, w, y))
            calls.append(lambda x=x, idx=idx, w=w, y=y: moe_decode(x, idx, w, gu, dn, limit, out=y))
        us = cuda_graph_us(calls, reps, inner)
        cfg_tg = replace(default_moe_config(fmt, t, k, e, i, d), group="triton")
        try:  # reported, not fatal: the rest of the row stands on the default (torch) grouping
            us_tg, tg_err = cuda_graph_us([lambda a=a, c=cfg_tg: moe_decode(a[0], a[1], a[2], gu, dn, limit, out=a[3],
                                                                        config=c) for a in xs], reps, inner), None
        except Exception as ex:
            us_tg, tg_err = float("nan"), f"{type(ex).__name__}: {str(ex)[:300]}"
        same = []  # every token on the same 8 experts (e.g. speculative tokens): the marginal cost of a token
        for x, idx, w, y in xs:
            idx_s = idx[:1].expand(t, k).contiguous()
            same.append(lambda x=x, idx=idx_s, w=w, y=y: moe_decode(x, idx, w, gu, dn, limit, out=y))
        us_same = cuda_graph_us(same, reps, inner)
        h = xs[0][0]
        route[t] = cuda_graph_us([lambda h=h: moe_route(h, router, bias, k, 3.0)], reps, inner)
        nd = sum(distinct) / len(distinct)
        nbytes = nd * per_expert
        row = dict(t=t, us=us, us_triton_group=us_tg, triton_group_error=tg_err, us_same=us_same,
                   us_per_pair=us / (t * k), distinct=nd, bytes=nbytes, tbs=nbytes / (us * 1e-6) / 1e12,
                   pct_copy=100.0 * nbytes / (us * 1e-6) / copy_bw)
        if check:  # fp32 activations (same values) so that the output's rounding does not hide errors
            x, idx, w, _ = xs[-1]
            yk = moe_decode(x.float(), idx, w, gu, dn, limit)
            yr = moe_decode_ref(x.float(), idx, w, gu, dn, limit)
            rel = float((yk - yr).abs().max() / yr.abs().max().clamp_min(1e-30))
            row.update(rel_err=rel, correct=bool(torch.isfinite(yk).all()) and rel <= tol)
        rows.append(row)
    for r in rows:
        r["ratio_t1"] = r["us"] / rows[0]["us"]
        r["ratio_same_t1"] = r["us_same"] / rows[0]["us_same"]
    return dict(shape=dict(FLAGSHIP), fmt=fmt, device=torch.cuda.get_device_name(dev), copy_tbs=copy_bw / 1e12,
                per_expert_bytes=per_expert, route_us=route, rows=rows, reps=reps, inner=inner, routings=routings)


def moe_config_sweep(ts=(1, 2), fmt: str = "nvfp4", configs=None, device: str = "cuda", reps: int = 20,
                     inner: int = 16, routings: int = 8, limit: float | None = 7.0) -> list[dict]:
    """Times :func:`moe_decode` for each launch configuration in ``configs`` (a list of
    :class:`~memra.kernels.moe_decode.MoeDecodeConfig`; default: a small grid around the defaults)
    at the flagship shape, random routing. Every configuration is also checked against
    :func:`moe_decode_ref` on the first routing (bf16 x, rel. error <= 1e-2 of max |y|). Returns
    rows {t, config, us, rel_err, correct} (configs that fail to compile: ``error``)."""
    from dataclasses import asdict

    dev = torch.device(device)
    e, k, d, i = FLAGSHIP["e"], FLAGSHIP["top_k"], FLAGSHIP["d"], FLAGSHIP["i"]
    gu, dn, gen = random_moe(fmt, dev, seed=3)
    out = []
    for t in ts:
        base = default_moe_config(fmt, t, k, e, i, d)
        cands = configs or [base, replace(base, ba=16), replace(base, ba=64), replace(base, bk1=256),
                            replace(base, bn=32), replace(base, bn=128), replace(base, split_k=2),
                            replace(base, num_warps=8), replace(base, prefetch=False)]
        calls = []
        for _ in range(routings):
            x = (torch.randn(t, d, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
            idx, w = random_routing(t, e, k, dev, gen)
            calls.append((x, idx, w, torch.empty_like(x)))
        x0, i0, w0, _ = calls[0]
        ref = moe_decode_ref(x0.float(), i0, w0, gu, dn, limit)
        for cfg in cands:
            try:
                y = moe_decode(x0, i0, w0, gu, dn, limit, config=cfg).float()
                rel = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                us = cuda_graph_us([lambda a=a, cfg=cfg: moe_decode(a[0], a[1], a[2], gu, dn, limit, out=a[3],
                                                                    config=cfg)
                                    for a in calls], reps, inner)
                out.append(dict(t=t, fmt=fmt, config=asdict(cfg), us=us, rel_err=rel,
                                correct=bool(torch.isfinite(y).all()) and rel <= 1e-2))
            except Exception as ex:  # a config the compiler rejects is reported, not fatal
                out.append(dict(t=t, fmt=fmt, config=asdict(cfg), error=f"{type(ex).__name__}: {str(ex)[:200]}"))
            print(out[-1], flush=True)
    return out


def grouped_candidates(fmt: str, t: int) -> list:
    """The launch configurations the curve tries for the multi-token (grouped tensor-core) path:
    :func:`~memra.kernels.moe_prefill.grouped_decode_config` and variants of its tiles, warps,
    stages and operand order (fp8 keeps block_k <= 128 and no swap)."""
    base = grouped_decode_config(fmt, t)
    c = [base, replace(base, block_n=128, block_n_down=128), replace(base, block_n=32, block_n_down=32),
         replace(base, num_warps=8), replace(base, num_stages=4), replace(base, block_n_down=128),
         replace(base, block_n=128)]
    if fmt != "fp8":
        c += [replace(base, swap_ab=not base.swap_ab), replace(base, block_k=256, block_k_down=256),
              replace(base, swap_ab_down=not base.swap_ab), replace(base, block_n_down=128, num_stages=4)]
    else:
        c += [replace(base, block_k=64, block_k_down=64)]
    return c


def moe_curve(ts=(1, 2, 4, 8, 16, 64, 256), fmt: str = "nvfp4", device: str = "cuda", reps: int = 20,
              inner: int = 8, routings: int = 6, limit: float | None = 7.0, sweep: bool = True) -> dict:
    """The MoE curve of issue 14: for each T, the single-token GEMV kernels (:func:`moe_decode`)
    and the multi-token grouped tensor-core path (:func:`moe_prefill` with
    :func:`grouped_decode_config`, and with ``sweep`` each of :func:`grouped_candidates`), each
    timed in CUDA graphs over ``routings`` random routings, against the point's own byte floor:
    distinct experts touched x bytes per expert + activations (x read and y written in bf16),
    at the device-to-device copy bandwidth measured in the same run. Every timed configuration
    is checked against :func:`moe_decode_ref` on one routing (rel. error <= 1e-2 of max |y|).

    Returns a JSON-able dict: ``shape``, ``fmt``, ``copy_tbs``, ``rows`` (one per T: ``floor_us``,
    ``gemv_us``, ``grouped_us`` (default config), ``best_us`` / ``best_config`` over the sweep,
    ``pct_floor_*`` = floor / time, ``layer_path``: which path memra's MoE layer takes at this T),
    ``sweep`` (every candidate's µs or error)."""
    from dataclasses import asdict

    from ..layers.moe import MOE_DECODE_MAX_T

    dev = torch.device(device)
    e, k, d = FLAGSHIP["e"], FLAGSHIP["top_k"], FLAGSHIP["d"]
    gu, dn, gen = random_moe(fmt, dev, seed=5)
    per_expert = gu.expert_nbytes + dn.expert_nbytes
    copy_bw = copy_bandwidth()
    rows, sweep_rows = [], []
    for t in ts:
        args, distinct = [], []
        for _ in range(routings):
            x = (torch.randn(t, d, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
            idx, w = random_routing(t, e, k, dev, gen)
            distinct.append(int(torch.unique(idx).numel()))
            args.append((x, idx, w, torch.empty_like(x)))
        nd = sum(distinct) / len(distinct)
        floor_us = (nd * per_expert + 2 * t * d * 2) / copy_bw * 1e6
        x0, i0, w0, _ = args[0]
        ref = moe_decode_ref(x0.float(), i0, w0, gu, dn, limit)

        def err(y, ref=ref):
            return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

        gemv_us = cuda_graph_us([lambda a=a: moe_decode(a[0], a[1], a[2], gu, dn, limit, out=a[3]) for a in args],
                                reps, inner)
        gemv_err = err(moe_decode(x0, i0, w0, gu, dn, limit))
        results = []
        for cfg in (grouped_candidates(fmt, t) if sweep and t > 1 else [grouped_decode_config(fmt, t)]):
            try:
                rel = err(moe_prefill(x0, i0, w0, gu, dn, limit, config=cfg))
                us = cuda_graph_us([lambda a=a, c=cfg: a[3].copy_(moe_prefill(a[0], a[1], a[2], gu, dn, limit,
                                                                               config=c)) for a in args], reps, inner)
                results.append(dict(t=t, fmt=fmt, config=asdict(cfg), us=us, rel_err=rel, correct=rel <= 1e-2))
            except Exception as ex:  # a config the compiler rejects is reported, not fatal
                results.append(dict(t=t, fmt=fmt, config=asdict(cfg), error=f"{type(ex).__name__}: {str(ex)[:200]}"))
            print(results[-1], flush=True)
        # probe (not a layer path): the default config with fp16 operands (x cast to fp16; the nvfp4
        # weights are exact in fp16 too), i.e. what the bf16 conversion of the decoded weights costs
        try:
            cfg = grouped_decode_config(fmt, t)
            rel = err(moe_prefill(x0.half(), i0, w0, gu, dn, limit, config=cfg))
            halves = [a[0].half() for a in args]
            us = cuda_graph_us([lambda a=a, h=h, c=cfg: moe_prefill(h, a[1], a[2], gu, dn, limit, config=c)
                                for a, h in zip(args, halves)], reps, inner)
            probe = dict(t=t, fmt=fmt, x_dtype="float16", config=asdict(cfg), us=us, rel_err=rel)
        except Exception as ex:
            probe = dict(t=t, fmt=fmt, x_dtype="float16", error=f"{type(ex).__name__}: {str(ex)[:200]}")
        print(probe, flush=True)
        sweep_rows += results + [probe]
        ok = [r for r in results if "us" in r and r["correct"]]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        g0 = results[0]
        row = dict(t=t, distinct=nd, bytes=nd * per_expert + 2 * t * d * 2, floor_us=floor_us, gemv_us=gemv_us,
                   gemv_rel_err=gemv_err, grouped_us=g0.get("us", float("nan")),
                   grouped_rel_err=g0.get("rel_err", float("nan")),
                   best_us=best["us"] if best else float("nan"), best_config=best["config"] if best else None,
                   fp16_probe_us=probe.get("us", float("nan")),
                   layer_path="gemv" if t <= MOE_DECODE_MAX_T else "grouped")
        row["pct_floor_gemv"] = 100.0 * floor_us / gemv_us
        row["pct_floor_grouped"] = 100.0 * floor_us / row["grouped_us"]
        row["pct_floor_best"] = 100.0 * floor_us / row["best_us"]
        row["layer_us"] = gemv_us if row["layer_path"] == "gemv" else row["grouped_us"]
        row["pct_floor_layer"] = 100.0 * floor_us / row["layer_us"]
        row["correct"] = gemv_err <= 1e-2 and bool(ok)
        rows.append(row)
        print(row, flush=True)
    return dict(shape=dict(FLAGSHIP), fmt=fmt, device=torch.cuda.get_device_name(dev), copy_tbs=copy_bw / 1e12,
                per_expert_bytes=per_expert, rows=rows, sweep=sweep_rows, reps=reps, inner=inner, routings=routings)


def print_curve_table(res: dict) -> None:
    """The MoE curve as a table: per T, µs and % of the byte floor of each path."""
    s = res["shape"]
    print(f"MoE curve {res['fmt']} E={s['e']} top-{s['top_k']} D={s['d']} I={s['i']} on {res['device']}; "
          f"copy {res['copy_tbs']:.2f} TB/s; {res['per_expert_bytes'] / 1e6:.2f} MB per expert")
    print(f"{'T':>4} {'experts':>7} {'floor us':>8} {'gemv us':>8} {'%floor':>6} {'grouped':>8} {'%floor':>6} "
          f"{'best':>8} {'%floor':>6} {'fp16 x':>8} {'layer':>7} {'%floor':>6}")
    for r in res["rows"]:
        print(f"{r['t']:>4} {r['distinct']:>7.1f} {r['floor_us']:>8.1f} {r['gemv_us']:>8.1f} {r['pct_floor_gemv']:>6.1f} "
              f"{r['grouped_us']:>8.1f} {r['pct_floor_grouped']:>6.1f} {r['best_us']:>8.1f} "
              f"{r['pct_floor_best']:>6.1f} {r['fp16_probe_us']:>8.1f} {r['layer_path']:>7} {r['pct_floor_layer']:>6.1f}")


def plot_curve(results: list[dict], path: str) -> str:
    """A PNG of the MoE curve (:func:`moe_curve` results, one per format): µs per call against T
    (log-log) for the GEMV kernels, the grouped tensor-core path, and the byte floor. Returns
    ``path``, or a message when matplotlib is not importable (it is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as ex:  # matplotlib is optional
        return f"no PNG: matplotlib not importable ({ex})"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        ts = [r["t"] for r in res["rows"]]
        f = res["fmt"]
        ax.plot(ts, [r["gemv_us"] for r in res["rows"]], "o-", label=f"{f} GEMV kernels (moe_decode)")
        ax.plot(ts, [r["grouped_us"] for r in res["rows"]], "s-", label=f"{f} grouped tensor-core (moe_prefill)")
        ax.plot(ts, [r["floor_us"] for r in res["rows"]], "k--", label=f"{f} byte floor (distinct experts)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per call (T)")
    ax.set_ylabel("µs per MoE layer call")
    r0 = results[0]
    ax.set_title(f"routed experts, E={r0['shape']['e']} top-{r0['shape']['top_k']}, {r0['device']}, "
                 f"copy {r0['copy_tbs']:.2f} TB/s", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_moe_table(res: dict) -> None:
    """Prints the census result as a table (one line per T)."""
    s = res["shape"]
    print(f"MoE decode {res['fmt']} E={s['e']} top-{s['top_k']} D={s['d']} I={s['i']} on {res['device']}; "
          f"copy {res['copy_tbs']:.2f} TB/s; {res['per_expert_bytes'] / 1e6:.2f} MB per expert")
    print(f"{'T':>3} {'us':>8} {'us/pair':>8} {'experts':>8} {'MB':>7} {'TB/s':>6} {'%copy':>6} {'xT=1':>5} "
          f"{'route us':>8} {'rel err':>9} {'same us':>8} {'xT=1':>5} {'tgroup us':>9}")
    for r in res["rows"]:
        print(f"{r['t']:>3} {r['us']:>8.1f} {r['us_per_pair']:>8.2f} {r['distinct']:>8.1f} {r['bytes'] / 1e6:>7.1f} "
              f"{r['tbs']:>6.2f} {r['pct_copy']:>6.1f} {r['ratio_t1']:>5.2f} {res['route_us'][r['t']]:>8.1f} "
              f"{r.get('rel_err', float('nan')):>9.2e} {r['us_same']:>8.1f} {r['ratio_same_t1']:>5.2f} "
              f"{r['us_triton_group']:>9.1f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="nvfp4", help="comma-separated: nvfp4,fp8,q8_0,bf16")
    ap.add_argument("--t", default="1,2,4,8", help="comma-separated token counts")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--sweep", action="store_true", help="time a small grid of launch configurations instead")
    ap.add_argument("--curve", action="store_true",
                    help="the MoE curve: GEMV vs grouped tensor-core path per T against each point's byte floor")
    ap.add_argument("--no-grouped-sweep", action="store_true", help="--curve: only the default grouped config")
    ap.add_argument("--png-out", default=None, help="--curve: write the curve chart here (needs matplotlib)")
    a = ap.parse_args(argv)
    out = []
    if a.curve:
        for fmt in a.fmt.split(","):
            res = moe_curve(tuple(int(v) for v in a.t.split(",")), fmt, reps=a.reps,
                            sweep=not a.no_grouped_sweep)
            print_curve_table(res)
            out.append(res)
        if a.png_out:
            print(plot_curve(out, a.png_out))
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(out, f, indent=1)
        return
    if a.sweep:
        for fmt in a.fmt.split(","):
            out += moe_config_sweep(tuple(int(v) for v in a.t.split(",")), fmt)
        for key in sorted({(r["fmt"], r["t"]) for r in out}):
            rows = [r for r in out if (r["fmt"], r["t"]) == key]
            ok = [r for r in rows if r.get("correct")]
            bad = len(rows) - len(ok)
            best = min(ok, key=lambda r: r["us"]) if ok else None
            print(f"{key[0]} T={key[1]}: fastest correct " + (f"{best['us']:.1f} us {best['config']}" if best else "none")
                  + (f"; {bad} configuration(s) wrong or failed against moe_decode_ref (not counted)" if bad else ""))
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(out, f, indent=1)
        return
    for fmt in a.fmt.split(","):
        res = moe_sel_census(tuple(int(v) for v in a.t.split(",")), fmt, reps=a.reps)
        print_moe_table(res)
        out.append(res)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
