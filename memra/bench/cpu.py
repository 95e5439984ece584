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

The ceiling: this machine's memory bandwidth, measured in the same run (a read of a
512 MiB buffer and a copy of it, ``--threads`` threads, before and after the engines),
and each engine's byte floor per decode token (every weight it reads once per step plus
the KV cache at the mean context of the decode steps, :func:`decode_bytes`); the
``% floor`` column is decode tok/s over bandwidth / bytes. Then each non-float32 mode's
top-1 agreement with float32 (the exact mode) over :data:`AGREEMENT_TEXT` (~300 tokens,
teacher-forced one decode step per token, as a served request decodes).
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

from .common import commit

__all__ = ["run_cpu_bench"]


def _prompt_ids(n: int, vocab: int) -> list[int]:
    """A deterministic, non-degenerate prompt of ``n`` token ids."""
    import random

    rng = random.Random(0)
    return [rng.randrange(1000, min(vocab, 30000)) for _ in range(n)]


#: The text of the agreement measurement: plain English prose, about 300 tokens.
AGREEMENT_TEXT = (
    "The lighthouse keeper woke before dawn, as he had every morning for thirty years. He climbed the "
    "spiral stairs with a lantern in one hand and a tin cup of coffee in the other, counting the steps "
    "out of habit rather than need. At the top he wiped the salt from the glass, checked the oil, and "
    "looked out over the grey water. A fishing boat was heading home early, its engine coughing, and "
    "far beyond it a cargo ship moved so slowly that it seemed painted on the horizon. He wrote both "
    "in the logbook, together with the wind, the temperature and the height of the swell. In the "
    "afternoon he repaired the fence around the vegetable garden, which the goats had pushed over "
    "again, and walked to the village to collect his letters. The baker asked whether the storm "
    "forecast for the weekend worried him. He said that storms were the reason the light existed, and "
    "that he had seen worse ones than this. On the way back he stopped at the harbour to watch the "
    "children learning to sail small wooden boats between the buoys. One of them capsized, laughed, "
    "climbed back in and tried again. When the sun went down he lit the lamp, sat by the window with "
    "a book about the history of navigation, and listened to the waves until he fell asleep in his "
    "chair, the beam turning slowly above him through the night. In the morning the storm had passed "
    "to the north, the sea was flat and bright, and a new family of gulls had settled on the rocks "
    "below the tower, quarrelling loudly over the remains of a crab."
)


def decode_bytes(model, context: float) -> dict:
    """Bytes a decode step of ``model`` (a :class:`memra.models.base.CausalLM` on the CPU) reads:
    each Linear's stored weight once (native: codes + scales + offsets; int4: packed codes + bf16
    scale/zero; dense: the matrix in its dtype; the dense copy a native or int4 layer keeps for
    prefill is not read at decode), one embedding row,
    the norms, and the fp32 KV cache of ``context`` tokens.
    Returns ``{"weights": bytes, "kv": bytes, "total": bytes}``."""
    from memra.layers.linear import Embedding, Linear
    from memra.layers.norm import RMSNorm

    w = 0
    for mod in model.modules():
        if isinstance(mod, Linear):
            if mod.kernel == "native":
                w += mod.native.nbytes + (0 if mod.bias is None else mod.bias.numel() * mod.bias.element_size())
                continue
            read = [mod.packed, mod.scale_zero] if mod.kernel == "int4" else [mod.stored]
            w += sum(t.numel() * t.element_size() for t in read + ([] if mod.bias is None else [mod.bias]))
        elif isinstance(mod, Embedding):
            w += mod.rows.numel() * mod.rows.element_size() // mod.vocab_size
        elif isinstance(mod, RMSNorm):
            w += mod.weight.numel() * 4
    kv = _kv_bytes(model.config, context, 4)
    return {"weights": w, "kv": kv, "total": w + kv}


def _kv_bytes(config, context: float, elem_bytes: int) -> float:
    """Bytes of K and V a decode step reads at ``context`` tokens (a sliding layer: its window)."""
    return sum(2 * lc.num_kv_heads * lc.head_dim * elem_bytes
               * (context if lc.sliding_window is None else min(context, lc.sliding_window)) for lc in config.layers)


def _llamacpp_bytes(path: str, context: float) -> dict:
    """The same floor for llama.cpp on a GGUF file: every tensor but the token embedding (one row
    of it; a tied output reads it whole), and its f16 KV cache of ``context`` tokens."""
    from memra.config import ModelConfig
    from memra.io.gguf import read_gguf

    ck = read_gguf(path)
    cfg = ModelConfig.from_gguf(ck.metadata, set(ck.infos), path)
    w = 0
    for name, info in ck.infos.items():
        nb = info.nbytes
        if name == "token_embd.weight":
            w += nb // cfg.vocab_size + (nb if cfg.tie_word_embeddings else 0)
        else:
            w += nb
    kv = _kv_bytes(cfg, context, 2)
    return {"weights": w, "kv": kv, "total": w + kv}


def memory_bandwidth(threads: int, mib: int = 512) -> dict:
    """This machine's memory bandwidth with ``threads`` torch threads, GB/s: the best of 5 reads
    (a sum) of a ``mib`` MiB fp32 buffer and of 5 copies of it (read + write bytes counted).
    Runs in a child process (its buffers would otherwise count in the engines' peak RSS: the
    high-water mark survives fork and exec)."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_memory_bandwidth, (threads, mib))


def _memory_bandwidth(threads: int, mib: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    a = torch.rand(mib * 2**20 // 4)
    b = torch.empty_like(a)
    nbytes = a.numel() * 4
    read = copy = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        a.sum()
        t1 = time.perf_counter()
        b.copy_(a)
        t2 = time.perf_counter()
        read, copy = max(read, nbytes / (t1 - t0) / 1e9), max(copy, 2 * nbytes / (t2 - t1) / 1e9)
    return {"read_gb_s": read, "copy_gb_s": copy}


def _memra_engine(model: str, dtype: str, threads: int, p: int, d: int):
    import torch

    torch.set_num_threads(threads)
    from memra import LLM
    from memra.engine.kv_cache import ContiguousKVCache, kv_storage_dtype

    llm = LLM(model, dtype=dtype)
    ids = _prompt_ids(p, llm.config.vocab_size)
    floor = decode_bytes(llm.model, p + d / 2)

    @torch.inference_mode()
    def agreement() -> list[int]:
        """Greedy token after each prefix of AGREEMENT_TEXT, one decode step per token."""
        text = llm.engine.encode_prompt(AGREEMENT_TEXT)
        kv = ContiguousKVCache(llm.config, len(text) + 1, kv_storage_dtype(llm.model.dtype, "cpu"))
        out = []
        for i, t in enumerate(text):
            h = llm.model(torch.tensor([t]), torch.tensor([i]), kv)
            kv.advance(1)
            out.append(int(llm.model.logits(h[-1]).argmax()))
        return out

    @torch.inference_mode()
    def measure() -> tuple[float, float]:
        kv = ContiguousKVCache(llm.config, p + d + 1, kv_storage_dtype(llm.model.dtype, "cpu"))
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

    measure.floor = floor
    measure.agreement = agreement
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
        conn.send({"load_s": load_s, **({"bytes_per_token": measure.floor} if hasattr(measure, "floor") else {})})
        while (msg := conn.recv()) in ("measure", "agreement"):
            conn.send(measure() if msg == "measure" else {"greedy": measure.agreement()})
        conn.send({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    except Exception as e:  # reported in the table, not swallowed
        conn.send({"error": f"{type(e).__name__}: {e}"})


def run_cpu_bench(a) -> int:
    """Run the benchmark described in the module docstring; print a table, write JSON if asked."""
    from memra.hub import resolve_model

    path = str(resolve_model(a.model))  # install once, outside the timed children
    bw = memory_bandwidth(a.threads)
    engines = [(f"memra {dt}", "memra", (a.model, dt, a.threads, a.prompt_tokens, a.decode_tokens))
               for dt in a.dtypes.split(",") if dt]
    if not a.no_llamacpp:
        engines.append(("llama.cpp", "llamacpp", (a.model, a.threads, a.prompt_tokens, a.decode_tokens)))
    ctx = mp.get_context("spawn")
    rows, procs = [], []

    def ask(row: dict, conn, msg: str):
        """Send ``msg`` to a worker; its reply, or None once the worker has failed (the row then holds
        the error: one it reported, or its death)."""
        if "error" in row:
            return None
        try:
            conn.send(msg)
            got = conn.recv()
        except (EOFError, OSError) as e:
            row["error"] = f"worker died ({type(e).__name__})"
            return None
        if isinstance(got, dict) and "error" in got:
            row.update(got)
            return None
        return got

    greedy = {}
    try:
        for name, kind, args in engines:  # load one at a time so loads do not disturb each other
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(kind, args, child), daemon=True)
            proc.start()
            try:
                first = parent.recv()
            except EOFError:
                first = {"error": "worker died while loading"}
            rows.append({"engine": name, **first, "prefill": [], "decode": []})
            procs.append((proc, parent))
        for _ in range(a.rounds):
            for row, (_proc, conn) in zip(rows, procs):
                got = ask(row, conn, "measure")
                if got is not None:
                    row["prefill"].append(got[0])
                    row["decode"].append(got[1])
        for row, (_proc, conn) in zip(rows, procs):
            if row["engine"].startswith("memra") and (got := ask(row, conn, "agreement")) is not None:
                greedy[row["engine"]] = got["greedy"]
        for row, (_proc, conn) in zip(rows, procs):
            if (got := ask(row, conn, "stop")) is not None:
                row.update(got)
    finally:
        for proc, _conn in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    exact = greedy.get("memra float32")
    for row in rows:
        if exact and row["engine"] in greedy and row["engine"] != "memra float32":
            g = greedy[row["engine"]]
            row["top1_agreement_vs_float32"] = sum(a == b for a, b in zip(g, exact)) / len(exact)
            row["agreement_tokens"] = len(exact)
    if not a.no_llamacpp:
        rows.append(_llama_bench(a.model, a.threads, a.prompt_tokens, a.decode_tokens, a.rounds))
        try:
            floor = _llamacpp_bytes(path, a.prompt_tokens + a.decode_tokens / 2)
            for r in rows:
                if r["engine"].startswith("llama"):
                    r["bytes_per_token"] = floor
        except Exception as e:  # noqa: BLE001 - reported, the timings still stand
            print(f"llama.cpp byte floor not computed: {type(e).__name__}: {e}")
    bw2 = memory_bandwidth(a.threads)
    bw = {k: max(bw[k], bw2[k]) for k in bw}
    for row in rows:
        if row.get("decode"):
            row.update(prefill_tok_s_best=max(row["prefill"]), prefill_tok_s_median=statistics.median(row["prefill"]),
                       decode_tok_s_best=max(row["decode"]), decode_tok_s_median=statistics.median(row["decode"]))
    # the peer for the ratios: llama-bench (llama.cpp's own timing, no Python), else the binding row
    peers = [r for r in rows[::-1] if r["engine"].startswith("llama") and "decode_tok_s_best" in r]
    ref = peers[0] if peers else None
    print(f"memra bench cpu: model={a.model} threads={a.threads} prompt={a.prompt_tokens} decode={a.decode_tokens} "
          f"rounds={a.rounds} cpu={_cpu_name()}")
    print(f"memory bandwidth ({a.threads} threads): read {bw['read_gb_s']:.1f} GB/s, copy {bw['copy_gb_s']:.1f} GB/s; "
          f"floor = read bandwidth / bytes per decode token")
    hdr = (f"{'engine':<16}{'load s':>7}{'prefill tok/s':>16}{'decode tok/s':>15}{'decode ratio':>13}"
           f"{'prefill ratio':>14}{'MB/token':>9}{'% floor':>8}{'top-1':>7}{'peak RSS MiB':>13}")
    print(hdr)
    print(f"{'':<23}{'best (median)':>16}{'best (median)':>15}{'':>36}{'vs fp32':>7}")
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
        mb, fl, ag = "", "", ""
        if "bytes_per_token" in r:
            by = r["bytes_per_token"]["total"]
            r["floor_tok_s"] = bw["read_gb_s"] * 1e9 / by
            r["decode_pct_of_floor"] = 100 * r["decode_tok_s_best"] / r["floor_tok_s"]
            mb, fl = f"{by / 1e6:.1f}", f"{r['decode_pct_of_floor']:.0f} %"
        if "top1_agreement_vs_float32" in r:
            ag = f"{100 * r['top1_agreement_vs_float32']:.1f}%"
        print(f"{r['engine']:<16}{r['load_s']:>7.2f}{pf:>16}{dc:>15}{dr:>13}{pr:>14}{mb:>9}{fl:>8}{ag:>7}"
              f"{r['peak_rss_mib']:>13.0f}")
    result = {"bench": "cpu", "model": a.model, "threads": a.threads, "prompt_tokens": a.prompt_tokens,
              "decode_tokens": a.decode_tokens, "rounds": a.rounds, "cpu": _cpu_name(), "machine": platform.node(),
              "commit": commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "memory_bandwidth": bw, "agreement_text_tokens": len(exact) if exact else None, "rows": rows}
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
