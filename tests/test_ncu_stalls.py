"""benchmarks/ncu_stalls.py on a hand-written ncu source page: a long-scoreboard stall is charged
to the load that wrote the register it reads and ran as often as it (the loop-carried prefetch at
the loop's end, not the prologue's first load of the same registers); a file without the stall
columns is refused by name."""

import csv

import pytest
from bench_scripts import load


@pytest.fixture(scope="module")
def ncu_stalls():
    return load("ncu_stalls")


HDR = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
       "stall_wait", "stall_long_sb (Not Issued)"]
# (source, all samples, executed, long_sb, wait)
ROWS = [
    ("LDG.E.128 R44, desc[UR14][R60.64]", 1, 10, 0, 1),  # prologue: the first step's codes
    ("LDG.E.U16 R8, desc[UR14][R62.64]", 0, 80, 0, 0),  # loop: an activation
    ("SHF.R.U32.HI R136, RZ, 0x3, R46", 40, 80, 30, 10),  # reads R46: the codes (R44..R47)
    ("IMAD.U32 R40, R8, 0x10000, RZ", 20, 80, 20, 0),  # reads R8
    ("HFMA2 R10, R40, R136, R10", 5, 80, 0, 5),
    ("@!P0 LDG.E.128 R44, desc[UR14][R64.64]", 2, 80, 0, 2),  # loop end: the next step's codes
    ("@P1 BRA 0x100", 2, 80, 0, 2),
]


def _write(path, rows, hdr=HDR):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k_test"])
        w.writerow(hdr)
        for i, (src, a, e, lsb, wait) in enumerate(rows):
            w.writerow([hex(16 * i), src, a, e, lsb, wait, 0])


def test_stalls_are_charged_to_the_loop_carried_load(ncu_stalls, tmp_path):
    p = tmp_path / "k.csv"
    _write(p, ROWS)
    a = ncu_stalls.analyse(str(p))
    assert a["kernel"] == "k_test" and a["samples"] == 70 and a["instructions"] == 7
    assert a["reasons"] == {"long_sb": 50 / 70, "wait": 20 / 70}
    first, second = a["long_sb_by_load"]
    assert first["index"] == 5 and first["fraction_of_long_sb"] == 30 / 50  # not the prologue's [0]
    assert first["uses"][0]["index"] == 2 and first["uses"][0]["distance"] == 4  # wraps: 5 -> 6, 0, 1, 2
    assert second["index"] == 1 and second["uses"][0]["distance"] == 2


def test_a_page_without_stall_columns_is_refused(ncu_stalls, tmp_path):
    p = tmp_path / "k.csv"
    _write(p, [(s, a, e, 0, 0) for s, a, e, _, _ in ROWS], hdr=[h.replace("stall_long_sb", "x") for h in HDR])
    with pytest.raises(ValueError, match="stall_long_sb"):
        ncu_stalls.analyse(str(p))
