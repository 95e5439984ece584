"""Occupancy sweep of the single-token MoE decode kernels (H200): ncu showed them latency-bound
(gate+up 168 registers, 3 warps per scheduler, 40 % of issue slots busy, 38 % of DRAM bandwidth),
so this times tile shapes and warp counts that trade registers for warps, at T = 1, 4, 16, with
the fraction of the byte floor (distinct experts x bytes per expert at the copy bandwidth of the
same run). Writes JSON to argv[1] (default /tmp/moe-occupancy.json) and prints a table.

The ``stages`` grid of 2026-12-05 (weight loads pipelined through shared memory by Triton,
cp.async) measured 1.4-1.6x slower (benchmarks/results/issue14/moe-stages-sweep-h100.json) and
was removed with the knob. Every configuration is checked against the torch reference
(moe_census.moe_config_sweep).

Usage: ``python3 benchmarks/moe_occupancy_sweep.py $OUT/sweep.json [occupancy|chunk|maxnreg|xvec|prefetch2] [T,...] [fmt]``
(``chunk``: tokens per chunk 1/2/4 with and without the register prefetch, and with it only in the
chunks that finish a slot; ``maxnreg``: register caps of the two kernels at the default tiles, which
``python3 benchmarks/sass_census.py --caps`` prices on the CPU: gate+up from 168 registers, 3
blocks per SM, to 128, 4 blocks, with no spill in its T = 1 loop and 16 spill loads in the
1375-instruction loop of two-token chunks; down from 95 / 128 registers to 80 / 96; ``xvec``: the
16-byte activation loads with each chunking; ``prefetch2``: codes two K steps ahead.)
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace

import torch

from memra.bench.common import FLAGSHIP, copy_bandwidth, expected_distinct, random_moe
from memra.bench.moe_census import moe_config_sweep
from memra.kernels.moe_decode import default_moe_config


def candidates(grid: str, base):
    """The launch configurations a grid tries around ``base`` (``base`` first)."""
    cands = [base]

    def add(c):
        if c not in cands:
            cands.append(c)

    if grid == "occupancy":
        for ba, bk1 in ((16, 512), (32, 256), (16, 256), (8, 512)):
            for bn, nw in ((64, 4), (32, 4), (64, 8)):
                for pf in (True, False):
                    add(replace(base, ba=ba, bk1=bk1, bn=bn, num_warps=nw, prefetch=pf))
        for c in (replace(base, num_warps=8), replace(base, bn=32), replace(base, prefetch=not base.prefetch)):
            add(c)
    elif grid == "chunk":  # token chunk size x register prefetch (T = 1's one-token, prefetching tile at T > 1)
        for nc in (1, 2, 4):
            for pf in (True, False):
                add(replace(base, nc=nc, prefetch=pf, prefetch_tail=None))
        for nc in (2, 4):  # no prefetch in full chunks, prefetch in the 1-2 token chunks that finish a slot
            add(replace(base, nc=nc, prefetch=False, prefetch_tail=True))
    elif grid == "maxnreg":  # register caps (MoeDecodeConfig maxnreg1 / maxnreg2) at the default tiles
        for m1 in (None, 128, 120):  # gate+up: 168 registers -> 3 blocks per SM; 128 -> 4
            for m2 in (None, 96, 80):  # down: 95-128 -> 4-5 blocks; 96 -> 5, 80 -> 6
                add(replace(base, maxnreg1=m1, maxnreg2=m2))
    elif grid == "xvec":  # 16-byte activation loads (MoeDecodeConfig.xvec), also with the other chunkings
        for b in (base, replace(base, nc=1, prefetch=True), replace(base, nc=2, prefetch=False),
                  replace(base, nc=4, prefetch=False)):
            add(b)
            add(replace(b, xvec=True))
    elif grid == "prefetch2":  # codes two K steps ahead (prefetch_depth 2), at 512- and 256-wide steps
        for bk1, bk2 in ((base.bk1, base.bk2), (256, 256), (256, 128)):
            for xv in (False, True):
                b = replace(base, bk1=bk1, bk2=bk2, xvec=xv, prefetch=True)
                add(b)
                add(replace(b, prefetch_depth=2))
    else:
        raise SystemExit(f"unknown grid {grid!r} (occupancy, chunk, maxnreg, xvec, prefetch2)")
    return cands


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/moe-occupancy.json"
    grid = sys.argv[2] if len(sys.argv) > 2 else "occupancy"
    ts = [int(v) for v in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 4, 16]
    fmt = sys.argv[4] if len(sys.argv) > 4 else "nvfp4"
    if not torch.cuda.is_available():
        raise SystemExit("moe_occupancy_sweep.py times GPU kernels: it needs a CUDA GPU")
    e, k, d, i = FLAGSHIP["e"], FLAGSHIP["top_k"], FLAGSHIP["d"], FLAGSHIP["i"]
    bw = copy_bandwidth()
    gu, dn, _ = random_moe(fmt, torch.device("cuda"))
    per_expert = gu.expert_nbytes + dn.expert_nbytes
    del gu, dn
    rows = []
    for t in ts:
        base = default_moe_config(fmt, t, k, e, i, d)
        res = moe_config_sweep(ts=(t,), fmt=fmt, configs=candidates(grid, base), reps=15, inner=8, routings=8)
        nd = expected_distinct(t, e, k)
        floor_us = nd * per_expert / bw * 1e6
        for r in res:
            r["floor_us"] = floor_us
            r["pct_floor"] = 100.0 * floor_us / r["us"] if "us" in r else None
            r["default"] = r["config"] == asdict(base)
        rows += res
    rows_ok = [r for r in rows if "us" in r and r["correct"]]
    bad = [r for r in rows if "us" in r and not r["correct"]]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {per_expert / 1e6:.2f} MB per expert; {len(bad)} configurations "
          f"failed the reference check, {sum('error' in r for r in rows)} did not compile")
    print(" T  default  us      %floor  ba  bk1  bn  bk2 warps prefetch tail nc maxnreg1/2 xvec depth")
    for t in ts:
        best = sorted([r for r in rows_ok if r["t"] == t], key=lambda r: r["us"])
        for r in [x for x in best if x["default"]] + best[:5]:
            c = r["config"]
            print(f"{t:2d}  {'*' if r['default'] else ' '}  {r['us']:8.1f}  {r['pct_floor']:5.1f}  {c['ba']:3d} {c['bk1']:4d} "
                  f"{c['bn']:3d} {c['bk2']:4d} {c['num_warps']:5d} {c['prefetch']!s:5} {c.get('prefetch_tail')!s:5} {c['nc']} "
                  f"{c.get('maxnreg1')}/{c.get('maxnreg2')} {c.get('xvec')!s:5} {c.get('prefetch_depth')}")
    json.dump(dict(fmt=fmt, grid=grid, device=torch.cuda.get_device_name(), copy_tbs=bw / 1e12,
                   per_expert_bytes=per_expert, rows=rows), open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
