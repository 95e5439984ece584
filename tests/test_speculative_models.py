"""Model-based speculation (memra/engine/speculative.py): the MTP proposer's incremental, paged,
chained drafting equals a full recompute of ``Step35ForCausalLM.draft`` at every round (random
acceptance, chunked prefill, restarts, sliding-window block release); greedy output identical
with speculation on and off for MTP K = 1, 2, 3 on the tiny Step model, and for the draft-model
proposer (smollm2-135m drafting for itself, and qwen2.5-coder-0.5b for 1.5b); stop strings,
max_tokens, n = 2, prefix-cache hits and preemption inside speculation."""

from __future__ import annotations

import random

import pytest
import torch
from step35_tiny import VOCAB, make_tensors, write_llm_dir

from memra import LLM, SamplingParams
from memra.engine.engine import EngineConfig, LLMEngine
from memra.engine.kv_cache import ContiguousKVCache
from memra.engine.speculative import MTPProposer
from memra.models import load_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_llm_dir(tmp_path_factory.mktemp("tiny_step"), make_tensors(3), dtype=torch.float32)


class _Seq:
    """The part of a Request the MTP proposer reads."""

    def __init__(self, tokens: list[int]):
        self.all_token_ids = tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
@pytest.mark.parametrize("K", [1, 2, 3])
def test_mtp_proposer_equals_full_recompute(tiny_dir, K, padded):
    """Drive the proposer as the engine does, with random acceptance, and compare every round's
    draft logits with ``draft()`` recomputed over the whole context (no cache) from the same base.
    ``padded``: steady-state rounds take the padded-row layout that the GPU captures in CUDA graphs
    (here run eagerly, the attention through the decode kernels' torch twins)."""
    model, _ = load_model(tiny_dir, torch.float32)
    rng = random.Random(K)
    L = 190
    T = [rng.randrange(3, VOCAB) for _ in range(L)]
    with torch.no_grad():
        h_ref = model(torch.tensor(T), torch.arange(L), ContiguousKVCache(model.config, L), prenorm=True)
    rec: list = []
    prop = MTPProposer(model, K, block_size=4, max_num_seqs=2, max_model_len=256, max_num_batched_tokens=16,
                       device=torch.device("cpu"), record=rec, graphs=padded)
    P, D = 37, model.config.hidden_size
    req = _Seq(T[:P])
    compared = restarts = 0
    # chunked prefill: rows of each chunk; the last chunk's step also samples token P
    for s in range(0, P, 16):
        e = min(P, s + 16)
        req.all_token_ids = T[:P + (e == P)]
        out = prop.draft([req], {id(req): K} if e == P else {}, {id(req): (s, h_ref[s:e])})
    base = 0
    drafted = out[id(req)]
    while req.num_tokens < L - K - 2:
        N = req.num_tokens
        if rng.random() < 0.08:  # drafting stepped aside for a few steps: the state restarts later
            req.all_token_ids = T[:N + rng.randrange(1, 5)]
            drafted = []
            restarts += 1
            continue
        first = N - 1
        acc = rng.randrange(0, len(drafted) + 1)
        junk = torch.randn(len(drafted) - acc, D)  # rejected drafts' rows: must be ignored
        rows = torch.cat([h_ref[first:first + acc + 1], junk])
        req.all_token_ids = T[:N + acc + 1]
        if prop.states.get(id(req)) is None or prop.states[id(req)].done[0] != first:
            base = first
        room = rng.randrange(0, K + 1)
        rec.clear()
        out = prop.draft([req], {id(req): room} if room else {}, {id(req): (first, rows)})
        drafted = out[id(req)]
        assert len(drafted) == room
        if not room:
            continue
        N = req.num_tokens
        want, want_logits = model.draft(h_ref[base:N - 1], torch.tensor(T[base + 1:N]), room,
                                        positions=torch.arange(base, N - 1), return_logits=True)
        got_base, got_logits = rec[0][id(req)]
        assert got_base == base
        assert drafted == want.tolist(), (N, base)
        assert torch.allclose(got_logits, want_logits, atol=2e-4, rtol=1e-4), \
            (got_logits - want_logits).abs().max()
        compared += 1
    assert compared > 30 and restarts > 0
    assert prop.num_eager_layers > 0  # the chunked prefill's rounds and restarts
    assert (prop.num_graph_layers > compared) == padded, (prop.num_graph_layers, compared)
    pool = prop.cache.manager
    assert 0 < pool.num_used_blocks <= 2 * (8 // 4 + 16 // 4 + 3)  # sliding window: old blocks released
    prop.release(set())
    assert pool.num_used_blocks == 0 and not prop.states


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mtp_padded_rows_equal_packed_over_a_batch(tiny_dir, device):
    """Several requests at once, with different acceptances, rooms and restarts: the padded-row
    layout (each request's rows in its own slot, the head on each slot's last row) drafts what the
    packed layout drafts, round by round, with the same logits (each MTP step reads its own row).
    On the GPU (fp32 weights and activations) the padded rows replay CUDA graphs and the packed ones
    run eagerly through the prefill attention kernel: logits agree to 1e-3."""
    model, _ = load_model(tiny_dir, torch.float32)
    if device == "cuda":
        model.to_gpu("cuda", torch.float32)
    K, L, B = 3, 120, 3
    tol = dict(atol=2e-4, rtol=1e-4) if device == "cpu" else dict(atol=1e-3, rtol=1e-3)
    rng = random.Random(5)
    T = [[rng.randrange(3, VOCAB) for _ in range(L)] for _ in range(B)]
    with torch.no_grad():
        H = [model(torch.tensor(t, device=device), torch.arange(L, device=device),
                   ContiguousKVCache(model.config, L, device=device), prenorm=True) for t in T]
    recs, props = ([], []), []
    for padded, rec in zip((False, True), recs):
        props.append(MTPProposer(model, K, block_size=4, max_num_seqs=B, max_model_len=256,
                                 max_num_batched_tokens=32, device=torch.device(device), record=rec, graphs=padded))
    # and one packed proposer per request alone: in a batch each MTP step must read its own row
    solo = [MTPProposer(model, K, block_size=4, max_num_seqs=1, max_model_len=256, max_num_batched_tokens=32,
                        device=torch.device(device), graphs=False) for _ in range(B)]
    reqs = [[_Seq(T[b][:20 + 3 * b]) for b in range(B)] for _ in range(len(props) + 1)]
    hidden = {b: (0, H[b][:20 + 3 * b]) for b in range(B)}
    rounds = 0
    while min(r.num_tokens for r in reqs[0]) < L - 2 * K - 2:
        rooms = [rng.randrange(0, K + 1) for _ in range(B)]
        outs = []
        for prop, rs in zip(props, reqs):
            outs.append(prop.draft(rs, {id(r): k for r, k in zip(rs, rooms) if k},
                                   {id(r): hidden[b] for b, r in enumerate(rs) if b in hidden}))
        got = [[o.get(id(r), []) for r in rs] for o, rs in zip(outs, reqs)]
        assert got[0] == got[1], rounds
        alone = []
        for b, (prop, r) in enumerate(zip(solo, reqs[2])):
            alone.append(prop.draft([r], {id(r): rooms[b]} if rooms[b] else {}, {id(r): hidden[b]} if b in hidden else {})
                         .get(id(r), []))
        assert alone == got[0], rounds
        recorded = [[rec[-1].get(id(r)) for r in rs] for rec, rs in zip(recs, reqs)]
        for ra, rb in zip(*recorded):
            assert (ra is None) == (rb is None)
            if ra is not None:
                assert ra[0] == rb[0] and torch.allclose(ra[1], rb[1], **tol), (ra[1] - rb[1]).abs().max()
        rounds += 1
        hidden = {}
        for b in range(B):
            N = reqs[0][b].num_tokens
            if rng.random() < 0.1:  # no rows this step (drafting stepped aside): restarts later
                step = rng.randrange(1, 4)
            else:
                acc = rng.randrange(0, len(got[0][b]) + 1)
                step = acc + 1
                junk = torch.randn(len(got[0][b]) - acc, model.config.hidden_size, device=device)
                hidden[b] = (N - 1, torch.cat([H[b][N - 1:N + acc], junk]))
            for rs in reqs:
                rs[b].all_token_ids = T[b][:N + step]
    assert rounds > 20 and props[1].num_graph_layers > 2 * rounds
    for p in props + solo:
        p.release(set())
        assert p.cache.manager.num_used_blocks == 0


@pytest.mark.parametrize("layout", ["paged_batch", "decode_rows"])
def test_verify_columns_near_the_window_edge_see_exactly_their_window(tiny_dir, layout):
    """A verify step's 1 + k columns straddling the sliding window's edge (window 8, 4-token blocks,
    out-of-window blocks released by the block manager) give the logits of a plain forward over the
    whole sequence at those positions: each column sees exactly its own window. Both attention
    layouts of a verify step: one chunk of the mixed batch (eager, :class:`PagedBatch`) and one
    decode row per column sharing the block table (the CUDA-graph layout, :class:`DecodeKV`, here
    through the kernels' torch twins). Giving every column the last column's context changes them."""
    from memra.engine.block_manager import KVCacheManager, kv_groups
    from memra.engine.cuda_graph import DecodeKV
    from memra.engine.kv_cache import PagedBatch, PagedKVCache, SeqChunk
    from memra.engine.speculative import _Seq as Seq

    model, _ = load_model(tiny_dir, torch.float32)
    cfg, bs, P, n = model.config, 4, 30, 4
    assert any(lc.sliding_window == 8 for lc in cfg.layers)
    rng = random.Random(11)
    T = torch.tensor([rng.randrange(3, VOCAB) for _ in range(P + n)])
    with torch.no_grad():
        want = model.logits(model(T, torch.arange(P + n), ContiguousKVCache(cfg, P + n)))[P:]
    groups = kv_groups(cfg)
    mgr = KVCacheManager(groups, [32] * len(groups), bs, enable_prefix_caching=False)
    cache = PagedKVCache(groups, [33] * len(groups), bs)  # block 32: scratch, never allocated
    seq = Seq()
    with torch.no_grad():
        assert mgr.allocate(seq, P)
        model(T[:P], torch.arange(P), PagedBatch(cache, [SeqChunk(0, P, seq.block_tables)], use_kernels=False))
        seq.num_computed_tokens = P
        assert mgr.allocate(seq, n)
        assert any(t[0] == -1 for t in seq.block_tables)  # the sliding group released its first blocks
        pos = torch.arange(P, P + n)

        def verify(seq_lens):
            if layout == "paged_batch":
                kv = PagedBatch(cache, [SeqChunk(P, n, seq.block_tables)], use_kernels=False)
            else:
                tables = [torch.tensor([t] * n, dtype=torch.int32) for t in seq.block_tables]
                slots = [torch.tensor([t[p // bs] * bs + p % bs for p in pos.tolist()]) for t in seq.block_tables]
                kv = DecodeKV(cache, tables, torch.tensor(seq_lens, dtype=torch.int32), slots)
            return model.logits(model(T[P:], pos, kv))

        got = verify([p + 1 for p in pos.tolist()])
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
        if layout == "decode_rows":  # the check can fail: every column seeing the last one's context
            wrong = verify([P + n] * n)
            assert not torch.allclose(wrong[:-1], want[:-1], atol=1e-2, rtol=1e-2)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = random.Random(seed)
    return [[0] + [g.randrange(3, VOCAB) for _ in range(g.randrange(1, 50))] for _ in range(n)]


def _run(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def tiny_plain(tiny_dir):
    return LLM(str(tiny_dir), max_model_len=256)


@pytest.mark.parametrize("K", [1, 2, 3])
def test_mtp_greedy_identical(tiny_dir, tiny_plain, K):
    spec = LLM(str(tiny_dir), max_model_len=256, speculative_method="mtp", num_speculative_tokens=K,
               speculative_max_batch=32)
    prompts = _prompts(20, K)
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    assert _run(tiny_plain, prompts, greedy) == _run(spec, prompts, greedy)
    e = spec.engine
    assert sum(e.spec_drafted) > 20 * 64 // 2 and len(e.spec_drafted) == K
    # stop string and max_tokens land wherever they land; n = 2; a repeated prompt hits the prefix cache
    out = _run(tiny_plain, [prompts[0]], greedy)[0][0][1].split()
    stop = out[5]
    for params in (SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, stop=[stop]),
                   SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, n=2, logprobs=1)):
        assert _run(tiny_plain, prompts[:4], params) == _run(spec, prompts[:4], params), params
    hits = e.kv.prefix_hits
    assert _run(tiny_plain, prompts[:3], greedy) == _run(spec, prompts[:3], greedy)
    assert e.kv.prefix_hits > hits
    assert spec.engine.proposer.cache.manager.num_used_blocks == 0  # every state released at the end


def test_mtp_under_preemption(tiny_dir, tiny_plain):
    tight = LLM(str(tiny_dir), max_model_len=256, kv_cache_blocks=20, max_num_seqs=8, max_num_batched_tokens=48,
                speculative_method="mtp", num_speculative_tokens=3, enable_prefix_caching=False)
    prompts = _prompts(8, 11)
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    assert _run(tiny_plain, prompts, greedy) == _run(tight, prompts, greedy)
    assert tight.engine.scheduler.num_preemptions > 0
    assert sum(tight.engine.spec_drafted) > 0


def test_mtp_refuses_too_many_drafts(tiny_dir):
    with pytest.raises(ValueError, match="has 3 MTP layer"):
        LLM(str(tiny_dir), max_model_len=64, speculative_method="mtp", num_speculative_tokens=4)


def test_draft_model_config_errors():
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_model="smollm2-135m")


PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "1, 2, 3, 4, 5, 6,",
    "The capital of France is",
    "Write a haiku about the sea.",
    "import numpy as np\nx = np.",
    "Q: What is 7 * 8?\nA:",
    "class Stack:\n    def __init__(self):\n",
    "Monday, Tuesday,",
]


def test_draft_model_self_draft_accepts_and_stays_exact():
    """smollm2-135m drafting for itself: greedy drafts are (nearly) all accepted, which drives the
    accepted-run paths (bonus tokens, draft KV kept across rounds) hard."""
    plain = LLM("smollm2-135m", max_model_len=512, max_num_seqs=8)
    spec = LLM("smollm2-135m", max_model_len=512, max_num_seqs=8, speculative_method="draft",
               speculative_model="smollm2-135m", num_speculative_tokens=4)
    for params, n in ((SamplingParams(max_tokens=40, temperature=0.0), 6),
                      (SamplingParams(max_tokens=32, temperature=0.0, stop=["\n\n"], logprobs=2), 4),
                      (SamplingParams(max_tokens=9, temperature=0.0, n=2), 2)):
        assert _run(plain, PROMPTS[:n], params) == _run(spec, PROMPTS[:n], params), params
    e = spec.engine
    assert sum(e.spec_accepted) > 0.9 * sum(e.spec_drafted) > 150, (e.spec_drafted, e.spec_accepted)
    assert e.proposer.cache.manager.num_used_blocks == 0
    # a prefix-cache hit (the same prompts again) and preemption (a cache too small for the batch)
    hits = e.kv.prefix_hits
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    assert _run(plain, PROMPTS[:4], greedy) == _run(spec, PROMPTS[:4], greedy)
    assert e.kv.prefix_hits > hits
    tight = LLM.from_engine(LLMEngine(
        EngineConfig(max_model_len=128, max_num_seqs=8, kv_cache_blocks=14, max_num_batched_tokens=64,
                     speculative_method="draft", speculative_model="smollm2-135m", num_speculative_tokens=4),
        model=plain.engine.model, tokenizer=plain.tokenizer))
    assert _run(plain, PROMPTS, greedy) == _run(tight, PROMPTS, greedy)
    assert tight.engine.scheduler.num_preemptions > 0 and sum(tight.engine.spec_accepted) > 100


@pytest.mark.slow
def test_draft_model_qwen_0p5b_for_1p5b():
    """The issue's pair: qwen2.5-coder-0.5b drafting for qwen2.5-coder-1.5b over 20 prompts x 64
    tokens, greedy identical to the 1.5b alone (one copy of the 1.5b's weights serves both engines)."""
    from test_speculative import PROMPTS as TWENTY

    plain = LLM("qwen2.5-coder-1.5b", max_model_len=512, max_num_seqs=20)
    spec = LLM.from_engine(LLMEngine(
        EngineConfig(model="qwen2.5-coder-1.5b", max_model_len=512, max_num_seqs=20, speculative_method="draft",
                     speculative_model="qwen2.5-coder-0.5b", num_speculative_tokens=3, speculative_max_batch=20),
        model=plain.engine.model, tokenizer=plain.tokenizer))
    greedy = SamplingParams(max_tokens=64, temperature=0.0)
    assert len(TWENTY) == 20
    assert _run(plain, TWENTY, greedy) == _run(spec, TWENTY, greedy)
    e = spec.engine
    assert sum(e.spec_accepted) > 0.5 * sum(e.spec_drafted) > 300, (e.spec_drafted, e.spec_accepted)
