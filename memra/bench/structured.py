"""``memra bench structured``: what grammar-constrained decoding costs per token on this machine.

The same model, prompt and greedy decode run interleaved with and without a grammar (a JSON
schema of a tool call's arguments, its integer, string, enum and array fields; plus
``json_object``), ``rounds`` times each, in one process: tok/s of each, their ratio, and the
grammar's own time per token (mask computation and advance, timed inside the sampler), with the
grammar's compile time. tok/s are decode tok/s: the first token (after the prefill, the same
for every mode) is left out, and each mode stops where its output ends. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

__all__ = ["add_structured_args", "run_structured_bench"]

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["celsius", "fahrenheit"]}, "tags": {"type": "array", "items": {"type": "string",
                                                                                        "maxLength": 12},
                                                          "maxItems": 3}},
    "required": ["city", "days", "unit", "tags"], "additionalProperties": False}


def add_structured_args(p: argparse.ArgumentParser) -> None:
    from ..hub import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="model key or GGUF file")
    p.add_argument("--tokens", type=int, default=64, help="greedy decode tokens per measurement")
    p.add_argument("--rounds", type=int, default=5, help="interleaved measurements per mode")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--json-out", default=None, help="write results here")


def run_structured_bench(a: argparse.Namespace) -> dict:
    """Measure (module docstring); returns the JSON-able result."""
    import torch

    from ..engine.llm import LLM
    from ..engine.sampling import SamplingParams
    from ..engine.structured import GrammarBackend, Matcher

    torch.set_num_threads(a.threads)
    llm = LLM(a.model, max_model_len=1024, max_num_seqs=1)
    g = GrammarBackend(llm.tokenizer, llm.config.vocab_size, llm.eos_ids)
    t0 = time.perf_counter()
    g._tok()
    tok_s = time.perf_counter() - t0
    compiled = {}
    for name, build in (("json_schema", lambda: g.json_schema(SCHEMA)),
                        ("json_object", lambda: g.json_schema({"type": "object"}))):
        t0 = time.perf_counter()
        compiled[name] = build()
        compiled[name + "_compile_ms"] = (time.perf_counter() - t0) * 1e3

    spent = {"s": 0.0, "n": 0}  # the grammar's time inside the sampler
    allowed, advance = Matcher.allowed, Matcher.advance

    def timed_allowed(self):
        t = time.perf_counter()
        try:
            return allowed(self)
        finally:
            spent["s"] += time.perf_counter() - t
            spent["n"] += 1

    def timed_advance(self, token):
        t = time.perf_counter()
        try:
            return advance(self, token)
        finally:
            spent["s"] += time.perf_counter() - t

    prompt = "Give the weather request as JSON: city, days, unit, tags."
    rows: dict[str, list[float]] = {"free": [], "json_schema": [], "json_object": []}
    per_tok: dict[str, list[float]] = {"json_schema": [], "json_object": []}
    Matcher.allowed, Matcher.advance = timed_allowed, timed_advance
    try:
        for _ in range(a.rounds):
            for mode in rows:
                params = SamplingParams(max_tokens=a.tokens, temperature=0.0,
                                        structured=None if mode == "free" else compiled[mode])
                spent.update(s=0.0, n=0)
                for _ in llm.stream(prompt, params):
                    pass
                m = llm.last_metrics  # decode only: the prefill (the same for every mode) is left out
                rows[mode].append(m["decode_tokens"] / m["decode_s"])
                if mode != "free" and spent["n"]:
                    per_tok[mode].append(spent["s"] / spent["n"] * 1e6)
    finally:
        Matcher.allowed, Matcher.advance = allowed, advance
    free = statistics.median(rows["free"])
    res = {"machine": platform.processor() or platform.machine(), "model": a.model, "threads": a.threads,
           "tokens": a.tokens, "rounds": a.rounds, "tokenizer_build_s": tok_s,
           "compile_ms": {m: compiled[m + "_compile_ms"] for m in per_tok},
           "tok_s": {m: statistics.median(v) for m, v in rows.items()},
           "ratio_to_free": {m: statistics.median(v) / free for m, v in rows.items()},
           "grammar_us_per_token": {m: statistics.median(v) if v else None for m, v in per_tok.items()}}
    print(f"memra bench structured: {a.model}, {a.threads} threads, greedy {a.tokens} tokens, median of "
          f"{a.rounds} interleaved rounds; llguidance tokenizer built in {tok_s:.2f} s")
    print("| mode | tok/s | ratio to free text | grammar us/token | compile ms |")
    print("| --- | --- | --- | --- | --- |")
    for m in rows:
        us = res["grammar_us_per_token"].get(m)
        ms = res["compile_ms"].get(m)
        print(f"| {m} | {res['tok_s'][m]:.1f} | {res['ratio_to_free'][m]:.3f} | "
              f"{'-' if us is None else f'{us:.0f}'} | {'-' if ms is None else f'{ms:.1f}'} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"JSON written to {a.json_out}")
    return res
