"""benchmarks/sass_census.py and memra.kernels.sm90 on the CPU: the int8 lookup's integer model
(PRMT tables, sign select, DP4A) against the E2M1 values, the SASS loop finder on a hand-written
listing, and the whole census compiled for sm_90 (a process without the Triton interpreter)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from bench_scripts import BENCHMARKS, load

_PATH = BENCHMARKS / "sass_census.py"


@pytest.fixture(scope="module")
def census():
    return load("sass_census")


def test_lookup_model_equals_the_e2m1_products(census):
    assert census.check_lookup(words=300, seed=1) == 300
    # every code in every nibble, against x = 1 in that position only
    for code in range(16):
        for pos in range(8):
            x = np.zeros(8, dtype=np.int8)
            x[pos] = -1 if code % 3 else 1
            want = 5 + census.E2M1_X2[code] * int(x[pos])
            assert census.q8_word_model(code << (4 * pos), *census.pack_x(x), 5) == want


def test_the_ptx_is_the_model(census):
    """_Q8_ASM is rendered from the step list the model runs: a step list with its positive
    tables swapped gives other PTX and fails the check."""
    assert census._Q8_ASM.value == census.q8_ptx()
    assert census.q8_ptx().count("prmt.b32") == 6 and census.q8_ptx().count("dp4a.s32.s32") == 2
    bad = tuple(("prmt", d, "$6", "$5", srcs[2]) if srcs[:2] == ["$5", "$6"] else (op, d, *srcs)
                for op, d, *srcs in census.Q8_STEPS)
    assert census.q8_ptx(bad) != census.q8_ptx()
    with pytest.raises(AssertionError):
        census.check_lookup(words=300, seed=1, steps=bad)


def test_lookup_check_fails_on_a_wrong_table(census, monkeypatch):
    t = list(census.TABLES)
    t[3] ^= 1  # -12 -> -11 in the negatives' table
    monkeypatch.setattr(census, "TABLES", tuple(t))
    with pytest.raises(AssertionError):
        census.check_lookup(words=300, seed=1)


def test_prmt_sign_replicate_mode(census):
    # selector nibble 8 + i: byte i's sign bit replicated (PTX ISA, prmt default mode)
    assert census.prmt(0x00800000, 0, 0x000A) == 0xFF
    assert census.prmt(0x007F0000, 0, 0x000A) == 0x00
    assert census.prmt(0x44332211, 0x88776655, 0x7531) == 0x88664422


def test_loops_finds_nesting():
    from memra.kernels.sm90 import loops

    listing = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_0:",
        "        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;",
        ".L_x_1:",
        "        /*0020*/                   LOP3.LUT R3, R3, 0xf, RZ, 0xc0, !PT ;",
        "        /*0030*/                   LOP3.LUT R4, R3, 0xf, RZ, 0xc0, !PT ;",
        "        /*0040*/              @P0 BRA `(.L_x_1) ;",
        "        /*0050*/              @!P1 BRA `(.L_x_0) ;",
        "        /*0060*/                   EXIT ;",
    ])
    got = loops(listing)
    assert [(lp["instructions"], lp["innermost"]) for lp in got] == [(3, True), (5, False)]
    assert got[0]["ops"] == {"LOP3": 2, "BRA": 1}
    # two branches back to one label: one loop, to the last of them; uniform and divergent branches
    listing = "\n".join([
        ".L_x_3:",
        "        /*0000*/                   IADD3 R2, R2, 0x1, RZ ;",
        "        /*0010*/              @P0 BRA `(.L_x_3) ;",
        "        /*0020*/                   IADD3 R3, R3, 0x1, RZ ;",
        "        /*0030*/                   BRA.U !UP0, `(.L_x_3) ;",
        ".L_x_4:",
        "        /*0040*/                   FADD R4, R4, R5 ;",
        "        /*0050*/                   BRA.DIV UR4, `(.L_x_4) ;",
        "        /*0060*/                   EXIT ;",
    ])
    got = loops(listing)
    assert [(lp["instructions"], lp["innermost"]) for lp in got] == [(4, True), (2, True)]


def test_census_compiles_for_sm90(tmp_path):
    out = tmp_path / "census.json"
    code = (
        "import runpy, sys, triton, triton.language as tl\n"
        "from memra.kernels.sm90 import compile_sm90\n"
        "@triton.jit\n"
        "def k(x_ptr, n, B: tl.constexpr):\n"
        "    tl.store(x_ptr + tl.arange(0, B), n)\n"
        "try:\n"
        "    compile_sm90(k, {'x_ptr': '*i32'}, {}, {'B': 16})\n"
        "    raise SystemExit('no error for the unnamed argument n')\n"
        "except ValueError as e:\n"
        "    assert \"'n'\" in str(e), e\n"
        "import importlib.util, json\n"  # one register cap (the down kernel compiles fastest): --caps's rows
        f"spec = importlib.util.spec_from_file_location('sc', {str(_PATH)!r})\n"
        "sc = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(sc)\n"
        "sc.CAPS = (('down', '1', 1, True, (80,)),)\n"
        f"open({str(tmp_path / 'caps.json')!r}, 'w').write(json.dumps(sc.caps()))\n"
        f"sys.argv = ['sass_census', {str(out)!r}]\n"
        f"runpy.run_path({str(_PATH)!r}, run_name='__main__')\n"  # ends in SystemExit(0)
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(_PATH.parents[1])] + [p for p in [env.get("PYTHONPATH")] if p])
    script = tmp_path / "run_census.py"  # a file: @triton.jit needs the source of what it wraps
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=_PATH.parents[1], timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["lookup_words_checked"] == 2000
    names = [r["kernel"] for r in rep["loops"]]
    assert len(names) == 3 and len(set(names)) == 3, names  # one K loop per kernel
    for r in rep["loops"]:
        assert r["innermost"] and r["instructions"] >= 100 and r["registers"] > 0, r
    (cap,) = json.loads((tmp_path / "caps.json").read_text())
    assert cap["maxnreg"] == 80 and 0 < cap["registers"] <= 80, cap  # ptxas kept to the cap
    assert cap["blocks_per_sm"] >= 6 and len(cap["k_loops"]) == 1, cap


def test_blocks_per_sm():
    """sm_90 occupancy: registers in 256-register units per warp, 64 warps, 32 blocks, 228 KiB of
    shared memory with 1 KiB reserved per block."""
    from memra.kernels.sm90 import blocks_per_sm

    assert blocks_per_sm(168, 4) == 3  # 168 * 32 = 5376 -> 5376 registers a warp: 65536 // 21504
    assert blocks_per_sm(128, 4) == 4 and blocks_per_sm(80, 4) == 6 and blocks_per_sm(255, 4) == 2
    assert blocks_per_sm(188, 4) == 2  # 6016 -> 6144 a warp
    assert blocks_per_sm(32, 4) == 16  # 64 warps
    assert blocks_per_sm(16, 1) == 32  # 32 blocks
    assert blocks_per_sm(32, 4, shared_bytes=100 * 1024) == 2  # 228 KiB // 101 KiB
    with pytest.raises(ValueError, match="registers 256"):
        blocks_per_sm(256, 4)
