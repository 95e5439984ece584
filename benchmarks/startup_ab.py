"""A/B of an engine's warm start between source trees (issue 14: "load <= 2x llama.cpp's").

Each start is a fresh ``python3`` process that imports memra from one tree (``PYTHONPATH``) and
builds ``LLM(FILE, device="cuda")``; the parent times it from the process's start to the child's
"ready" line (interpreter, imports, weights, KV-cache profile, CUDA graphs: what a user waits
for). The child also reports its imports' seconds, the engine's start-up phases and the precompile
reports. Every tree first gets one untimed start (it fills Triton's cache and, where the tree has
one, the precompile manifest), then the timed starts alternate between the trees (A B, B A, ...), so
that a drift of the machine or a place in the order falls on all. Each start checks that it
imported memra from its own tree. Compare ``ready_s`` first: a phase's meaning may differ between trees
(at 12f447f..e5d58f3 the "tokenizer" phase was only the tokenizer's time beyond the weights,
built alongside them), and ``torch_import_s`` varies by a second from start to start on the
H100 host, so the engine's own part is ``ready_s - torch_import_s``. No profiler runs (benchmarks/startup_profile.py has one, and it
inflates the Python-heavy phases).

Prints a table (median seconds per tree and phase, ratio to the first tree) and writes JSON.

Usage (GPU machine): python3 benchmarks/startup_ab.py FILE.gguf base=/path/to/tree new=. --reps 3
    --json-out $OUT/startup-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter() - t0
from memra import LLM
import memra
llm = LLM(sys.argv[1], device=sys.argv[3], max_model_len=int(sys.argv[2]))
eng = llm.engine
reports = [r.__dict__ for r in getattr(eng, "precompile_reports", []) if r is not None]
print("READY " + json.dumps({"memra": memra.__file__, "torch_import_s": t_torch,
                             "phases": dict(getattr(eng, "startup_seconds", {})),
                             "precompile": [{k: v for k, v in r.items() if k in (
                                 "kernels", "on_disk", "record_s", "compile_s", "load_s", "workers",
                                 "from_manifest", "skipped")} for r in reports],
                             "summary": getattr(eng, "memory_report", "")}), flush=True)
"""


def start(tree: str, path: str, max_model_len: int, device: str = "cuda") -> dict:
    """One engine start in a fresh process importing memra from ``tree``; its report plus ``ready_s``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree)] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p and os.path.abspath(p) != os.path.abspath(".")])
    with tempfile.TemporaryFile("w+") as errf:  # stderr to a file: a pipe read only at the end could fill and block
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-c", _CHILD, path, str(max_model_len), device], env=env,
                             stdout=subprocess.PIPE, stderr=errf, text=True, cwd="/")
        report = None
        for line in p.stdout:
            if line.startswith("READY "):
                ready = time.perf_counter() - t0
                report = json.loads(line[6:])
                report["ready_s"] = ready
                break
        p.stdout.close()
        p.wait()
        errf.seek(0)
        err = errf.read()
    if report is None:
        raise RuntimeError(f"start with {tree} failed (exit {p.returncode}): {err[-3000:]}")
    want = os.path.join(os.path.abspath(tree), "memra") + os.sep
    if not report["memra"].startswith(want):
        raise RuntimeError(f"the start meant for {tree} imported memra from {report['memra']}")
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("trees", nargs="+", help="NAME=DIR: a memra source tree (the first is the base)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096 + 128)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the script without a GPU")
    a = ap.parse_args()
    trees = []
    for t in a.trees:
        name, sep, d = t.partition("=")
        if not sep or not os.path.isdir(os.path.join(d, "memra")):
            ap.error(f"{t!r}: expected NAME=DIR with DIR/memra a source tree")
        trees.append((name, d))
    runs: dict[str, list[dict]] = {n: [] for n, _ in trees}
    first: dict[str, dict] = {}
    for name, d in trees:  # untimed: fills the Triton cache (and the manifest) for that tree
        first[name] = start(d, a.path, a.max_model_len, a.device)
        print(f"{name}: first start {first[name]['ready_s']:.2f} s ({first[name]['memra']})", flush=True)
    for r in range(a.reps):
        for name, d in (trees if r % 2 == 0 else trees[::-1]):  # ABBA...: a drift or a place in the order falls on all
            rep = start(d, a.path, a.max_model_len, a.device)
            runs[name].append(rep)
            print(f"{name} #{r + 1}: ready {rep['ready_s']:.2f} s, torch import {rep['torch_import_s']:.2f}, "
                  + ", ".join(f"{k} {v:.2f}" for k, v in rep["phases"].items()), flush=True)
    base = trees[0][0]
    phases = list(dict.fromkeys(k for n, _ in trees for rep in runs[n] for k in rep["phases"]))

    def med(n: str, f) -> float:
        return statistics.median(f(rep) for rep in runs[n])

    cols = ["ready_s", "torch_import_s"] + phases
    print("\n| tree | " + " | ".join(cols) + " | ready / " + base + " |")
    print("| --- " * (len(cols) + 2) + "|")
    table = {}
    for n, _ in trees:
        row = {c: med(n, (lambda rep, c=c: rep[c]) if c in ("ready_s", "torch_import_s")
                      else (lambda rep, c=c: rep["phases"].get(c, 0.0))) for c in cols}
        table[n] = row
        print(f"| {n} | " + " | ".join(f"{row[c]:.2f}" for c in cols)
              + f" | {row['ready_s'] / table[base]['ready_s']:.3f} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"bench": "startup_ab", "path": a.path, "trees": dict(trees), "reps": a.reps,
                       "medians": table, "first": first, "runs": runs}, f, indent=1)
        print(f"JSON written to {a.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
