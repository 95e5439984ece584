"""``memra bench cpu``: decode and prefill speed of a GGUF model on this CPU, beside llama.cpp.

Each engine lives in its own child process (fresh memory, so peak RSS is its own):
memra's LLM at each requested dtype, and llama.cpp of 2026-10-01 (its Python binding over
the library :mod:`memra.bench.llamacpp` builds) on the same file with the same thread
count. Both do the same work per measurement: prefill ``--prompt-tokens`` tokens once, then
``--decode-tokens`` greedy single-token steps, each followed by an argmax over the
logits. Then ``llama-bench`` (llama.cpp's own benchmark, same file, threads, prompt and
decode lengths, ``--rounds`` repetitions) runs alone; it is the peer the ratio columns
divide by (no Python, no logits copy: the stricter comparison).

Shared CPUs are noisy (neighbours come and go), so measurements are interleaved: in
each of ``--rounds`` rounds every engine measures once, in turn, after one warm-up.
The table shows the best round (the least disturbed) and the median; the ratio
columns divide memra's best by llama.cpp's best, measured in the same run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import platform
import resource
import statistics
import subprocess
import time
from pathlib import Path

__all__ = ["run_cpu_bench"]


def _prompt_ids(n: int, vocab: int) -> list[int]:
    """A deterministic, non-degenerate prompt of ``n`` token ids."""
    import random

    rng = random.Random(0)
    return [rng.randrange(1000, min(vocab, 30000)) for _ in range(n)]


def _memra_engine(model: str, dtype: str, threads: int, p: int, d: int):
    import torch

    torch.set_num_threads(threads)
    from memra import LLM
    from memra.engine.kv_cache import ContiguousKVCache

    llm = LLM(model, dtype=dtype)
    ids = _prompt_ids(p, llm.config.vocab_size)

    @torch.inference_mode()
    def measure() -> tuple[float, float]:
        kv = ContiguousKVCache(llm.config, p + d + 1, llm.model.dtype)
        t0 = time.perf_counter()
        h = llm.model(torch.tensor(ids), torch.arange(p), kv)
        kv.advance(p)
        tok = int(llm.model.logits(h[-1]).argmax())
        t1 = time.perf_counter()
        for i in range(d):
            h = llm.model(torch.tensor([tok]), torch.tensor([p + i]), kv)
            kv.advance(1)
            tok = int(llm.model.logits(h[-1]).argmax())
        t2 = time.perf_counter()
        return p / (t1 - t0), d / (t2 - t1)

    return measure


def _llamacpp_engine(model: str, threads: int, p: int, d: int):
    import numpy as np

    from memra.bench.llamacpp import load_llama
    from memra.hub import resolve_model

    llm = load_llama(str(resolve_model(model)), n_ctx=p + d + 8, n_threads=threads)
    ids = _prompt_ids(p, llm.n_vocab())

    def measure() -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t1 = time.perf_counter()
        for _ in range(d):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t2 = time.perf_counter()
        return p / (t1 - t0), d / (t2 - t1)

    return measure


def _worker(kind: str, args: tuple, conn) -> None:
    """Load one engine, then answer 'measure' requests until told to stop."""
    try:
        t0 = time.perf_counter()
        measure = _memra_engine(*args) if kind == "memra" else _llamacpp_engine(*args)
        load_s = time.perf_counter() - t0
        measure()  # warm-up
        conn.send({"load_s": load_s})
        while conn.recv() == "measure":
            conn.send(measure())
        conn.send({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    except Exception as e:  # reported in the table, not swallowed
        conn.send({"error": f"{type(e).__name__}: {e}"})


def run_cpu_bench(a) -> int:
    """Run the benchmark described in the module docstring; print a table, write JSON if asked."""
    from memra.hub import resolve_model

    resolve_model(a.model)  # install once, outside the timed children
    engines = [(f"memra {dt}", "memra", (a.model, dt, a.threads, a.prompt_tokens, a.decode_tokens))
               for dt in a.dtypes.split(",") if dt]
    if not a.no_llamacpp:
        engines.append(("llama.cpp", "llamacpp", (a.model, a.threads, a.prompt_tokens, a.decode_tokens)))
    ctx = mp.get_context("spawn")
    rows, procs = [], []
    for name, kind, args in engines:  # load one at a time so loads do not disturb each other
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(kind, args, child))
        proc.start()
        first = parent.recv()
        rows.append({"engine": name, **first, "prefill": [], "decode": []})
        procs.append((proc, parent))
    for _ in range(a.rounds):
        for row, (_proc, conn) in zip(rows, procs):
            if "error" in row:
                continue
            conn.send("measure")
            got = conn.recv()
            if isinstance(got, dict):
                row.update(got)
                continue
            row["prefill"].append(got[0])
            row["decode"].append(got[1])
    for row, (proc, conn) in zip(rows, procs):
        if "error" not in row:
            conn.send("stop")
            row.update(conn.recv())
        proc.join()
    if not a.no_llamacpp:
        rows.append(_llama_bench(a.model, a.threads, a.prompt_tokens, a.decode_tokens, a.rounds))
    for row in rows:
        if row.get("decode"):
            row.update(prefill_tok_s_best=max(row["prefill"]), prefill_tok_s_median=statistics.median(row["prefill"]),
                       decode_tok_s_best=max(row["decode"]), decode_tok_s_median=statistics.median(row["decode"]))
    # the peer for the ratios: llama-bench (llama.cpp's own timing, no Python), else the binding row
    peers = [r for r in rows[::-1] if r["engine"].startswith("llama") and "decode_tok_s_best" in r]
    ref = peers[0] if peers else None
    print(f"memra bench cpu: model={a.model} threads={a.threads} prompt={a.prompt_tokens} decode={a.decode_tokens} "
          f"rounds={a.rounds} cpu={_cpu_name()}")
    hdr = (f"{'engine':<16}{'load s':>7}{'prefill tok/s':>16}{'decode tok/s':>15}{'decode ratio':>13}"
           f"{'prefill ratio':>14}{'peak RSS MiB':>13}")
    print(hdr)
    print(f"{'':<23}{'best (median)':>16}{'best (median)':>15}")
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<16} error: {r['error']}")
            continue
        r.setdefault("load_s", float("nan"))
        r.setdefault("peak_rss_mib", float("nan"))
        if ref is not None:
            r["decode_ratio_vs_llamacpp"] = r["decode_tok_s_best"] / ref["decode_tok_s_best"]
            r["prefill_ratio_vs_llamacpp"] = r["prefill_tok_s_best"] / ref["prefill_tok_s_best"]
        dr = f"{r['decode_ratio_vs_llamacpp']:.2f}x" if ref else "n/a"
        pr = f"{r['prefill_ratio_vs_llamacpp']:.2f}x" if ref else "n/a"
        pf = f"{r['prefill_tok_s_best']:.0f} ({r['prefill_tok_s_median']:.0f})"
        dc = f"{r['decode_tok_s_best']:.1f} ({r['decode_tok_s_median']:.1f})"
        print(f"{r['engine']:<16}{r['load_s']:>7.2f}{pf:>16}{dc:>15}{dr:>13}{pr:>14}{r['peak_rss_mib']:>13.0f}")
    result = {"bench": "cpu", "model": a.model, "threads": a.threads, "prompt_tokens": a.prompt_tokens,
              "decode_tokens": a.decode_tokens, "rounds": a.rounds, "cpu": _cpu_name(), "machine": platform.node(),
              "commit": _commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_out).write_text(json.dumps(result, indent=2))
        print(f"wrote {a.json_out}")
    return 0


def _llama_bench(model: str, threads: int, p: int, d: int, reps: int) -> dict:
    """llama.cpp's ``llama-bench -t threads -p p -n d -r reps -o json`` on the same file: its
    own timing of a ``p``-token prefill and ``d`` decode steps (no Python, no logits copy).
    Returns a table row (``error`` set if it could not be built or run)."""
    from memra.bench.llamacpp import binary
    from memra.hub import resolve_model

    row: dict = {"engine": "llama-bench", "prefill": [], "decode": [], "commands": []}
    try:
        exe = binary("llama-bench")
        base = [str(exe), "-m", str(resolve_model(model)), "-t", str(threads), "-r", str(reps), "-o", "json"]
        # prefill from an empty context; decode after the p-token prompt (-d: context depth), as memra does
        for key, extra in (("prefill", ["-p", str(p), "-n", "0"]), ("decode", ["-p", "0", "-n", str(d), "-d", str(p)])):
            cmd = base + extra
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                raise RuntimeError(f"exit {r.returncode}: {r.stderr[-500:]}")
            row[key] = [float(x) for t in json.loads(r.stdout) for x in t["samples_ts"]]
            row["commands"].append(cmd)
    except Exception as e:  # reported in the table
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" x{mp.cpu_count()}"
    except OSError:
        pass
    return platform.processor()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""
