"""The serving engine: paged KV cache, block pools, scheduler, chunked prefill, prefix caching, preemption.

Numerical checks compare the engine (paged cache, several sequences per step, prefill in
chunks, sliding-window blocks released) against the plain single-sequence path
(``ContiguousKVCache``, whole prompt at once) on random tiny models, through prompt
logprobs (every prompt position's logits) and greedy outputs.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import VOCAB, tiny_gguf

from memra.engine.block_manager import (
    NULL_BLOCK,
    KVCacheManager,
    KVCapacityError,
    KVGroupSpec,
    kv_groups,
    plan_kv_blocks,
)
from memra.engine.engine import EngineConfig, LLMEngine
from memra.engine.kv_cache import ContiguousKVCache
from memra.engine.request import Request
from memra.engine.sampling import SamplingParams
from memra.io.synthetic import build_model, gguf_tokenizer_metadata, load_geometry, model_config
from memra.io.tokenizer import Tokenizer
from memra.models import load_gguf_model


# ----------------------------------------------------------------- helpers
def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, prompt_logprobs=None):
    """Submit every prompt at once, step to the end; returns per request (token ids, prompt logprobs)."""
    out = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, prompt_logprobs=prompt_logprobs)
        out[str(i)] = [[], None]
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.prompt_logprobs is not None:
                out[ev.request_id][1] = ev.prompt_logprobs
            for d in ev.deltas:
                out[ev.request_id][0].extend(d.token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits of every position, whole sequence at once through ContiguousKVCache."""
    with torch.no_grad():
        h = model(torch.tensor(ids), torch.arange(len(ids)), ContiguousKVCache(model.config, len(ids)))
        return torch.log_softmax(model.logits(h), -1)


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    kv = ContiguousKVCache(model.config, len(ids) + n)
    out, cur, pos = [], list(ids), 0
    with torch.no_grad():
        for _ in range(n):
            h = model(torch.tensor(cur), torch.arange(pos, pos + len(cur)), kv)
            kv.advance(len(cur))
            pos += len(cur)
            cur = [int(model.logits(h[-1]).argmax())]
            out.append(cur[0])
    return out


def check_prompt_logprobs(got, ref: torch.Tensor, ids: list[int], tol: float = 1e-4) -> float:
    assert got[0] is None and len(got) == len(ids)
    worst = 0.0
    for p in range(1, len(ids)):
        lp, _ = got[p]
        worst = max(worst, abs(lp - float(ref[p - 1, ids[p]])))
    assert worst < tol, f"prompt logprob differs from the reference by {worst}"
    return worst


@pytest.fixture(scope="module")
def gemma_tiny(tmp_path_factory):
    """Tiny random Gemma 3 (window 5: 5 sliding layers + 1 full per 6) with its toy tokenizer."""
    path = tiny_gguf(tmp_path_factory.mktemp("g") / "gemma3.gguf", "gemma3", layers=7)
    model, ckpt = load_gguf_model(path)
    return model, Tokenizer.from_gguf_metadata(ckpt.metadata)


@pytest.fixture(scope="module")
def step_tiny():
    """Tiny synthetic Step-3.5 (full layers with 4 query heads, sliding window 8 with 8) + a toy tokenizer."""
    model = build_model("tiny", seed=3)
    return model, Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(model.config.vocab_size))


def make_engine(model_tok, **kw) -> LLMEngine:
    model, tok = model_tok
    return LLMEngine(EngineConfig(**kw), model=model, tokenizer=tok)


def rand_prompts(seed: int, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ------------------------------------------------------------ block manager
def test_kv_groups_of_the_flagship_split_full_and_sliding():
    groups = kv_groups(model_config(load_geometry("full")))
    assert [(len(g.layers), g.window, g.num_kv_heads, g.head_dim) for g in groups] == [(12, None, 8, 128),
                                                                                         (33, 512, 8, 128)]
    # 64 sequences at 32k context, 4096-token steps, bf16: the sliding group holds only the windows
    blocks = plan_kv_blocks(groups, 16, torch.bfloat16, memory_bytes=40 << 30, max_num_seqs=64,
                            max_num_batched_tokens=4096, max_model_len=32768)
    per_block = [g.block_bytes(16, torch.bfloat16) for g in groups]
    assert blocks[1] == 64 * (32 + 2) + 256 < blocks[0]  # ceil(511 / 16) + 2 blocks per sequence + one step
    assert sum(b * s for b, s in zip(blocks, per_block)) <= 40 << 30
    # one pool for all 45 layers (no groups) would hold 45/12 as much per block of full context:
    naive_tokens = (40 << 30) // (per_block[0] // 12 * 45) * 16
    assert blocks[0] * 16 > 3 * naive_tokens


def test_plan_errors_name_the_shortfall():
    groups = [KVGroupSpec((0, 1), None, 2, 16)]
    with pytest.raises(ValueError, match="too small.*needs 8"):
        plan_kv_blocks(groups, 16, torch.float32, num_blocks=4, max_num_seqs=4, max_num_batched_tokens=64,
                       max_model_len=128)
    with pytest.raises(ValueError, match="exactly one"):
        plan_kv_blocks(groups, 16, torch.float32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    m = KVCacheManager(groups, [8], 16)
    with pytest.raises(KVCapacityError, match="needs 9 KV-cache blocks.*8 blocks"):
        m.check_fits(129, 64)


def _req(ids, n_out=0):
    params = SamplingParams(max_tokens=8)

    class Proc:  # the manager only reads the request's tokens
        class out:
            token_ids = list(range(n_out))

    return Request("r", ids, params, sampler=None, processor=Proc)


def test_prefix_hits_share_blocks_and_sliding_groups_release_out_of_window_blocks():
    groups = [KVGroupSpec((0,), None, 1, 4), KVGroupSpec((1,), 6, 1, 4)]
    m = KVCacheManager(groups, [16, 16], block_size=4)
    a = _req(list(range(100, 122)))  # 22 tokens: 5 full blocks
    assert m.find_prefix(a)[0] == 0
    assert m.allocate(a, 22, m.find_prefix(a))
    assert [len(t) for t in a.block_tables] == [6, 6]
    a.num_computed_tokens = 22
    m.cache_computed(a)
    # next query at position 22 sees keys 17..22: sliding blocks 0..3 (tokens 0..15) are released
    assert m.allocate(a, 1)
    assert a.block_tables[1][:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in a.block_tables[0]
    assert m.pools[1].num_used == 2 and m.pools[0].num_used == 6
    # a second request with the same first 21 tokens reuses 5 blocks in the full group and the
    # window blocks (4 = tokens 16..19, and 3 = 12..15 for the query at 20) in the sliding group
    b = _req(list(range(100, 121)) + [7, 8, 9])
    n, tables = m.find_prefix(b)
    assert n == 20
    assert tables[0] == a.block_tables[0][:5]
    assert tables[1][:3] == [NULL_BLOCK] * 3 and tables[1][4] == a.block_tables[1][4]
    assert tables[1][3] != NULL_BLOCK  # block 3 was released by a but is still cached
    used = m.pools[0].num_used
    assert m.allocate(b, 4, (n, tables))
    assert b.num_computed_tokens == 20 and m.pools[0].num_used == used + 1  # shares 5, adds 1
    m.free(a)
    m.free(b)
    assert m.num_used_blocks == 0
    # freed blocks stay cached until reused
    c = _req(list(range(100, 121)))
    assert m.find_prefix(c)[0] == 20


def test_allocation_failure_changes_nothing():
    groups = [KVGroupSpec((0,), None, 1, 4)]
    m = KVCacheManager(groups, [4], block_size=4)
    a, b = _req(list(range(12))), _req(list(range(50, 62)))
    assert m.allocate(a, 12)
    assert not m.allocate(b, 12)
    assert b.block_tables == [[]] and m.pools[0].num_used == 3


# ------------------------------------------------------ engine vs reference
@pytest.mark.parametrize("which", ["gemma", "step"])
def test_chunked_paged_prefill_matches_whole_sequence(which, gemma_tiny, step_tiny):
    """Prompt logprobs of 6 concurrent prompts (longer than the window), prefilled in chunks of 7
    tokens per step over 4-token blocks with out-of-window blocks released, equal the whole-sequence ones."""
    mt = gemma_tiny if which == "gemma" else step_tiny
    model = mt[0]
    eng = make_engine(mt, block_size=4, max_num_batched_tokens=7, kv_cache_blocks=64, max_model_len=64)
    assert len(eng.kv.groups) == 2
    prompts = rand_prompts(1, 6, 9, 30, model.config.vocab_size)
    got = run_all(eng, prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), prompt_logprobs=2)
    for p, (toks, plp) in zip(prompts, got):
        check_prompt_logprobs(plp, reference_logprobs(model, p), p)
        assert toks == reference_greedy(model, p, 3)
    assert eng.kv.num_used_blocks == 0


def test_greedy_concurrent_equals_alone_with_preemption(step_tiny):
    """A pool too small for the load: requests are preempted and recomputed, outputs unchanged."""
    model = step_tiny[0]
    prompts = rand_prompts(2, 6, 5, 20, model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng = make_engine(step_tiny, block_size=4, max_num_batched_tokens=32, kv_cache_blocks=9, max_model_len=32,
                      max_num_seqs=6)
    got = [t for t, _ in run_all(eng, prompts, params)]
    assert eng.stats().num_preemptions > 0
    assert eng.kv.num_used_blocks == 0 and not eng.scheduler.running and not eng.scheduler.waiting
    for p, t in zip(prompts, got):
        assert t == reference_greedy(model, p, 8)


def test_sampled_outputs_survive_preemption(gemma_tiny):
    """Seeded sampling with penalties gives the same tokens with and without preemption."""
    prompts = rand_prompts(3, 8, 4, 12, VOCAB)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=5, ignore_eos=True,
                            repetition_penalty=1.3, presence_penalty=0.5)
    roomy = make_engine(gemma_tiny, block_size=4, kv_cache_blocks=128, max_model_len=32)
    tight = make_engine(gemma_tiny, block_size=4, kv_cache_blocks=8, max_model_len=32, max_num_batched_tokens=16)
    a = [t for t, _ in run_all(roomy, prompts, params)]
    b = [t for t, _ in run_all(tight, prompts, params)]
    assert tight.stats().num_preemptions > 0 and roomy.stats().num_preemptions == 0
    assert a == b


def test_decodes_are_not_stalled_by_a_long_prefill(gemma_tiny):
    """While a long prompt is prefilled chunk by chunk, every running decode gets a token each step."""
    eng = make_engine(gemma_tiny, block_size=4, kv_cache_blocks=128, max_model_len=128, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng.add_request("short", [5, 6, 7], params)
    eng.step()  # prefill of the short request
    eng.add_request("long", list(range(3, 83)), params)  # 80 tokens: 10+ chunks of <= 7
    steps = 0
    while "long" in eng.request_ids() and eng.scheduler.running[-1].num_computed_tokens < 80 and steps < 30:
        evs = {e.request_id: e for e in eng.step()}
        steps += 1
        assert "short" in evs or "short" not in eng.request_ids()
    assert steps >= 10


def test_abort_frees_blocks_and_queues(gemma_tiny):
    eng = make_engine(gemma_tiny, block_size=4, kv_cache_blocks=64, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(5):
        eng.add_request(f"r{i}", [3 + i] * 10, params)
    eng.step()
    eng.step()
    assert eng.kv.num_used_blocks > 0
    for i in range(5):
        assert eng.abort_request(f"r{i}")
    assert not eng.abort_request("r0")  # already gone
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished()
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_startup_phases_are_timed_and_summarised(gemma_tiny):
    """The engine times its start-up phases (weights, ..., other) and the summary line adds up to
    the whole start-up (``load_seconds``)."""
    eng = make_engine(gemma_tiny, block_size=4, max_model_len=64)
    ph = eng.startup_seconds
    assert list(ph)[0] == "weights" and list(ph)[-1] == "other" and all(v >= 0 for v in ph.values())
    assert sum(ph.values()) == pytest.approx(eng.load_seconds, abs=1e-6)
    assert f"start-up: {eng.load_seconds:.1f} s" in eng.kv_cache_summary()


def test_an_engine_from_a_file_times_weights_and_tokenizer_apart(tmp_path):
    """An engine that reads its model from a GGUF file: the weights' phase, then the tokenizer's,
    first in its start-up phases (engine._load), and the phases still add up to the start-up."""
    path = tiny_gguf(tmp_path / "gemma3.gguf", "gemma3", layers=2)
    eng = LLMEngine(EngineConfig(model=str(path), block_size=4, max_model_len=64))
    ph = eng.startup_seconds
    assert list(ph)[:2] == ["weights", "tokenizer"] and ph["weights"] > 0 and ph["tokenizer"] > 0
    assert sum(ph.values()) == pytest.approx(eng.load_seconds, abs=1e-6)


def test_the_precompile_key_names_the_file_the_config_and_the_gpu(tmp_path, monkeypatch, gemma_tiny):
    """LLMEngine._precompile_key (the start-up precompile's manifest key): the same for the same
    file, config and GPU; another when the file changes, the config differs or the GPU does; None
    when the file is gone or the model came in as an object."""
    import os
    import types

    path = tiny_gguf(tmp_path / "gemma3.gguf", "gemma3", layers=2)
    eng = LLMEngine(EngineConfig(model=str(path), block_size=4, max_model_len=64))
    gpu = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", multi_processor_count=132, total_memory=80 << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: gpu)
    dev = torch.device("cuda")
    key = eng._precompile_key(dev)
    assert key is not None and key == eng._precompile_key(dev) and str(path.resolve()) in key
    other = LLMEngine(EngineConfig(model=str(path), block_size=4, max_model_len=32))
    assert other._precompile_key(dev) != key
    gpu.name = "NVIDIA H200"
    assert eng._precompile_key(dev) != key
    gpu.name = "NVIDIA H100 80GB HBM3"
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert eng._precompile_key(dev) not in (key, None)
    path.unlink()
    assert eng._precompile_key(dev) is None
    assert make_engine(gemma_tiny, block_size=4, max_model_len=64)._precompile_key(dev) is None


def test_n_completions_share_the_prompt_and_differ(gemma_tiny):
    eng = make_engine(gemma_tiny, block_size=4, kv_cache_blocks=64, max_model_len=64)
    eng.add_request("x", list(range(3, 20)), SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8,
                                                            ignore_eos=True))
    outs = {0: [], 1: [], 2: []}
    finished = False
    while eng.has_unfinished():
        for ev in eng.step():
            finished |= ev.finished
            for d in ev.deltas:
                outs[d.index].extend(d.token_ids)
    assert finished and all(len(v) == 8 for v in outs.values())
    assert len({tuple(v) for v in outs.values()}) > 1


def test_validation_errors(gemma_tiny):
    eng = make_engine(gemma_tiny, block_size=4, kv_cache_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="context length 64"):
        eng.add_request("a", [3] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("a", [3, VOCAB], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.add_request("a", [3], SamplingParams(max_tokens=5, stop_token_ids=[VOCAB + 1]))
    eng.add_request("a", [3], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", [3], SamplingParams(max_tokens=5))


# ------------------------------------------------------ real model (smollm2)
@pytest.fixture(scope="module")
def smol():
    return LLMEngine(EngineConfig(max_model_len=1024, kv_cache_blocks=400, max_num_seqs=32,
                                  max_num_batched_tokens=256))


def test_32_concurrent_greedy_equal_one_at_a_time(smol):
    """Acceptance: greedy outputs of 32 concurrent requests of mixed lengths equal the same requests alone."""
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
             "List of prime numbers: 2, 3, 5,", "The quick brown fox", "import numpy as np\n",
             "In 1492, Columbus", "Water boils at"]
    rng = random.Random(4)
    prompts = []
    for i in range(32):
        base = smol.tokenizer.encode(texts[i % len(texts)])
        extra = [rng.randrange(1000, 20000) for _ in range(rng.choice([0, 3, 40, 120]))]
        prompts.append(extra + base)
    lens = [rng.randint(3, 10) for _ in prompts]
    together = {}
    for i, (p, n) in enumerate(zip(prompts, lens)):
        smol.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        together[str(i)] = []
    while smol.has_unfinished():
        for ev in smol.step():
            for d in ev.deltas:
                together[ev.request_id].extend(d.token_ids)
    smol.kv.reset_prefix_cache()
    for i, (p, n) in enumerate(zip(prompts, lens)):
        alone = run_all(smol, [p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0][0]
        assert together[str(i)] == alone, f"request {i} differs"
    assert smol.kv.num_used_blocks == 0


def test_prefix_cache_skips_the_shared_system_prompt(smol):
    """Acceptance: 10 requests sharing a 200-token system prompt prefill it once."""
    smol.kv.reset_prefix_cache()
    system = smol.tokenizer.encode("You are a helpful assistant. " * 40)[:200]
    users = [smol.tokenizer.encode(f" Question {i}: what is {i} plus {i}?") for i in range(10)]
    s0 = smol.stats()
    first = run_all(smol, [system + users[0]], SamplingParams(temperature=0, max_tokens=4))
    s1 = smol.stats()
    rest = run_all(smol, [system + u for u in users[1:]], SamplingParams(temperature=0, max_tokens=4))
    s2 = smol.stats()
    cached = 192  # 12 full blocks of 16 tokens of the 200-token prefix
    assert s1.num_prompt_tokens_computed - s0.num_prompt_tokens_computed == 200 + len(users[0])
    assert s2.num_prompt_tokens_computed - s1.num_prompt_tokens_computed == sum(200 + len(u) - cached
                                                                                for u in users[1:])
    assert s2.prefix_cache_hits - s1.prefix_cache_hits == 9 * cached
    # and the answers are those computed without the cache
    smol.kv.reset_prefix_cache()
    again = run_all(smol, [system + u for u in users[1:]], SamplingParams(temperature=0, max_tokens=4))
    assert [t for t, _ in rest] == [t for t, _ in again]
    assert first[0][0]


def test_preemption_on_the_real_model_keeps_greedy_outputs(smol):
    """Acceptance: a KV pool too small for the offered load; every request completes with its alone output."""
    tight = LLMEngine(EngineConfig(max_model_len=128, kv_cache_blocks=12, max_num_seqs=8, max_num_batched_tokens=64),
                      model=smol.model, tokenizer=smol.tokenizer)
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 20000) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = [t for t, _ in run_all(tight, prompts, params)]
    assert tight.stats().num_preemptions > 0
    assert tight.kv.num_used_blocks == 0 and not tight.has_unfinished()
    smol.kv.reset_prefix_cache()
    for p, t in zip(prompts, together):
        assert t == run_all(smol, [p], params)[0][0]


def test_a_failing_request_does_not_take_the_batch_down(gemma_tiny):
    eng = make_engine(gemma_tiny, block_size=4, kv_cache_blocks=64, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng.add_request("bad", [3, 4, 5], params)
    eng.add_request("good", [6, 7, 8], params)
    bad = next(r for r in eng.scheduler.waiting if r.request_id == "bad")

    def boom(logits):
        raise ValueError("sampler exploded")

    bad.sampler.sample = boom
    got, failures = [], []
    while eng.has_unfinished():
        for ev in eng.step():
            assert ev.request_id == "good"
            got.extend(t for d in ev.deltas for t in d.token_ids)
        failures += eng.pop_failures()
    assert [(rid, str(e)) for rid, e in failures] == [("bad", "sampler exploded")]
    assert got == reference_greedy(gemma_tiny[0], [6, 7, 8], 6)
    assert eng.kv.num_used_blocks == 0


def test_n_sequences_prefill_the_prompt_once(gemma_tiny):
    """n = 4 on a 40-token prompt: the prompt is computed once (plus the partial last block per
    extra sequence), the cache lookup is counted once, and usage's cached count is the first sequence's."""
    eng = make_engine(gemma_tiny, block_size=4, kv_cache_blocks=128, max_model_len=64, max_num_batched_tokens=512)
    prompt = rand_prompts(9, 1, 41, 41, VOCAB)[0]  # 10 full blocks + 1 token
    eng.add_request("x", prompt, SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=5, ignore_eos=True))
    cached = None
    while eng.has_unfinished():
        for ev in eng.step():
            cached = ev.num_cached_tokens
    s = eng.stats()
    assert s.num_prompt_tokens_computed == 41 + 3 * 1  # siblings reuse the 40 tokens of full blocks
    assert s.prefix_cache_queries == 41 and cached == 0
