"""Hostile clients and hostile model files against ``memra serve`` and ``memra generate``.

Bounded in time; every figure (requests sent, 5xx count, blocks leaked, RSS growth, render
times) is printed (``pytest -s``) and asserted:

* runaway chat templates (nested loops, string doubling with ``~``, a namespace doubling)
  fail within 2 s with an error naming the bound, in the server (400, and a normal request
  right after succeeds) and in ``memra generate --chat`` (non-zero exit, peak RSS < 1.5 GB);
  the server refuses to start with a template that cannot render a plain conversation;
* a 10 MB body gets 413 in under 0.5 s while another stream's longest inter-chunk gap stays
  under 0.5 s, and the server's RSS grows by less than 100 MB;
* malformed JSON, a wrong or missing Content-Type, an empty body: 400/415 in OpenAI's shape;
* 100 streaming clients that disconnect after 2 chunks, 8 at a time: then 0 running and
  every KV block free.
"""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import ServerThread, wait_idle  # noqa: I001 - the shared server-thread helper

from memra.engine.async_engine import AsyncLLMEngine
from memra.engine.engine import EngineConfig, LLMEngine
from memra.server.app import check_chat_template, create_app

MAX_MODEL_LEN = 512
RUNAWAY = {
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "tilde_doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                      "{% endfor %}{{ ns.s }}",
    "list_growth": "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                   "{% endfor %}{{ ns.l | length }}",
}


def _rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model="smollm2-135m", max_model_len=MAX_MODEL_LEN,
                                                max_num_seqs=16, kv_cache_blocks=64)))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    srv = ServerThread(create_app(engine, served_model_name="smol"))
    yield srv
    srv.stop()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _chat(http, content="Say hi.", **kw):
    return http.post("/v1/chat/completions", json={"model": "smol", "messages": [{"role": "user", "content": content}],
                                                    "max_tokens": 4, "temperature": 0, **kw})


@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_runaway_template_in_server_is_400_and_server_keeps_serving(name, engine, server, http):
    tok = engine.engine.tokenizer
    good = tok.chat_template
    tok.chat_template = RUNAWAY[name]
    try:
        t0 = time.monotonic()
        r = _chat(http)
        dt = time.monotonic() - t0
        print(f"\n{name}: HTTP {r.status_code} in {dt:.2f} s: {r.json()['error']['message']}")
        assert r.status_code == 400 and dt < 2.0
        assert "limit" in r.json()["error"]["message"]
        with pytest.raises(ValueError, match="cannot render a plain user/assistant conversation"):
            check_chat_template(server.server.config.app.state.server)
    finally:
        tok.chat_template = good
    r = _chat(http)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def hostile_gguf(tmp_path_factory):
    """smollm2-135m's GGUF with each runaway template as its chat template."""
    from memra.hub import resolve_model
    from memra.io.gguf import read_gguf
    from memra.io.gguf_writer import write_gguf

    d = tmp_path_factory.mktemp("hostile")
    ck = read_gguf(resolve_model("smollm2-135m"))
    meta = {k: v for k, v in ck.metadata.items() if k != "general.architecture"}
    tensors = {n: ck.tensor(n) for n in ck.infos}
    return {name: write_gguf(d / f"{name}.gguf", ck.architecture, meta | {"tokenizer.chat_template": tpl}, tensors)
            for name, tpl in RUNAWAY.items()}


@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_runaway_template_in_generate_cli(name, hostile_gguf):
    code = ("import resource, subprocess, sys, time\n"
            "t = time.monotonic()\n"
            "r = subprocess.run([sys.executable, '-m', 'memra', 'generate', '--model', sys.argv[1], '--chat',\n"
            "                    '--prompt', 'hi', '--max-tokens', '2', '--threads', '1'], capture_output=True, text=True)\n"
            "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
            "print(r.returncode, round(time.monotonic() - t, 2), round(kids), repr(r.stderr.strip().splitlines()[-1]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(hostile_gguf[name])], capture_output=True, text=True,
                         timeout=120).stdout.strip()
    rc, secs, peak_mib, last = out.split(" ", 3)
    print(f"\n{name}: memra generate --chat exit {rc} after {secs} s (model load included), "
          f"peak RSS {peak_mib} MiB: {last}")
    assert int(rc) != 0 and "limit" in last
    assert float(peak_mib) < 1500


def test_huge_body_is_413_fast_and_other_streams_flow(server, http):
    gaps: list[float] = []
    errors: list[BaseException] = []

    def stream():
        try:
            with httpx.Client(base_url=server.url, timeout=60) as c:
                body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
                        "stream": True, "ignore_eos": True}
                with c.stream("POST", "/v1/completions", json=body) as r:
                    last = None
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            now = time.monotonic()
                            if last is not None:
                                gaps.append(now - last)
                            last = now
        except BaseException as e:  # reported below
            errors.append(e)

    th = threading.Thread(target=stream)
    th.start()
    time.sleep(0.5)  # the stream is flowing
    rss0 = _rss_mib()
    payload = json.dumps({"model": "smol", "prompt": "x " * (5 << 20), "max_tokens": 1}).encode()
    assert len(payload) > 10_000_000
    t0 = time.monotonic()
    r = http.post("/v1/completions", content=payload, headers={"Content-Type": "application/json"})
    dt = time.monotonic() - t0
    th.join(60)
    growth = _rss_mib() - rss0
    print(f"\n10 MB body: HTTP {r.status_code} in {dt:.3f} s; other stream: {len(gaps) + 1} chunks, longest gap "
          f"{max(gaps):.3f} s; RSS growth {growth:.0f} MiB")
    assert not errors, errors
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert dt < 0.5 and max(gaps) < 0.5 and growth < 100


@pytest.mark.parametrize("content,headers,status,words", [
    (b'{"model": "smol", "prompt": ', {"Content-Type": "application/json"}, 400, "not valid JSON"),
    (b"", {"Content-Type": "application/json"}, 400, "JSON object body is required"),
    (b'{"prompt": "hi"}', {"Content-Type": "text/plain"}, 415, "Content-Type 'text/plain'"),
    (b'{"prompt": "hi"}', {}, 415, "no Content-Type header"),
    (b'[1, 2]', {"Content-Type": "application/json"}, 400, "invalid request body"),
])
def test_malformed_requests(http, content, headers, status, words):
    r = http.post("/v1/completions", content=content, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"


def test_unknown_field_is_400_naming_it(http):
    r = _chat(http, guided_json={"type": "object"})
    assert r.status_code == 400 and "guided_json" in r.json()["error"]["message"]


def test_disconnecting_stream_clients_leak_nothing(server, engine):
    n_clients, at_once = 100, 8
    statuses: list[int] = []

    async def one(c: httpx.AsyncClient, i: int):
        body = {"model": "smol", "prompt": f"Story {i}:", "max_tokens": 64, "stream": True, "ignore_eos": True,
                "temperature": 0.8, "seed": i}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            got = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got == 2:
                        break  # leaving the context closes the connection mid-stream

    async def main():
        sem = asyncio.Semaphore(at_once)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            async def guarded(i):
                async with sem:
                    await one(c, i)
            await asyncio.gather(*(guarded(i) for i in range(n_clients)))

    t0 = time.monotonic()
    asyncio.run(main())
    s = wait_idle(engine, timeout=30)
    metrics = httpx.get(server.url + "/metrics").text
    running = [ln for ln in metrics.splitlines() if ln.startswith("memra:num_requests_running")]
    used = [ln for ln in metrics.splitlines() if ln.startswith("memra:kv_cache_blocks_used")]
    fivexx = sum(1 for st in statuses if st >= 500)
    print(f"\n{n_clients} streaming clients ({at_once} at a time) left after 2 chunks in "
          f"{time.monotonic() - t0:.1f} s: {fivexx} responses >= 500, engine running {s.num_running}, "
          f"KV blocks used {s.kv_blocks_used}; /metrics: {running} {used}")
    assert len(statuses) == n_clients and fivexx == 0 and all(st == 200 for st in statuses)
    assert s.kv_blocks_used == 0 and s.num_running == 0
    assert running and float(running[0].split()[-1]) == 0 and used and float(used[0].split()[-1]) == 0


def test_runaway_render_does_not_grow_this_process():
    from memra.io.chat_template import ChatTemplateLimitError, render_chat_template_bounded

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for tpl in RUNAWAY.values():
        with pytest.raises(ChatTemplateLimitError):
            render_chat_template_bounded(tpl, [{"role": "user", "content": "hi"}])
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(f"\npeak RSS of the test process grew {grown:.0f} MiB over {len(RUNAWAY)} runaway renders")
    assert grown < 50


def test_gauges_drop_soon_after_a_non_streaming_client_leaves(server, engine):
    """A non-streaming request whose client disconnects is aborted and leaves the running /
    KV gauges within a second (the server polls for the disconnect every 0.2 s)."""
    import socket

    wait_idle(engine)
    body = json.dumps({"model": "smol", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                       "temperature": 0}).encode()
    s = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 20
    while engine.stats().num_running == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    s.close()
    t0 = time.monotonic()
    while engine.stats().num_running or engine.stats().kv_blocks_used:
        assert time.monotonic() - t0 < 5, engine.stats()
        time.sleep(0.02)
    dt = time.monotonic() - t0
    print(f"\ngauges back to 0 running / 0 KV blocks {dt:.2f} s after the client left")
    assert dt < 1.0


def test_chunked_body_over_the_limit_is_413(http):
    """No Content-Length (chunked transfer): the body is counted as it arrives."""
    def chunks():
        yield b'{"model": "smol", "prompt": "'
        for _ in range(6):
            yield b"x" * (1 << 20)
        yield b'", "max_tokens": 1}'

    t0 = time.monotonic()
    r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert "larger than this server's limit" in r.json()["error"]["message"] and time.monotonic() - t0 < 2
    small = http.post("/v1/completions", content=iter([b'{"model": "smol", "prompt": "Hi", ', b'"max_tokens": 1}']),
                      headers={"Content-Type": "application/json"})
    assert small.status_code == 200, small.text
