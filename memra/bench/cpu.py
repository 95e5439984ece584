"""``memra bench cpu``: decode and prefill speed of a GGUF model on this CPU, beside llama.cpp.

Each engine runs in its own child process (fresh memory, so peak RSS is its own):
memra's LLM at each requested dtype, and llama.cpp (its Python binding, see
:mod:`memra.bench.llamacpp`) on the same file with the same thread count. Both do the
same work: prefill ``--prompt-tokens`` tokens once, then ``--decode-tokens`` greedy
single-token steps. Figures are medians over ``--repeats`` runs after one warm-up.
The table's ratio column is memra's tok/s over llama.cpp's measured in the same run.
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
    """A deterministic, non-degenerate prompt of ``n`` token ids (no special tokens at the low end)."""
    import random

    rng = random.Random(0)
    return [rng.randrange(1000, min(vocab, 30000)) for _ in range(n)]


def _memra_worker(model: str, dtype: str, threads: int, p: int, d: int, repeats: int, q) -> None:
    try:
        import torch

        torch.set_num_threads(threads)
        from memra import LLM
        from memra.engine.kv_cache import ContiguousKVCache

        t0 = time.perf_counter()
        llm = LLM(model, dtype=dtype)
        load_s = time.perf_counter() - t0
        ids = _prompt_ids(p, llm.config.vocab_size)
        pre, dec = [], []
        with torch.no_grad():
            for r in range(repeats + 1):
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
                if r:
                    pre.append(p / (t1 - t0))
                    dec.append(d / (t2 - t1))
        q.put({"engine": f"memra {dtype}", "load_s": load_s, "prefill_tok_s": statistics.median(pre),
               "decode_tok_s": statistics.median(dec), "peak_rss_mib": _rss_mib()})
    except Exception as e:  # reported in the table, not swallowed
        q.put({"engine": f"memra {dtype}", "error": f"{type(e).__name__}: {e}"})


def _llamacpp_worker(model: str, threads: int, p: int, d: int, repeats: int, q) -> None:
    try:
        import numpy as np

        from memra.bench.llamacpp import load_llama
        from memra.hub import resolve_model

        path = resolve_model(model)
        t0 = time.perf_counter()
        llm = load_llama(str(path), n_ctx=p + d + 8, n_threads=threads)
        load_s = time.perf_counter() - t0
        ids = _prompt_ids(p, llm.n_vocab())
        pre, dec = [], []
        for r in range(repeats + 1):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            t1 = time.perf_counter()
            for _ in range(d):
                llm.eval([tok])
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            t2 = time.perf_counter()
            if r:
                pre.append(p / (t1 - t0))
                dec.append(d / (t2 - t1))
        q.put({"engine": "llama.cpp", "load_s": load_s, "prefill_tok_s": statistics.median(pre),
               "decode_tok_s": statistics.median(dec), "peak_rss_mib": _rss_mib()})
    except Exception as e:
        q.put({"engine": "llama.cpp", "error": f"{type(e).__name__}: {e}"})


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q))
    proc.start()
    res = q.get()
    proc.join()
    return res


def run_cpu_bench(a) -> int:
    """Run the benchmark described in the module docstring; print a table, write JSON if asked."""
    from memra.hub import resolve_model

    resolve_model(a.model)  # install once, outside the timed children
    rows = []
    for dtype in [s for s in a.dtypes.split(",") if s]:
        rows.append(_run(_memra_worker, a.model, dtype, a.threads, a.prompt_tokens, a.decode_tokens, a.repeats))
    ref = None
    if not a.no_llamacpp:
        ref = _run(_llamacpp_worker, a.model, a.threads, a.prompt_tokens, a.decode_tokens, a.repeats)
        rows.append(ref)
    ok_ref = ref is not None and "error" not in ref
    print(f"memra bench cpu: model={a.model} threads={a.threads} prompt={a.prompt_tokens} "
          f"decode={a.decode_tokens} repeats={a.repeats} cpu={_cpu_name()}")
    hdr = f"{'engine':<16}{'load s':>8}{'prefill tok/s':>15}{'decode tok/s':>14}{'decode ratio':>14}" \
          f"{'prefill ratio':>15}{'peak RSS MiB':>14}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['engine']:<16}  error: {r['error']}")
            continue
        if ok_ref:
            r["decode_ratio_vs_llamacpp"] = r["decode_tok_s"] / ref["decode_tok_s"]
            r["prefill_ratio_vs_llamacpp"] = r["prefill_tok_s"] / ref["prefill_tok_s"]
        dr = f"{r['decode_ratio_vs_llamacpp']:.2f}x" if ok_ref else "n/a"
        pr = f"{r['prefill_ratio_vs_llamacpp']:.2f}x" if ok_ref else "n/a"
        print(f"{r['engine']:<16}{r['load_s']:>8.2f}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.1f}"
              f"{dr:>14}{pr:>15}{r['peak_rss_mib']:>14.0f}")
    result = {"bench": "cpu", "model": a.model, "threads": a.threads, "prompt_tokens": a.prompt_tokens,
              "decode_tokens": a.decode_tokens, "repeats": a.repeats, "cpu": _cpu_name(),
              "machine": platform.node(), "commit": _commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "rows": rows}
    if a.json_out:
        Path(a.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json_out).write_text(json.dumps(result, indent=2))
        print(f"wrote {a.json_out}")
    return 0


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
