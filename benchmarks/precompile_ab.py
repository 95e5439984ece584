"""A/B of the start-up precompile (memra/kernels/precompile.py) on one model: two engine starts,
``MEMRA_PRECOMPILE=0`` then ``=1``, each in its own process with its own empty Triton cache (a
cold start), and in each: ready time, the precompile reports, greedy tokens of three prompts,
TTFT of a 4096-token prompt (4 times), decode tok/s, the prefill's device time per kernel
(torch.profiler), the in-memory Triton kernels (key, binary hash, registers, spills) and the
processes still alive after ready.

It exists because the one A/B on the 12-layer step35 GGUF (H100, 6078d6d, multiprocessing
workers) had the precompile-on engine prefill 2x slower and decode at 420 tok/s on its warm
start, unexplained: with the same greedy tokens, the same kernels (binaries, registers) and
per-kernel times the two modes must agree, and this prints where they do not.

Usage (GPU): ``python3 benchmarks/precompile_ab.py GGUF OUT.json [--prompt 4096]``.
A third cold start with it off is the control for the tokens (the default MoE prefill adds with
fp32 atomics, in no fixed order). Prints a table (ratios on / off) and writes JSON. Exit status 1
when the greedy tokens differ between off and on while the two off runs agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time


def child(path: str, prompt: int, out: str) -> None:
    """One engine start and its measurements (run in a fresh process); writes JSON to ``out``."""
    t_start = time.time()
    import torch
    from torch.profiler import ProfilerActivity, profile
    from triton.runtime.jit import JITFunction

    from memra import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(path, device="cuda", max_model_len=prompt + 128)
    ready = time.time() - t0
    # processes this one still has after ready (the compile workers must be gone: they would take
    # CPU from the host-bound steps measured below)
    kids = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "pid=,pcpu=,args="], capture_output=True,
                          text=True).stdout.strip().splitlines()
    kids = [k for k in kids if " ps " not in f" {k} "]
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(10, vocab - 10, (n,), generator=gen).tolist()

    def timed(p: list[int], n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        return time.perf_counter() - t

    outs = llm.generate([ids(n) for n in (5, 300, 2000)],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in outs]
    ttft = [timed(ids(prompt), 1) for _ in range(4)]
    short = ids(8)
    one = min(timed(short, 1) for _ in range(3))
    full = min(timed(short, 65) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed(ids(prompt), 1)
    kernels = {}
    for e in prof.key_averages():
        dt = getattr(e, "device_time_total", 0) or 0
        if dt > 0 and e.device_type.name == "CUDA":
            kernels[e.key[:90]] = [round(dt, 1), e.count]
    cache = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("memra."):
            continue
        for oname, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction):
                for caches in obj.device_caches.values():
                    for key, k in caches[0].items():
                        cache.append(dict(fn=f"{name}:{oname}", key=hashlib.sha1(str(key).encode()).hexdigest()[:12],
                                          bin=k.hash[:12], regs=getattr(k, "n_regs", None),
                                          spills=getattr(k, "n_spills", None)))
    reports = [vars(r) for r in llm.engine.precompile_reports if r is not None]
    with open(out, "w") as f:
        json.dump(dict(process_s=time.time() - t_start, ready_s=ready, children_after_ready=kids, tokens=tokens, ttft_s=ttft,
                       decode_tok_s=64 / (full - one), memory=llm.engine.memory_report, reports=reports,
                       startup_s=llm.engine.startup_seconds,
                       kernels=kernels, cache=cache), f)


def compare(a: dict, b: dict) -> tuple[list[str], bool]:
    """Table lines comparing run ``a`` (off) with ``b`` (on), and whether the tokens agree."""
    lines = [f"{'':<34} {'off':>10} {'on':>10} {'on/off':>7}"]
    for label, x, y in (("ready, s", a["ready_s"], b["ready_s"]),
                        ("TTFT (min of 4), ms", 1e3 * min(a["ttft_s"]), 1e3 * min(b["ttft_s"])),
                        ("decode, tok/s", a["decode_tok_s"], b["decode_tok_s"])):
        lines.append(f"{label:<34} {x:>10.1f} {y:>10.1f} {y / x:>7.2f}")
    for tag, x in (("off", a), ("on", b)):
        lines.append(f"{tag}: start-up phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in x["startup_s"].items()))
        if x.get("children_after_ready"):
            lines.append(f"{tag}: processes still alive after ready: {x['children_after_ready']}")
    same = a["tokens"] == b["tokens"]
    lines.append(f"greedy tokens (3 prompts x 16): {'the same' if same else 'DIFFERENT'}")
    ka, kb = a["kernels"], b["kernels"]
    lines.append("prefill device time per kernel, us (top 12 of the on run)")
    for k in sorted(kb, key=lambda k: -kb[k][0])[:12]:
        x = ka.get(k, [float("nan")])[0]
        lines.append(f"  {k[:60]:<60} {x:>10.1f} {kb[k][0]:>10.1f} {kb[k][0] / x:>7.2f}")
    ca = {(c["fn"], c["key"]): c for c in a["cache"]}
    cb = {(c["fn"], c["key"]): c for c in b["cache"]}
    diff = [k for k in sorted(set(ca) | set(cb))
            if k not in ca or k not in cb or any(ca[k][f] != cb[k][f] for f in ("bin", "regs", "spills"))]
    lines.append(f"in-memory kernels: off {len(ca)}, on {len(cb)}; differing (missing, binary, registers): {len(diff)}")
    for k in diff[:20]:
        lines.append(f"  {k[0]} {k[1]}: off {ca.get(k)} on {cb.get(k)}")
    for r in b["reports"]:
        lines.append(f"on, precompile pass: {r['kernels']} kernels, {r['failed']} failed in workers, "
                     f"{r.get('cache_hits')} disk hits, record {r['record_s']:.1f} s, compile {r['compile_s']:.1f} s, "
                     f"load {r['load_s']:.1f} s, {r['workers']} workers {r.get('errors') or ''}")
    return lines, same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 benchmarks/precompile_ab.py", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="model (a GGUF file, a directory, or a name memra resolves)")
    p.add_argument("json_out", help="write the result JSON here")
    p.add_argument("--prompt", type=int, default=4096, help="tokens of the timed prefill")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        child(a.path, a.prompt, a.child)
        return 0
    runs = {}
    with tempfile.TemporaryDirectory(prefix="memra-precompile-ab-") as tmp:
        for run in ("0", "1", "0b"):  # 0b: a second plain cold start, the control for the tokens
            flag = run[0]
            out = os.path.join(tmp, f"run-{run}.json")
            env = dict(os.environ, MEMRA_PRECOMPILE=flag, TRITON_CACHE_DIR=os.path.join(tmp, f"triton-{run}"))
            t0 = time.time()
            r = subprocess.run([sys.executable, os.path.abspath(__file__), a.path, a.json_out, "--prompt",
                                str(a.prompt), "--child", out], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"MEMRA_PRECOMPILE={flag}: the engine process failed ({r.returncode}):\n{r.stderr[-3000:]}",
                      file=sys.stderr)
                return 2
            with open(out) as f:
                runs[run] = json.load(f)
            print(f"MEMRA_PRECOMPILE={flag} ({run}): {time.time() - t0:.0f} s", flush=True)
    lines, same = compare(runs["0"], runs["1"])
    control = runs["0"]["tokens"] == runs["0b"]["tokens"]
    lines.append(f"control, two plain cold starts: greedy tokens {'the same' if control else 'DIFFERENT'} "
                 "(the default MoE prefill adds with fp32 atomics, in no fixed order)")
    print("\n".join(lines))
    from memra.bench.common import commit, write_json

    write_json(a.json_out, dict(bench="precompile_ab", commit=commit(), path=a.path, prompt=a.prompt,
                                off=runs["0"], on=runs["1"], off_control=runs["0b"], table=lines,
                                same_tokens=same, control_same_tokens=control))
    return 0 if same or not control else 1


if __name__ == "__main__":
    sys.exit(main())
