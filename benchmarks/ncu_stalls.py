"""Which loads a kernel's warps wait for: long-scoreboard stall samples attributed to the load
that wrote the register the stalled instruction reads (issue 14).

Input: the SASS source page of one kernel from an Nsight Compute report with the WarpStateStats
and SourceCounters sections (``benchmarks/moe_profile.py`` under ``ncu``), exported as CSV::

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass --kernel-name K --launch-count 1 > K.csv

For each instruction with long-scoreboard samples (``stall_long_sb``: waiting on an L1TEX result,
global or local memory), the load waited for is the nearest earlier ``LDG`` / ``LDL`` / ``LDS``
whose destination registers (``.64`` / ``.128`` loads write 2 / 4) it reads and that ran at least
as often as the stalled instruction; the search wraps around to the bottom of the listing, so a
loop-carried prefetch issued late in a loop body is found ahead of the prologue's first load of
the same registers (which ran once per program). Without such a load, the nearest one is taken. Prints the kernel's stall reasons and the loads that take the most
long-scoreboard samples, with the distance in instructions from load to use; writes JSON.

Usage: ``python3 benchmarks/ncu_stalls.py K.csv [K2.csv ...] [--json OUT.json]``
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys

_LOAD = re.compile(r"^\s*(?:@!?U?P\w+\s+)?(LDG|LDL|LDS)(\.[\w.]+)?\s+R(\d+)")


def _float(v: str) -> float:
    return float(v.replace(",", "")) if v.strip() else 0.0


def _writes(ins: str) -> set[int]:
    """Registers a load instruction writes (empty for anything else)."""
    m = _LOAD.match(ins)
    if not m:
        return set()
    mods = m.group(2) or ""
    n = 4 if ".128" in mods else 2 if ".64" in mods else 1
    base = int(m.group(3))
    return set(range(base, base + n))


def _reads(ins: str) -> set[int]:
    """Source registers of an instruction (the operands after its first, destination, operand)."""
    body = re.sub(r"^\s*@!?U?P\w+\s+", "", ins)
    parts = body.split(None, 1)
    if len(parts) < 2:
        return set()
    ops = parts[1].split(",", 1)
    srcs = ops[1] if len(ops) > 1 and not parts[0].startswith(("ST", "RED", "ATOM", "BRA", "ISETP", "FSETP")) \
        else parts[1]
    return {int(r) for r in re.findall(r"\bR(\d+)\b", srcs)}


def analyse(path: str, top: int = 8) -> dict:
    """Stall reasons and the loads waited for, from one kernel's source-page CSV.

    Returns ``{kernel, samples, reasons: {reason: fraction}, long_sb_by_load: [{load, index,
    fraction_of_long_sb, uses: [{index, instruction, samples, distance}]}]}``.

    Raises: ValueError if the file has no ``Source`` / ``stall_long_sb`` columns (not a source page
    exported with the WarpStateStats section)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    kernel = rows[0][1] if rows and len(rows[0]) > 1 else path
    hdr = rows[1] if len(rows) > 1 else []
    for col in ("Source", "stall_long_sb", "Warp Stall Sampling (All Samples)"):
        if col not in hdr:
            raise ValueError(f"{path}: no {col!r} column (ncu --page source --csv --print-source sass "
                             f"of a report with the WarpStateStats and SourceCounters sections)")
    data = rows[2:]
    src = [r[hdr.index("Source")] for r in data]
    execs = [_float(r[hdr.index("Instructions Executed")]) if "Instructions Executed" in hdr else 0.0 for r in data]
    reasons = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    total = sum(_float(r[hdr.index("Warp Stall Sampling (All Samples)")]) for r in data)
    by_reason = {h[6:]: sum(_float(r[hdr.index(h)]) for r in data) / max(total, 1.0) for h in reasons}
    lsb_col = hdr.index("stall_long_sb")
    lsb_total = sum(_float(r[lsb_col]) for r in data)
    loads: dict[int, dict] = {}
    n = len(src)
    for i, r in enumerate(data):
        v = _float(r[lsb_col])
        if v <= 0:
            continue
        need = _reads(src[i])
        hit = nearest = None
        for d in range(1, n):  # backwards, wrapping: a prefetch loaded at the loop's end
            j = (i - d) % n
            if _writes(src[j]) & need:
                nearest = nearest or (j, d)
                if execs[j] >= execs[i]:
                    hit = (j, d)
                    break
        j, d = hit or nearest or (-1, 0)
        e = loads.setdefault(j, {"load": src[j].strip() if j >= 0 else "(no load found)", "index": j,
                                 "samples": 0.0, "uses": []})
        e["samples"] += v
        e["uses"].append({"index": i, "instruction": src[i].strip(), "samples": v, "distance": d})
    ranked = sorted(loads.values(), key=lambda e: -e["samples"])[:top]
    for e in ranked:
        e["fraction_of_long_sb"] = e.pop("samples") / max(lsb_total, 1.0)
        e["uses"] = sorted(e["uses"], key=lambda u: -u["samples"])[:4]
    return {"kernel": kernel, "samples": total, "instructions": n,
            "reasons": dict(sorted(by_reason.items(), key=lambda kv: -kv[1])), "long_sb_by_load": ranked}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+", help="source-page CSV of one kernel each")
    ap.add_argument("--json", help="write the analyses here")
    ap.add_argument("--top", type=int, default=8, help="loads to list per kernel")
    args = ap.parse_args(argv)
    out = []
    for path in args.csv:
        a = analyse(path, args.top)
        out.append(a)
        rs = ", ".join(f"{k} {100 * v:.1f}%" for k, v in list(a["reasons"].items())[:6])
        print(f"{a['kernel']}: {a['samples']:.0f} samples over {a['instructions']} instructions; {rs}")
        for e in a["long_sb_by_load"]:
            u = e["uses"][0] if e["uses"] else {}
            print(f"  {100 * e['fraction_of_long_sb']:5.1f}% of long-scoreboard  [{e['index']:5d}] {e['load'][:60]}"
                  f"  -> first use [{u.get('index', -1)}] {u.get('distance', 0)} instructions later")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
