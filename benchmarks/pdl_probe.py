"""Programmatic dependent launch (PDL) on a chain of decode-like kernels, in a CUDA graph.

Question: how much of a batch-1 decode step's ~850 kernel boundaries could PDL take back? A
decode step is a chain of short memory-bound kernels, each needing its predecessor's output
(activations) but not its weights. With PDL (sm_90+, ``launch_pdl=True`` at launch) a kernel may
start while its predecessor's last programs still run; ``griddepcontrol.wait``
(``tl.extra.cuda.gdc_wait``) then blocks until the predecessor has finished and flushed, and
``griddepcontrol.launch_dependents`` lets the successor start early. Weights can be loaded before
the wait. CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization".

The chain: ``links`` times [GEMV 4096x4096 bf16, a 4096-element scale kernel, GEMV 1024x4096,
GEMV 4096x1024], each reading the previous output, weights rotated over copies so the bytes come
from HBM. Variants: ``base`` (plain launches), ``wait`` (PDL launch, wait first, implicit
trigger), ``trigger`` (+ launch_dependents right after the wait), ``prefetch`` (+ the first
weight tile loaded before the wait). Every variant's output is compared with ``base``'s, bit for
bit, and with a torch fp32 chain. Prints µs per chain and per boundary, writes JSON.

Usage: ``python3 benchmarks/pdl_probe.py OUT.json``  (needs an sm_90 GPU)
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv(w_ptr, x_ptr, y_ptr, K, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
          TRIGGER: tl.constexpr, PREFETCH: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    wp = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
    if PREFETCH:
        w = tl.load(wp)  # weights do not depend on the predecessor
    if PDL:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if not PREFETCH:
        w = tl.load(wp)
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(0, K, BK):
        cur = w
        w = tl.load(wp + k0 + BK, mask=k0 + BK < K, other=0.0)
        x = tl.load(x_ptr + k0 + rk).to(tl.float32)
        acc += tl.sum(cur.to(tl.float32) * x[None, :], 1)
    tl.store(y_ptr + rn, acc.to(tl.bfloat16))


@triton.jit
def _scale(x_ptr, y_ptr, s, N: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.arange(0, N)
    x = tl.load(x_ptr + r).to(tl.float32)
    tl.store(y_ptr + r, (x * s).to(tl.bfloat16))


VARIANTS = {"base": (False, False, False), "wait": (True, False, False), "trigger": (True, True, False),
            "prefetch": (True, True, True)}


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/pdl-probe.json"
    from memra.bench.common import copy_bandwidth, cuda_graph_us

    dev = torch.device("cuda")
    bw = copy_bandwidth()
    g = torch.Generator(device=dev).manual_seed(0)
    copies, links = 6, 10
    shapes = [(4096, 4096), (1024, 4096), (4096, 1024)]
    ws = {s: [(torch.randn(s, generator=g, device=dev) / s[1] ** 0.5).to(torch.bfloat16) for _ in range(copies)]
          for s in shapes}
    x0 = torch.randn(4096, generator=g, device=dev).to(torch.bfloat16)
    bufs = [torch.empty(4096, device=dev, dtype=torch.bfloat16) for _ in range(2)]
    mid = torch.empty(1024, device=dev, dtype=torch.bfloat16)
    state = {"i": 0}

    def gemv(w, x, y, flags):
        pdl, trig, pf = flags
        n, k = w.shape
        bn = 16 if n >= 4096 else 8
        _gemv[(n // bn,)](w, x, y, k, BN=bn, BK=256, PDL=pdl, TRIGGER=trig, PREFETCH=pf, num_warps=4,
                          launch_pdl=pdl)

    def chain(flags, ref=False):
        x = x0
        for j in range(links):
            c = (state["i"] + j) % copies
            if ref:
                y = (ws[shapes[0]][c].float() @ x.float()).to(torch.bfloat16)
                y = (y.float() * 0.5).to(torch.bfloat16)
                m = (ws[shapes[1]][c].float() @ y.float()).to(torch.bfloat16)
                x = (ws[shapes[2]][c].float() @ m.float()).to(torch.bfloat16)
                continue
            a, b = bufs[j % 2], bufs[(j + 1) % 2]
            gemv(ws[shapes[0]][c], x, a, flags)
            _scale[(1,)](a, b, 0.5, N=4096, PDL=flags[0], TRIGGER=flags[1], num_warps=4, launch_pdl=flags[0])
            gemv(ws[shapes[1]][c], b, mid, flags)
            gemv(ws[shapes[2]][c], mid, a, flags)
            x = a
        return x

    ref = chain(None, ref=True).float()
    outs, rows = {}, []
    floor_us = links * sum(n * k * 2 for n, k in shapes) / bw * 1e6
    for name, flags in VARIANTS.items():
        y = chain(flags).float().clone()
        torch.cuda.synchronize()
        outs[name] = y
        us = cuda_graph_us([lambda flags=flags: chain(flags)], 15, 8)
        rel = float((y - ref).abs().max() / ref.abs().max())
        same = bool(torch.equal(y, outs["base"]))
        rows.append(dict(variant=name, us_per_chain=us, kernels_per_chain=4 * links, floor_us=floor_us,
                         pct_floor=100 * floor_us / us, rel_vs_torch=rel, bitwise_equal_base=same))
        print(f"{name:>9}: {us:8.1f} us per chain of {4 * links} kernels ({100 * floor_us / us:5.1f} % of the "
              f"{floor_us:.1f} us byte floor), vs base {us - rows[0]['us_per_chain']:+7.1f} us "
              f"({(us - rows[0]['us_per_chain']) / (4 * links):+.2f} per kernel); rel err vs torch {rel:.1e}, "
              f"bitwise = base: {same}", flush=True)
    json.dump(dict(device=torch.cuda.get_device_name(), copy_tbs=bw / 1e12, rows=rows), open(out, "w"), indent=1)
    print("JSON written to", out)


if __name__ == "__main__":
    main()
