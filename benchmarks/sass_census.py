"""Static census of the MoE decode GEMV's K loop for sm_90, on a machine without a GPU (issue 14).

Question: how many instructions does each weight cost in the hot loop of memra's NVFP4 MoE decode
kernels, and how many would an int8-activation path (llama.cpp's MMVQ recipe: activations
quantized to int8 per 16-block, codes looked up as int8 with PRMT, products summed with DP4A)
cost at the same tile? At T = 1 a loop step of the decode GEMV lasts as long as its warps take to
issue its instructions at low occupancy (168 registers, 3 warps a scheduler, ncu: ~40 % of issue
slots busy; memra/kernels/NOTES.md), so instructions per weight prices a change before any GPU
time is spent.

Each kernel is compiled for sm_90 and disassembled on the CPU (:mod:`memra.kernels.sm90`: Triton's
bundled ptxas and ``nvdisasm``, no driver), and the innermost loop holding the K loop is counted:
body size and the most frequent opcodes. Kernels:

- ``gate_up`` / ``down``: memra's ``_moe_gate_up_kernel`` / ``_moe_down_kernel`` at the flagship
  shape (D 4096, I 1280), nvfp4, fp16x2 path, T = 1 defaults (64 weight rows x 512 / 256 K per step).
- ``q8_dp4a``: a prototype GEMV loop, same tile (64 rows x 512 K, 4 warps, codes prefetched one
  step ahead in registers): per 32-bit word of 8 E2M1 codes, two PRMT lookups in a table of
  E2M1 x 2 magnitudes and two in the table of their negatives (one per 4 codes each), two PRMT
  byte selects by the sign bits, two DP4A against int8 activations; per 16-block, the int32 sum
  times (UE4M3 scale x the activations' block scale). A probe, not a memra kernel: its PTX and an
  exact integer model of it (PRMT and DP4A as the PTX ISA defines them) are rendered from one
  step list, and the model is checked against the E2M1 values; the SASS count is the result; it
  has not run on a GPU.

Prints one line per loop and writes JSON. Usage: ``python3 benchmarks/sass_census.py [OUT.json] [--caps]``
(``--caps``: also each register cap of :data:`CAPS`: registers, spills, thread blocks per SM and the
K loops' instructions, to choose the ``maxnreg1`` / ``maxnreg2`` caps of ``MoeDecodeConfig`` worth
timing on a GPU).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from memra.kernels import _moe_triton  # noqa: E402
from memra.kernels._gemv_triton import _ue4m3_raw  # noqa: E402
from memra.kernels.sm90 import blocks_per_sm, compile_sm90, loops, resources, sass  # noqa: E402

#: E2M1 code (sign bit 3, magnitude bits 0-2) -> value x 2, an integer in [-12, 12]
E2M1_X2 = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
#: the lookup tables as PRMT operands (bytes 0-3 in the first word, 4-7 in the second)
TABLES = (0x03020100, 0x0C080604, 0xFDFEFF00, 0xF4F8FAFC)

# The per-word lookup + dot, one program for both the PTX and its integer model (q8_word_model):
# (op, destination, operands). $0: int32 sum; $1: 8 codes (code i in nibble i); $2, $3: int8x4
# activations of codes 0-3 and 4-7; $4: int32 added; $5-$8: TABLES (registers: as immediates
# inside the asm ptxas rebuilt them per use, 823 instructions a loop step instead of 725).
Q8_STEPS = (
    ("and", "m", "$1", 0x77777777),  # the magnitudes (signs off): PRMT selectors
    ("prmt", "p0", "$5", "$6", "m"),  # codes 0-3: E2M1 x 2
    ("prmt", "n0", "$7", "$8", "m"),  # codes 0-3: -(E2M1 x 2)
    ("shr", "mh", "m", 16),  # PRMT reads its selector's low 16 bits only
    ("prmt", "p1", "$5", "$6", "mh"),
    ("prmt", "n1", "$7", "$8", "mh"),
    ("shr", "s", "$1", 1),  # sign of code i to bit 2 of nibble i: byte i from p (0-3) or n (4-7)
    ("and", "s", "s", 0x44444444),
    ("or", "s", "s", 0x32103210),
    ("prmt", "a", "p0", "n0", "s"),
    ("shr", "sh", "s", 16),
    ("prmt", "b", "p1", "n1", "sh"),
    ("dp4a", "$0", "a", "$2", "$4"),
    ("dp4a", "$0", "b", "$3", "$0"),
)
_PTX_OP = {"and": "and.b32", "or": "or.b32", "shr": "shr.u32", "prmt": "prmt.b32", "dp4a": "dp4a.s32.s32"}


def q8_ptx(steps=Q8_STEPS) -> str:
    """The inline PTX of ``steps``."""
    regs = sorted({d for _, d, *_ in steps if not d.startswith("$")})
    body = [f"{_PTX_OP[op]} {d}, " + ", ".join(hex(v) if isinstance(v, int) else v for v in srcs) + ";"
            for op, d, *srcs in steps]
    return "{\n.reg .b32 " + ", ".join(regs) + ";\n" + "\n".join(body) + "\n}"


_Q8_ASM = tl.constexpr(q8_ptx())


def prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32 d, a, b, c`` (default mode): byte i of d is byte c[4i+2:4i] of {b, a}
    (a: bytes 0-3), or that byte's sign replicated when c[4i+3] is set; c's low 16 bits only."""
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    d = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        d |= byte << (8 * i)
    return d


def dp4a(a: int, b: int, c: int) -> int:
    """PTX ``dp4a.s32.s32 d, a, b, c``: c + the sum of the four signed byte products."""
    sa = np.array([a >> (8 * i) & 0xFF for i in range(4)], dtype=np.uint8).view(np.int8).astype(np.int64)
    sb = np.array([b >> (8 * i) & 0xFF for i in range(4)], dtype=np.uint8).view(np.int8).astype(np.int64)
    return int(c + (sa * sb).sum())


def q8_word_model(q: int, xa: int, xb: int, acc: int, steps=Q8_STEPS) -> int:
    """``steps`` (the PTX of ``_Q8_ASM``) run on Python ints: the int32 result."""
    env = {"$1": q, "$2": xa, "$3": xb, "$4": acc, "$5": TABLES[0], "$6": TABLES[1], "$7": TABLES[2],
           "$8": TABLES[3]}

    def val(v):
        return v if isinstance(v, int) else env[v]

    for op, d, *srcs in steps:
        a = [val(v) for v in srcs]
        if op == "and":
            r = a[0] & a[1]
        elif op == "or":
            r = a[0] | a[1]
        elif op == "shr":
            r = (a[0] & 0xFFFFFFFF) >> a[1]
        elif op == "prmt":
            r = prmt(*a)
        else:  # dp4a
            r = dp4a(*a) & 0xFFFFFFFF
        env[d] = r
    res = env["$0"]
    return res - (1 << 32) if res >= 1 << 31 else res


def pack_x(x) -> tuple[int, int]:
    """Eight int8 activations -> the two int8x4 words ($2, $3 of _Q8_ASM), x[0] in the low byte."""
    b = np.asarray(x, dtype=np.int64).astype(np.int8).view(np.uint8).astype(np.int64)
    return tuple(int(sum(int(v) << (8 * i) for i, v in enumerate(b[j:j + 4]))) for j in (0, 4))


def check_lookup(words: int = 2000, seed: int = 0, steps=Q8_STEPS) -> int:
    """Compares the model of ``steps`` with sum_i E2M1_X2[code_i] * x_i on random code words and
    int8 x; returns the number of words checked. Raises AssertionError on the first mismatch."""
    rng = np.random.default_rng(seed)
    for _ in range(words):
        q = int(rng.integers(0, 2**32))
        x = rng.integers(-128, 128, size=8)
        want = sum(E2M1_X2[(q >> (4 * i)) & 15] * int(x[i]) for i in range(8))
        got = q8_word_model(q, *pack_x(x), 0, steps)
        assert got == want, (hex(q), x.tolist(), got, want)
    return words


@triton.jit
def _q8_word(q, xa, xb, acc, t0, t1, t2, t3):
    return tl.inline_asm_elementwise(_Q8_ASM, "=r,r,r,r,r,r,r,r,r", [q, xa, xb, acc, t0, t1, t2, t3],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _q8_gemv_kernel(w_ptr, s_ptr, x_ptr, xs_ptr, tab_ptr, y_ptr, N, K, stride_wn, stride_sn,
                    BN: tl.constexpr, BK: tl.constexpr):
    # y[n] = sum over 16-blocks b of (sum_k E2M1_X2[code] * xq[k]) * ue4m3(s[n, b]) * xs[b] (up to the
    # constant factor of _ue4m3_raw, which does not change the instruction count)
    # w: int32 [N, K / 8]; s: uint8 [N, K / 16]; x: int32 [K / 4] (int8 x 4); xs: fp32 [K / 16]
    SB: tl.constexpr = BK // 16
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    n3 = rn[:, None, None]
    rs = tl.arange(0, SB)
    rw = rs[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    t0 = tl.load(tab_ptr)
    t1 = tl.load(tab_ptr + 1)
    t2 = tl.load(tab_ptr + 2)
    t3 = tl.load(tab_ptr + 3)
    acc = tl.zeros([BN, SB], dtype=tl.float32)
    q = tl.load(w_ptr + n3 * stride_wn + rw)
    sb = tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :]).to(tl.int32)
    for k0 in tl.range(0, K, BK, num_stages=1):
        kn = tl.minimum(k0 + BK, K - BK)  # the next step's codes, one step ahead in registers
        qn = tl.load(w_ptr + n3 * stride_wn + kn // 8 + rw)
        sbn = tl.load(s_ptr + rn[:, None] * stride_sn + kn // 16 + rs[None, :]).to(tl.int32)
        xw = tl.load(x_ptr + k0 // 4 + rs[:, None, None] * 4 + tl.arange(0, 2)[None, :, None] * 2
                     + tl.arange(0, 2)[None, None, :])
        xa, xb = tl.split(xw)
        d = _q8_word(q, xa[None, :, :], xb[None, :, :], tl.zeros([BN, SB, 2], dtype=tl.int32), t0, t1, t2, t3)
        xsc = tl.load(xs_ptr + k0 // 16 + rs)
        acc += tl.sum(d, axis=2).to(tl.float32) * (_ue4m3_raw(sb) * xsc[None, :])
        q = qn
        sb = sbn
    tl.store(y_ptr + rn, tl.sum(acc, axis=1))


I_FLAG, D_FLAG, WARPS = 1280, 4096, 4  # the flagship's MoE shape; the decode kernels' 4 warps


def gate_up(nc: int = 1, prefetch: bool | int = True, maxnreg: int | None = None, xv: bool = False):
    """memra's nvfp4 gate+up decode kernel (fp16x2 path, 32 act columns = 64 rows x 512 per step)
    compiled for sm_90: ``nc`` tokens per chunk, register prefetch (2: two steps ahead), register
    cap, 16-byte activation loads (moe_decode's MoeDecodeConfig nc / prefetch and prefetch_depth /
    maxnreg1 / xvec)."""
    i, d = I_FLAG, D_FLAG
    opts = {} if maxnreg is None else {"maxnreg": maxnreg}
    xvd = {"XV": True} if xv else {}
    return compile_sm90(
        _moe_triton._moe_gate_up_kernel,
        dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", act_ptr="*fp32", perm_ptr="*i32", se_ptr="*i32",
             ss_ptr="*i32", sc_ptr="*i32"),
        dict(topk=8, I=i, K=d, stride_x=d, stride_we=2 * i * d // 16, stride_wn=d // 16, stride_se=2 * i * d // 16,
             stride_sn=d // 16),
        dict(FMT=2, BA=32, U=16, G=32, GS=16, NC=nc, EVEN_K=True, ASM=True, F16=True, PREFETCH=prefetch,
             HAS_LIMIT=True, PREFETCH_TAIL=prefetch, PDL=False, **xvd), floats={"limit"}, num_warps=WARPS, num_stages=1,
        **opts)


def down(nc: int = 1, prefetch: bool | int = True, maxnreg: int | None = None, xv: bool = False):
    """memra's nvfp4 down decode kernel (fp16x2 path, 64 rows x 256 per step) for sm_90; arguments
    as :func:`gate_up` (MoeDecodeConfig maxnreg2)."""
    i, d = I_FLAG, D_FLAG
    opts = {} if maxnreg is None else {"maxnreg": maxnreg}
    xvd = {"XV": True} if xv else {}
    return compile_sm90(
        _moe_triton._moe_down_kernel,
        dict(act_ptr="*fp32", w_ptr="*u8", s_ptr="*u8", y_ptr="*fp32", perm_ptr="*i32", wt_ptr="*fp32",
             se_ptr="*i32", ss_ptr="*i32", sc_ptr="*i32"),
        dict(topk=8, N=d, K=i, k_per_split=i, stride_we=d * i // 16, stride_wn=i // 16, stride_se=d * i // 16,
             stride_sn=i // 16),
        dict(FMT=2, BN=64, G=16, GS=16, NC=nc, EVEN_K=True, ASM=True, F16=True, PREFETCH=prefetch, ATOMIC=False,
             PREFETCH_TAIL=prefetch, PDL=False, **xvd), num_warps=WARPS, num_stages=1, **opts)


def kernels() -> dict:
    """name -> (compiled kernel, weights per thread per loop step of the K loop)."""
    i, d = I_FLAG, D_FLAG
    q8 = compile_sm90(
        _q8_gemv_kernel,
        dict(w_ptr="*i32", s_ptr="*u8", x_ptr="*i32", xs_ptr="*fp32", tab_ptr="*i32", y_ptr="*fp32"),
        dict(N=2 * i, K=d, stride_wn=d // 8, stride_sn=d // 16), dict(BN=64, BK=512), num_warps=WARPS, num_stages=1)
    threads = 32 * WARPS
    return {"gate_up nvfp4 T=1 (fp16x2)": (gate_up(), 64 * 512 / threads),
            "down nvfp4 T=1 (fp16x2)": (down(), 64 * 256 / threads),
            "q8_dp4a prototype (64 x 512)": (q8, 64 * 512 / threads)}


#: (kernel, T it serves by default, nc, prefetch, register caps tried): the defaults of
#: moe_decode.default_moe_config for nvfp4 (T = 1: one-token chunks with prefetch; T >= 2: two-token
#: chunks without) and caps at the next whole blocks per SM
CAPS = (("gate_up", "1", 1, True, (None, 128)), ("gate_up", ">=2", 2, False, (None, 128, 120)),
        ("down", "1", 1, True, (None, 96, 80)), ("down", ">=2", 2, False, (None, 96, 80)))


def caps() -> list[dict]:
    """Register caps of the MoE decode kernels: per cap, the registers ptxas used, local memory
    (spills), thread blocks per SM, and the K loops' instructions and spill loads/stores."""
    rows = []
    for name, t, nc, pf, regs_tried in CAPS:
        for cap in regs_tried:
            k = (gate_up if name == "gate_up" else down)(nc, pf, cap)
            regs, stack = resources(k)
            lps = [lp for lp in loops(sass(k)) if lp["innermost"] and lp["instructions"] >= 100]
            rows.append({"kernel": name, "T": t, "nc": nc, "prefetch": pf, "maxnreg": cap, "registers": regs,
                         "local_bytes": stack, "blocks_per_sm": blocks_per_sm(regs, WARPS, k.metadata.shared),
                         "k_loops": [{"instructions": lp["instructions"], "local": lp["local"]} for lp in lps]})
            r = rows[-1]
            print(f"{name} T {t} (nc {nc}, prefetch {pf}) maxnreg {cap}: {regs} registers, {stack} B local, "
                  f"{r['blocks_per_sm']} blocks/SM; K loops (instructions, LDL+STL): "
                  + ", ".join(f"({x['instructions']}, {x['local']})" for x in r["k_loops"]), flush=True)
    return rows


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="JSON file to write")
    ap.add_argument("--caps", action="store_true", help="also the register caps of the MoE decode kernels")
    args = ap.parse_args(argv)
    checked = check_lookup()
    print(f"q8 lookup model: {checked} random code words x int8 activations equal sum E2M1 x 2 * x")
    rows = []
    for name, (k, per_thread) in kernels().items():
        regs, _ = resources(k)
        for lp in loops(sass(k)):
            if not lp["innermost"] or lp["instructions"] < 100:  # the K loop only (not the x-scale
                continue  # pass, a bare branch, or the loop over a slot's tokens around the K loop)
            per_w = lp["instructions"] / per_thread
            rows.append({"kernel": name, "registers": regs, "weights_per_thread": per_thread,
                         "instructions_per_weight": per_w, **lp})
            print(f"{name}: {regs} registers; loop {lp['instructions']} instructions for {per_thread:.0f} weights "
                  f"a thread = {per_w:.2f} per weight; {lp['ops']}")
    out = {"bench": "sass_census", "target": "sm_90", "triton": triton.__version__, "lookup_words_checked": checked,
           "loops": rows}
    if args.caps:
        out["caps"] = caps()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"JSON written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
