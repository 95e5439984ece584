"""Where a flagship decode step's time goes, kernel by kernel (issue 14, item 4: launches per layer).

Builds the synthetic flagship as `memra bench decode` does, captures the decode CUDA graph at the
given batch sizes, replays each under torch.profiler (CUPTI traces the kernels inside a graph) and
prints, per batch: the step's wall time, the sum of kernel durations (GPU busy), the idle gaps
between kernels, the kernel count, and the kernels grouped by name (count per step, µs per step,
mean µs). Writes JSON to --json-out.

Usage (H200): python benchmarks/step_profile.py --batches 1,4 --json-out $OUT/step-profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from memra.engine.block_manager import kv_groups
    from memra.engine.cuda_graph import CudaGraphRunner
    from memra.engine.kv_cache import PagedKVCache
    from memra.io.synthetic import build_gpu_model, load_geometry

    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,4")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (H100: 24)")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    dev = torch.device("cuda")
    geometry = load_geometry("full") | {"mtp_layers": 0}
    if a.layers:
        geometry["layers"] = a.layers
        geometry["clamp_layers"] = [i for i in geometry["clamp_layers"] if i < a.layers]
    model = build_gpu_model(geometry, 0, dev, "nvfp4", progress=False)
    bs, max_b = 16, max(batches)
    per_seq = -(-(a.context + 1) // bs)
    groups = kv_groups(model.config)
    cache = PagedKVCache(groups, [max_b * per_seq + 1] * len(groups), bs, torch.bfloat16, device=dev)
    for t in cache.k + cache.v:
        if t is not None:
            t.normal_()
    runner = CudaGraphRunner(model, cache, max_b, per_seq, scratch_blocks=[max_b * per_seq] * len(groups),
                             buckets=batches)
    runner.capture()
    out = {}
    for b in batches:
        ids = torch.randint(3, model.config.vocab_size, (b,)).tolist()
        tables = [[list(range(r * per_seq, (r + 1) * per_seq))] * len(groups) for r in range(b)]
        runner.run(ids, [a.context] * b, tables)
        g = runner.graphs[b]
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            g.replay()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) / a.reps * 1e6
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.reps):
                g.replay()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                         key=lambda e: e.time_range.start)
        busy = sum(e.time_range.end - e.time_range.start for e in kernels) / a.reps
        span = (kernels[-1].time_range.end - kernels[0].time_range.start) / a.reps if kernels else 0.0
        by = defaultdict(lambda: [0, 0.0])
        for e in kernels:
            by[e.name][0] += 1
            by[e.name][1] += e.time_range.end - e.time_range.start
        rows = sorted(((n, c / a.reps, t / a.reps) for n, (c, t) in by.items()), key=lambda r: -r[2])
        print(f"\nB={b}: wall {wall_us:.1f} µs/step; kernels {len(kernels) / a.reps:.0f}/step, busy {busy:.1f} µs, "
              f"span {span:.1f} µs, idle inside the span {span - busy:.1f} µs")
        print("| kernel | per step | µs/step | mean µs |\n| --- | --- | --- | --- |")
        for n, c, t in rows[:40]:
            print(f"| {n[:90]} | {c:.0f} | {t:.1f} | {t / c:.2f} |")
        out[b] = {"wall_us": wall_us, "kernels_per_step": len(kernels) / a.reps, "busy_us": busy, "span_us": span,
                  "by_kernel": [{"name": n, "per_step": c, "us_per_step": t} for n, c, t in rows]}
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "context": a.context, "layers": model.config.num_layers,
                       "batches": out}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
