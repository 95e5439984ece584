"""The server under load (acceptance of the serving issue), with the official async ``openai`` client.

- 64 concurrent streaming requests with random prompt and output lengths, 16 of them
  cancelled by the client mid-stream: every other one completes with exactly the greedy
  tokens it gets when run alone, the server stays up, and afterwards no KV block is held
  and no request is left in any queue.
- 10 chat requests sharing a 200-token system prompt: the prefill tokens computed drop by
  what the prefix cache served, as ``/metrics`` shows.
"""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import openai
import pytest
from test_server import ServerThread, wait_idle

from memra.engine.async_engine import AsyncLLMEngine
from memra.engine.engine import EngineConfig, LLMEngine
from memra.server import create_app


@pytest.fixture(scope="module")
def server():
    # 16 running at most (the other 48 queue) in a pool of 640 tokens
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model="smollm2-135m", max_model_len=256, max_num_seqs=16,
                                                max_num_batched_tokens=256, kv_cache_blocks=40)))
    eng.start()
    srv = ServerThread(create_app(eng, served_model_name="smol"))
    yield srv, eng
    srv.stop()
    eng.shutdown()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
            found = True
    assert found, f"{name} {labels} not in /metrics"
    return total


def test_64_streams_16_cancelled(server):
    srv, eng = server
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
    rng = random.Random(11)
    jobs = [([rng.randrange(1000, 20000) for _ in range(rng.randint(4, 64))], rng.randint(2, 12), i % 4 == 1)
            for i in range(64)]

    async def one(prompt, max_tokens, cancel):
        stream = await client.completions.create(model="smol", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, finish, usage, chunks = "", None, None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
                chunks += 1
            if cancel and chunks >= 1:
                await stream.close()
                return None
        return text, finish, usage

    async def run():
        return await asyncio.gather(*[one(*j) for j in jobs])

    results = asyncio.run(run())
    stats = wait_idle(eng, timeout=60)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert httpx.get(srv.url + "/health").status_code == 200
    # the cancelled ones were aborted in the engine, not run to the end
    assert stats.num_aborted >= 16 - 2  # a tiny request may finish before its cancel lands
    # every other one finished with its alone output
    sync = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
    for (prompt, max_tokens, cancel), res in zip(jobs, results):
        if cancel:
            assert res is None
            continue
        text, finish, usage = res
        assert finish == "length" and usage.completion_tokens == max_tokens and usage.prompt_tokens == len(prompt)
        alone = sync.completions.create(model="smol", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert text == alone.choices[0].text
    assert wait_idle(eng).kv_blocks_used == 0


def test_prefix_cache_visible_in_metrics(server):
    srv, eng = server
    eng.engine.kv.reset_prefix_cache()
    sync = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
    tok = eng.engine.tokenizer
    system = tok.decode(tok.encode("You are a terse assistant who answers with one word. " * 30,
                                   add_special_tokens=False)[:200])

    def counters():
        t = httpx.get(srv.url + "/metrics").text
        return metric(t, "memra:prompt_tokens_total"), metric(t, "memra:prompt_tokens_computed_total"), \
            metric(t, "memra:prefix_cache_hits_total")

    p0, c0, h0 = counters()
    cached = []
    for i in range(10):
        r = sync.chat.completions.create(model="smol", max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": f"What is {i} + {i}?"}])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    p1, c1, h1 = counters()
    prompt_tokens = p1 - p0
    assert prompt_tokens > 10 * 200
    assert cached[0] == 0 and all(c >= 192 for c in cached[1:])  # the system prompt's full 16-token blocks
    assert h1 - h0 == sum(cached)
    assert c1 - c0 == prompt_tokens - sum(cached)  # prefill skipped exactly what the cache served
