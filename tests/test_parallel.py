"""Tensor + expert parallelism on gloo (memra/parallel): TP 2 / 4 and EP 2 / 4 shards compute logits
bit-identical (torch.equal) to one rank under the canonical order, for the tiny Step model (MoE,
head gate, sliding + full layers, GQA) and smollm2-135m (GQA with 9 query / 3 KV heads, so TP 2 and
4 cut GQA groups and replicate KV heads); the canonical one-rank path agrees with the plain model
to 1e-5 and gives its greedy tokens; splits that would cut a head or a quantization block are
refused with the tensor's name. Each run: prefill of a 13-token prompt through a contiguous KV
cache, then 4 greedy decode steps, in ``world`` processes (torch.multiprocessing, gloo over a
file rendezvous), one thread each."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from memra.engine.kv_cache import ContiguousKVCache
from memra.parallel import ParallelContext, shard_model
from memra.parallel.plan import split_sizes

PROMPT = [1, 17, 300, 5, 42, 77, 9, 123, 250, 8, 3, 64, 11]
STEPS = 4


def _load(kind: str, path: str):
    from memra.models import load_model

    if kind == "smollm2":
        from memra.hub import resolve_model

        path = str(resolve_model(path))
    model, _ = load_model(path, torch.float32)
    return model


def _generate(model, vocab_clip: int | None = None) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill + STEPS greedy steps; returns (logits of every step, tokens)."""
    kv = ContiguousKVCache(model.config, 64)
    ids = list(PROMPT)
    logits, toks = [], []
    with torch.no_grad():
        h = model(torch.tensor(ids), torch.arange(len(ids)), kv)
        kv.length = len(ids)
        for _ in range(STEPS):
            lg = model.logits(h[-1:])[0]
            logits.append(lg)
            t = int(lg.argmax())
            toks.append(t)
            pos = kv.length
            h = model(torch.tensor([t]), torch.tensor([pos]), kv)
            kv.length = pos + 1
    return logits, toks


def _worker(rank: int, world: int, kind: str, path: str, ep: bool, init: str, out: str, parts: int = 4) -> None:
    torch.set_num_threads(1)
    ctx = ParallelContext.init(rank, world, init, "gloo", parts=parts, expert_parallel=ep, timeout_s=120)
    try:
        model = shard_model(_load(kind, path), ctx)
        logits, toks = _generate(model)
        if rank == 0:
            torch.save({"logits": logits, "tokens": toks}, out)
    finally:
        ctx.close()


def _run(kind: str, path: str, world: int, ep: bool, tmp_path, parts: int = 4) -> dict:
    out = str(tmp_path / f"out-{kind}-{world}-{ep}-{parts}.pt")
    init = f"file://{tmp_path}/rdv-{kind}-{world}-{ep}-{parts}"
    if world == 1:
        _worker(0, 1, kind, path, ep, init, out, parts)
    else:
        mp.start_processes(_worker, args=(world, kind, path, ep, init, out), nprocs=world, join=True,
                           start_method="spawn")
    return torch.load(out)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from step35_tiny import make_tensors, write_llm_dir

    return str(write_llm_dir(tmp_path_factory.mktemp("tiny_tp"), make_tensors(3), dtype=torch.float32))


def _same(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and all(torch.equal(x, y) for x, y in zip(a["logits"], b["logits"]))


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_tiny_step_bit_identical_across_tp_and_ep(tiny_path, tmp_path, ep):
    torch.set_num_threads(1)
    ref = _run("tiny", tiny_path, 1, ep, tmp_path)
    # the canonical one-rank path vs the plain model: same greedy tokens, logits to 1e-5
    plain_logits, plain_toks = _generate(_load("tiny", tiny_path))
    assert ref["tokens"] == plain_toks
    for a, b in zip(ref["logits"], plain_logits):
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-5
    for world in (2, 4):
        got = _run("tiny", tiny_path, world, ep, tmp_path)
        assert _same(got, ref), (world, ep, got["tokens"], ref["tokens"])
    # the comparison can fail: another canonical partition (2 parts) changes the bits, not the tokens
    other = _run("tiny", tiny_path, 1, ep, tmp_path, parts=2)
    assert other["tokens"] == ref["tokens"] and not _same(other, ref)


@pytest.mark.slow
def test_smollm2_bit_identical_across_tp(tmp_path):
    torch.set_num_threads(1)
    ref = _run("smollm2", "smollm2-135m", 1, False, tmp_path)
    plain_logits, plain_toks = _generate(_load("smollm2", "smollm2-135m"))
    assert ref["tokens"] == plain_toks
    for a, b in zip(ref["logits"], plain_logits):
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-5
    for world in (2, 4):
        assert _same(_run("smollm2", "smollm2-135m", world, False, tmp_path), ref), world


def test_splits_that_cut_a_block_or_head_are_refused(tiny_path):
    assert split_sizes(9, 4) == [3, 2, 2, 2]
    assert split_sizes(1536, 4, 32) == [384] * 4
    with pytest.raises(ValueError, match="cannot fill 4 canonical parts"):
        split_sizes(96, 4, 32, "blk.3.ffn_down_exps")  # 3 Q8_0 blocks of 32 for 4 parts
    with pytest.raises(ValueError, match="not a multiple"):
        split_sizes(100, 2, 32, "x")
    with pytest.raises(ValueError, match="multiple of the tensor-parallel size"):
        ParallelContext(0, 3, parts=4)
    model = _load("tiny", tiny_path)
    with pytest.raises(ValueError, match="query heads"):
        shard_model(model, ParallelContext(0, 8, parts=8))  # the full layers have 4 query heads


def test_shard_keeps_local_heads_in_the_config(tiny_path):
    model = shard_model(_load("tiny", tiny_path), ParallelContext(1, 2, parts=4))
    from step35_tiny import H_FULL, H_SWA

    full = model.config.layers[0]
    sliding = model.config.layers[1]
    assert full.num_heads == H_FULL // 2 and sliding.num_heads == H_SWA // 2
    assert full.num_kv_heads == 1 and sliding.num_kv_heads == 1  # 2 KV heads over 2 ranks


