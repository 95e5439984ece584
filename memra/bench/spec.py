"""``memra bench spec``: speculative decoding on this machine, against plain decode in the same run.

One model loaded once and served by two engines (speculation off / on, same weights and KV
settings; ``--method draft`` also loads ``--draft-model``), a fixed prompt set
(code, lists, repeated text: what prompt lookup drafts well, and plain prose: what it does not),
greedy single-stream generation of ``--tokens`` tokens per prompt, ``--rounds`` interleaved rounds.
Reports decode tok/s of each (the prefill is left out: the first token's time), their ratio,
the acceptance rate per draft position, the mean accepted length per verify step (accepted drafts
+ 1), and checks that both produce the same tokens (greedy speculation is exact). Prints a table,
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

__all__ = ["PROMPTS", "add_spec_args", "run_spec_bench"]

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "<ul>\n  <li>one</li>\n  <li>two</li>\n  <li>",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "SELECT name FROM users; SELECT age FROM users; SELECT",
    "Q: What is 2+2?\nA: 4\nQ: What is 3+3?\nA: 6\nQ: What is 4+4?\nA:",
    "Once upon a time",
    "The capital of France is",
    "To be or not to be, that is",
]


def add_spec_args(p: argparse.ArgumentParser) -> None:
    from ..hub import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="model key or GGUF file")
    p.add_argument("--method", default="ngram", choices=["ngram", "draft", "mtp"], help="proposer")
    p.add_argument("--draft-model", default=None, help="draft model of --method draft (key or file)")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"first N of the {len(PROMPTS)} prompts")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="drafts per step")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--json-out", default=None, help="write results here")


def run_spec_bench(a: argparse.Namespace) -> dict:
    """Measure (module docstring); returns the JSON-able result."""
    import torch

    from ..engine.engine import EngineConfig, LLMEngine
    from ..engine.llm import LLM
    from ..engine.sampling import SamplingParams

    torch.set_num_threads(a.threads)
    k = a.num_speculative_tokens
    prompts = PROMPTS[:a.prompts]
    plain = LLM(a.model, max_model_len=1024, max_num_seqs=1)
    spec = LLM.from_engine(LLMEngine(
        EngineConfig(model=a.model, max_model_len=1024, max_num_seqs=1, speculative_method=a.method,
                     num_speculative_tokens=k, speculative_model=a.draft_model),
        model=plain.model, tokenizer=plain.tokenizer))
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0)
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    same = True
    for _ in range(a.rounds):
        for name, llm in (("plain", plain), ("spec", spec)):
            toks = secs = 0.0
            outs = []
            for prompt in prompts:
                outs.append("".join(llm.stream(prompt, params)))
                m = llm.last_metrics
                toks += m["decode_tokens"]
                secs += m["decode_s"]
            rates[name].append(toks / secs)
            if name == "plain":
                want = outs
            else:
                same &= outs == want
    e = spec.engine
    steps = e.spec_drafted[0]  # verify steps with at least one draft
    accepted = sum(e.spec_accepted)
    res = {"machine": platform.processor() or platform.machine(), "model": a.model, "method": a.method,
           "draft_model": a.draft_model, "num_speculative_tokens": k, "tokens": a.tokens, "rounds": a.rounds, "threads": a.threads,
           "prompts": len(prompts), "tok_s_plain": statistics.median(rates["plain"]),
           "tok_s_spec": statistics.median(rates["spec"]),
           "acceptance_per_position": [acc / d if d else None for acc, d in zip(e.spec_accepted, e.spec_drafted)],
           "drafted": list(e.spec_drafted), "accepted": list(e.spec_accepted),
           "mean_accepted_length": (accepted + steps) / steps if steps else None, "greedy_identical": same}
    res["speedup"] = res["tok_s_spec"] / res["tok_s_plain"]
    name = a.method + (f" ({a.draft_model})" if a.draft_model else "")
    print(f"memra bench spec: {a.model}, {name} K={k}, {len(prompts)} prompts x {a.tokens} greedy tokens, "
          f"{a.threads} threads, median of {a.rounds} interleaved rounds")
    print("| mode | decode tok/s | ratio | mean accepted length | acceptance per position | greedy identical |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| plain | {res['tok_s_plain']:.1f} | 1.00 | - | - | - |")
    acc = ", ".join("-" if x is None else f"{x:.2f}" for x in res["acceptance_per_position"])
    mal = res["mean_accepted_length"]
    print(f"| {name} K={k} | {res['tok_s_spec']:.1f} | {res['speedup']:.2f} | "
          f"{'-' if mal is None else f'{mal:.2f}'} | {acc} | {same} |")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"JSON written to {a.json_out}")
    return res
