"""``memra bench serve``: a load generator for any OpenAI-compatible completions server.

It speaks only HTTP (``POST {base}/v1/completions`` with ``stream: true`` and
``stream_options: {"include_usage": true}``), so memra, vLLM, SGLang and llama.cpp's
servers are measured the same way. One ``httpx.AsyncClient`` sends the requests; an
``asyncio.Semaphore`` keeps at most ``--max-concurrency`` of them in flight; requests
arrive either all at once (``--request-rate inf``, the default) or as a Poisson process
of ``--request-rate`` requests per second (exponential gaps, seeded).

Dataset ``random``: ``--num-prompts`` prompts of exactly ``--input-len`` tokens.

* ``--prompt-format ids`` (default): each prompt is a list of token ids drawn uniformly
  (seeded) from ``--random-token-range`` (default ``[1000, 10000)``, clear of the
  special tokens at the bottom of common vocabularies); the server sees exactly that
  many tokens without tokenizing anything.
* ``--prompt-format text`` (for servers that take only text, such as llama-cpp-python's):
  each prompt is ``input-len`` random words, each of which is one token of the
  ``--tokenizer`` model's vocabulary (a token whose text is a space and two or more
  lowercase ASCII letters and that re-encodes to itself); the whole prompt is re-encoded
  and must give ``input-len`` tokens, or :class:`ValueError` is raised.

Each request asks for ``max_tokens = --output-len`` with ``ignore_eos: true`` (an
extension honoured by vLLM, SGLang and memra) and ``temperature: 0``; ``--extra-body``
adds fields (``'{"logit_bias": {"2": -100}}'`` keeps llama-cpp-python from stopping at
EOS token 2, since it ignores ``ignore_eos``).

Before the measured runs one non-streaming probe request (the first prompt,
``max_tokens`` 1) checks that the server answers, and records the ``prompt_tokens`` it
reports (a warning is printed if that differs from ``--input-len``).

Metrics (the definitions of vLLM's ``benchmarks/benchmark_serving.py``; times in
milliseconds in the table and JSON summary, seconds in the per-request records):

* **TTFT**, time to first token: from sending the request to receiving the first
  streamed chunk that carries non-empty text. Includes queueing inside the server and
  the prefill.
* **ITL**, inter-token latency: the gaps between consecutive non-empty chunks of one
  response (a chunk carrying several tokens counts once); pooled over all requests.
* **TPOT**, time per output token: per request ``(e2e - ttft) / (output_tokens - 1)``,
  for requests with more than one output token; statistics are over requests.
* **E2E**, end-to-end latency: from sending the request to the end of its stream.
* **output tokens** of a request: ``usage.completion_tokens`` from the final usage chunk
  when the server sends one, else the number of non-empty text chunks.
* **input tokens** of a request: ``usage.prompt_tokens`` when sent, else the prompt's
  length (ids) or its length under ``--tokenizer`` (text).
* **duration**: wall time from the first request's start to the last request's end.
  Request throughput = successful requests / duration (req/s); input and output token
  throughput = summed tokens of successful requests / duration (tok/s).

A request fails on a non-200 answer, an ``error`` object in the stream, a transport
error or timeout, or a stream that ends with neither ``[DONE]`` nor a finish reason; its
error text is kept. ``short outputs`` counts successful requests that returned fewer
tokens than asked for (a server ignoring ``ignore_eos``, or cutting streams short).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BenchConfig",
    "RequestRecord",
    "random_token_prompts",
    "random_text_prompts",
    "parse_concurrency",
    "Dataset",
    "build_dataset",
    "run_level",
    "summarize",
    "format_table",
    "run_serve_benchmark",
    "add_serve_args",
    "cmd_bench_serve",
]


@dataclass
class BenchConfig:
    """Settings of one benchmark invocation (every level shares them but the concurrency).

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1/...`` is appended).
        model: the ``model`` field sent with each request.
        num_prompts: requests per concurrency level.
        input_len: prompt length in tokens.
        output_len: ``max_tokens`` of each request.
        max_concurrency: the levels to run, in order (requests in flight at most).
        request_rate: mean arrival rate in requests/s (Poisson); ``inf`` sends all at once.
        seed: seeds the prompts and the arrival times.
        api_key: sent as ``Authorization: Bearer KEY`` when set.
        endpoint: ``completions`` (``POST {base}/v1/completions``).
        prompt_format: ``ids`` or ``text`` (see the module docstring).
        tokenizer: model key, GGUF path or HF directory for ``text`` prompts.
        random_token_range: ``(low, high)``: ids are drawn from ``[low, high)``.
        ignore_eos: send ``ignore_eos: true``.
        extra_body: extra JSON fields merged into every request body.
        timeout_s: seconds a request may wait on any one network operation (connect is
            capped at 30 s; a read waits this long for the next bytes of the stream).
        label: a name for this run (e.g. the engine), copied into the JSON.
    """

    base_url: str
    model: str
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    max_concurrency: list[int] = field(default_factory=lambda: [1])
    request_rate: float = math.inf
    seed: int = 0
    api_key: str | None = None
    endpoint: str = "completions"
    prompt_format: str = "ids"
    tokenizer: str | None = None
    random_token_range: tuple[int, int] = (1000, 10000)
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    label: str | None = None

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        if not re.match(r"^https?://", self.base_url):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.max_concurrency or any(c < 1 for c in self.max_concurrency):
            raise ValueError(f"--max-concurrency levels must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        lo, hi = self.random_token_range
        if not 0 <= lo < hi:
            raise ValueError(f"--random-token-range must be LOW,HIGH with 0 <= LOW < HIGH, got {lo},{hi}")
        if self.endpoint != "completions":
            raise ValueError(f"--endpoint must be 'completions', got {self.endpoint!r}")
        if self.prompt_format not in ("ids", "text"):
            raise ValueError(f"--prompt-format must be 'ids' or 'text', got {self.prompt_format!r}")
        if self.prompt_format == "text" and not self.tokenizer:
            raise ValueError("--prompt-format text needs --tokenizer (a model key, GGUF path or HF directory)")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout_s}")


@dataclass
class RequestRecord:
    """The measurements of one request. Times in seconds.

    Attributes:
        index: the prompt's index in the dataset.
        success: True when the stream completed (see the module docstring for failures).
        error: why it failed ("" on success).
        start_s: when it was sent, relative to the start of its level's run.
        ttft_s: time to the first non-empty text chunk (None if there was none).
        e2e_s: time to the end of the stream (or to the failure).
        itl_s: gaps between consecutive non-empty text chunks.
        output_tokens: ``usage.completion_tokens`` if sent, else the non-empty chunks.
        output_tokens_source: ``"usage"`` or ``"chunks"``.
        input_tokens: ``usage.prompt_tokens`` if sent, else the prompt's own length.
        chunks: non-empty text chunks received.
        finish_reason: the last finish reason seen in the stream (None if none).
        output_chars: characters of generated text.
    """

    index: int
    success: bool = False
    error: str = ""
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_source: str = "chunks"
    input_tokens: int = 0
    chunks: int = 0
    finish_reason: str | None = None
    output_chars: int = 0

    @property
    def tpot_s(self) -> float | None:
        """``(e2e - ttft) / (output_tokens - 1)`` in seconds; None for <= 1 output token."""
        if not self.success or self.ttft_s is None or self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# ---------------------------------------------------------------------------------- dataset


def random_token_prompts(n: int, input_len: int, seed: int, token_range: tuple[int, int]) -> list[list[int]]:
    """``n`` prompts of ``input_len`` token ids, uniform on ``[low, high)``, reproducible by seed.

    Returns:
        list of n lists of int.
    """
    rng = random.Random(seed)
    lo, hi = token_range
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(n)]


def _load_tokenizer(spec: str):
    from ..io.tokenizer import Tokenizer

    p = Path(spec).expanduser()
    if p.is_dir():
        return Tokenizer.from_hf_dir(p)
    from ..hub import resolve_model

    return Tokenizer.from_gguf(resolve_model(spec))


_POOLS: dict[int, tuple[Any, list[str]]] = {}


def _word_pool(tok) -> list[str]:
    """The single-token lowercase words of ``tok``'s vocabulary (memoized per tokenizer object)."""
    hit = _POOLS.get(id(tok))
    if hit is not None and hit[0] is tok:
        return hit[1]
    word = re.compile(r" [a-z]{2,}")
    pool = []
    special = tok.special_token_ids  # a property that builds the set: read it once
    for i in range(tok.vocab_size):
        if i in special:
            continue
        s = tok.decode([i])
        if word.fullmatch(s) and tok.encode(s, add_special_tokens=False) == [i]:
            pool.append(s)
    _POOLS[id(tok)] = (tok, pool)
    return pool


def random_text_prompts(n: int, input_len: int, seed: int, tokenizer) -> list[str]:
    """``n`` text prompts of exactly ``input_len`` tokens under ``tokenizer`` (no specials added).

    Each prompt joins ``input_len`` words drawn (seeded) from the vocabulary tokens whose
    text is a space plus two or more lowercase ASCII letters and which re-encode to
    themselves, so byte-level BPE and SentencePiece tokenizers (and llama.cpp's
    approximation of them) split the prompt back into the same words.

    Args:
        tokenizer: a :class:`memra.io.tokenizer.Tokenizer` or a spec for one (model key,
            GGUF path, HF directory).

    Raises:
        ValueError: the vocabulary has fewer than 100 such words, or a prompt does not
            re-encode to ``input_len`` tokens.
    """
    tok = _load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    pool = _word_pool(tok)
    if len(pool) < 100:
        raise ValueError(f"tokenizer has only {len(pool)} single-token lowercase words; cannot build text prompts")
    rng = random.Random(seed)
    prompts = []
    for k in range(n):
        text = "".join(rng.choice(pool) for _ in range(input_len))
        got = len(tok.encode(text, add_special_tokens=False))
        if got != input_len:
            raise ValueError(f"text prompt {k} re-encodes to {got} tokens, expected {input_len}")
        prompts.append(text)
    return prompts


def parse_concurrency(s: str | int | list[int]) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``. Raises ValueError for anything but positive integers."""
    if isinstance(s, int):
        return [s]
    if isinstance(s, list):
        return [int(x) for x in s]
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--max-concurrency must be a comma-separated list of integers, got {s!r}") from None
    if not out or any(c < 1 for c in out):
        raise ValueError(f"--max-concurrency levels must be integers >= 1, got {s!r}")
    return out


# ---------------------------------------------------------------------------------- client


def _headers(cfg: BenchConfig) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if cfg.api_key:
        h["Authorization"] = f"Bearer {cfg.api_key}"
    return h


def _url(cfg: BenchConfig) -> str:
    return cfg.base_url.rstrip("/") + "/v1/" + cfg.endpoint


def spec_counters(cfg: BenchConfig) -> tuple[float, float] | None:
    """(verify steps with a draft, accepted draft tokens) from the server's ``/metrics`` (memra's
    ``memra:spec_decode_num_draft_tokens_per_pos`` at position 0 and
    ``memra:spec_decode_num_accepted_tokens``), or None when the server exposes no such counters
    (speculation off, another server, no /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(cfg.base_url.rstrip("/") + "/metrics", headers=_headers(cfg), timeout=10.0, trust_env=False)
        if r.status_code != 200:
            return None
        steps = accepted = None
        for fam in text_string_to_metric_families(r.text):
            for smp in fam.samples:
                if not smp.name.endswith("_total"):  # (a counter's _created sample is a timestamp)
                    continue
                if smp.name.startswith("memra:spec_decode_num_draft_tokens_per_pos") and \
                        smp.labels.get("position") == "0":
                    steps = (steps or 0.0) + smp.value
                elif smp.name.startswith("memra:spec_decode_num_accepted_tokens") and "per_pos" not in smp.name:
                    accepted = (accepted or 0.0) + smp.value
    except (httpx.HTTPError, ValueError):
        return None
    return None if steps is None or accepted is None else (steps, accepted)


def _payload(cfg: BenchConfig, prompt: list[int] | str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _error_text(status: int, raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    try:
        err = json.loads(text)
        if isinstance(err, dict) and isinstance(err.get("error"), dict) and "message" in err["error"]:
            text = err["error"]["message"]
        elif isinstance(err, dict) and "detail" in err:
            text = json.dumps(err["detail"])
    except ValueError:
        pass
    return f"HTTP {status}: {text[:500]}"


async def _send(client, cfg: BenchConfig, index: int, prompt: list[int] | str, prompt_len: int,
                t_run0: float) -> RequestRecord:
    """Send one streaming request and time it (see the module docstring for the metrics)."""
    rec = RequestRecord(index=index, input_tokens=prompt_len)
    body = _payload(cfg, prompt, cfg.output_len, stream=True)
    t0 = time.perf_counter()
    rec.start_s = t0 - t_run0
    last = t0
    done = False
    usage = None
    try:
        async with client.stream("POST", _url(cfg), json=body, headers=_headers(cfg)) as r:
            if r.status_code != 200:
                rec.error = _error_text(r.status_code, await r.aread())
                rec.e2e_s = time.perf_counter() - t0
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    msg = json.loads(data)
                except ValueError:
                    rec.error = f"malformed SSE data: {data[:200]!r}"
                    break
                if "error" in msg:
                    e = msg["error"]
                    rec.error = "stream error: " + (e.get("message", str(e)) if isinstance(e, dict) else str(e))
                    break
                if msg.get("usage"):
                    usage = msg["usage"]
                for ch in msg.get("choices") or []:
                    text = ch.get("text") or ""
                    if text:
                        if rec.ttft_s is None:
                            rec.ttft_s = now - t0
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        rec.chunks += 1
                        rec.output_chars += len(text)
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
    except Exception as e:  # transport errors, timeouts, protocol errors
        rec.error = f"{type(e).__name__}: {e}".strip()
    rec.e2e_s = time.perf_counter() - t0
    if not rec.error and not done and rec.finish_reason is None:
        rec.error = "stream ended without [DONE] or a finish_reason"
    if usage and isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens, rec.output_tokens_source = usage["completion_tokens"], "usage"
    else:
        rec.output_tokens, rec.output_tokens_source = rec.chunks, "chunks"
    if usage and isinstance(usage.get("prompt_tokens"), int):
        rec.input_tokens = usage["prompt_tokens"]
    rec.success = not rec.error
    return rec


def _client(cfg: BenchConfig, concurrency: int):
    import httpx

    n = max(concurrency, 1) + 4
    # trust_env=False: no proxy from the environment sits between us and the server.
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0)),
                             limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                             trust_env=False)


async def probe(cfg: BenchConfig, prompt: list[int] | str) -> dict[str, Any]:
    """One non-streaming request (``max_tokens`` 1): checks the server answers.

    Returns:
        ``{"prompt_tokens": int | None, "latency_s": float}``.

    Raises:
        RuntimeError: the server could not be reached or did not answer 200.
    """
    body = _payload(cfg, prompt, 1, stream=False)
    async with _client(cfg, 1) as client:
        t0 = time.perf_counter()
        try:
            r = await client.post(_url(cfg), json=body, headers=_headers(cfg))
        except Exception as e:
            raise RuntimeError(f"probe request to {_url(cfg)} failed: {type(e).__name__}: {e}") from e
        dt = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"probe request to {_url(cfg)} failed: {_error_text(r.status_code, r.content)}")
    try:
        usage = r.json().get("usage") or {}
    except ValueError:
        usage = {}
    pt = usage.get("prompt_tokens")
    return {"prompt_tokens": pt if isinstance(pt, int) else None, "latency_s": dt}


def _arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before releasing each request: all 0 for ``rate=inf``; else the first
    at once and then Exp(rate) gaps (mean ``1/rate`` s), i.e. a Poisson process of ``rate`` req/s."""
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    rng = random.Random(seed + 1)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


async def run_level(cfg: BenchConfig, prompts: list, prompt_lens: list[int],
                    concurrency: int) -> tuple[list[RequestRecord], float]:
    """Run every prompt once with at most ``concurrency`` requests in flight.

    Requests are released on the arrival schedule (see :func:`_arrival_gaps`) and then
    wait for the semaphore; a request's clock starts when it is sent, not when it arrives.

    Returns:
        (records in prompt order, duration in seconds from start to the last completion).
    """
    sem = asyncio.Semaphore(concurrency)
    gaps = _arrival_gaps(len(prompts), cfg.request_rate, cfg.seed)
    async with _client(cfg, concurrency) as client:
        t_run0 = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            async with sem:
                return await _send(client, cfg, i, prompts[i], prompt_lens[i], t_run0)

        tasks = []
        for i, g in enumerate(gaps):
            if g > 0:
                await asyncio.sleep(g)
            tasks.append(asyncio.create_task(one(i)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_run0
    return list(records), duration


# ---------------------------------------------------------------------------------- report


def _stats_ms(xs: list[float]) -> dict[str, float | None]:
    """mean, median, p99 (linear interpolation, as numpy's default) in ms; None if empty."""
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    s = sorted(xs)
    pos = 0.99 * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    p99 = s[lo] + (s[hi] - s[lo]) * (pos - lo)
    return {"mean": 1e3 * statistics.fmean(s), "median": 1e3 * statistics.median(s), "p99": 1e3 * p99}


def summarize(records: list[RequestRecord], duration_s: float, output_len: int | None = None) -> dict[str, Any]:
    """The summary figures of one level.

    Args:
        records: one per request.
        duration_s: wall time of the level in seconds.
        output_len: the ``max_tokens`` asked for (to count short outputs), or None.

    Returns:
        dict with ``successful_requests``, ``failed_requests``, ``short_outputs``,
        ``duration_s``, ``total_input_tokens``, ``total_output_tokens``,
        ``request_throughput`` (req/s), ``input_throughput``, ``output_throughput``,
        ``total_token_throughput`` (tok/s), and ``ttft_ms``, ``tpot_ms``, ``itl_ms``,
        ``e2e_ms`` (each ``{"mean", "median", "p99"}`` in ms, None when empty), and
        ``errors`` (up to 5 distinct error texts).
    """
    ok = [r for r in records if r.success]
    n_in = sum(r.input_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    d = duration_s if duration_s > 0 else float("nan")
    errors: list[str] = []
    for r in records:
        if r.error and r.error not in errors and len(errors) < 5:
            errors.append(r.error)
    return {
        "successful_requests": len(ok),
        "failed_requests": len(records) - len(ok),
        "short_outputs": sum(1 for r in ok if output_len is not None and r.output_tokens < output_len),
        "duration_s": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / d,
        "input_throughput": n_in / d,
        "output_throughput": n_out / d,
        "total_token_throughput": (n_in + n_out) / d,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
        "errors": errors,
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table, one row per level: ``results[i]`` has ``max_concurrency`` and ``summary``."""
    cols = [("conc", 5), ("ok", 5), ("fail", 5), ("dur s", 8), ("req/s", 8), ("in tok/s", 10), ("out tok/s", 10)]
    metrics = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")]
    w = 9
    head1 = "".join(f"{'':>{n}}" for _, n in cols) + "".join(f"{name + ' ms (mean/med/p99)':^{3 * w}}" for name, _ in metrics)
    head2 = "".join(f"{c:>{n}}" for c, n in cols) + "".join(f"{s:>{w}}" for _ in metrics for s in ("mean", "median", "p99"))
    spec = any(res["summary"].get("mean_accepted_length") is not None for res in results)
    if spec:
        head1, head2 = head1 + f"{'':>10}", head2 + f"{'accepted':>10}"
    lines = [head1.rstrip(), head2, "-" * len(head2)]
    for res in results:
        s = res["summary"]
        row = (f"{res['max_concurrency']:>5}{s['successful_requests']:>5}{s['failed_requests']:>5}"
               f"{_f(s['duration_s'], '.2f'):>8}{_f(s['request_throughput'], '.2f'):>8}"
               f"{_f(s['input_throughput'], '.1f'):>10}{_f(s['output_throughput'], '.1f'):>10}")
        for _, key in metrics:
            for q in ("mean", "median", "p99"):
                row += f"{_f(s[key][q], '.1f'):>{w}}"
        if spec:
            row += f"{_f(s.get('mean_accepted_length'), '.2f'):>10}"
        lines.append(row)
    return "\n".join(lines)


@dataclass
class Dataset:
    """The prompts of one invocation: one probe prompt and a fresh set per concurrency level.

    Each level gets its own prompts (seeded by ``seed * 1000 + level index``; the probe by
    ``seed * 1000 + 999``) so that a server's prefix cache cannot serve one level from
    the prompts of another.
    """

    probe: list[int] | str
    levels: list[list]


def build_dataset(cfg: BenchConfig) -> Dataset:
    """The :class:`Dataset` of ``cfg`` (``len(cfg.max_concurrency)`` sets of ``cfg.num_prompts``)."""
    if cfg.prompt_format == "ids":
        def make(n: int, seed: int) -> list:
            return random_token_prompts(n, cfg.input_len, seed, cfg.random_token_range)
    else:
        tok = _load_tokenizer(cfg.tokenizer) if isinstance(cfg.tokenizer, str) else cfg.tokenizer

        def make(n: int, seed: int) -> list:
            return random_text_prompts(n, cfg.input_len, seed, tok)
    return Dataset(probe=make(1, cfg.seed * 1000 + 999)[0],
                   levels=[make(cfg.num_prompts, cfg.seed * 1000 + i) for i in range(len(cfg.max_concurrency))])


def run_serve_benchmark(cfg: BenchConfig, log=print, dataset: Dataset | None = None) -> dict[str, Any]:
    """Probe the server, then run every concurrency level of ``cfg`` in turn.

    ``dataset`` (default :func:`build_dataset`) may be given to reuse one across servers.

    Returns:
        the JSON-ready result: ``bench``, ``label``, ``date`` (UTC ISO 8601), ``host``,
        ``config``, ``probe``, and ``results`` (one dict per level: ``max_concurrency``,
        ``summary`` as :func:`summarize`, ``requests`` as :class:`RequestRecord` dicts
        with ``tpot_s`` added).

    Raises:
        ValueError: bad configuration.
        RuntimeError: the probe request failed.
    """
    cfg.validate()
    ds = dataset or build_dataset(cfg)
    if len(ds.levels) != len(cfg.max_concurrency) or any(len(p) != cfg.num_prompts for p in ds.levels):
        raise ValueError(f"the dataset needs {len(cfg.max_concurrency)} sets of {cfg.num_prompts} prompts")
    lens = [cfg.input_len] * cfg.num_prompts
    pr = asyncio.run(probe(cfg, ds.probe))
    if pr["prompt_tokens"] is not None and pr["prompt_tokens"] != cfg.input_len:
        print(f"warning: the server counted {pr['prompt_tokens']} prompt tokens for a prompt of "
              f"{cfg.input_len} tokens", file=sys.stderr)
    results = []
    for c, prompts in zip(cfg.max_concurrency, ds.levels):
        log(f"[{cfg.label or cfg.base_url}] max_concurrency={c}: {cfg.num_prompts} requests, "
            f"input {cfg.input_len}, output {cfg.output_len}, rate {cfg.request_rate} req/s")
        before = spec_counters(cfg)
        records, duration = asyncio.run(run_level(cfg, prompts, lens, c))
        summary = summarize(records, duration, cfg.output_len)
        after = spec_counters(cfg)
        # mean accepted length: tokens a verify step yields per sequence (accepted drafts + 1)
        summary["mean_accepted_length"] = (1 + (after[1] - before[1]) / (after[0] - before[0])
                                           if before and after and after[0] > before[0] else None)
        for e in summary["errors"]:
            log(f"  error: {e}")
        reqs = []
        for r in records:
            d = asdict(r)
            d["tpot_s"] = r.tpot_s
            reqs.append(d)
        results.append({"max_concurrency": c, "summary": summary, "requests": reqs})
    conf = asdict(cfg)
    conf["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    if cfg.api_key:
        conf["api_key"] = "***"
    return {
        "bench": "serve",
        "label": cfg.label,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "config": conf,
        "probe": pr,
        "results": results,
    }


# ---------------------------------------------------------------------------------- CLI


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The ``memra bench serve`` options."""
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name sent in each request")
    p.add_argument("--dataset", default="random", choices=["random"], help="prompt source (random tokens or words)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per concurrency level")
    p.add_argument("--max-concurrency", default="1", help="requests in flight at most; a list (1,8,32) runs each level")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens of each request (ignore_eos is sent)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="mean arrivals per second (Poisson); inf: all at once")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--endpoint", default="completions", choices=["completions"], help="API route that is loaded")
    p.add_argument("--prompt-format", default="ids", choices=["ids", "text"],
                   help="ids: token-id prompts; text: single-token words, needs --tokenizer")
    p.add_argument("--tokenizer", default=None, help="model key, GGUF path or HF dir (for --prompt-format text)")
    p.add_argument("--random-token-range", default="1000,10000", help="LOW,HIGH: prompt ids are drawn from [LOW, HIGH)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos: true")
    p.add_argument("--extra-body", default=None, help="JSON object merged into each request body")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may wait for the connection or the next bytes of its stream")
    p.add_argument("--label", default=None, help="a name for this run (copied into the JSON)")
    p.add_argument("--json-out", default=None, help="write the results here")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    """Build a :class:`BenchConfig` from parsed ``memra bench serve`` arguments. Raises ValueError."""
    try:
        lo, hi = (int(x) for x in a.random_token_range.split(","))
    except ValueError:
        raise ValueError(f"--random-token-range must be LOW,HIGH, got {a.random_token_range!r}") from None
    extra: dict[str, Any] = {}
    if a.extra_body:
        try:
            extra = json.loads(a.extra_body)
        except ValueError as e:
            raise ValueError(f"--extra-body is not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    return BenchConfig(
        base_url=a.base_url, model=a.model, num_prompts=a.num_prompts, input_len=a.input_len,
        output_len=a.output_len, max_concurrency=parse_concurrency(a.max_concurrency),
        request_rate=a.request_rate, seed=a.seed, api_key=a.api_key, endpoint=a.endpoint,
        prompt_format=a.prompt_format, tokenizer=a.tokenizer, random_token_range=(lo, hi),
        ignore_eos=not a.no_ignore_eos, extra_body=extra, timeout_s=a.timeout, label=a.label,
    )


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, creating parent folders."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2))


def cmd_bench_serve(a: argparse.Namespace) -> int:
    """``memra bench serve``: returns 0, or 1 when the probe or every request failed."""
    cfg = config_from_args(a)
    try:
        result = run_serve_benchmark(cfg, log=lambda s: print(s, file=sys.stderr))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"memra bench serve: {cfg.base_url} model={cfg.model} prompts={cfg.num_prompts} "
          f"input={cfg.input_len} output={cfg.output_len} rate={cfg.request_rate} req/s")
    print(format_table(result["results"]))
    if a.json_out:
        write_json(a.json_out, result)
        print(f"wrote {a.json_out}")
    return 0 if any(r["summary"]["successful_requests"] for r in result["results"]) else 1
