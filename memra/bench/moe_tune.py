"""Tile-configuration tuning of the grouped MoE prefill GEMM (:mod:`memra.kernels.moe_prefill`)
on the current GPU: ``memra bench moe-grouped --tune`` (writes
:data:`memra.kernels.moe_prefill.TUNED_TABLE`, which :func:`~memra.kernels.moe_prefill.default_prefill_config`
reads).

Method, per (format, T), on the bench's skewed routing (:func:`memra.bench.common.skewed_routing`,
the original's production distribution at 4096 tokens) and random banks at the flagship shape:

1. Candidates (:func:`candidates`): for each ``block_m`` of a short list chosen from the mean
   rows per expert, kernel A (gate+up) variants over block_n x block_k x num_warps x
   num_stages (x swap_ab, except for fp8) and, independently, kernel B (down) variants over
   block_n_down x block_k_down x num_warps_down x num_stages_down (x swap_ab_down). The two kernels share only ``block_m`` (the pair
   alignment) and ``group_m``, so each is tuned on its own and the best pair is summed.
   ``fp8_act`` is never tuned (it changes the numerics): it stays at the default.
2. Compilation in parallel (:func:`precompile`): worker processes launch every candidate once
   at the real shapes, which fills Triton's on-disk kernel cache; a candidate that fails to
   compile (e.g. too much shared memory) is dropped with its error recorded.
3. Timing in this process: each candidate's launch (gate+up: activation quantization for the
   fp8 recipe + kernel A; down: accumulator init + kernel B + cast, i.e. the launches
   :func:`~memra.kernels.moe_prefill.prefill_launches` returns) as the median of ``reps``
   CUDA-event timings of 3 back-to-back eager calls (:func:`memra.bench.common.eager_us`; each
   call is 0.3-5 ms, so launch overhead is negligible). Per block_m: best A + best B
   (+ moe_align); the smallest total wins.
   Then group_m is swept on the winner (whole moe_prefill call).
4. The winner is checked against :func:`~memra.kernels.moe_prefill.moe_prefill_ref` (rel. error
   <= :data:`memra.bench.common.CHECK_TOL`) before it is written; the heuristic default's
   times are stored next to it.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .common import (
    CHECK_TOL,
    FLAGSHIP,
    commit,
    eager_us,
    random_moe,
    rel_err,
    require_cuda,
    routing_weights,
    skewed_routing,
)

__all__ = ["candidates", "precompile", "tune_point", "run_tune"]


def _block_ms(fmt: str, t: int, topk: int, e: int) -> list[int]:
    mean = t * topk / max(1, min(e, t * topk))
    cands = [16, 32, 64, 128]
    # the two sizes around the mean rows per expert (padding vs tile efficiency)
    near = sorted(cands, key=lambda b: abs(math.log2(b) - math.log2(max(mean, 16))))[:2]
    return sorted(near)


def candidates(fmt: str, t: int, shape: dict, quick: bool = False) -> dict[int, dict[str, list]]:
    """{block_m: {"a": [MoePrefillConfig...], "b": [MoePrefillConfig...]}} for one format and T
    (module docstring). ``quick``: a handful per kernel (tests)."""
    from ..kernels.moe_prefill import _validate, default_prefill_config

    e, k, d, i = shape["e"], shape["top_k"], shape["d"], shape["i"]
    out = {}
    for bm in _block_ms(fmt, t, k, e):
        base = replace(default_prefill_config(fmt, t, k, e, i, d, tuned=False), block_m=bm)
        f8 = base.fp8_act and fmt == "fp8"
        a_list, b_list = [], []
        bns = [128] if f8 else [64, 128]
        swaps = (False,) if fmt == "fp8" else (False, True)  # swap_ab: not for fp8 banks
        for sw in swaps:
            for bn in bns:
                for bk in (64, 128):
                    for w in (4, 8):
                        for st in (3, 4):
                            if quick and (w, st) != (4, 3):
                                continue
                            a_list.append(replace(base, block_n=bn, block_k=bk, num_warps=w, num_stages=st,
                                                  swap_ab=sw, swap_ab_down=False))
            for bn in (64, 128, 256):
                for bk in (64, 128):
                    for w in (4, 8):
                        for st in (3, 4):
                            if quick and (w, st) != (4, 3):
                                continue
                            b_list.append(replace(base, block_n_down=bn, block_k_down=bk, num_warps_down=w,
                                                  num_stages_down=st, swap_ab_down=sw))
        ok_a, ok_b = [], []
        for c in a_list + b_list:
            try:
                _validate_shape(c, fmt, d, i, _validate)
            except ValueError:
                continue
            (ok_a if c in a_list else ok_b).append(c)
        out[bm] = {"a": ok_a, "b": ok_b}
    return out


def _validate_shape(cfg, fmt: str, d: int, i: int, validate) -> None:
    """Raises ValueError for a config the kernels refuse at this shape (no GPU needed)."""
    from types import SimpleNamespace

    bank = SimpleNamespace(fmt=fmt)  # _validate reads only the banks' format
    validate(cfg, bank, bank, cfg.fp8_act and fmt == "fp8")
    bn2, bk2 = cfg.block_n_down or cfg.block_n, cfg.block_k_down or cfg.block_k
    if cfg.block_k > d or bk2 > i or bn2 > d or cfg.block_n > i:
        raise ValueError("blocks larger than the shape")


def _inputs(fmt: str, t: int, shape: dict, seed: int):
    dev = torch.device("cuda")
    e, k, d, i = shape["e"], shape["top_k"], shape["d"], shape["i"]
    gu, dn = random_moe(fmt, dev, seed=seed, e=e, d=d, i=i)[:2]
    index = skewed_routing(t, e, k, seed).to(dev)
    weight = routing_weights(t, k, seed).to(dev)
    gx = torch.Generator(device=dev).manual_seed(seed + 1000 + t)
    x = (torch.randn(t, d, device=dev, generator=gx) * 0.5).to(torch.bfloat16)
    return x, index, weight, gu, dn


def _compile_worker(args) -> list[str | None]:
    fmt, t, shape, seed, cfgs = args
    from ..kernels.moe_prefill import prefill_launches

    x, index, weight, gu, dn = _inputs(fmt, t, shape, seed)
    errs = []
    for c in cfgs:
        try:
            p = prefill_launches(x, index, weight, gu, dn, 7.0, None, c)
            p["gate_up"]()
            p["down"]()
            torch.cuda.synchronize()
            errs.append(None)
        except Exception as ex:  # noqa: BLE001 - compile / resource errors drop the candidate
            errs.append(f"{type(ex).__name__}: {str(ex)[:200]}")
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                pass
    return errs


def precompile(fmt: str, t: int, shape: dict, seed: int, cfgs: list, workers: int) -> list[str | None]:
    """Launches every config once in ``workers`` spawned processes (fills Triton's on-disk cache);
    returns per config None or the error. workers <= 1: in this process."""
    if not cfgs:
        return []
    if workers <= 1:
        return _compile_worker((fmt, t, shape, seed, cfgs))
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    chunks = [cfgs[j::workers] for j in range(workers)]
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        res = list(ex.map(_compile_worker, [(fmt, t, shape, seed, ch) for ch in chunks if ch]))
    errs: list[str | None] = [None] * len(cfgs)
    for j, r in enumerate(res):
        for n, v in enumerate(r):
            errs[j + n * workers] = v
    return errs


def tune_point(fmt: str, t: int, shape: dict, seed: int = 0, workers: int = 12, reps: int = 5,
               quick: bool = False, log=print) -> dict:
    """Tunes one (format, T) (module docstring). Returns the table entry: {"t", "routing",
    "config", "us": {gate_up, down, align, call}, "default_config", "default_us", "rel_err",
    "tried", "failed"}. Raises: RuntimeError if no candidate ran or the winner is wrong."""
    from ..kernels.moe_prefill import default_prefill_config, moe_prefill, moe_prefill_ref, prefill_launches

    e, k, d, i = shape["e"], shape["top_k"], shape["d"], shape["i"]
    cands = candidates(fmt, t, shape, quick)
    allc = [c for v in cands.values() for c in v["a"] + v["b"]]
    bank_bytes = e * 3 * i * d * {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5625, "q8_0": 1.0625}[fmt]
    workers = max(1, min(workers, int(80e9 // bank_bytes)))  # each worker holds its own banks
    t0 = time.time()
    errs = precompile(fmt, t, shape, seed, allc, workers)
    failed = {str(asdict(c)): er for c, er in zip(allc, errs) if er}
    log(f"  {fmt} T={t}: compiled {len(allc)} candidates in {time.time() - t0:.0f} s ({len(failed)} failed)")
    x, index, weight, gu, dn = _inputs(fmt, t, shape, seed)
    best = None
    for bm, v in cands.items():
        res = {}
        for part, lst in (("gate_up", v["a"]), ("down", v["b"])):
            scored = []
            for c in lst:
                if str(asdict(c)) in failed:
                    continue
                try:
                    p = prefill_launches(x, index, weight, gu, dn, 7.0, None, c)
                    if part == "down":
                        p["gate_up"]()
                    scored.append((eager_us(p[part], reps=reps), c))
                except Exception as ex:  # noqa: BLE001
                    failed[str(asdict(c))] = f"{type(ex).__name__}: {str(ex)[:200]}"
                    torch.cuda.synchronize()
            if scored:
                res[part] = min(scored, key=lambda s: s[0])
        if len(res) < 2:
            continue
        p = prefill_launches(x, index, weight, gu, dn, 7.0, None, res["gate_up"][1])
        align_us = eager_us(p["align"], reps=reps)
        total = res["gate_up"][0] + res["down"][0] + align_us
        a, b = res["gate_up"][1], res["down"][1]
        merged = replace(a, block_n_down=b.block_n_down, block_k_down=b.block_k_down,
                         num_warps_down=b.num_warps_down, num_stages_down=b.num_stages_down,
                         swap_ab_down=b.swap_ab_down)
        log(f"  {fmt} T={t} block_m={bm}: gate_up {res['gate_up'][0]:.0f} us, down {res['down'][0]:.0f} us, "
            f"align {align_us:.0f} us")
        if best is None or total < best[0]:
            best = (total, merged, dict(gate_up=res["gate_up"][0], down=res["down"][0], align=align_us))
    if best is None:
        raise RuntimeError(f"tune {fmt} T={t}: no candidate ran ({len(failed)} failed; e.g. "
                           f"{next(iter(failed.values()), None)})")
    win = best[1]
    calls = []
    for gm in (1, 4, 8, 16, 32):
        c = replace(win, group_m=gm)
        calls.append((eager_us(lambda c=c: moe_prefill(x, index, weight, gu, dn, 7.0, config=c), reps=reps), c))
    call_us, win = min(calls, key=lambda s: s[0])
    pl = prefill_launches(x, index, weight, gu, dn, 7.0, None, win)
    us = dict(gate_up=eager_us(pl["gate_up"], reps=reps), down=eager_us(pl["down"], reps=reps),
              align=best[2]["align"], call=call_us)
    dflt = default_prefill_config(fmt, t, k, e, i, d, tuned=False)
    pd = prefill_launches(x, index, weight, gu, dn, 7.0, None, dflt)
    default_us = dict(gate_up=eager_us(pd["gate_up"], reps=reps), down=eager_us(pd["down"], reps=reps),
                      call=eager_us(lambda: moe_prefill(x, index, weight, gu, dn, 7.0, config=dflt), reps=reps))
    y = moe_prefill(x, index, weight, gu, dn, 7.0, config=win)
    r = moe_prefill_ref(x.float(), index, weight, gu, dn, 7.0, fp8_act=win.fp8_act and fmt == "fp8")
    rel = rel_err(y, r)
    if not (bool(torch.isfinite(y).all()) and rel <= CHECK_TOL):
        raise RuntimeError(f"tune {fmt} T={t}: the winner {win} is wrong: rel. error {rel:.3e}")
    log(f"  {fmt} T={t}: best {asdict(win)}: call {call_us:.0f} us (default {default_us['call']:.0f} us), "
        f"rel err {rel:.1e}")
    return dict(t=t, routing="skewed", config=asdict(win), us=us, default_config=asdict(dflt),
                default_us=default_us, rel_err=rel, tried=len(allc), failed=len(failed))


def run_tune(ts, formats, out_path: str | Path, seed: int = 0, workers: int | None = None, reps: int = 5,
             quick: bool = False) -> dict:
    """Tunes every (format, T) and writes/merges the table at ``out_path`` (entries of other
    formats / shapes already there are kept; a re-tuned (format, T) replaces its entry).
    Returns the table. Raises: SystemExit without CUDA."""
    require_cuda("moe-grouped --tune")
    from ..kernels.moe_prefill import table_key, tuned_table

    shape = dict(FLAGSHIP)
    workers = workers or max(1, min(12, (os.cpu_count() or 2) - 2))
    out_path = Path(out_path)
    table = json.loads(out_path.read_text()) if out_path.exists() else {}
    table.setdefault("configs", {})
    t0 = time.time()
    for fmt in formats:
        key = table_key(fmt, shape["top_k"], shape["e"], shape["i"], shape["d"])
        for t in ts:
            entry = tune_point(fmt, t, shape, seed, workers, reps, quick)
            lst = [en for en in table["configs"].get(key, []) if en["t"] != t]
            table["configs"][key] = sorted(lst + [entry], key=lambda en: en["t"])
            table.update(device=torch.cuda.get_device_name(), commit=commit(),
                         torch=torch.__version__, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         method="memra/bench/moe_tune.py: skewed routing, per-kernel candidates, "
                                "CUDA-event medians of eager calls; rel. error vs moe_prefill_ref checked")
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(table, indent=1) + "\n")  # after every point: nothing lost
    print(f"tuned {len(formats)} formats x {len(ts)} token counts in {time.time() - t0:.0f} s -> {out_path}")
    tuned_table.cache_clear()
    return table
