"""memra's command line: ``memra generate | chat | inspect | convert synth | bench``."""

from __future__ import annotations

import argparse
import json
import sys

from .hub import DEFAULT_MODEL, MODELS

__all__ = ["main"]


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model key ({', '.join(MODELS)}), path to a .gguf file or a Hugging Face directory")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="compute dtype (None: float32 on the CPU, bfloat16 on a GPU)")
    p.add_argument("--device", default="cpu",
                   help="'cpu' or a CUDA device ('cuda', 'cuda:1'): weights stay in their checkpoint format "
                        "on the GPU and decode steps replay CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="GPU: fraction of the device's memory to use in all (weights, activations, graphs, "
                        "and the KV cache, which gets what is left)")
    p.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs")
    p.add_argument("--attention-weights", default="auto", choices=["auto", "fp8"],
                   help="GPU: attention projections as loaded (auto), or bf16 ones requantized to FP8 "
                        "block 128x128 at load (fp8: half their bytes per decode step)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (None: torch's default, one per core); on a busy machine 1 "
                        "avoids oversubscription")
    p.add_argument("--speculative-method", default=None, choices=["ngram", "draft", "mtp"],
                   help="speculative decoding (drafts verified in one pass, output distributed exactly as "
                        "without): ngram = prompt lookup, draft = a smaller model (--draft-model), mtp = the "
                        "model's MTP layers (Step-3.5)")
    p.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="most draft tokens per step (1..8; mtp: at most the model's MTP layers)")
    p.add_argument("--draft-model", default=None,
                   help="draft model of --speculative-method draft (key, GGUF path or HF directory; same "
                        "vocabulary as the model)")
    p.add_argument("--speculative-max-batch", type=int, default=8,
                   help="no drafting while more requests than this are running")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the model is sharded over (CPU, gloo; workers spawned on this machine, or "
                        "torchrun's ranks: every rank runs this same command, rank 0 serves)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="routed experts split by expert over the ranks (EP) instead of along their width")
    p.add_argument("--deterministic", action="store_true",
                   help="at TP 1: the canonical-order parallel path (logits bit-identical to TP 2 and 4)")
    p.add_argument("--parallel-timeout", type=float, default=120.0,
                   help="seconds a collective may wait (a dead rank fails the run after this)")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL-style penalty (1: off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampler (None: random)")
    g.add_argument("--stop", action="append", default=[], type=_unescape,
                   help="stop string (repeatable); \\n, \\t and \\\\ are read as newline, tab and backslash")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    g.add_argument("--logprobs", type=int, default=None, help="print the top-N logprobs of each token")


def _unescape(s: str) -> str:
    """Read \\n, \\t and \\\\ in a command-line string as newline, tab and backslash."""
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s) and s[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[s[i + 1]])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _params(a: argparse.Namespace, **over):
    from .engine.sampling import SamplingParams

    kw = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
              repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
              frequency_penalty=a.frequency_penalty, seed=a.seed, stop=a.stop, stop_token_ids=a.stop_token_id,
              ignore_eos=a.ignore_eos, logprobs=getattr(a, "logprobs", None))
    kw.update(over)
    return SamplingParams(**kw)


def _load(a: argparse.Namespace):
    from .engine.llm import LLM

    return LLM(a.model, dtype=a.dtype, progress=True, device=a.device,
               gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
               attention_weights=a.attention_weights, **_speculative(a))


def _speculative(a: argparse.Namespace) -> dict:
    """The speculative-decoding EngineConfig fields of the command line."""
    return dict(speculative_method=a.speculative_method, num_speculative_tokens=a.num_speculative_tokens,
                speculative_max_batch=a.speculative_max_batch, speculative_model=a.draft_model,
                tensor_parallel_size=a.tensor_parallel_size, enable_expert_parallel=a.enable_expert_parallel,
                deterministic=a.deterministic, parallel_timeout_s=a.parallel_timeout)


def _finish_line(reason: str | None, stop, n_tokens: int, max_tokens: int, tokenizer) -> str:
    """What ended a completion, for stderr (as llama.cpp's CLI reports it)."""
    if reason == "length":
        return f"[finished: length, max_tokens={max_tokens} reached after {n_tokens} tokens]"
    if reason == "stop" and isinstance(stop, str):
        return f"[finished: stop, stop string {stop!r}, {n_tokens} tokens]"
    if reason == "stop":
        name = tokenizer.id_to_token(stop) if stop is not None and hasattr(tokenizer, "id_to_token") else None
        what = f"end-of-generation token {stop}" + (f" {name!r}" if name else "")
        return f"[finished: stop, {what}, {n_tokens} tokens]"
    return f"[finished: {reason}, {n_tokens} tokens]"


def cmd_generate(a: argparse.Namespace) -> int:
    params = _params(a)
    # from stdin: one trailing newline (echo's, a file's last line end) is not part of the prompt
    prompt = sys.stdin.read().removesuffix("\n") if a.prompt == "-" else a.prompt
    llm = _load(a)
    if a.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        prompt = llm.tokenizer.encode(prompt, add_special_tokens=False)
    if params.logprobs is not None:
        out = llm.generate([prompt], params)[0].outputs[0]
        print(out.text)
        for tok, lp, top in out.logprobs:
            alts = ", ".join(f"{llm.tokenizer.decode([i])!r}:{v:.3f}" for i, v in top)
            print(f"{llm.tokenizer.decode([tok])!r}\t{lp:.4f}\t{alts}")
        print(_finish_line(out.finish_reason, out.stop_reason, len(out.token_ids), params.max_tokens, llm.tokenizer),
              file=sys.stderr)
        return 0
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    m = llm.last_metrics
    print(_finish_line(m["finish_reason"], m["stop_reason"], m["completion_tokens"], params.max_tokens, llm.tokenizer),
          file=sys.stderr)
    if a.verbose:
        print(f"[prompt {m['prompt_tokens']} tok, first token after {m['ttft_s']:.3f} s; {m['decode_tokens']} decode "
              f"steps in {m['decode_s']:.3f} s]", file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    llm = _load(a)
    if llm.tokenizer.chat_template is None:
        print(f"error: model {a.model!r} has no chat template; use `memra generate`", file=sys.stderr)
        return 2
    messages: list[dict] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    print("memra chat: type a message; /reset clears the conversation, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if a.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        reply = []
        try:
            for delta in llm.stream(ids, _params(a)):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except ValueError as e:
            print(f"\nerror: {e}", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def _size(text: str) -> int:
    from .server.app import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_serve(a: argparse.Namespace) -> int:
    """``memra serve``: the OpenAI-compatible HTTP server (memra/server)."""
    import os

    from .engine.engine import EngineConfig
    from .server.app import check_api_key, run_server

    if a.api_key is not None:
        key = check_api_key(a.api_key, "--api-key")
    else:
        key = check_api_key(os.environ.get("MEMRA_API_KEY"), "MEMRA_API_KEY")
    cfg = EngineConfig(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                       max_num_batched_tokens=a.max_num_batched_tokens, block_size=a.block_size,
                       kv_cache_blocks=a.kv_cache_blocks, kv_cache_memory=a.kv_cache_memory,
                       enable_prefix_caching=not a.no_prefix_caching, device=a.device,
                       gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
                       attention_weights=a.attention_weights, **_speculative(a))
    return run_server(cfg, host=a.host, port=a.port, api_key=key, served_model_name=a.served_model_name,
                      max_queue=a.max_queue, log_level=a.log_level, max_body_bytes=a.max_request_body,
                      chat_template_timeout_s=a.chat_template_timeout, tool_call_parser=a.tool_call_parser,
                      reasoning_parser=a.reasoning_parser)


def _inspect_config_only(a: argparse.Namespace) -> int:
    """``memra inspect --geometry G`` or ``memra inspect HF_DIR``: config + byte accounting."""
    from pathlib import Path

    from .config import ModelConfig
    from .roofline import format_bytes_table, step35_bytes

    if a.geometry:
        from .io.synthetic import load_geometry, model_config

        config, where = model_config(load_geometry(a.geometry)), f"synthetic geometry {a.geometry}"
    else:
        from .io.safetensors import read_hf_dir

        d = Path(a.file).expanduser()
        # the same checks as loading: config.json, every safetensors header (dtypes, shapes,
        # offsets within the file and not overlapping), the shard index
        ck = read_hf_dir(d)
        config, where = ModelConfig.from_hf_config(ck.config, str(d / "config.json")), str(d)
        where += f" ({len(ck.names())} tensors, {ck.parameter_count():,} parameters in the safetensors files)"
    acct = step35_bytes(config, context=a.context) if config.arch == "step35" else None
    tp = getattr(a, "tensor_parallel_size", 1)
    pr = None
    if acct and (tp > 1 or a.enable_expert_parallel):
        from .roofline import per_rank_bytes

        pr = per_rank_bytes(config, acct, tp, a.enable_expert_parallel)
    if a.json:
        print(json.dumps({"source": where, "config": config.summary(), "bytes": acct, "per_rank": pr}, indent=2,
                         default=str))
        return 0
    print(f"source      {where}")
    print("config      " + ", ".join(f"{k}={v}" for k, v in config.summary().items()))
    if acct:
        print(format_bytes_table(acct))
    if pr:
        from .roofline import format_per_rank_table

        print(format_per_rank_table(pr))
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from pathlib import Path

    from .io.summary import inspect_gguf

    if a.geometry or (a.file and Path(a.file).expanduser().is_dir()):
        return _inspect_config_only(a)
    if not a.file:
        raise ValueError("memra inspect needs a GGUF path / model key, a HF directory, or --geometry")
    info = inspect_gguf(a.file)
    acct = None
    if info["arch"] == "step35" and "error" not in info["config"]:
        from .config import ModelConfig
        from .io.gguf import read_gguf
        from .roofline import step35_bytes

        ck = read_gguf(info["path"])
        acct = step35_bytes(ModelConfig.from_gguf(ck.metadata, set(ck.infos), info["path"]), context=a.context)
        info["bytes"] = acct
    if a.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print(f"file        {info['path']}")
    print(f"arch        {info['arch']}    name: {info['name']}")
    print(f"parameters  {info['parameters']:,}")
    print(f"bytes       {info['tensor_bytes']:,} in tensors ({info['tensor_bytes'] / 2**20:.1f} MiB), "
          f"{info['bits_per_weight']:.2f} bits/weight")
    print("config      " + ", ".join(f"{k}={v}" for k, v in info["config"].items()))
    print("tensor types:")
    for t, (n, params, nbytes) in sorted(info["types"].items(), key=lambda kv: -kv[1][2]):
        print(f"  {t:<6} {n:>5} tensors  {params:>14,} weights  {nbytes:>14,} bytes")
    if acct:
        from .roofline import format_bytes_table

        print("byte accounting from the config (formats as if converted):")
        print(format_bytes_table(acct))
    if a.metadata:
        print("metadata:")
        for k, v in info["metadata"].items():
            print(f"  {k} = {v}")
    return 0


_SYNTH_FORMATS = ("hf-bf16", "hf-fp8", "gguf-q8_0", "gguf-nvfp4", "gguf-q4_k")  # memra.io.synthetic.FORMATS


def cmd_convert_synth(a: argparse.Namespace) -> int:
    from .io.synthetic import cut_geometry, describe, load_geometry, write_synthetic

    g = load_geometry(a.geometry)
    if (a.layers, a.dense_layers, a.mtp_layers) != (None, None, None):
        g = cut_geometry(g, a.layers, a.dense_layers, a.mtp_layers)
    if a.vocab_from is not None:
        from .hub import resolve_model
        from .io.synthetic import with_vocabulary

        g = with_vocabulary(g, resolve_model(a.vocab_from))
    out = write_synthetic(g, a.format, a.seed, a.out, expert_codes=a.expert_codes)
    print(f"wrote {out} ({a.format}, seed {a.seed}): {describe(g)}")
    return 0


def cmd_bench_cpu(a: argparse.Namespace) -> int:
    from .bench.cpu import run_cpu_bench

    return run_cpu_bench(a)


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from .bench.serve import cmd_bench_serve as run

    return run(a)


def cmd_bench_serve_compare(a: argparse.Namespace) -> int:
    from .bench.serve_compare import cmd_bench_serve_compare as run

    return run(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memra", description="memra: LLM inference engine",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from . import __version__

    p.add_argument("--version", action="version", version=f"memra {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    g = sub.add_parser("generate", help="complete a prompt", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model(g)
    g.add_argument("--prompt", required=True, help="the prompt text; '-' reads it from standard input (one trailing newline dropped)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="print timings to stderr")
    _add_sampling(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat through the model's chat template", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model(c)
    c.add_argument("--system", default=None, help="system message")
    _add_sampling(c)
    c.set_defaults(func=cmd_chat, max_tokens=512)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model(sv)
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to bind (0.0.0.0 exposes the server to the network)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port")
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' (None: $MEMRA_API_KEY if set, else no key)")
    sv.add_argument("--served-model-name", default=None, help="name clients send as 'model' (None: the --model value)")
    sv.add_argument("--max-num-seqs", type=int, default=None,
                    help="most sequences running at once (None: 64 on the CPU, 256 on a GPU)")
    sv.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="most tokens per engine step: the prefill chunk (None: 512 on the CPU, 4096 on a GPU)")
    sv.add_argument("--max-model-len", type=int, default=None, help="context length (None: the model's)")
    sv.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    kv = sv.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-blocks", type=int, default=None, help="KV-cache blocks per full-attention group (sliding-window groups get what their windows need)")
    kv.add_argument("--kv-cache-memory", type=_size, default=None,
                    help="KV-cache bytes, e.g. 2GiB, 512MiB, 1.5GB (None with no --kv-cache-blocks: 2GiB on the CPU, "
                         "what --gpu-memory-utilization leaves on a GPU)")
    sv.add_argument("--max-queue", type=int, default=None,
                    help="most requests waiting for admission; more are answered 429 (None: unbounded)")
    sv.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    sv.add_argument("--max-request-body", type=_size, default=4 << 20,
                    help="largest POST body in bytes (e.g. 4MiB); larger ones are answered 413 before parsing")
    sv.add_argument("--chat-template-timeout", type=float, default=1.0,
                    help="seconds one chat-template render may take (a separate bounded process renders it; "
                         "past it the request gets 400)")
    sv.add_argument("--tool-call-parser", default="auto", choices=["auto", "step3p5", "hermes", "none"],
                    help="how tool calls in the output are parsed into message.tool_calls (and forced by "
                         "tool_choice): auto = the format the chat template speaks")
    sv.add_argument("--reasoning-parser", default="auto", choices=["auto", "step3p5", "none"],
                    help="split <think>...</think> into reasoning_content: auto = when the chat template "
                         "speaks <think>")
    sv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                    help="uvicorn log level")
    sv.set_defaults(func=cmd_serve)

    i = sub.add_parser("inspect", help="metadata, tensor types, parameter count and bytes of a GGUF file", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    i.add_argument("file", nargs="?", default=None, help="GGUF path, model key or HF model directory")
    i.add_argument("--geometry", default=None,
                   help="inspect a synthetic Step-3.5 geometry instead (tiny, full or a JSON file): config, "
                        "parameters, resident and per-decode-step bytes by format")
    i.add_argument("--context", type=int, default=0, help="tokens in the KV cache for the KV-read figure")
    i.add_argument("--json", action="store_true", help="print the result as JSON")
    i.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="with --geometry or a HF directory: also the bytes per rank at this TP size")
    i.add_argument("--enable-expert-parallel", action="store_true", help="per-rank bytes with the experts split by expert")
    i.add_argument("--metadata", action="store_true", help="also print every metadata key (arrays summarised)")
    i.set_defaults(func=cmd_inspect)

    cv = sub.add_parser("convert", help="write checkpoints")
    cvsub = cv.add_subparsers(dest="convert", required=True)
    cs = cvsub.add_parser("synth", help="write a deterministic random Step-3.5 checkpoint",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cs.add_argument("--geometry", default="tiny", help="tiny, full, or a JSON file of geometry keys")
    cs.add_argument("--format", required=True, choices=list(_SYNTH_FORMATS), help="checkpoint format to write")
    cs.add_argument("--seed", type=int, default=0, help="seed of the random weights (same seed: same file)")
    cs.add_argument("--out", required=True, help="output directory (hf-*) or .gguf file (gguf-*)")
    cs.add_argument("--vocab-from", default=None, metavar="MODEL",
                    help="take the vocabulary (tokenizer, size, bos/eos) from this GGUF model or model key, "
                         "e.g. smollm2-135m, whose pre-tokenizer llama.cpp's convert_hf_to_gguf.py recognises; "
                         "default: a tiny synthetic byte-level BPE vocabulary")
    cs.add_argument("--layers", type=int, default=None, metavar="N",
                    help="cut the geometry to N decoder layers (e.g. --geometry full --layers 12 --dense-layers 3)")
    cs.add_argument("--dense-layers", type=int, default=None, metavar="N", help="leading dense layers of the cut")
    cs.add_argument("--mtp-layers", type=int, default=None, metavar="N", help="MTP layers of the cut")
    cs.add_argument("--expert-codes", default="quantized", choices=["quantized", "random"],
                    help="routed experts: bf16 draws quantized to the format, or (gguf-nvfp4) NVFP4 codes and "
                         "scales drawn directly, for full-size files (the quantizer takes minutes per GB)")
    cs.set_defaults(func=cmd_convert_synth)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    bc = bsub.add_parser("cpu", help="decode/prefill tok/s on this CPU, side by side with llama.cpp",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    bc.add_argument("--model", default=DEFAULT_MODEL, help="model key or GGUF file, run by both engines")
    bc.add_argument("--prompt-tokens", type=int, default=128, help="tokens prefilled per measurement")
    bc.add_argument("--decode-tokens", type=int, default=64, help="greedy decode steps per measurement")
    bc.add_argument("--threads", type=int, default=2, help="CPU threads for every engine")
    bc.add_argument("--rounds", type=int, default=5, help="interleaved measurements per engine")
    bc.add_argument("--dtypes", default="float32,bfloat16", help="comma list of memra activation dtypes")
    bc.add_argument("--no-llamacpp", action="store_true",
                    help="skip llama.cpp (its binding and llama-bench; both are built on first use)")
    bc.add_argument("--json-out", default=None, help="write results here (default: print only)")
    bc.set_defaults(func=cmd_bench_cpu)
    bce = bsub.add_parser("census", help="decode-kernel census on a CUDA GPU: us/call, TB/s, %% of copy bandwidth",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .bench.census import add_census_args, run_from_args

    add_census_args(bce)
    bce.set_defaults(func=run_from_args)
    bde = bsub.add_parser("decode", help="the flagship's whole decode step on one GPU (synthetic weights in GPU "
                          "memory): tok/s at several batch sizes vs the byte roofline, per-phase split",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .bench.decode import add_decode_args
    from .bench.decode import run_from_args as run_decode

    add_decode_args(bde)
    bde.set_defaults(func=run_decode)
    bfi = bsub.add_parser("file", help="one GGUF file on one GPU, memra and llama.cpp side by side: load (GB/s "
                          "against the page-cache read), TTFT first vs second request, prefill and batch-1 decode",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .bench.file import add_file_args
    from .bench.file import run_from_args as run_file

    add_file_args(bfi)
    bfi.set_defaults(func=run_file)
    bpf = bsub.add_parser("prefill", help="the flagship's prefill chunk on one GPU (synthetic weights in GPU memory): "
                          "tok/s vs the FLOP/byte roofline, per-phase split, TTFT through the engine",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .bench.prefill import add_prefill_args
    from .bench.prefill import run_from_args as run_prefill

    add_prefill_args(bpf)
    bpf.set_defaults(func=run_prefill)
    bmg = bsub.add_parser("moe-grouped", help="prefill grouped MoE GEMM rate probe on a CUDA GPU (seeds' "
                          "moe-sk-repro): skewed/uniform routing, per-projection time, TFLOP/s, %% of roofline",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .bench.moe_grouped import add_moe_grouped_args
    from .bench.moe_grouped import run_from_args as run_moe_grouped

    add_moe_grouped_args(bmg)
    bmg.set_defaults(func=run_moe_grouped)
    bst = bsub.add_parser("structured", help="grammar-constrained decoding's cost on this CPU: tok/s with and "
                          "without a JSON schema, grammar us/token, compile ms",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .bench.structured import add_structured_args, run_structured_bench

    add_structured_args(bst)
    bst.set_defaults(func=lambda a: run_structured_bench(a) and 0)
    bsp = bsub.add_parser("spec", help="speculative decoding vs plain decode on this machine: tok/s, acceptance "
                          "per draft position, mean accepted length, exactness",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .bench.spec import add_spec_args, run_spec_bench

    add_spec_args(bsp)
    bsp.set_defaults(func=lambda a: 0 if run_spec_bench(a)["greedy_identical"] else 1)
    bs = bsub.add_parser("serve", help="load-test an OpenAI-compatible server: TTFT, TPOT, ITL, throughput",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .bench.serve import add_serve_args

    add_serve_args(bs)
    bs.set_defaults(func=cmd_bench_serve)
    bsc = bsub.add_parser("serve-compare", help="memra serve and llama.cpp's server under the same load, side by side",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from .bench.serve_compare import add_compare_args

    add_compare_args(bsc)
    bsc.set_defaults(func=cmd_bench_serve_compare)
    return p


def _torchrun_worker(a: argparse.Namespace) -> int | None:
    """Under torchrun (``WORLD_SIZE`` > 1 in the environment) the same ``memra serve | generate |
    chat`` command runs on every rank: rank 0 runs it, the others become tensor-parallel workers
    (memra/engine/tensor_parallel.py ``worker_main``) and return 0 when rank 0 stops them. None: not a
    worker rank."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world <= 1 or rank == 0 or not hasattr(a, "tensor_parallel_size"):
        return None
    if a.tensor_parallel_size != world:
        raise ValueError(f"torchrun started {world} ranks but --tensor-parallel-size is {a.tensor_parallel_size}")
    import torch

    from .engine.engine import DTYPES
    from .engine.tensor_parallel import default_parts, worker_main

    worker_main(rank, world, "env://", a.model, DTYPES[a.dtype or "float32"], a.enable_expert_parallel,
                default_parts(world), a.parallel_timeout, threads=torch.get_num_threads())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        threads = getattr(args, "threads", None)
        if threads is not None:
            if threads < 1:
                raise ValueError(f"--threads {threads} must be >= 1")
            import torch

            torch.set_num_threads(threads)
        worker = _torchrun_worker(args)
        if worker is not None:
            return worker
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `memra generate ... | head`: the reader left; stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
