"""The asyncio front end: request-id reuse after an abort, shutdown, queue bound, abort by id."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import tiny_gguf

from memra.engine.async_engine import AsyncLLMEngine, QueueFullError
from memra.engine.engine import EngineConfig, LLMEngine
from memra.engine.sampling import SamplingParams
from memra.io.tokenizer import Tokenizer
from memra.models import load_gguf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_gguf(tmp_path_factory.mktemp("a") / "llama.gguf", "llama")
    model, ckpt = load_gguf_model(path)
    return model, Tokenizer.from_gguf_metadata(ckpt.metadata)


def make(tiny) -> AsyncLLMEngine:
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(block_size=4, kv_cache_blocks=64, max_model_len=128),
                                   model=tiny[0], tokenizer=tiny[1]))
    eng.start()
    return eng


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def collect(agen):
    toks = []
    async for ev in agen:
        toks += [t for d in ev.deltas for t in d.token_ids]
    return toks


def test_reused_id_after_abort_gets_only_its_own_tokens(tiny):
    eng = make(tiny)

    async def run():
        alone = await collect(eng.generate([9, 9, 9, 9], greedy(3), "ref"))
        for _ in range(5):
            old = eng.generate([5, 6, 7], greedy(50), "same")
            await old.__anext__()
            await old.aclose()  # the abort is only queued when the id is reused
            assert await collect(eng.generate([9, 9, 9, 9], greedy(3), "same")) == alone

    try:
        asyncio.run(run())
    finally:
        eng.shutdown()


def test_shutdown_ends_waiting_consumers_and_refuses_new_requests(tiny):
    eng = make(tiny)

    async def run():
        agen = eng.generate([5, 6, 7], greedy(100), "long")
        await agen.__anext__()
        assert eng.is_running
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        assert not eng.is_running
        with pytest.raises(RuntimeError, match="shut down"):
            await asyncio.wait_for(collect(agen), 10)
        with pytest.raises(RuntimeError, match="shut down"):
            await eng.generate([5], greedy(2), "late").__anext__()

    asyncio.run(run())
    assert eng.engine.kv.num_used_blocks == 0


def test_queue_bound_and_abort_by_id(tiny):
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(block_size=4, kv_cache_blocks=64, max_model_len=128, max_num_seqs=1),
                                   model=tiny[0], tokenizer=tiny[1]), max_queue=1)
    eng.start()

    async def run():
        a = eng.generate([5, 6], greedy(100), "a")
        await a.__anext__()  # a runs; the only sequence slot is taken
        b = eng.generate([7, 8], greedy(100), "b")
        task = asyncio.ensure_future(b.__anext__())
        await asyncio.sleep(0)
        assert eng.stats().num_waiting + eng._pending == 1  # b fills the queue of 1
        with pytest.raises(QueueFullError, match="1 requests waiting"):
            await eng.generate([3], greedy(1), "c").__anext__()
        eng.abort("a")
        eng.abort("b")
        await asyncio.sleep(0.5)
        assert not task.done()  # an aborted consumer gets no more events
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):
            if eng.stats().kv_blocks_used == 0 and not eng.engine.has_unfinished():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"blocks still held: {eng.stats()}")

    try:
        asyncio.run(run())
    finally:
        eng.shutdown()
