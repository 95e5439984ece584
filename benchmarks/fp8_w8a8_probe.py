"""Probe: would FP8 activations make the FP8-weight attention projections at T = 16..64 faster
than bf16 cuBLAS?

At T >= 32 memra's ``decode_linear`` on FP8 block weights (bf16 activations, each weight tile
converted to bf16 for ``tl.dot``) reaches only 33-55 % of copy bandwidth and loses to cuBLAS on
the bf16 weights it halves (H100 census, 2026-12-05). The recipe of DeepSeek-V3 (its report,
section 3.3: per-token 1x128 activation groups, 128x128 weight blocks) keeps both operands in
FP8, so the products run on FP8 tensor cores straight from shared memory. This probe times, on
the four TP1 attention shapes of the flagship:

- ``w8a16``: ``decode_linear`` with the configuration memra picks today;
- ``cublas``: ``torch.mm`` on the bf16 weights (twice the bytes);
- ``w8a8``: the activation quantization kernel + an FP8 x FP8 ``tl.dot`` GEMM (weights as the
  M side of the product, tokens as N: "swap AB"), over a small tile sweep; its time includes the
  quantization kernel (and the zeroing of the output when it splits K).

Correctness: the w8a8 result against its torch twin (the same quantization in torch, fp32
matmul of the dequantized operands), and its distance to the bf16-activation reference
(``decode_linear_ref``), which is the error FP8 activations add.

Usage: ``python3 benchmarks/fp8_w8a8_probe.py OUT.json``  (needs a CUDA GPU; the kernels also
run under ``TRITON_INTERPRET=1`` for ``--check`` at a small shape)
"""

from __future__ import annotations

import json
import math
import sys

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s):
    # one program per (token t, 128-column group g): s = amax / 448, q = x / s rounded to E4M3
    t = tl.program_id(0)
    g = tl.program_id(1)
    rk = g * 128 + tl.arange(0, 128)
    m = rk < K
    x = tl.load(x_ptr + t * stride_x + rk, mask=m, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x)), 1e-30) / FP8_MAX
    q = tl.math.div_rn(x, tl.broadcast_to(s, [128]))
    tl.store(q_ptr + t * stride_q + rk, q.to(tl.float8e4nv), mask=m)
    tl.store(s_ptr + t * stride_s + g, s)


@triton.jit
def _w8a8_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, T, N, k_per_split,
                 stride_xq, stride_xs, stride_w, stride_ws, stride_y,
                 BN: tl.constexpr, BT: tl.constexpr, ATOMIC: tl.constexpr):
    # y[t, n] (+)= sum_k (xq[t, k] xs[t, k/128]) (w[n, k] ws[n/128, k/128]); K % 128 == 0
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_t = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rt = pid_t * BT + tl.arange(0, BT)
    n_ok = rn < N
    t_ok = rt < T
    k_lo = pid_k * k_per_split
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, 128):
        rk = k0 + tl.arange(0, 128)
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=n_ok[:, None], other=0.0)
        xq = tl.load(xq_ptr + rt[:, None] * stride_xq + rk[None, :], mask=t_ok[:, None], other=0.0)
        ws = tl.load(ws_ptr + (rn // 128) * stride_ws + k0 // 128, mask=n_ok, other=0.0)
        xs = tl.load(xs_ptr + rt * stride_xs + k0 // 128, mask=t_ok, other=0.0)
        acc += tl.dot(w, tl.trans(xq)) * ws[:, None] * xs[None, :]
    yp = y_ptr + rt[None, :] * stride_y + rn[:, None]
    ym = n_ok[:, None] & t_ok[None, :]
    if ATOMIC:
        tl.atomic_add(yp, acc, mask=ym, sem="relaxed")
    else:
        tl.store(yp, acc, mask=ym)


def act_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    t, k = x.shape
    _act_quant_kernel[(t, k // 128)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0))


def w8a8_gemm(xq, xs, w, y, bn: int, bt: int, split: int, warps: int, stages: int) -> None:
    t, k = xq.shape
    n = w.n
    if split > 1:
        y.zero_()
    grid = (triton.cdiv(n, bn), split, triton.cdiv(t, bt))
    _w8a8_kernel[grid](xq, xs, w.data, w.scale, y, t, n, k // split, xq.stride(0), xs.stride(0),
                       w.data.stride(0), w.scale.stride(0), y.stride(0), BN=bn, BT=bt, ATOMIC=split > 1,
                       num_warps=warps, num_stages=stages)


def act_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of _act_quant_kernel: fp8 codes [T, K] and fp32 scales [T, K/128]."""
    t, k = x.shape
    xg = x.float().reshape(t, k // 128, 128)
    s = xg.abs().amax(-1).clamp_min(1e-30) / FP8_MAX
    return (xg / s[..., None]).to(torch.float8_e4m3fn).reshape(t, k), s


def w8a8_ref(xq, xs, w) -> torch.Tensor:
    from memra.kernels.gemv import dequantize_packed

    t, k = xq.shape
    xd = (xq.float().reshape(t, k // 128, 128) * xs[..., None]).reshape(t, k)
    return xd @ dequantize_packed(w).t()


def random_fp8_weight(n: int, k: int, gen, dev):
    from memra.kernels.gemv import DecodeWeight

    codes = (torch.randn(n, k, generator=gen, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen, device=dev) * 2e-4 + 1e-4
    return DecodeWeight("fp8", n, k, codes, scale, "probe")


def check(dev, t: int = 5, n: int = 320, k: int = 384, bn: int = 64, bt: int = 16, split: int = 1) -> dict:
    from memra.kernels.gemv import decode_linear_ref

    gen = torch.Generator(device=dev)
    gen.manual_seed(7)
    w = random_fp8_weight(n, k, gen, dev)
    x = torch.randn(t, k, generator=gen, device=dev).to(torch.bfloat16)
    xq = torch.empty(t, k, device=dev, dtype=torch.float8_e4m3fn)
    xs = torch.empty(t, k // 128, device=dev, dtype=torch.float32)
    act_quant(x, xq, xs)
    rq, rs = act_quant_ref(x)
    y = torch.empty(t, n, device=dev, dtype=torch.float32)
    w8a8_gemm(xq, xs, w, y, bn, bt, split, 4, 2)
    yr = w8a8_ref(xq, xs, w)  # the GEMM against its twin on the kernel's own codes
    y16 = decode_linear_ref(x, w)
    scale = float(yr.abs().max())
    return dict(codes_equal=bool((xq.float() == rq.float()).all()), scales_rel=float(((xs - rs).abs() / rs).max()),
                rel_vs_twin=float((y - yr).abs().max()) / scale, rel_vs_bf16_act=float((y - y16).abs().max()) / scale)


def main() -> None:
    if "--check" in sys.argv:
        r = check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        print(r)
        # (the interpreter's fp32 -> E4M3 cast does not round to nearest even: codes differ there)
        assert r["scales_rel"] < 1e-6 and r["rel_vs_twin"] < 1e-5, r
        assert r["codes_equal"] or not torch.cuda.is_available(), r
        return
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/fp8-w8a8-probe.json"
    from memra.bench.census import shapes_for
    from memra.bench.common import copy_bandwidth, cuda_graph_us
    from memra.kernels import gemv

    dev = torch.device("cuda")
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy {bw / 1e12:.3f} TB/s", flush=True)
    print("check (small shape):", check(dev), flush=True)
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    rows = []
    for shp in [s for s in shapes_for(1) if s["name"] in ("qkvg_full", "o_full", "qkvg_swa", "o_swa")]:
        n, k = shp["n"], shp["k"]
        w0 = random_fp8_weight(n, k, gen, dev)
        ncop = max(2, math.ceil(256e6 / (n * k)))
        ws = [w0] + [random_fp8_weight(n, k, gen, dev) for _ in range(ncop - 1)]
        wb = [(torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16) for _ in range(max(2, ncop // 2))]
        for t in (16, 32, 64):
            x = torch.randn(t, k, generator=gen, device=dev).to(torch.bfloat16)
            y = torch.empty(t, n, device=dev, dtype=torch.float32)
            yb = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
            xq = torch.empty(t, k, device=dev, dtype=torch.float8_e4m3fn)
            xs = torch.empty(t, k // 128, device=dev, dtype=torch.float32)
            floor8 = (n * k + t * k * 2 + t * n * 4) / bw * 1e6
            floor16 = (2 * n * k + t * k * 2 + t * n * 2) / bw * 1e6
            inner = 40
            cfg = gemv.pick_config("fp8", n, k, t, dev)
            us16a = cuda_graph_us([lambda w=w: gemv.decode_linear(x, w, config=cfg, out=y) for w in ws], 20, inner)
            usbl = cuda_graph_us([lambda w=w: torch.mm(x, w.t(), out=yb) for w in wb], 20, inner)
            usq = cuda_graph_us([lambda: act_quant(x, xq, xs)], 20, inner)
            best = None
            for bn in (64, 128):
                for warps in (4, 8):
                    for stages in (3, 4):
                        for split in (1, 2, 4):
                            if k // split < 256 or (k // split) % 128:
                                continue
                            bt = max(16, triton.next_power_of_2(t))

                            def run(w, bn=bn, bt=bt, split=split, warps=warps, stages=stages):
                                act_quant(x, xq, xs)
                                w8a8_gemm(xq, xs, w, y, bn, bt, split, warps, stages)
                            try:
                                us = cuda_graph_us([lambda w=w, run=run: run(w) for w in ws], 10, inner)
                            except Exception as e:  # a tile the compiler rejects is skipped, and said
                                print(f"  skip bn{bn} w{warps} s{stages} split{split}: {type(e).__name__}: {str(e)[:120]}")
                                continue
                            if best is None or us < best[0]:
                                best = (us, dict(bn=bn, bt=bt, warps=warps, stages=stages, split=split), run)
            us8, c8, run = best
            us8 = cuda_graph_us([lambda w=w: run(w) for w in ws], 20, inner)
            run(w0)
            act_q, act_s = act_quant_ref(x)
            yr = w8a8_ref(act_q, act_s, w0)
            y16 = gemv.decode_linear_ref(x, w0)
            sc = float(yr.abs().max())
            row = dict(shape=shp["name"], n=n, k=k, t=t, w8a16_us=us16a, w8a16_config=gemv.config_to_json(cfg),
                       cublas_bf16_us=usbl, act_quant_us=usq, w8a8_us=us8, w8a8_config=c8,
                       floor_fp8_us=floor8, floor_bf16_us=floor16,
                       rel_vs_twin=float((y - yr).abs().max()) / sc, rel_vs_bf16_act=float((y - y16).abs().max()) / sc)
            rows.append(row)
            print(f"{shp['name']:>9} {n:>5}x{k:<5} T={t:<2} w8a16 {us16a:6.1f} ({100 * floor8 / us16a:4.1f} %)  "
                  f"cuBLAS bf16 {usbl:6.1f} ({100 * floor16 / usbl:4.1f} %)  w8a8 {us8:6.1f} ({100 * floor8 / us8:4.1f} %, "
                  f"quant {usq:4.1f})  {c8}  err twin {row['rel_vs_twin']:.1e} vs bf16-act {row['rel_vs_bf16_act']:.1e}",
                  flush=True)
        del ws, wb
        torch.cuda.empty_cache()
    json.dump(dict(device=torch.cuda.get_device_name(), copy_tbs=bw / 1e12, rows=rows), open(out, "w"), indent=1)
    print("JSON written to", out)


if __name__ == "__main__":
    main()
