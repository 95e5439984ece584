"""Decode router logits on the H200: memra.kernels.fused.router_logits launch configurations against
the cast + cuBLAS fp32 GEMM, at the flagship shape (288 experts x 4096), per token count.

Each variant is captured 42 times in one CUDA graph (one call per MoE layer, each on its own router
weight so that nothing stays in L2 between calls) and the replay is timed with CUDA events; prints µs
per call and writes JSON.

Usage (H200): python benchmarks/router_tune.py --json-out $OUT/router-tune.json
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    import torch

    from memra.kernels.fused import router_logits

    p = argparse.ArgumentParser()
    p.add_argument("--t", default="1,2,4,8,16,32,64")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    E, D, L = 288, 4096, 42
    routers = [torch.randn(E, D, device="cuda") * D ** -0.5 for _ in range(L)]
    configs = [(1, 4096, 4), (1, 4096, 8), (1, 2048, 4), (2, 2048, 4), (2, 4096, 8), (2, 1024, 4), (4, 1024, 4),
               (4, 2048, 8)]
    res = {}
    for t in [int(x) for x in a.t.split(",")]:
        h = torch.randn(t, D, device="cuda").to(torch.bfloat16)
        ref = h.float() @ routers[0].t()
        variants = {"cublas": lambda r, h=h: h.float() @ r.t()}
        for be, bd, nw in configs:
            variants[f"e{be}_d{bd}_w{nw}"] = (lambda r, h=h, be=be, bd=bd, nw=nw:
                                              router_logits(h, r, block_e=be, block_d=bd, num_warps=nw))
        row = {}
        for name, fn in variants.items():
            assert torch.allclose(fn(routers[0]), ref, rtol=1e-4, atol=1e-4), name
            for _ in range(2):
                for r in routers:
                    fn(r)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for r in routers:
                    fn(r)
            for _ in range(3):
                g.replay()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(15):
                s.record()
                g.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) * 1e3 / L)
            row[name] = sorted(times)[len(times) // 2]
        best = min(row, key=row.get)
        print(f"T={t}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()) + f"  -> best {best}", flush=True)
        res[t] = row
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "us_per_call": res}, f, indent=1)


if __name__ == "__main__":
    main()
