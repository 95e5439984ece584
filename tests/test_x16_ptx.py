"""The 16-byte activation loads of the nvfp4 MoE decode kernels (memra.kernels._gemv_triton._x16_ptx,
MoeDecodeConfig.xvec) run only as inline PTX on a GPU. Here the rendered PTX runs through a small
interpreter of the instructions it uses (PTX ISA semantics: ld.global.v4.b32, shl/and.b32,
mul.rn.f32, cvt.rn.f16x2.f32 with the second source in the low half, predicated loads) and is
compared with what the scalar path (_h2_pair) computes: each element loaded, widened to fp32,
multiplied by xs in fp32 and rounded to fp16, paired as (x_j, x_j+4) and (x_8+j, x_12+j)."""

import os
import re

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # Triton reads this when the kernel module is first imported:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as the interpreter tests collected after this file expect

pytest.importorskip("triton")

from memra.kernels._gemv_triton import _x16_ptx  # noqa: E402


def run_ptx(src: str, mem: bytes, addr: int, xs: np.float32, ok: int) -> list[int]:
    """Interpret the asm block; returns $0..$7 (uint32). Unknown instructions raise."""
    reg: dict[str, int] = {"$8": addr, "$9": int(np.float32(xs).view(np.uint32)), "$10": ok}
    pred: dict[str, bool] = {}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in reg:
            return reg[tok]
        return int(tok, 16) if tok.lower().startswith("0x") else int(tok)

    def f32(v: int) -> np.float32:
        return np.array([v], dtype=np.uint32).view(np.float32)[0]

    def f16bits(v: np.float32) -> int:
        return int(np.array([v], dtype=np.float32).astype(np.float16).view(np.uint16)[0])

    for line in src.splitlines():
        line = line.strip()
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        m = re.fullmatch(r"(@(\w+) )?([\w.]+) (.*);", line)
        assert m, line
        guard, op, args = m.group(2), m.group(3), m.group(4)
        if guard is not None and not pred[guard]:
            continue
        if op == "ld.global.v4.b32":
            mm = re.fullmatch(r"\{(.*)\}, \[(\$\d+)(\+(\d+))?\]", args)
            a = reg[mm.group(2)] + int(mm.group(4) or 0)
            assert a % 16 == 0, "ld.global.v4.b32 needs a 16-byte aligned address"
            words = np.frombuffer(mem[a:a + 16], dtype=np.uint32)
            for r, w in zip(mm.group(1).split(","), words):
                reg[r.strip()] = int(w)
            continue
        ops = [a.strip() for a in args.split(",")]
        if op == "setp.ne.b32":
            pred[ops[0]] = val(ops[1]) != val(ops[2])
        elif op == "mov.b32":
            reg[ops[0]] = val(ops[1]) & 0xFFFFFFFF
        elif op == "shl.b32":
            reg[ops[0]] = (val(ops[1]) << val(ops[2])) & 0xFFFFFFFF
        elif op == "and.b32":
            reg[ops[0]] = val(ops[1]) & val(ops[2])
        elif op == "mul.rn.f32":
            p = np.float32(f32(val(ops[1])) * f32(val(ops[2])))  # numpy: IEEE round to nearest even
            reg[ops[0]] = int(np.array([p], dtype=np.float32).view(np.uint32)[0])
        elif op == "cvt.rn.f16x2.f32":
            reg[ops[0]] = (f16bits(f32(val(ops[1]))) << 16) | f16bits(f32(val(ops[2])))
        else:
            raise AssertionError(f"the interpreter does not know {op!r}")
    return [reg[f"${j}"] for j in range(8)]


def scalar_pairs(x: np.ndarray, xs: np.float32) -> list[int]:
    """What 8 _h2_pair calls give for one sub-block x[0..15] (any float dtype)."""
    h = (x.astype(np.float32) * np.float32(xs)).astype(np.float16).view(np.uint16).astype(np.int64)
    lo = [j if j < 4 else 4 + j for j in range(8)]
    return [int(h[i] | (h[i + 4] << 16)) for i in lo]


def same(a: int, b: int) -> bool:
    # fp16x2 equality with any NaN equal to any NaN (the hardware's NaN payload is its own)
    for s in (0, 16):
        ha, hb = (a >> s) & 0xFFFF, (b >> s) & 0xFFFF
        nan_a, nan_b = (ha & 0x7C00) == 0x7C00 and ha & 0x3FF, (hb & 0x7C00) == 0x7C00 and hb & 0x3FF
        if not ((nan_a and nan_b) or ha == hb):
            return False
    return True


def _bf16_from_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("xbytes", [2, 4])
def test_x16_ptx_equals_the_scalar_path(xbytes):
    rng = np.random.default_rng(20 + xbytes)
    src = _x16_ptx(xbytes)
    n = 0
    for trial in range(400):
        if trial % 4 == 0:  # any bit pattern: subnormals, huge values (fp16 overflow), infs, NaNs
            bits = rng.integers(0, 1 << 16, 16, dtype=np.uint32)
            v = _bf16_from_bits(bits) if xbytes == 2 else _bf16_from_bits(bits) * np.float32(1 + 2.0 ** -9)
        else:  # activations at the scales _h2_xscale sees
            v = (rng.standard_normal(16) * 10.0 ** rng.uniform(-6, 4)).astype(np.float32)
            if xbytes == 2:  # bf16 round trip (truncation: any bf16 value is fine)
                v = _bf16_from_bits(v.view(np.uint32) >> 16)
        xs = np.float32(2.0 ** int(rng.integers(-20, 20)))
        if xbytes == 2:
            raw = (v.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        else:
            raw = v.astype(np.float32).tobytes()
        off = 16 * int(rng.integers(1, 4))
        mem = bytes(off) + raw + bytes(16)
        got = run_ptx(src, mem, off, xs, 1)
        want = scalar_pairs(v, xs)
        assert all(same(g, w) for g, w in zip(got, want)), (trial, [hex(g) for g in got], [hex(w) for w in want])
        assert run_ptx(src, mem, off, xs, 0) == [0] * 8  # masked: the pairs of other=0
        n += 1
    assert n == 400


def test_interpreter_catches_a_swapped_pair():
    """The check can fail: a PTX whose cvt puts the halves the other way round is caught."""
    src = _x16_ptx(2).replace("cvt.rn.f16x2.f32 $0, b, a;", "cvt.rn.f16x2.f32 $0, a, b;")
    v = _bf16_from_bits(np.arange(1, 17, dtype=np.uint32) * 0x40 + 0x3F00)
    mem = (v.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    got = run_ptx(src, mem, 0, np.float32(1.0), 1)
    want = scalar_pairs(v, np.float32(1.0))
    assert not same(got[0], want[0]) and all(same(g, w) for g, w in zip(got[1:], want[1:]))
