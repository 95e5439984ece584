"""``memra bench serve`` against a fake OpenAI completions server with known timings.

The fake (Starlette on uvicorn in a daemon thread, a free 127.0.0.1 port) streams
``max_tokens`` one-token chunks: the first after ``first_delay`` seconds, the others
``gap`` seconds apart, then a usage chunk (when asked for and enabled) and ``[DONE]``.
It records every request body and the largest number of requests in flight at once,
and answers 500 to the requests whose arrival number is in ``fail`` (``broken``: drops
the connection mid-stream; ``stream_error``: sends an error object in the stream).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
import threading
import time

import pytest

from memra.bench.serve import (
    BenchConfig,
    RequestRecord,
    _stats_ms,
    format_table,
    parse_concurrency,
    random_token_prompts,
    run_serve_benchmark,
    summarize,
)


class FakeServer:
    def __init__(self):
        self.first_delay = 0.15
        self.gap = 0.02
        self.send_usage = True
        self.fail: set[int] = set()
        self.broken: set[int] = set()  # stream two chunks, then drop the connection
        self.stream_error: set[int] = set()  # stream one chunk, then an error object
        self.truncated: set[int] = set()  # two chunks, then a clean end without finish_reason or [DONE]
        self.bodies: list[dict] = []
        self.spec = False  # expose memra's speculative-decoding counters on /metrics
        self.arrivals = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        self.port = None

    def reset(self, **kw):
        self.__init__()
        for k, v in kw.items():
            setattr(self, k, v)

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        fake = self

        async def completions(request):
            body = await request.json()
            with fake.lock:
                n = fake.arrivals
                fake.arrivals += 1
                fake.bodies.append(body)
            if n in fake.fail:
                return JSONResponse({"error": {"message": f"injected failure {n}", "type": "server_error"}},
                                    status_code=500)
            k = body["max_tokens"]
            if not body.get("stream"):
                return JSONResponse({"choices": [{"text": "x" * k, "index": 0, "finish_reason": "length"}],
                                     "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": k}})
            usage = body.get("stream_options", {}).get("include_usage") and fake.send_usage

            async def stream():
                with fake.lock:
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    await asyncio.sleep(fake.first_delay)
                    for i in range(k):
                        if i:
                            await asyncio.sleep(fake.gap)
                        if n in fake.broken and i == 2:
                            raise RuntimeError("fake: connection dropped")
                        if n in fake.truncated and i == 2:
                            return
                        if n in fake.stream_error and i == 1:
                            yield 'data: {"error": {"message": "fake stream error"}}\n\n'
                            return
                        ch = {"choices": [{"text": f" t{i}", "index": 0,
                                           "finish_reason": "length" if i == k - 1 else None}]}
                        yield f"data: {json.dumps(ch)}\n\n"
                    if usage:
                        u = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": k}}
                        yield f"data: {json.dumps(u)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

            return StreamingResponse(stream(), media_type="text/event-stream")

        async def metrics(request):
            from starlette.responses import PlainTextResponse

            if not fake.spec:
                return PlainTextResponse("# no speculation\n")
            n = fake.arrivals  # every request: 2 verify steps, 3 drafts accepted (1 + 3/2 = 2.5 per step)
            lines = ["# TYPE memra:spec_decode_num_accepted_tokens counter",
                     f'memra:spec_decode_num_accepted_tokens_total{{model_name="fake"}} {3 * n}',
                     "# TYPE memra:spec_decode_num_draft_tokens_per_pos counter"]
            lines += [f'memra:spec_decode_num_draft_tokens_per_pos_total{{model_name="fake",position="{j}"}} '
                      f'{(2 - j) * n}' for j in range(2)]
            return PlainTextResponse("\n".join(lines) + "\n")

        return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                                 Route("/metrics", metrics)])


@pytest.fixture(scope="module")
def fake():
    import uvicorn

    f = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    f.port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(f.app(), log_level="warning", lifespan="off"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.02)
    else:
        raise RuntimeError("fake server did not start")
    yield f
    server.should_exit = True
    t.join(timeout=5)


def cfg(fake, **kw) -> BenchConfig:
    base = dict(base_url=f"http://127.0.0.1:{fake.port}", model="fake", num_prompts=8, input_len=12, output_len=6,
                max_concurrency=[2], seed=3, timeout_s=30.0)
    base.update(kw)
    return BenchConfig(**base)


def test_timings_tokens_and_request_body(fake):
    fake.reset(port=fake.port, first_delay=0.15, gap=0.02)
    res = run_serve_benchmark(cfg(fake), log=lambda s: None)
    (level,) = res["results"]
    s = level["summary"]
    assert s["successful_requests"] == 8 and s["failed_requests"] == 0 and s["short_outputs"] == 0
    assert s["total_output_tokens"] == 8 * 6 and s["total_input_tokens"] == 8 * 12
    # lower bounds are the fake's delays; upper bounds leave room for a busy CI machine
    assert 150 <= s["ttft_ms"]["mean"] < 350, s["ttft_ms"]
    assert 150 <= s["ttft_ms"]["median"] <= s["ttft_ms"]["p99"] < 450
    assert 18 <= s["itl_ms"]["median"] < 60, s["itl_ms"]
    assert 18 <= s["tpot_ms"]["mean"] < 60, s["tpot_ms"]
    e2e_expected = 150 + 5 * 20
    assert e2e_expected <= s["e2e_ms"]["mean"] < e2e_expected + 200, s["e2e_ms"]
    # 8 requests, 2 at a time: 4 waves of >= 0.25 s each
    assert s["duration_s"] >= 4 * 0.25
    assert s["output_throughput"] == pytest.approx(48 / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(8 / s["duration_s"])
    for r in level["requests"]:
        assert r["success"] and r["output_tokens"] == 6 and r["output_tokens_source"] == "usage"
        assert r["chunks"] == 6 and len(r["itl_s"]) == 5 and r["finish_reason"] == "length"
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 5)
    # the probe (non-streaming, max_tokens 1) came first, then the 8 streamed requests
    assert res["probe"]["prompt_tokens"] == 12
    probe_body, bodies = fake.bodies[0], fake.bodies[1:]
    assert probe_body["stream"] is False and probe_body["max_tokens"] == 1
    assert len(bodies) == 8
    expected = random_token_prompts(8, 12, 3000, (1000, 10000))  # level 0 of seed 3
    assert sorted(b["prompt"] for b in bodies) == sorted(expected)
    assert probe_body["prompt"] == random_token_prompts(1, 12, 3999, (1000, 10000))[0]
    assert probe_body["prompt"] not in expected
    for b in bodies:
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["temperature"] == 0 and b["max_tokens"] == 6 and b["model"] == "fake"
        assert len(b["prompt"]) == 12 and all(1000 <= t < 10000 for t in b["prompt"])


@pytest.mark.parametrize("concurrency", [1, 3])
def test_concurrency_is_bounded(fake, concurrency):
    fake.reset(port=fake.port, first_delay=0.05, gap=0.005)
    res = run_serve_benchmark(cfg(fake, num_prompts=9, output_len=3, max_concurrency=[concurrency]),
                              log=lambda s: None)
    assert res["results"][0]["summary"]["successful_requests"] == 9
    assert fake.max_in_flight == concurrency


def test_failures_counted_with_error_text(fake):
    fake.reset(port=fake.port, first_delay=0.01, gap=0.001, fail={2, 5})  # arrival 0 is the probe
    res = run_serve_benchmark(cfg(fake, max_concurrency=[1]), log=lambda s: None)
    s = res["results"][0]["summary"]
    assert s["successful_requests"] == 6 and s["failed_requests"] == 2
    assert s["total_output_tokens"] == 6 * 6
    failed = [r for r in res["results"][0]["requests"] if not r["success"]]
    assert [r["index"] for r in failed] == [1, 4]
    assert all(r["error"].startswith("HTTP 500: injected failure") for r in failed)
    assert s["errors"] == ["HTTP 500: injected failure 2", "HTTP 500: injected failure 5"]


def test_broken_streams_are_failures(fake):
    fake.reset(port=fake.port, first_delay=0.01, gap=0.001, broken={1}, stream_error={3}, truncated={5})
    res = run_serve_benchmark(cfg(fake, max_concurrency=[1], num_prompts=5), log=lambda s: None)
    s = res["results"][0]["summary"]
    assert s["successful_requests"] == 2 and s["failed_requests"] == 3
    reqs = res["results"][0]["requests"]
    assert [r["success"] for r in reqs] == [False, True, False, True, False]
    assert reqs[4]["error"] == "stream ended without [DONE] or a finish_reason"
    assert "RemoteProtocolError" in reqs[0]["error"] or "incomplete" in reqs[0]["error"], reqs[0]["error"]
    assert reqs[2]["error"] == "stream error: fake stream error"
    assert s["total_output_tokens"] == 12


def test_probe_failure_raises(fake):
    fake.reset(port=fake.port, fail={0})
    with pytest.raises(RuntimeError, match="probe request .* HTTP 500: injected failure 0"):
        run_serve_benchmark(cfg(fake), log=lambda s: None)


def test_output_tokens_counted_from_chunks_without_usage(fake):
    fake.reset(port=fake.port, first_delay=0.01, gap=0.001, send_usage=False)
    res = run_serve_benchmark(cfg(fake, output_len=7), log=lambda s: None)
    reqs = res["results"][0]["requests"]
    assert all(r["output_tokens"] == 7 and r["output_tokens_source"] == "chunks" for r in reqs)
    assert all(r["input_tokens"] == 12 for r in reqs)  # the prompt's own length when no usage comes


def test_poisson_arrivals(fake):
    fake.reset(port=fake.port, first_delay=0.0, gap=0.0)
    res = run_serve_benchmark(cfg(fake, num_prompts=20, output_len=1, max_concurrency=[20], request_rate=40.0),
                              log=lambda s: None)
    starts = sorted(r["start_s"] for r in res["results"][0]["requests"])
    # 20 exponential gaps of mean 25 ms (seeded): the last starts after ~0.5 s, not at once
    assert 0.2 < starts[-1] < 1.5, starts
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert 0.01 < sum(gaps) / len(gaps) < 0.075


def test_several_levels_and_cli_json(fake, tmp_path, capsys):
    from memra.cli import main

    fake.reset(port=fake.port, first_delay=0.02, gap=0.002)
    out = tmp_path / "sub" / "serve.json"
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{fake.port}", "--model", "fake",
               "--num-prompts", "6", "--max-concurrency", "1,3", "--input-len", "5", "--output-len", "4",
               "--seed", "1", "--label", "fake-engine", "--json-out", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    rows = [ln.split() for ln in stdout.splitlines() if ln.split()[:1] in (["1"], ["3"])]
    assert [r[:3] for r in rows] == [["1", "6", "0"], ["3", "6", "0"]]
    d = json.loads(out.read_text())
    assert d["bench"] == "serve" and d["label"] == "fake-engine" and d["host"] and d["date"].endswith("Z")
    assert d["config"]["max_concurrency"] == [1, 3] and d["config"]["input_len"] == 5
    assert d["config"]["request_rate"] == "inf"
    assert [r["max_concurrency"] for r in d["results"]] == [1, 3]
    for r in d["results"]:
        assert r["summary"]["successful_requests"] == 6 and len(r["requests"]) == 6
        assert r["summary"]["total_output_tokens"] == 24
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(r["summary"][k]) == {"mean", "median", "p99"}
    assert fake.max_in_flight == 3
    # fresh prompts at each level (a prefix cache cannot reuse the previous level's), seeded
    p1 = sorted(b["prompt"] for b in fake.bodies[1:7])
    p3 = sorted(b["prompt"] for b in fake.bodies[7:])
    assert len(fake.bodies) == 13 and not set(map(tuple, p1)) & set(map(tuple, p3))
    assert p1 == sorted(random_token_prompts(6, 5, 1000, (1000, 10000)))
    assert p3 == sorted(random_token_prompts(6, 5, 1001, (1000, 10000)))


def test_cli_unreachable_server_and_bad_args(tmp_path, capsys):
    from memra.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens here
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "1"])
    assert rc == 1 and "probe request" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", "x", "--model", "m"]) == 2
    assert main(["bench", "serve", "--base-url", "http://h", "--model", "m", "--max-concurrency", "1,0"]) == 2
    assert main(["bench", "serve", "--base-url", "http://h", "--model", "m", "--prompt-format", "text"]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_summary_math_on_known_records():
    recs = [
        RequestRecord(index=0, success=True, ttft_s=0.1, e2e_s=0.5, itl_s=[0.1, 0.2, 0.1], output_tokens=5,
                      input_tokens=10),
        RequestRecord(index=1, success=True, ttft_s=0.3, e2e_s=0.3, itl_s=[], output_tokens=1, input_tokens=10),
        RequestRecord(index=2, success=False, error="boom", e2e_s=0.01),
    ]
    s = summarize(recs, 2.0, output_len=5)
    assert s["successful_requests"] == 2 and s["failed_requests"] == 1 and s["short_outputs"] == 1
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["input_throughput"] == 10.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["median"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4; one-token request excluded
    assert s["itl_ms"]["median"] == pytest.approx(100.0) and s["itl_ms"]["mean"] == pytest.approx(400 / 3)
    assert s["e2e_ms"]["mean"] == pytest.approx(400.0)
    assert s["errors"] == ["boom"]
    p = _stats_ms([float(i) for i in range(101)])  # 0..100 s: p99 by linear interpolation is 99 s
    assert p["p99"] == pytest.approx(99_000.0) and p["median"] == pytest.approx(50_000.0)
    assert _stats_ms([])["mean"] is None
    table = format_table([{"max_concurrency": 4, "summary": s}])
    assert table.splitlines()[-1].split()[:3] == ["4", "2", "1"]
    assert parse_concurrency("1,8,32") == [1, 8, 32]
    with pytest.raises(ValueError):
        parse_concurrency("1,x")
    assert math.isinf(BenchConfig(base_url="http://h", model="m").request_rate)


# ------------------------------------------------------------------------------ serve-compare


def test_compare_rows_and_ratios():
    from memra.bench.serve_compare import _comparison, format_compare_table

    def res(tput, ttft):
        return {"results": [{"max_concurrency": 2, "summary": {
            "output_throughput": tput, "failed_requests": 0, "ttft_ms": {"median": ttft},
            "tpot_ms": {"median": 10.0}}}]}

    out = {"engines": {"memra": {"result": res(30.0, 50.0)}, "llamacpp": {"result": res(10.0, 200.0)}}}
    (row,) = _comparison(out, [2])
    assert row["output_throughput_ratio"] == pytest.approx(3.0)
    assert row["ttft_median_ratio"] == pytest.approx(0.25)
    line = format_compare_table([row]).splitlines()[-1].split()
    assert line[:4] == ["2", "30.0", "10.0", "3.00"] and line[6] == "0.25"
    out["engines"]["llamacpp"] = {"error": "did not start"}
    (row,) = _comparison(out, [2])
    assert row["output_throughput_ratio"] is None and row["llamacpp_output_throughput"] is None
    assert format_compare_table([row]).splitlines()[-1].split()[2:4] == ["-", "-"]


def test_server_process_reports_early_exit(tmp_path):
    from memra.bench.serve_compare import ServerProcess, free_port

    argv = [sys.executable, "-c", "import sys; print('boom: bad flag'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 .*boom: bad flag"):
        with ServerProcess("fake", argv, free_port(), tmp_path / "fake.log", startup_timeout_s=20):
            pass


@pytest.mark.slow
def test_llamacpp_server_end_to_end(tmp_path):
    """llama.cpp's llama-server (built on first use): text prompts counted right, ignore_eos
    honoured, two requests decoded concurrently in its continuous-batching slots."""
    from memra.bench.serve import BenchConfig, run_serve_benchmark
    from memra.bench.serve_compare import ServerProcess, free_port, llamacpp_server_command
    from memra.hub import resolve_model

    gguf = resolve_model("smollm2-135m")
    port = free_port()
    with ServerProcess("llamacpp", llamacpp_server_command(gguf, port, 1, 256, parallel=2), port,
                       tmp_path / "l.log", startup_timeout_s=120) as srv:
        cfg = BenchConfig(base_url=srv.base_url, model="m", num_prompts=2, input_len=16, output_len=24,
                          max_concurrency=[2], prompt_format="text", tokenizer=str(gguf), timeout_s=120)
        res = run_serve_benchmark(cfg, log=lambda s: None)
        assert res["probe"]["prompt_tokens"] == 16  # llama.cpp counts the text prompt as 16 tokens
        s = res["results"][0]["summary"]
        assert s["successful_requests"] == 2 and s["short_outputs"] == 0
        reqs = sorted(res["results"][0]["requests"], key=lambda r: r["start_s"] + r["e2e_s"])
        assert all(r["output_tokens"] == 24 for r in reqs)
        # both in flight at once: the second's first token arrives before the first one finishes
        first_end = reqs[0]["start_s"] + reqs[0]["e2e_s"]
        assert reqs[1]["start_s"] + reqs[1]["ttft_s"] < first_end

def test_mean_accepted_length_from_the_servers_counters(fake):
    fake.reset(port=fake.port, first_delay=0.01, gap=0.0, spec=True)
    res = run_serve_benchmark(cfg(fake, max_concurrency=[2, 4]), log=lambda s: None)
    assert [r["summary"]["mean_accepted_length"] for r in res["results"]] == [2.5, 2.5]
    assert "accepted" in format_table(res["results"])
    fake.reset(port=fake.port, first_delay=0.01, gap=0.0)
    res = run_serve_benchmark(cfg(fake), log=lambda s: None)
    assert res["results"][0]["summary"]["mean_accepted_length"] is None
    assert "accepted" not in format_table(res["results"])
