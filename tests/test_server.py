"""The OpenAI-compatible server, end to end: the official ``openai`` client against
``memra serve``'s app on the real engine and the real model (smollm2-135m, CPU).

One server for the module (uvicorn in a background thread on a free port), with an API
key, a served model name that differs from the model key, a small context and a bounded
queue so every error path can be reached quickly.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest

from memra.engine.async_engine import AsyncLLMEngine
from memra.engine.engine import EngineConfig, LLMEngine
from memra.server import create_app, parse_size
from memra.server.app import check_api_key

KEY = "test-key-123"
NAME = "smol"
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
MAX_QUEUE = 3
PROMPT = "The capital of France is"


class ServerThread:
    """Runs an ASGI app with uvicorn in a daemon thread on a free 127.0.0.1 port."""

    def __init__(self, app):
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def wait_idle(engine: AsyncLLMEngine, timeout: float = 20.0) -> object:
    """Wait until the engine has nothing running or waiting and no KV block in use; return its stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0 and not engine.engine.has_unfinished():
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy after {timeout} s: {s}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model="smollm2-135m", max_model_len=MAX_MODEL_LEN,
                                                max_num_seqs=MAX_NUM_SEQS, kv_cache_blocks=96)),
                         max_queue=MAX_QUEUE)
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    srv = ServerThread(create_app(engine, served_model_name=NAME, api_key=KEY))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_text(client):
    """The greedy 12-token completion of PROMPT (the reference for streaming / stop tests)."""
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    return r.choices[0].text


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


# --------------------------------------------------------------------------- meta routes

def test_models_and_health(client, http, server):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    m = models[0]
    assert m.object == "model" and m.owned_by == "memra" and m.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    # /health and /metrics need no key
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_tokenize_detokenize_round_trip(http, engine):
    r = http.post("/tokenize", json={"prompt": "Hello, world! Ünïcödé 🙂"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == engine.engine.tokenizer.encode("Hello, world! Ünïcödé 🙂")
    assert body["count"] == len(body["tokens"]) > 5 and body["max_model_len"] == MAX_MODEL_LEN
    r = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == "Hello, world! Ünïcödé 🙂"
    msgs = [{"role": "user", "content": "Hi"}]
    r = http.post("/tokenize", json={"messages": msgs})
    text = engine.engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert r.json()["tokens"] == engine.engine.tokenizer.encode(text, add_special_tokens=False)
    r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert r.json()["token_strs"] == [engine.engine.tokenizer.id_to_token(t) for t in r.json()["tokens"]]
    assert "".join(r.json()["token_strs"]).replace("Ġ", " ") == "Hello world"
    r = http.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and _error(r)["param"] == "tokens"
    r = http.post("/tokenize", json={"prompt": "a", "messages": msgs})
    assert r.status_code == 400


# --------------------------------------------------------------------------- completions

def test_completion_greedy_and_usage(client, http, greedy_text):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.text == greedy_text and c.text.strip()
    assert c.finish_reason == "length" and c.index == 0
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    n_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == n_prompt + 12


def test_completion_stream_matches(client, greedy_text):
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == greedy_text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completion_batch_token_prompts_and_n(client, engine):
    tok = engine.engine.tokenizer
    ids = tok.encode(PROMPT)
    r = client.completions.create(model=NAME, prompt=[PROMPT, "Once upon a time"], n=2, max_tokens=4,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # greedy, so the n copies agree; prompt-major: choices 0,1 belong to prompt 0
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text
    assert r.choices[0].text != r.choices[2].text
    assert r.usage.prompt_tokens == len(ids) + len(tok.encode("Once upon a time"))
    assert r.usage.completion_tokens == 16
    one = client.completions.create(model=NAME, prompt=ids, max_tokens=4, temperature=0)
    assert one.choices[0].text == r.choices[0].text
    two = client.completions.create(model=NAME, prompt=[ids, ids[:3]], max_tokens=4, temperature=0)
    assert len(two.choices) == 2 and two.choices[0].text == r.choices[0].text


def test_completion_stream_batch_prompt_major(client):
    prompts = [PROMPT, "Once upon a time"]
    ref = client.completions.create(model=NAME, prompt=prompts, n=2, max_tokens=5, temperature=0)
    texts: dict[int, str] = {}
    finished = {}
    for ch in client.completions.create(model=NAME, prompt=prompts, n=2, max_tokens=5, temperature=0, stream=True):
        c = ch.choices[0]
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason:
            finished[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in ref.choices}
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}


def test_completion_stop_string(client, greedy_text):
    words = greedy_text.split()
    assert len(words) >= 3, greedy_text
    stop = " " + words[2]
    cut = greedy_text.index(stop)
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].text == greedy_text[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop


def test_seed_reproducible(client):
    kw = dict(model=NAME, prompt="My favourite food is", max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=4321, **kw).choices[0].text
    assert a == b
    assert a != c


def test_completion_logprobs(client):
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens).startswith(r.choices[0].text)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 2 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_completion_echo_logprobs(client, http):
    n_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    r = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == PROMPT
    # streamed echo: the prompt comes first
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(ch.choices[0].text for ch in chunks) == c.text


# --------------------------------------------------------------------------- chat

MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three colours."}]


def test_chat_and_stream(client, http):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content.strip()
    assert c.finish_reason in ("stop", "length") and r.object == "chat.completion"
    n_prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_completion_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [c.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # same prompt again: its full KV blocks (16 tokens each) come from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_stop_and_stream_logprobs(client):
    full = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) >= 2, text
    stop = words[1]
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10, temperature=0, stop=stop)
    assert r.choices[0].message.content == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, temperature=0,
                                                 stream=True, logprobs=True, top_logprobs=2))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert len(streamed) == 4 and all(len(t.top_logprobs) == 2 for t in streamed)
    assert streamed[0].logprob == pytest.approx(streamed[0].top_logprobs[0].logprob)  # greedy = top-1


def test_chat_content_parts_equal_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}]
    a = client.chat.completions.create(model=NAME, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Name three colours."}],
                                       max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_logprobs_n_seed(client):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5, temperature=1.0, seed=7, n=2,
                                       logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) >= 1
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 3
        if c.finish_reason == "length":  # no end-of-turn token: the tokens' bytes spell the content exactly
            assert b"".join(bytes(t.bytes) for t in content).decode("utf-8") == c.message.content
    r2 = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5, temperature=1.0, seed=7, n=2)
    assert [c.message.content for c in r2.choices] == [c.message.content for c in r.choices]
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)


def test_chat_without_max_tokens_stops_at_eos(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Say OK."}],
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens <= MAX_MODEL_LEN


def test_logit_bias_bans_the_greedy_token(client, http):
    first = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    tok = http.post("/tokenize", json={"prompt": first.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    banned = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(tok[0]): -100})
    assert banned.choices[0].text != first.choices[0].text
    boosted = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                        logit_bias={"17": 100})  # id 17 everywhere
    assert boosted.choices[0].text == http.post("/detokenize", json={"tokens": [17, 17, 17]}).json()["prompt"]


def test_min_tokens_defers_eos(client):
    msgs = [{"role": "user", "content": "Say OK."}]
    short = client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=64)
    assert short.choices[0].finish_reason == "stop"
    k = short.usage.completion_tokens
    longer = client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=64,
                                            extra_body={"min_tokens": k + 8})
    assert longer.usage.completion_tokens >= k + 8


# --------------------------------------------------------------------------- errors

def test_invalid_temperature_is_400(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=NAME, prompt=PROMPT, temperature=-1)
    assert ei.value.status_code == 400 and ei.value.body["param"] == "temperature"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert "gpt-4o" in ei.value.body["message"] and ei.value.body["code"] == "model_not_found"


def test_prompt_too_long_is_400(client):
    long_prompt = "hello " * 300
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=NAME, prompt=long_prompt, max_tokens=8)
    msg = ei.value.body["message"]
    assert "max_tokens=8" in msg and str(MAX_MODEL_LEN) in msg
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": long_prompt}])


def test_wrong_or_missing_api_key_is_401(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x"})
    assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"n": 1.5}, "n"),
    ({"n": 0}, "n"),
    ({"logprobs": 6}, "logprobs"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"stop": [""]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"logit_bias": {"x": 5}}, "logit_bias"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens = 2
    ({"guided_json": {"type": "object"}}, "guided_json"),  # unknown fields are refused, named
    ({"return_token_strs": True}, "return_token_strs"),
    ({"best_of": 3}, "best_of"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"seed": True}, "seed"),
    ({"seed": 2**64}, "seed"),
])
def test_completion_bad_params_are_400(http, body, param):
    r = http.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"temperature": float("nan")}, "temperature"),
])
def test_chat_bad_params_are_400(http, body, param):
    payload = {"model": NAME, "messages": MESSAGES, "max_tokens": 2, **body}
    r = http.post("/v1/chat/completions", content=json.dumps(payload), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert _error(r)["param"] == param


def test_malformed_bodies_and_routes(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in _error(r)["message"]
    r = http.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and _error(r)["type"] == "invalid_request_error"
    r = http.get("/v1/completions")
    assert r.status_code == 405 and _error(r)
    # unknown fields are refused, named (as OpenAI's API does); greedy with n > 1 is fine
    r = http.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 1, "n": 2,
                                           "temperature": 0, "frobnicate": {"x": 1}, "user": "u1"})
    assert r.status_code == 400 and _error(r)["param"] == "frobnicate" and "frobnicate" in _error(r)["message"]
    r = http.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 1, "n": 2,
                                           "temperature": 0, "user": "u1"})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


# --------------------------------------------------------------------------- load, disconnects, metrics

def test_queue_full_is_429(server, engine, client):
    """max_num_seqs requests run, MAX_QUEUE wait; one more is refused with 429."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=60) as ac:
            body = {"model": NAME, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
            streams = []

            async def wait_for(what: str, k: int) -> None:
                deadline = time.monotonic() + 20
                while getattr(engine.stats(), what) < k:
                    assert time.monotonic() < deadline, (what, k, engine.stats())
                    await asyncio.sleep(0.02)

            # one at a time, so each is admitted (running, then waiting) before the next arrives
            for k in range(MAX_NUM_SEQS + MAX_QUEUE):
                cm = ac.stream("POST", "/v1/completions", json=body)
                resp = await cm.__aenter__()
                assert resp.status_code == 200, await resp.aread()
                streams.append(cm)
                if k < MAX_NUM_SEQS:
                    await wait_for("num_running", k + 1)
                else:
                    await wait_for("num_waiting", k + 1 - MAX_NUM_SEQS)
            try:
                r = await ac.post("/v1/completions", json={**body, "stream": False})
                assert r.status_code == 429, r.text
                assert _error(r)["type"] == "rate_limit_error"
                with pytest.raises(openai.RateLimitError):  # returns at once, so a blocking call is fine here
                    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
            finally:
                for cm in streams:
                    await cm.__aexit__(None, None, None)

    asyncio.run(main())
    wait_idle(engine)


def _aborts(server, expect: float | None = None) -> float:
    """Completions counted as aborted in /metrics (waiting up to 5 s for ``expect``)."""
    deadline = time.monotonic() + 5
    while True:
        text = httpx.get(server.url + "/metrics").text
        m = re.search(r'^memra:request_finished_total\{finished_reason="abort",model_name="smol"\} ([0-9.]+)$',
                      text, re.M)
        assert m, text
        if expect is None or float(m.group(1)) == expect or time.monotonic() > deadline:
            return float(m.group(1))
        time.sleep(0.05)


# The full request (n=2, 240 tokens each) takes far longer than the client stays, so
# fewer generated tokens than 2 * 240 show that leaving aborted it.
LONG = {"model": NAME, "prompt": PROMPT, "n": 2, "max_tokens": 240, "ignore_eos": True}


def test_client_disconnect_mid_stream_frees_request(server, engine):
    wait_idle(engine)
    before, aborts = engine.stats().num_generation_tokens, _aborts(server)
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as resp:
            got = 0
            for line in resp.iter_lines():
                got += line.startswith("data: {")
                if got >= 3:
                    break
            assert engine.stats().num_running + engine.stats().num_waiting >= 1
    s = wait_idle(engine)  # nothing running or waiting, every KV block free
    assert 0 < s.num_generation_tokens - before < 2 * 240
    assert _aborts(server, aborts + 2) == aborts + 2  # both completions counted as aborted


def test_client_disconnect_batch_stream_frees_requests(server, engine):
    """Two prompts (two engine requests, merged into one SSE stream), n=2 each."""
    wait_idle(engine)
    before, aborts = engine.stats().num_generation_tokens, _aborts(server)
    body = {**LONG, "prompt": [PROMPT, "Once upon a time"], "stream": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as resp:
            assert sum(1 for _, line in zip(range(4), resp.iter_lines()) if line.startswith("data: {")) >= 1
    s = wait_idle(engine)
    assert s.num_generation_tokens - before < 4 * 240
    assert _aborts(server, aborts + 4) == aborts + 4


def test_client_disconnect_non_streaming_frees_request(server, engine):
    wait_idle(engine)
    before, aborts = engine.stats().num_generation_tokens, _aborts(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=LONG, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=0.7)
    s = wait_idle(engine)
    assert s.num_generation_tokens - before < 2 * 240
    assert _aborts(server, aborts + 2) == aborts + 2


def test_metrics(server, client):
    client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text

    def value(pattern: str) -> float:
        m = re.search(rf"^{pattern}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
        assert m, f"{pattern} not in /metrics"
        return float(m.group(1))

    assert value("memra:time_to_first_token_seconds_count") >= 1
    assert value("memra:time_per_output_token_seconds_count") >= 1
    assert value("memra:inter_token_latency_seconds_count") >= 2
    assert value("memra:e2e_request_latency_seconds_count") >= 1
    assert re.search(r'^memra:request_finished_total\{finished_reason="length",model_name="smol"\} [1-9]', text,
                     re.M), text
    assert 'finished_reason="error"' in text and 'finished_reason="abort"' in text
    assert value("memra:kv_cache_blocks_total") == 96
    assert value("memra:num_requests_running") >= 0 and value("memra:num_requests_waiting") >= 0
    assert 0 <= value("memra:kv_cache_usage_perc") <= 1
    assert value("memra:prompt_tokens_total") >= value("memra:prompt_tokens_computed_total") > 0
    assert value("memra:generation_tokens_total") >= 3
    assert value("memra:prefix_cache_queries_total") >= value("memra:prefix_cache_hits_total") > 0  # PROMPT repeats
    assert value("memra:num_preemptions_total") >= 0


# --------------------------------------------------------------------------- engine failures

class _FlakyEngine:
    """The real engine, except that every request fails after its first event."""

    def __init__(self, real: AsyncLLMEngine):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def submit(self, ids, params, request_id, prompt_logprobs=None):
        stream = self.real.submit(ids, params, request_id, prompt_logprobs=prompt_logprobs)

        async def failing():
            try:
                yield await stream.__anext__()
                raise RuntimeError("simulated engine failure")
            finally:
                await stream.aclose()

        return failing()


def test_engine_failure_is_500_and_server_survives(engine, client):
    app = create_app(_FlakyEngine(engine), served_model_name=NAME)

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as ac:
            r = await ac.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": 20})
            assert r.status_code == 500 and _error(r)["type"] == "server_error"
            assert "simulated engine failure" in _error(r)["message"]
            r = await ac.post("/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, "max_tokens": 20,
                                                            "stream": True})
            assert r.status_code == 200
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
            m = (await ac.get("/metrics")).text
            assert re.search(r'finished_reason="error",model_name="smol"\} [1-9]', m), m

    asyncio.run(main())
    wait_idle(engine)
    # the real server still serves
    assert client.completions.create(model=NAME, prompt=PROMPT, max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("extreme", [{"temperature": 1e-300}, {"repetition_penalty": 5e-324, "temperature": 1.0},
                                     {"presence_penalty": 2.0, "temperature": 1e-45}])
def test_extreme_sampling_values_are_not_500_and_spare_other_requests(server, engine, extreme):
    """Valid-but-extreme values (found by the schemathesis fuzz test) must not become a
    500, nor fail the other requests running in the same engine step."""
    wait_idle(engine)
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        body = {"model": NAME, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as innocent:
            lines = innocent.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # it is running
            r = c.post("/v1/completions", json={"model": NAME, "prompt": PROMPT + " Paris", "max_tokens": 4,
                                                **extreme})
            status = r.status_code
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert rest and "error" not in rest[-1], f"the other request failed too: {rest[-1]}"
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert status in (200, 400), r.text


def test_token_bytes_exact_for_partial_characters(engine):
    srv = create_app(engine).state.server
    text = "🙂 héllo, 世界"
    ids = engine.engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some token holds part of a character
    assert b"".join(bytes(srv.token_bytes(i)) for i in ids) == text.encode("utf-8")


# --------------------------------------------------------------------------- configuration helpers

@pytest.mark.parametrize("text,value", [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                        ("1000", 1000), ("4kib", 4096)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "1.5B", "2 gigs", "0", "1e9", "nan"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("key", ["", "has space", "tab\t", "ünï"])
def test_api_key_validation(key):
    with pytest.raises(ValueError):
        check_api_key(key, "MEMRA_API_KEY")
    assert check_api_key("sk-abc_123", "MEMRA_API_KEY") == "sk-abc_123"


def test_cli_serve_arguments(monkeypatch, capsys):
    from memra.cli import build_parser, main

    a = build_parser().parse_args(["serve", "--kv-cache-memory", "1.5GB", "--max-queue", "8", "--no-prefix-caching"])
    assert a.kv_cache_memory == 1_500_000_000 and a.max_queue == 8 and a.no_prefix_caching
    assert a.host == "127.0.0.1" and a.port == 8000 and a.api_key is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-blocks", "10", "--kv-cache-memory", "1GiB"])
    capsys.readouterr()
    # configuration errors are reported before the model is loaded
    monkeypatch.setenv("MEMRA_API_KEY", "two words")
    assert main(["serve"]) == 2
    assert "MEMRA_API_KEY" in capsys.readouterr().err
    monkeypatch.delenv("MEMRA_API_KEY")
    assert main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


# --------------------------------------------------------------------------- found by adversarial testing
def _raw(http, path, text: str) -> httpx.Response:
    """POST a JSON body given as text (lone surrogates stay \\ud800 escapes, as a client may send them)."""
    return http.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def test_lone_surrogates_are_400_not_500(http):
    r = _raw(http, "/v1/completions", '{"model": "%s", "prompt": "\\ud800x", "max_tokens": 2}' % NAME)
    assert r.status_code == 400 and _error(r)["param"] == "prompt"
    r = _raw(http, "/v1/chat/completions",
             '{"model": "%s", "messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}' % NAME)
    assert r.status_code == 400 and _error(r)["param"] == "messages"
    r = _raw(http, "/tokenize", '{"prompt": "\\ud800"}')
    assert r.status_code == 400 and _error(r)["param"] == "prompt"
    r = _raw(http, "/v1/completions", '{"model": "\\ud800", "prompt": "x", "max_tokens": 2}')
    assert r.status_code == 404 and "\\ud800" in r.text  # the name is quoted, escaped
    r = _raw(http, "/v1/completions", '{"model": "%s", "prompt": "x", "max_tokens": "\\ud800"}' % NAME)
    assert r.status_code == 400 and _error(r)["param"] == "max_tokens"


def test_batch_larger_than_the_queue_is_400_not_429(client):
    with pytest.raises(openai.BadRequestError, match="max-queue"):
        client.completions.create(model=NAME, prompt=["a"] * (MAX_QUEUE + 1), max_tokens=1)


def test_health_is_503_when_the_engine_loop_stopped(engine):
    class Stopped:  # the real engine, seen as stopped
        is_running = False

        def __getattr__(self, name):
            return getattr(engine, name)

    app = create_app(Stopped(), served_model_name=NAME)

    async def probe():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/health")

    r = asyncio.run(probe())
    assert r.status_code == 503 and _error(r)["code"] == "engine_stopped"
    assert engine.is_running
