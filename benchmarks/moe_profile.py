"""Runs the routed-expert kernels at the flagship shape for a profiler (H200, ncu).

One MoE layer (E = 288, top-8, D = 4096, I = 1280, random nvfp4 weights, uniform random routing)
per (T, path) given on the command line; each is compiled and warmed first, then run ``--reps``
times between ``torch.cuda.profiler.start()`` / ``stop()``, so that
``ncu --profile-from-start off`` sees only the timed launches. Each launch is labelled by an
NVTX range ``moe:<path>:t<T>`` (``ncu --nvtx --nvtx-include``).

Usage: ``ncu --clock-control none --profile-from-start off --nvtx --set detailed -o moe
python3 benchmarks/moe_profile.py --points gemv:1,gemv:4,grouped:64``
"""

from __future__ import annotations

import argparse

import torch

from memra.bench.common import FLAGSHIP, random_moe, random_routing
from memra.kernels.moe_decode import moe_decode
from memra.kernels.moe_prefill import grouped_decode_config, moe_prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="gemv:1,gemv:4,gemv:16,grouped:16,grouped:64",
                    help="comma list of path:T, path in gemv|grouped")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--fmt", default="nvfp4")
    args = ap.parse_args()
    dev = torch.device("cuda")
    e, k, d = FLAGSHIP["e"], FLAGSHIP["top_k"], FLAGSHIP["d"]
    gu, dn, gen = random_moe(args.fmt, dev)
    runs = []
    for p in args.points.split(","):
        path, t = p.split(":")
        t = int(t)
        x = (torch.randn(t, d, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        idx, w = random_routing(t, e, k, dev, gen)
        if path == "gemv":
            fn = (lambda x=x, idx=idx, w=w: moe_decode(x, idx, w, gu, dn, 7.0))
        elif path == "grouped":
            cfg = grouped_decode_config(args.fmt, t)
            fn = (lambda x=x, idx=idx, w=w, cfg=cfg: moe_prefill(x, idx, w, gu, dn, 7.0, config=cfg))
        else:
            raise SystemExit(f"unknown path {path!r} in --points")
        fn()
        runs.append((f"moe:{path}:t{t}", fn))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn in runs:
        for _ in range(args.reps):
            torch.cuda.nvtx.range_push(name)
            fn()
            torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("ran", [n for n, _ in runs])


if __name__ == "__main__":
    main()
