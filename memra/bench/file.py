"""``memra bench file``: one GGUF file on one GPU, memra and llama.cpp side by side (issue 14 item 5).

What it measures, all in one run on the same file and GPU:

- ceilings of the load: the file read from the page cache into pinned host buffers by one
  thread and by the loader's threads (GB/s; the file is read once before, to be in the page
  cache), and pinned
  host-to-device copies (GB/s); the device-to-device copy bandwidth (the decode roofline's
  denominator);
- memra, twice in a fresh process (``python -m memra.bench.file --child``; the first with a new,
  empty Triton cache unless ``--warm-triton-cache``, the second with the cache the first filled):
  process start to the engine ready (weights read and packed, KV cache
  sized, CUDA graphs captured), the weights' load alone (GB/s against the read ceiling), TTFT of
  a first and a second ``--prompt``-token request (random ids, greedy, one output token), then
  batch-1 decode: ``--gen`` tokens after an 8-token prompt (TPOT of a ``gen + 1``-token request:
  the time from its first token to its last over ``gen``, ``LLM.stream``'s ``decode_s``, best of
  ``--reps``; a difference of two requests' times went negative on a busy CPU) against the step's byte floor
  (memra/roofline.py ``step35_bytes`` "decode" + the KV cache read, at the copy bandwidth);
- llama.cpp (``--llama-bench EXE``, built for CUDA): ``llama-bench -ngl 99 -fa 1 -p P -n G``
  (its prefill and decode tok/s) and the wall time of a ``-p 0 -n 1 -r 1`` run (load, one
  warm-up and one token: the closest it has to "load").

Output: a table of both engines and the ratios memra / llama.cpp, and ``--json-out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["add_file_args", "run_from_args", "read_ceilings"]


def read_ceilings(path: str, chunk: int = 64 << 20, cuda: bool = True) -> dict:
    """Page-cache read GB/s of ``path`` in ``chunk``-byte pieces into a pinned buffer, by one thread
    and by the loader's :data:`memra.io.staging.READ_THREADS` (each after a first pass that brings
    the file into the page cache), and pinned host-to-device copy GB/s (1 GiB, median of 5;
    ``cuda`` False: the reads alone, into ordinary memory)."""
    from ..io import staging

    size = os.path.getsize(path)
    buf = torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda)
    mv = memoryview(buf.numpy())
    out: dict = {"file_bytes": size, "read_threads": staging.READ_THREADS}
    for key, threads in (("read_gbps_1_thread", 1), ("read_gbps", staging.READ_THREADS)):
        saved, staging.READ_THREADS = staging.READ_THREADS, threads
        r = staging.DeviceReader("cpu")
        try:
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                for off in range(0, size, chunk):
                    r._pread_into(Path(path), mv[:min(chunk, size - off)], off)
                times.append(time.perf_counter() - t0)
        finally:
            r.close()
            staging.READ_THREADS = saved
        out[key] = size / times[1] / 1e9
        out.setdefault("read_cold_s", times[0])
    if not cuda:
        return out
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    h2d = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - t0)
    h2d.sort()
    del src, dst
    return out | {"h2d_gbps": (1 << 30) / h2d[len(h2d) // 2] / 1e9}


def _child(a: argparse.Namespace) -> None:
    """The memra side, in its own process: prints one JSON line."""
    t_start = a.spawned
    import memra.engine.engine as eng
    from memra import LLM, SamplingParams

    t_import = time.time()
    loads = []
    cuda = torch.device(a.device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    orig = eng._load

    def timed_load(*args, **kw):
        t0 = time.perf_counter()
        out = orig(*args, **kw)
        sync()
        loads.append(time.perf_counter() - t0)
        return out

    eng._load = timed_load
    llm = LLM(a.path, device=a.device, max_model_len=a.prompt + a.gen + 64)
    t_ready = time.time()
    cfg = llm.config
    gen = torch.Generator().manual_seed(0)
    V = cfg.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(10, V - 10, (n,), generator=gen).tolist()

    def run(prompt, n) -> float:
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        sync()
        t0 = time.perf_counter()
        llm.generate([prompt], p)
        sync()
        return time.perf_counter() - t0

    def decode_tpot(prompt, n) -> float:  # seconds per token after the first, inside one request
        for _ in llm.stream(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)):
            pass
        m = llm.last_metrics
        if m["decode_tokens"] != n - 1 or m["decode_s"] <= 0:
            raise RuntimeError(f"memra bench file: a {n}-token request decoded {m['decode_tokens']} tokens after the "
                               f"first in {m['decode_s']} s")
        return m["decode_s"] / m["decode_tokens"]

    ttft = [run(ids(a.prompt), 1) for _ in range(3)]
    short = ids(8)
    tpot = min(decode_tpot(short, a.gen + 1) for _ in range(a.reps))
    from memra.roofline import step35_bytes

    floor = None
    if cfg.arch == "step35":
        acct = step35_bytes(cfg, context=8 + a.gen // 2)
        infos = getattr(llm.engine.checkpoint, "infos", {})
        kinds = {i.qtype.name for n, i in infos.items() if "_exps." in n}
        fmt = {"NVFP4": "nvfp4", "BF16": "bf16"}.get(kinds.pop()) if len(kinds) == 1 else None
        if fmt is not None:  # (the roofline counts every other weight as bf16)
            floor = acct["decode"][fmt]["total"] + acct["kv_cache"]
    print(json.dumps({
        "import_s": t_import - t_start, "weights_s": loads[0] if loads else None,
        "ready_s": t_ready - t_start, "engine_init_s": llm.engine.load_seconds,
        "startup_s": llm.engine.startup_seconds,
        "memory": llm.engine.memory_report, "ttft_s": ttft, "tpot_s": tpot, "decode_tok_s": 1.0 / tpot,
        "decode_floor_bytes": floor, "graph_steps": llm.engine.runner.num_graph_steps,
    }), flush=True)


def _llama_bench(exe: str, path: str, prompt: int, gen: int, reps: int) -> dict:
    row: dict = {"commands": []}
    cmd = [exe, "-m", path, "-ngl", "99", "-fa", "1", "-p", str(prompt), "-n", str(gen), "-r", str(reps),
           "-o", "json"]
    row["commands"].append(" ".join(cmd))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        row["error"] = r.stderr[-2000:]
        return row
    for t in json.loads(r.stdout):
        if t.get("n_prompt") and not t.get("n_gen"):
            row["prefill_tok_s"] = t["avg_ts"]
        elif t.get("n_gen") and not t.get("n_prompt"):
            row["decode_tok_s"] = t["avg_ts"]
    cmd = [exe, "-m", path, "-ngl", "99", "-fa", "1", "-p", "0", "-n", "1", "-r", "1", "-o", "json"]
    row["commands"].append(" ".join(cmd))
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    row["load_wall_s"] = time.time() - t0
    if r.returncode != 0:
        row["error"] = r.stderr[-2000:]
    return row


def run_from_args(a: argparse.Namespace) -> int:
    """Run the bench (``memra bench file``); returns the exit status."""
    from .common import commit, copy_bandwidth, no_cuda_message, write_json

    cuda = torch.device(a.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        print(no_cuda_message("file") + "; --device cpu runs the memra side on the CPU, a smoke test",
              file=sys.stderr)
        return 1
    if not Path(a.path).is_file():
        print(f"memra bench file: {a.path} is not a file (a GGUF file is expected)", file=sys.stderr)
        return 2
    if a.gen < 1 or a.prompt < 1 or a.reps < 1:
        print(f"memra bench file: --prompt, --gen and --reps must be >= 1 (got {a.prompt}, {a.gen}, {a.reps})",
              file=sys.stderr)
        return 2
    path = str(Path(a.path).resolve())
    from ..config import ModelConfig
    from ..io.gguf import read_gguf

    ck = read_gguf(path)
    ctx = ModelConfig.from_gguf(ck.metadata, set(ck.infos), where=path).max_position_embeddings
    if a.prompt + a.gen + 64 > ctx:
        print(f"memra bench file: {path} has a {ctx}-token context; --prompt {a.prompt} + --gen {a.gen} (+ 64) does "
              f"not fit: pass --prompt <= {ctx - a.gen - 64}", file=sys.stderr)
        return 2
    dev = torch.device(a.device)
    if cuda and dev.index is not None:
        torch.cuda.set_device(dev)
    res: dict = {"bench": "file", "commit": commit(), "file": path, "device": a.device,
                 "gpu": torch.cuda.get_device_name(dev.index) if cuda else None, "prompt": a.prompt, "gen": a.gen}
    res["ceilings"] = read_ceilings(path, cuda=cuda)
    res["ceilings"]["copy_tbps"] = copy_bandwidth() / 1e12 if cuda else None
    env = dict(os.environ)
    tmp = None if a.warm_triton_cache else tempfile.mkdtemp(prefix="memra-triton-")
    if tmp is not None:
        env["TRITON_CACHE_DIR"] = tmp
    runs = []
    try:
        for _ in range(2):  # a cold start (empty Triton cache, unless --warm-triton-cache), then a warm one
            cmd = [sys.executable, "-m", "memra.bench.file", "--child", path, "--device", a.device, "--prompt",
                   str(a.prompt), "--gen", str(a.gen), "--reps", str(a.reps), "--spawned", repr(time.time())]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode != 0 or not lines:
                print(r.stdout[-3000:], r.stderr[-5000:], file=sys.stderr)
                return 1
            runs.append(json.loads(lines[-1]))
            if tmp is not None and len(runs) == 1:  # what the cold start compiled: cubins by kernel name
                res["triton_compiled"] = dict(collections.Counter(
                    f.stem for f in Path(tmp).rglob("*.cubin")).most_common())
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    m = runs[0]
    res["memra"], res["memra_warm_start"] = runs
    if a.llama_bench:
        res["llama.cpp"] = _llama_bench(a.llama_bench, path, a.prompt, a.gen, a.reps)
    c = res["ceilings"]
    size = c["file_bytes"]
    copy_bps = c["copy_tbps"] * 1e12 if cuda else None
    print(f"file {path}: {size / 1e9:.2f} GB; read from the page cache {c['read_gbps']:.2f} GB/s by "
          f"{c['read_threads']} threads, {c['read_gbps_1_thread']:.2f} GB/s by one (first pass "
          f"{size / c['read_cold_s'] / 1e9:.2f} GB/s)"
          + (f", pinned host-to-device {c['h2d_gbps']:.1f} GB/s, device copy {c['copy_tbps']:.2f} TB/s" if cuda else ""))
    if m["memory"]:
        print(f"memra: {m['memory']}")
    print(f"{'engine':<10} {'ready s':>8} {'weights s':>10} {'GB/s':>6} {'% read':>7} {'TTFT1 ms':>9} "
          f"{'TTFT2 ms':>9} {'prefill tok/s':>14} {'decode tok/s':>13} {'% roofline':>11}")
    floor_s = m["decode_floor_bytes"] / copy_bps if m["decode_floor_bytes"] and copy_bps else None
    gbps = size / m["weights_s"] / 1e9 if m["weights_s"] else float("nan")
    mrow = {"ready_s": m["ready_s"], "weights_s": m["weights_s"], "weights_gbps": gbps,
            "ttft1_ms": 1e3 * m["ttft_s"][0], "ttft2_ms": 1e3 * m["ttft_s"][1],
            "prefill_tok_s": a.prompt / m["ttft_s"][1], "decode_tok_s": m["decode_tok_s"],
            "decode_roofline_pct": 100 * floor_s / m["tpot_s"] if floor_s else None}
    res["table"] = {"memra": mrow}
    print(f"{'memra':<10} {mrow['ready_s']:>8.1f} {mrow['weights_s']:>10.1f} {gbps:>6.2f} "
          f"{100 * gbps / c['read_gbps']:>6.0f}% {mrow['ttft1_ms']:>9.1f} {mrow['ttft2_ms']:>9.1f} "
          f"{mrow['prefill_tok_s']:>14.0f} {mrow['decode_tok_s']:>13.1f} "
          f"{_pct(mrow['decode_roofline_pct'])}")
    lc = res.get("llama.cpp")
    if lc and "decode_tok_s" in lc:
        lrow = {"ready_s": lc["load_wall_s"], "prefill_tok_s": lc.get("prefill_tok_s"),
                "decode_tok_s": lc["decode_tok_s"],
                "decode_roofline_pct": 100 * floor_s * lc["decode_tok_s"] if floor_s else None}
        res["table"]["llama.cpp"] = lrow
        print(f"{'llama.cpp':<10} {lrow['ready_s']:>8.1f} {'':>10} {'':>6} {'':>7} {'':>9} {'':>9} "
              f"{lrow['prefill_tok_s'] or float('nan'):>14.0f} {lrow['decode_tok_s']:>13.1f} "
              f"{_pct(lrow['decode_roofline_pct'])}")
        ratios = {"decode": mrow["decode_tok_s"] / lrow["decode_tok_s"],
                  "prefill": mrow["prefill_tok_s"] / (lrow["prefill_tok_s"] or float("nan")),
                  "load": mrow["ready_s"] / lrow["ready_s"]}
        res["table"]["ratios"] = ratios
        print(f"memra / llama.cpp: decode {ratios['decode']:.2f}x, prefill {ratios['prefill']:.2f}x, "
              f"load (ready) {ratios['load']:.2f}x the wall time")
    elif lc:
        print(f"llama.cpp failed: {lc.get('error', '')[-800:]}")
    comp = res.get("triton_compiled")
    if comp:
        print(f"cold start compiled {sum(comp.values())} Triton kernels ({len(comp)} distinct): "
              + ", ".join(f"{k} x{v}" for k, v in list(comp.items())[:12]))
    w = runs[1]
    print(f"TTFT first / second request: {m['ttft_s'][0] / m['ttft_s'][1]:.2f}x")
    print(f"second start{' (Triton cache warm)' if cuda else ''}: ready {w['ready_s']:.1f} s (weights {w['weights_s']:.1f} s), TTFT "
          f"{1e3 * w['ttft_s'][0]:.1f} / {1e3 * w['ttft_s'][1]:.1f} ms, decode {w['decode_tok_s']:.1f} tok/s"
          + (f"; ready / llama.cpp's: {w['ready_s'] / lc['load_wall_s']:.2f}x" if lc and "load_wall_s" in lc else ""))
    for name, r in (("cold", m), ("warm", w)):
        print(f"start-up phases, {name} start: import {r['import_s']:.1f} s, "
              + ", ".join(f"{k} {v:.1f} s" for k, v in r.get("startup_s", {}).items()))
    res["table"]["memra_warm_start"] = {"ready_s": w["ready_s"], "weights_s": w["weights_s"],
                                        "decode_tok_s": w["decode_tok_s"], "ttft_s": w["ttft_s"]}
    if a.json_out:
        write_json(a.json_out, res)
    return 0


def _pct(x: float | None) -> str:
    """An 11-character table cell: ``x`` as a percentage, or ``n/a`` where there is no ceiling
    (``--device cpu`` measures no copy bandwidth)."""
    return f"{x:>10.1f}%" if x is not None else f"{'n/a':>11}"


def add_file_args(p: argparse.ArgumentParser) -> None:
    """The arguments of ``memra bench file`` (the file, prompt / decode lengths, repetitions, the
    llama-bench executable, the Triton cache, the device, the JSON output) on ``p``."""
    p.add_argument("path", help="a GGUF file (e.g. memra convert synth --geometry full --layers 12 ...)")
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens for TTFT / prefill")
    p.add_argument("--gen", type=int, default=128, help="decode tokens at batch 1")
    p.add_argument("--reps", type=int, default=2, help="repetitions of the decode run (best) and of llama-bench")
    p.add_argument("--llama-bench", default=None, metavar="EXE", help="llama.cpp's llama-bench built for CUDA")
    p.add_argument("--warm-triton-cache", action="store_true",
                   help="let memra's process use the existing Triton cache (a warm start) rather than a fresh one "
                        "(a cold start)")
    p.add_argument("--device", default="cuda", help="memra's device (cpu: a smoke test of the bench itself)")
    p.add_argument("--json-out", default=None, help="write the result JSON here")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memra.bench.file")
    add_file_args(p)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spawned", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a)
        return 0
    return run_from_args(a)


if __name__ == "__main__":
    sys.exit(main())
