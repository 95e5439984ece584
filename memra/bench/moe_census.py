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
    at the flagship shape, random routing. Returns rows {t, config, us} (configs that fail to
    compile are reported with ``error``)."""
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
        for cfg in cands:
            try:
                us = cuda_graph_us([lambda a=a, cfg=cfg: moe_decode(a[0], a[1], a[2], gu, dn, limit, out=a[3],
                                                                    config=cfg)
                                    for a in calls], reps, inner)
                out.append(dict(t=t, fmt=fmt, config=asdict(cfg), us=us))
            except Exception as ex:  # a config the compiler rejects is reported, not fatal
                out.append(dict(t=t, fmt=fmt, config=asdict(cfg), error=f"{type(ex).__name__}: {str(ex)[:200]}"))
            print(out[-1], flush=True)
    return out


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
    a = ap.parse_args(argv)
    out = []
    if a.sweep:
        for fmt in a.fmt.split(","):
            out += moe_config_sweep(tuple(int(v) for v in a.t.split(",")), fmt)
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
