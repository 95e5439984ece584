"""FP8 block weights at the flagship's four TP1 attention shapes, T = 1 .. 2048: memra's FP8
block recipe (``fp8_act_linear``: activations quantized per 1x128 group, E4M3 x E4M3 on tensor
cores; memra/kernels/fp8_linear.py) against the bf16-activation path it replaces from
``FP8_ACT_MIN_T`` rows (``decode_linear`` up to 64 rows, dequantize + cuBLAS above) and against
cuBLAS on bf16 weights (twice the bytes); each against its byte floor at the copy bandwidth
measured in the same run. ``--sweep`` also times tiles around the rule (``fp8_linear_config``).

History: the first version of this probe (commit 23262c2, its own inline kernels; H200 result
benchmarks/results/issue14/fp8-w8a8-probe-23262c2-h200.json) found the recipe 1.3-1.8x faster than
bf16 cuBLAS and 2-2.3x faster than ``decode_linear`` at T = 16-64, which made it memra's path.

Usage: ``python3 benchmarks/fp8_w8a8_probe.py OUT.json [--sweep]``  (needs a CUDA GPU)
"""

from __future__ import annotations

import json
import math
import sys

import torch


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_w8a8_probe.py needs a CUDA GPU")
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/fp8-w8a8-probe.json"
    sweep = "--sweep" in sys.argv
    from memra.bench.census import _random_weight, shapes_for
    from memra.bench.common import copy_bandwidth, cuda_graph_us
    from memra.kernels import gemv
    from memra.kernels.fp8_linear import Fp8LinearConfig, fp8_act_linear, fp8_act_linear_ref, fp8_linear_config

    dev = torch.device("cuda")
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"device {torch.cuda.get_device_name()}  copy {bw / 1e12:.3f} TB/s", flush=True)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    rows = []
    for shp in [s for s in shapes_for(1) if s["name"] in ("qkvg_full", "o_full", "qkvg_swa", "o_swa")]:
        n, k = shp["n"], shp["k"]
        w0 = _random_weight("fp8", n, k, gen, dev)
        ncop = max(2, math.ceil(256e6 / (n * k)))
        ws = [w0] + [_random_weight("fp8", n, k, gen, dev) for _ in range(ncop - 1)]
        wb = [(torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16) for _ in range(max(2, ncop // 2))]
        for t in (1, 2, 4, 8, 16, 32, 64, 512, 2048):
            x = torch.randn(t, k, generator=gen, device=dev).to(torch.bfloat16)
            floor8 = (n * k + t * k * 2 + t * n * 2) / bw * 1e6
            floor16 = (2 * n * k + t * k * 2 + t * n * 2) / bw * 1e6
            inner = 40 if t <= 64 else 8
            if t <= gemv.MAX_T:  # today's w8a16 path: decode_linear, else dequantize + cuBLAS
                cfg = gemv.pick_config("fp8", n, k, t, dev)
                old = [lambda w=w, x=x, cfg=cfg: gemv.decode_linear(x, w, out_dtype=torch.bfloat16, config=cfg) for w in ws]
            else:
                old = [lambda w=w, x=x: torch.nn.functional.linear(x, gemv.dequantize_packed(w).to(torch.bfloat16)) for w in ws]
            us_old = cuda_graph_us(old, 10, inner)
            usbl = cuda_graph_us([lambda w=w, x=x: torch.mm(x, w.t()) for w in wb], 10, inner)
            rule = fp8_linear_config(t, n, k, sms)
            us8 = cuda_graph_us([lambda w=w, x=x, rule=rule: fp8_act_linear(x, w, out_dtype=torch.bfloat16, config=rule) for w in ws], 20, inner)
            best = (us8, rule)
            if sweep:
                for bn in (64, 128):
                    for split in (1, 2):
                        for stages in (3, 4):
                            c = Fp8LinearConfig(bn, rule.bt, split, 4, stages)
                            if c == rule:
                                continue
                            try:
                                u = cuda_graph_us([lambda w=w, c=c, x=x: fp8_act_linear(x, w, out_dtype=torch.bfloat16, config=c)
                                                   for w in ws], 10, inner)
                            except Exception as e:  # a tile the compiler rejects is skipped, and said
                                print(f"  skip {c}: {type(e).__name__}: {str(e)[:120]}")
                                continue
                            if u < best[0]:
                                best = (u, c)
            y = fp8_act_linear(x, w0)
            yr = fp8_act_linear_ref(x.float(), w0)
            y16 = x.float() @ gemv.dequantize_packed(w0).t()
            sc = float(yr.abs().max())
            row = dict(shape=shp["name"], n=n, k=k, t=t, w8a16_us=us_old, cublas_bf16_us=usbl, w8a8_us=us8,
                       w8a8_rule={f: getattr(rule, f) for f in rule.__dataclass_fields__},
                       sweep_best_us=best[0], sweep_best={f: getattr(best[1], f) for f in best[1].__dataclass_fields__},
                       floor_fp8_us=floor8, floor_bf16_us=floor16,
                       rel_vs_twin=float((y - yr).abs().max()) / sc, rel_vs_bf16_act=float((y - y16).abs().max()) / sc)
            rows.append(row)
            print(f"{shp['name']:>9} {n:>5}x{k:<5} T={t:<4} w8a16 {us_old:7.1f} ({100 * floor8 / us_old:5.1f} %)  "
                  f"cuBLAS bf16 {usbl:7.1f} ({100 * floor16 / usbl:5.1f} %)  w8a8 {us8:7.1f} ({100 * floor8 / us8:5.1f} %)"
                  f"  best {best[0]:7.1f} bn{best[1].bn} s{best[1].split} st{best[1].num_stages}"
                  f"  err twin {row['rel_vs_twin']:.1e} vs bf16-act {row['rel_vs_bf16_act']:.1e}", flush=True)
        del ws, wb
        torch.cuda.empty_cache()
    json.dump(dict(device=torch.cuda.get_device_name(), copy_tbs=bw / 1e12, rows=rows), open(out, "w"), indent=1)
    print("JSON written to", out)


if __name__ == "__main__":
    main()
