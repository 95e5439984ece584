"""A/B of the MoE decode GEMV for FP8 routed experts at the flagship shape (H200): the fp16x2
path (``f16=True``, the default since 2026-12-05) against the fp32-FMA path it replaced (the old
default tiles), at T = 1, 2, 4, with the fraction of each point's byte floor (distinct experts x
bytes per expert at the copy bandwidth measured in the same run). Every configuration is also
checked against ``moe_decode_ref`` (moe_census.moe_config_sweep); a wrong or failing one is
flagged in the table and listed at the end.

Usage: ``python3 benchmarks/fp8_moe_ab.py OUT.json``
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch

from memra.bench.common import FLAGSHIP, copy_bandwidth, expected_distinct, random_moe
from memra.bench.moe_census import moe_config_sweep
from memra.kernels.moe_decode import MoeDecodeConfig, default_moe_config


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/fp8-moe-ab.json"
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_moe_ab.py needs a CUDA GPU (it times the FP8 MoE decode kernels)")
    e, k, d, i = FLAGSHIP["e"], FLAGSHIP["top_k"], FLAGSHIP["d"], FLAGSHIP["i"]
    bw = copy_bandwidth()
    gu, dn, _ = random_moe("fp8", torch.device("cuda"))
    per_expert = gu.expert_nbytes + dn.expert_nbytes
    del gu, dn
    rows = []
    for t in (1, 2, 4):
        new = default_moe_config("fp8", t, k, e, i, d)
        old = MoeDecodeConfig(ba=8, bk1=256, nc=1 if t == 1 else (2 if t == 2 else 4), bn=16, bk2=256, f16=False,
                              prefetch=True)
        cands = [new, old, replace(new, prefetch=not new.prefetch), replace(new, ba=32 if new.ba == 16 else 16),
                 replace(new, bk1=512), replace(new, bn=32)]
        res = moe_config_sweep(ts=(t,), fmt="fp8", configs=cands, reps=15, inner=8, routings=8)
        floor_us = expected_distinct(t, e, k) * per_expert / bw * 1e6
        for r, name in zip(res, ["f16 default", "fp32 old default", "f16 prefetch flipped", f"f16 ba{cands[3].ba}", "f16 bk1 512",
                                 "f16 bn32"]):
            r.update(name=name, floor_us=floor_us, pct_floor=100 * floor_us / r["us"] if "us" in r else None)
            rows.append(r)
            verdict = "" if r.get("correct") else ("  FAILED: " + r["error"] if "error" in r
                                                   else f"  WRONG (rel. error {r['rel_err']:.2e})")
            print(f"T={t} {name:22s} {r.get('us', float('nan')):8.1f} us  {r['pct_floor'] or 0:5.1f} % of floor"
                  f"{verdict}", flush=True)
    bad = [r["name"] for r in rows if not r.get("correct")]
    if bad:
        print(f"not correct against moe_decode_ref (their times do not count): {bad}", flush=True)
    json.dump(dict(copy_tbs=bw / 1e12, per_expert_bytes=per_expert, rows=rows,
                   configs={r["name"]: r["config"] for r in rows}), open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
