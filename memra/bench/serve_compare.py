"""``memra bench serve-compare``: memra's server and llama.cpp's, under the same load.

Each engine runs in turn as a child process on a free loopback port (never both at
once: they would share the CPU): ``memra serve --model KEY --host 127.0.0.1 --port P
--max-num-seqs N`` and llama.cpp's own ``llama-server`` (llama.cpp of 2026-10-01, built by
:mod:`memra.bench.llamacpp`) on the same GGUF file with ``--threads`` threads and as many
parallel slots as the highest concurrency level, with continuous batching. Once
``GET /health`` (or ``GET /v1/models``) answers 200,
:func:`memra.bench.serve.run_serve_benchmark` runs every concurrency level against it with
identical prompts and settings, then the server is stopped. The table puts the two side by
side with the ratios memra / llama.cpp of output throughput (tok/s, higher is better) and
of median TTFT (ms, lower is better).

How llama-server is run (read from its source, ``tools/server``):

* ``--parallel N --cont-batching``: N slots decoded together in one batch per step; the
  context ``-c`` is split evenly over the slots, so it is given N x the per-request need.
* Both engines get the same text prompts (:func:`memra.bench.serve.random_text_prompts`:
  ``input-len`` single-token words under the model's tokenizer); the probe request checks
  that each server counts exactly ``input-len`` prompt tokens.
* ``ignore_eos`` is honoured by llama-server's OpenAI endpoints; sampling is plain greedy
  (``temperature 0``) for both, and llama-server's ``repeat_penalty`` is 1.0 by default.
* ``--no-webui``; ``-ngl 0`` is implicit on this CPU build.
* The 1-minute load average when each engine started is printed and kept in the JSON:
  compare on an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = [
    "free_port",
    "ServerProcess",
    "llamacpp_server_command",
    "memra_server_command",
    "run_compare",
    "format_compare_table",
    "add_compare_args",
    "cmd_bench_serve_compare",
]

def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llamacpp_server_command(gguf: str | Path, port: int, threads: int, n_ctx: int, parallel: int = 1) -> list[str]:
    """argv of llama.cpp's ``llama-server`` (built on first use) on 127.0.0.1:port with
    ``parallel`` continuous-batching slots of ``n_ctx`` tokens each.

    Raises:
        memra.bench.llamacpp.LlamaCppUnavailable: llama-server could not be built.
    """
    from .llamacpp import binary

    return [str(binary("llama-server")), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--ctx-size", str(n_ctx * parallel),
            "--parallel", str(parallel), "--cont-batching", "--no-webui"]


def memra_server_command(model: str, port: int, max_num_seqs: int, extra: list[str]) -> list[str]:
    """argv of ``memra serve`` on 127.0.0.1:port."""
    return [sys.executable, "-m", "memra", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(max_num_seqs), *extra]


class ServerProcess:
    """A server child process in its own session, logging to a file; a context manager.

    ``__enter__`` starts it and waits until ``GET /health`` or ``GET /v1/models``
    answers 200; ``__exit__`` sends SIGTERM to its process group, then SIGKILL after 15 s.

    Raises (from ``__enter__``):
        RuntimeError: it exited, or was not ready within ``startup_timeout_s``; the
            message ends with the tail of its log.
    """

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, startup_timeout_s: float = 600.0,
                 env: dict[str, str] | None = None):
        self.name, self.argv, self.port, self.log_path = name, argv, port, log_path
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.base_url = f"http://127.0.0.1:{port}"
        self.startup_s: float | None = None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> ServerProcess:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=self.env)
        log.close()
        deadline = t0 + self.startup_timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was ready; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
                for path in ("/health", "/v1/models"):
                    try:
                        if c.get(self.base_url + path).status_code == 200:
                            self.startup_s = time.perf_counter() - t0
                            return self
                    except httpx.HTTPError:
                        pass
                if time.perf_counter() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"{self.name} was not ready after {self.startup_timeout_s:.0f} s; "
                                       f"log {self.log_path}:\n{self.log_tail()}")
                time.sleep(0.5)

    def model_id(self, api_key: str | None = None) -> str | None:
        """The first model id of ``GET /v1/models`` (None if it has none)."""
        import httpx

        h = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        r = httpx.get(self.base_url + "/v1/models", headers=h, timeout=10.0, trust_env=False)
        data = r.json().get("data") or []
        return data[0].get("id") if data else None

    def __exit__(self, *exc) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=5)


def run_compare(a: argparse.Namespace, log=lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """Start each engine in turn, benchmark it at every level, stop it.

    Returns:
        JSON-ready dict: ``bench``, ``date``, ``host``, ``model``, ``gguf``, ``settings``,
        ``engines`` (per engine: ``command``, ``startup_s``, ``log``, and the
        :func:`memra.bench.serve.run_serve_benchmark` result, or ``error``), and
        ``comparison`` (one row per level, see :func:`format_compare_table`).
    """
    import platform

    from ..hub import resolve_model
    from .serve import BenchConfig, build_dataset, parse_concurrency, run_serve_benchmark

    levels = parse_concurrency(a.concurrency)
    gguf = resolve_model(a.model)
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ("memra", "llamacpp"):
            raise ValueError(f"--engines takes memra and/or llamacpp, got {e!r}")
    base = BenchConfig(base_url="http://127.0.0.1", model=a.model, num_prompts=a.num_prompts, input_len=a.input_len,
                       output_len=a.output_len, max_concurrency=levels, request_rate=a.request_rate, seed=a.seed,
                       prompt_format="text", tokenizer=str(gguf), timeout_s=a.timeout)
    base.validate()
    dataset = build_dataset(base)  # the same prompts for both engines
    logdir = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="memra-serve-compare-"))
    out: dict[str, Any] = {
        "bench": "serve-compare", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(), "model": a.model, "gguf": str(gguf),
        "settings": {"concurrency": levels, "num_prompts": a.num_prompts, "input_len": a.input_len,
                     "output_len": a.output_len, "request_rate": "inf" if math.isinf(a.request_rate) else a.request_rate,
                     "seed": a.seed, "llamacpp_threads": a.threads, "prompt_format": "text"},
        "engines": {},
    }
    for name in engines:
        entry: dict[str, Any] = {"log": str(logdir / f"{name}.log"), "loadavg_before": os.getloadavg()}
        out["engines"][name] = entry
        try:
            port = free_port()
            if name == "memra":
                argv = memra_server_command(a.model, port, a.max_num_seqs or max(levels),
                                            shlex.split(a.memra_args or ""))
                extra: dict[str, Any] = {}
                env = None
            else:
                argv = llamacpp_server_command(gguf, port, a.threads, a.input_len + a.output_len + 64,
                                               parallel=max(levels))
                extra = {}
                env = None
            entry["command"] = argv
            log(f"starting {name}: {shlex.join(argv)}")
            with ServerProcess(name, argv, port, logdir / f"{name}.log", a.startup_timeout, env=env) as srv:
                entry["startup_s"] = srv.startup_s
                log(f"{name} ready after {srv.startup_s:.1f} s on {srv.base_url}")
                cfg = dataclasses.replace(base, base_url=srv.base_url, model=srv.model_id() or a.model,
                                          extra_body=extra, label=name)
                entry["result"] = run_serve_benchmark(cfg, log=log, dataset=dataset)
        except Exception as e:  # one engine failing (start, probe, HTTP) must not lose the other's results
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"{name} failed: {entry['error']}")
        entry["loadavg_after"] = os.getloadavg()
    out["comparison"] = _comparison(out, levels)
    return out


def _level(out: dict[str, Any], engine: str, c: int) -> dict[str, Any] | None:
    res = out["engines"].get(engine, {}).get("result")
    if not res:
        return None
    for r in res["results"]:
        if r["max_concurrency"] == c:
            return r["summary"]
    return None


def _ratio(x: float | None, y: float | None) -> float | None:
    if x is None or y is None or not y or math.isnan(x) or math.isnan(y):
        return None
    return x / y


def _comparison(out: dict[str, Any], levels: list[int]) -> list[dict[str, Any]]:
    rows = []
    for c in levels:
        m, l = _level(out, "memra", c), _level(out, "llamacpp", c)
        row: dict[str, Any] = {"max_concurrency": c}
        for tag, s in (("memra", m), ("llamacpp", l)):
            row[f"{tag}_output_throughput"] = s["output_throughput"] if s else None
            row[f"{tag}_ttft_median_ms"] = s["ttft_ms"]["median"] if s else None
            row[f"{tag}_tpot_median_ms"] = s["tpot_ms"]["median"] if s else None
            row[f"{tag}_failed"] = s["failed_requests"] if s else None
        row["output_throughput_ratio"] = _ratio(row["memra_output_throughput"], row["llamacpp_output_throughput"])
        row["ttft_median_ratio"] = _ratio(row["memra_ttft_median_ms"], row["llamacpp_ttft_median_ms"])
        rows.append(row)
    return rows


def format_compare_table(rows: list[dict[str, Any]]) -> str:
    """One row per level: output tok/s, median TTFT and TPOT of each engine, ratios memra/llama.cpp."""
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    hdr = (f"{'conc':>5}{'out tok/s':>12}{'out tok/s':>12}{'ratio':>8}{'TTFT ms':>11}{'TTFT ms':>11}{'ratio':>8}"
           f"{'TPOT ms':>10}{'TPOT ms':>10}{'failed':>9}")
    sub = (f"{'':>5}{'memra':>12}{'llama.cpp':>12}{'m/l':>8}{'memra':>11}{'llama.cpp':>11}{'m/l':>8}"
           f"{'memra':>10}{'llama.cpp':>10}{'m / l':>9}")
    lines = [hdr, sub, "-" * len(hdr)]
    for r in rows:
        fails = f"{f(r['memra_failed'], 'd')} / {f(r['llamacpp_failed'], 'd')}"
        lines.append(
            f"{r['max_concurrency']:>5}{f(r['memra_output_throughput'], '.1f'):>12}"
            f"{f(r['llamacpp_output_throughput'], '.1f'):>12}{f(r['output_throughput_ratio'], '.2f'):>8}"
            f"{f(r['memra_ttft_median_ms'], '.0f'):>11}{f(r['llamacpp_ttft_median_ms'], '.0f'):>11}"
            f"{f(r['ttft_median_ratio'], '.2f'):>8}{f(r['memra_tpot_median_ms'], '.1f'):>10}"
            f"{f(r['llamacpp_tpot_median_ms'], '.1f'):>10}{fails:>9}")
    return "\n".join(lines)


def add_compare_args(p: argparse.ArgumentParser) -> None:
    """The ``memra bench serve-compare`` options."""
    from ..hub import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="model key or GGUF path (any architecture both engines know)")
    p.add_argument("--concurrency", default="1,8,32", help="max-concurrency levels, e.g. 1,8,32")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per level")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of each request (ignore_eos is sent)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="arrivals per second (Poisson); inf: all at once")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument("--threads", type=int, default=2, help="llama-server --threads and --threads-batch")
    p.add_argument("--max-num-seqs", type=int, default=None, help="memra serve --max-num-seqs (default: the top level)")
    p.add_argument("--memra-args", default="", help="extra arguments for memra serve, e.g. '--dtype bfloat16'")
    p.add_argument("--engines", default="memra,llamacpp", help="which to run, in order")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for each server")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout in seconds")
    p.add_argument("--log-dir", default=None, help="server logs go here (default: a new temp folder)")
    p.add_argument("--json-out", default=None, help="write the results here")


def cmd_bench_serve_compare(a: argparse.Namespace) -> int:
    """``memra bench serve-compare``: 0 when every engine produced results, else 1."""
    from .serve import write_json

    out = run_compare(a)
    s = out["settings"]
    print(f"memra bench serve-compare: model={a.model} prompts={s['num_prompts']} input={s['input_len']} "
          f"output={s['output_len']} rate={s['request_rate']} llama.cpp threads={a.threads}")
    print(format_compare_table(out["comparison"]))
    loads = ", ".join(f"{n} {e['loadavg_before'][0]:.1f}" for n, e in out["engines"].items())
    print(f"1-min load average when each engine started ({os.cpu_count()} CPUs): {loads}; other processes on "
          f"the CPUs slow both engines, llama.cpp's spinning threads much more")
    for name, e in out["engines"].items():
        if "error" in e:
            print(f"{name}: error: {e['error'].splitlines()[0]}")
    if a.json_out:
        write_json(a.json_out, out)
        print(f"wrote {a.json_out}")
    return 0 if all("result" in e for e in out["engines"].values()) else 1


