"""Batch-invariant mode (memra/kernels/batch_invariant.py): the invariant GEMM against its torch
twin and row by row, the switch, the dispatch, and on the GPU the tiny Step model's greedy tokens
at batch 1 and batch 16."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton sources are imported

from memra.kernels import batch_invariant as bi  # noqa: E402

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's tl.dot is wrong for bf16 (../shared/GPU.md): fp16 on the CPU
DT = torch.bfloat16 if DEV == "cuda" else torch.float16


def _rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.rand(shape[-1], generator=g).add(0.2)).to(DT).to(DEV)


@pytest.mark.parametrize("t,n,k", [(1, 96, 200), (5, 64, 64), (17, 130, 96), (40, 96, 200)])
def test_matmul_matches_twin_and_rows_stand_alone(t, n, k):
    """Against the fp32 twin (partial N, T and K tiles), and each row alone, in other subsets and
    in the whole batch: the same bits."""
    x, w = _rand(t, k, seed=t), _rand(n, k, seed=100 + n)
    y = bi.invariant_matmul(x, w)
    ref = bi.invariant_matmul_ref(x, w)
    assert y.shape == (t, n) and y.dtype == x.dtype
    assert float((y.float() - ref.float()).abs().max() / ref.float().abs().max()) < 1e-2
    for rows in ([0], [t - 1], list(range(0, t, 3))):
        assert torch.equal(bi.invariant_matmul(x[rows], w), y[rows]), rows


def test_errors_and_empty():
    w = _rand(32, 64, seed=1)
    with pytest.raises(ValueError, match=r"x \[T, K\] and w \[N, K\]"):
        bi.invariant_matmul(_rand(3, 32, seed=2), w)
    with pytest.raises(ValueError, match="fp16/bf16"):
        bi.invariant_matmul(_rand(3, 64, seed=2), w.float())
    assert bi.invariant_matmul(_rand(3, 64, seed=2)[:0], w).shape == (0, 32)


def test_switch(monkeypatch):
    monkeypatch.delenv("MEMRA_BATCH_INVARIANT", raising=False)
    assert not bi.batch_invariant()
    monkeypatch.setenv("MEMRA_BATCH_INVARIANT", "1")
    assert bi.batch_invariant()
    try:
        bi.set_batch_invariant(False)
        assert not bi.batch_invariant()
    finally:
        bi.set_batch_invariant(None)
    monkeypatch.setenv("MEMRA_BATCH_INVARIANT", "0")
    assert not bi.batch_invariant()
    for on in ("true", "ON", " yes "):
        monkeypatch.setenv("MEMRA_BATCH_INVARIANT", on)
        assert bi.batch_invariant(), on
    for off in ("off", "False", "no", ""):
        monkeypatch.setenv("MEMRA_BATCH_INVARIANT", off)
        assert not bi.batch_invariant(), off
    for bad in ("2", "enabled", "of"):
        monkeypatch.setenv("MEMRA_BATCH_INVARIANT", bad)
        with pytest.raises(ValueError, match=f"MEMRA_BATCH_INVARIANT='{bad}': expected one of"):
            bi.batch_invariant()


def test_dispatch_in_the_mode(monkeypatch):
    """With the mode on, gpu_linear takes invariant_linear for every format and T, and the router
    takes router_logits past its 16-token line; off, neither."""
    import memra.kernels.fused as fused
    from memra.kernels.gemv import pack_bf16
    from memra.kernels.moe_decode import moe_route
    from memra.layers import linear

    calls = []
    monkeypatch.setattr(linear, "invariant_linear", lambda x, w: calls.append(("linear", x.shape[0]))
                        or torch.zeros(x.shape[0], w.n, dtype=x.dtype))
    real_logits = fused.router_logits
    monkeypatch.setattr(fused, "router_logits", lambda h, r: calls.append(("router", h.shape[0])) or real_logits(h, r))
    w = pack_bf16(torch.randn(8, 128))
    h = torch.randn(40, 128)
    router = torch.randn(6, 128)
    for on in (True, False):
        calls.clear()
        bi.set_batch_invariant(on)
        try:
            linear.gpu_linear(h, w)
            moe_route(h, router, None, 2, 1.0)
        finally:
            bi.set_batch_invariant(None)
        assert calls == ([("linear", 40), ("router", 40)] if on else []), (on, calls)


@pytest.mark.gpu
def test_gpu_rows_do_not_depend_on_the_batch():
    """bf16 at real shapes (the flagship's o_full and shared expert gate+up, the tiny model's
    head): a row's bits are the same alone, in batches of 16, 37 and 300, and next to other
    values."""
    for n, k in ((4096, 8192), (2560, 4096), (512, 256)):
        w = _rand(n, k, seed=n)
        x = _rand(300, k, seed=k)
        full = bi.invariant_matmul(x, w)
        ref = bi.invariant_matmul_ref(x, w)
        assert float((full.float() - ref.float()).abs().max() / ref.float().abs().max()) < 1e-2, (n, k)
        for rows in ([0], [5], list(range(16)), list(range(7, 44))):
            assert torch.equal(bi.invariant_matmul(x[rows], w), full[rows]), (n, k, len(rows))
        other = x.clone()
        other[1:] = _rand(299, k, seed=k + 1)
        assert torch.equal(bi.invariant_matmul(other, w)[0], full[0]), (n, k)


@pytest.mark.gpu
def test_tiny_step_greedy_is_batch_invariant_in_the_mode(tmp_path, monkeypatch):
    """Issue 14's batch invariance, in batch-invariant mode: the tiny Step model's greedy tokens on
    the GPU are the same when each of 16 prompts decodes alone (batch 1) as when all 16 decode
    together (batch 16). (Without the mode: tests/test_gpu_engine.py, a strict xfail.)"""
    from step35_tiny import greedy_alone_vs_batch

    monkeypatch.setenv("MEMRA_BATCH_INVARIANT", "1")
    diverged = greedy_alone_vs_batch(tmp_path)
    print(f"\nbatch-invariant mode, batch 1 vs batch 16: {len(diverged)} of 16 prompts differ: {diverged}")
    assert not diverged


def test_fp32_activations_are_rounded_to_the_weight_dtype_as_the_twin_says():
    x, w = _rand(7, 96, seed=3).float() * 1.001, _rand(64, 96, seed=4)
    y = bi.invariant_matmul(x, w)
    ref = bi.invariant_matmul_ref(x, w)
    assert y.dtype == torch.float32
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-3


def test_engine_refuses_what_the_mode_does_not_cover(monkeypatch):
    """On a GPU the mode does not cover the parallel path yet: refused at configuration, with the
    reason; MTP speculation is allowed (the GPU is faked: only the configuration is checked)."""
    from memra.engine.engine import EngineConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("MEMRA_BATCH_INVARIANT", "1")
    with pytest.raises(ValueError, match="MEMRA_BATCH_INVARIANT=1 with the parallel path"):
        EngineConfig(model="m", device="cuda", tensor_parallel_size=2)
    EngineConfig(model="m", device="cuda", speculative_method="mtp")
    EngineConfig(model="m", device="cuda", speculative_method="ngram")
    monkeypatch.setenv("MEMRA_BATCH_INVARIANT", "0")
    EngineConfig(model="m", device="cuda", tensor_parallel_size=2)


@pytest.mark.gpu
def test_tiny_step_greedy_is_the_same_with_mtp_eager_and_any_chunks_in_the_mode(tmp_path, monkeypatch):
    """In batch-invariant mode a greedy token is the same bits-deep computation however the engine
    gets there: the tiny Step model's greedy tokens for 12 prompts (up to 80 tokens, past the
    sliding window of 8) are identical with CUDA graphs, eager steps, prefill chunks of 16 tokens
    (no prefix cache), and MTP speculation with K = 1 and 3 (verify rows and padded drafting graphs:
    drafts checked to have run from the graphs). Without the mode these differ
    (tests/test_gpu_engine.py bounds them by plain decode's own graph/eager spread)."""
    import random

    from step35_tiny import VOCAB, make_tensors, write_llm_dir

    from memra.engine.llm import LLM
    from memra.engine.sampling import SamplingParams

    monkeypatch.setenv("MEMRA_BATCH_INVARIANT", "1")
    d = write_llm_dir(tmp_path / "tiny", make_tensors(3))
    g = random.Random(7)
    prompts = [[0] + [g.randrange(3, VOCAB) for _ in range(g.randrange(1, 80))] for _ in range(12)]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    runs = {"graphs": {}, "eager": dict(enforce_eager=True),
            "chunks of 16": dict(max_num_batched_tokens=16, enable_prefix_caching=False)}
    runs.update({f"mtp K={k}": dict(speculative_method="mtp", num_speculative_tokens=k, speculative_max_batch=8)
                 for k in (1, 3)})
    outs = {}
    for name, kw in runs.items():
        llm = LLM(str(d), device="cuda", max_model_len=256, max_num_seqs=8, **kw)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        e = llm.engine
        if name.startswith("mtp"):
            drafted, graph_layers = sum(e.spec_drafted), e.proposer.num_graph_layers
            print(f"\n{name}: accepted {sum(e.spec_accepted)} of {drafted} drafts, {graph_layers} MTP layers "
                  f"from CUDA graphs")
            assert drafted > 0 and graph_layers > 0
        del llm, e
        torch.cuda.empty_cache()
    for name, out in outs.items():
        diff = [i for i, (u, v) in enumerate(zip(outs["graphs"], out)) if u != v]
        print(f"{name} vs graphs: {len(diff)} of {len(prompts)} prompts differ {diff}")
    assert all(out == outs["graphs"] for out in outs.values())
