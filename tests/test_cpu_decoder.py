"""The fused native CPU decode step (memra/kernels/cpu_native.py ``DecoderLayers``): every decoder
layer of a Llama-family model in one native call must give the same bits as the layer-by-layer
native path (the same kernels in the same order), over a contiguous cache and a paged batch,
in both CPU modes; it must be taken exactly where it applies and refuse what it cannot take."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import quants
from tiny_models import tiny_gguf

from memra.engine.block_manager import kv_groups
from memra.engine.kv_cache import ContextOverflowError, ContiguousKVCache, PagedBatch, PagedKVCache, SeqChunk
from memra.kernels import cpu_native
from memra.models.base import CausalLM
from memra.quant.tensor import QTensor
from memra.quant.types import QType

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels did not compile here")

#: The formats the tiny models' linears are stored in (both native code layouts, offsets or not).
FORMATS = {"attn_q": GT.Q4_1, "attn_k": GT.Q4_1, "attn_v": GT.Q8_0, "attn_output": GT.Q4_0,
           "ffn_gate": GT.Q4_1, "ffn_up": GT.Q4_1, "ffn_down": GT.Q8_0}


def quantized_gguf(path, arch: str, **kw):
    """tiny_gguf with its linears re-stored in the FORMATS (gguf's quantizer), so they take the
    native kernels."""
    import gguf

    src = tiny_gguf(path.with_suffix(".f32.gguf"), arch, **kw)
    r = gguf.GGUFReader(src)
    from memra.io.gguf_writer import write_gguf

    tensors = {}
    for t in r.tensors:
        w = torch.from_numpy(np.array(t.data, dtype=np.float32).reshape([int(d) for d in t.shape[::-1]]))
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else ""
        if kind in FORMATS and t.name.endswith(".weight"):
            q = quants.quantize(w.numpy(), FORMATS[kind])
            tensors[t.name] = QTensor(t.name, QType[FORMATS[kind].name], tuple(w.shape), torch.from_numpy(q))
        else:
            tensors[t.name] = w
    meta = {}
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        meta[f.name] = f.contents()
    return write_gguf(path, arch, meta, tensors)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(arch, dtype) -> a loaded tiny model (llama: permuted q/k; qwen2: q/k/v biases); ``llm=True``:
    its LLM."""
    from memra import LLM

    d = tmp_path_factory.mktemp("fused")
    paths = {a: quantized_gguf(d / f"{a}.gguf", a, layers=3, seed=5) for a in ("llama", "qwen2")}
    cache = {}

    def get(arch: str, dtype: str, llm: bool = False):
        if (arch, dtype) not in cache:
            cache[arch, dtype] = LLM(str(paths[arch]), dtype=dtype)
        return cache[arch, dtype] if llm else cache[arch, dtype].model

    return get


class Spy:
    """Counts the fused step's calls; ``off`` pins the layer-by-layer path."""

    def __init__(self, model, monkeypatch, off: bool = False):
        self.calls = 0
        real = CausalLM._native_step

        def step(m, x, kv):
            if off:
                return None
            got = real(m, x, kv)
            self.calls += got is not None
            return got

        monkeypatch.setattr(CausalLM, "_native_step", step)


def contiguous_run(model, ids: list[int], steps: int, seed: int):
    """A prefill of ``ids``, then ``steps`` one-token steps of random tokens: the decode steps'
    hidden states, stacked, and the used K/V of every layer."""
    g = torch.Generator().manual_seed(seed)
    kv = ContiguousKVCache(model.config, len(ids) + steps)
    outs = []
    with torch.inference_mode():
        model(torch.tensor(ids), torch.arange(len(ids)), kv)
        kv.advance(len(ids))
        for i in range(steps):
            tok = torch.randint(2, model.config.vocab_size, (1,), generator=g)
            outs.append(model(tok, torch.tensor([len(ids) + i]), kv))
            kv.advance(1)
    n = kv.length
    return torch.cat(outs), [t[:n].clone() for t in kv.k + kv.v]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_step_is_the_layer_by_layer_path_contiguous(models, arch, dtype, monkeypatch):
    model = models(arch, dtype)
    assert model.native_decoder() is not None
    ids = [3, 17, 40, 8, 61]
    with monkeypatch.context() as mp:
        spy = Spy(model, mp)
        fused, kv_fused = contiguous_run(model, ids, 12, seed=1)
        assert spy.calls == 12  # every decode step, never the 5-token prefill
    with monkeypatch.context() as mp:
        Spy(model, mp, off=True)
        ref, kv_ref = contiguous_run(model, ids, 12, seed=1)
    assert fused.dtype == getattr(torch, dtype) and fused.abs().max() > 0
    assert torch.equal(fused, ref)
    assert all(torch.equal(a, b) for a, b in zip(kv_fused, kv_ref))


def paged_decode(model, lens: list[int], use_fused: bool, monkeypatch, seed: int):
    """Sequences of ``lens`` tokens prefilled one by one into a paged cache (blocks of 4, shuffled
    block tables), then two decode steps of all of them together: their hidden states and the cache."""
    g = torch.Generator().manual_seed(seed)
    groups = kv_groups(model.config)
    bs = 4
    need = [-(-(n + 2) // bs) for n in lens]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()
    tables, o = [], 0
    for n in need:
        tables.append(perm[o:o + n])
        o += n
    cache = PagedKVCache(groups, [len(perm)], bs, torch.float32)
    for t in cache.k + cache.v:
        t.normal_(generator=g)  # unwritten slots hold garbage, never read
    outs = []
    with torch.inference_mode(), monkeypatch.context() as mp:
        spy = Spy(model, mp, off=not use_fused)
        for n, tab in zip(lens, tables):
            ids = torch.randint(2, model.config.vocab_size, (n,), generator=g)
            model(ids, torch.arange(n), PagedBatch(cache, [SeqChunk(0, n, [tab])]))
        assert spy.calls == 0
        for step in range(2):
            chunks = [SeqChunk(n + step, 1, [tab]) for n, tab in zip(lens, tables)]
            ids = torch.randint(2, model.config.vocab_size, (len(lens),), generator=g)
            pos = torch.tensor([n + step for n in lens])
            outs.append(model(ids, pos, PagedBatch(cache, chunks)))
        assert spy.calls == (2 if use_fused else 0)
    return torch.cat(outs), [t.clone() for t in cache.k + cache.v]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lens", [[7], [3, 9, 6], [5, 2, 12, 8]], ids=["B1", "B3", "B4"])
def test_fused_step_is_the_layer_by_layer_path_paged(models, dtype, lens, monkeypatch):
    model = models("qwen2", dtype)
    fused, cache_fused = paged_decode(model, lens, True, monkeypatch, seed=len(lens))
    ref, cache_ref = paged_decode(model, lens, False, monkeypatch, seed=len(lens))
    assert torch.equal(fused, ref)
    assert all(torch.equal(a, b) for a, b in zip(cache_fused, cache_ref))


def test_fused_step_is_not_taken_where_it_does_not_apply(models, tmp_path, monkeypatch):
    """Five decode rows (past NATIVE_MAX_ROWS), a step mixing a prefill chunk with decodes, the
    torch paths pinned, float weights (dense linears) and a model with q/k norms and sliding
    windows (gemma3) all take the layer-by-layer path; their results are still those of that path."""
    from memra import LLM

    model = models("llama", "bfloat16")
    groups = kv_groups(model.config)
    cache = PagedKVCache(groups, [40], 4, torch.float32)
    with torch.inference_mode(), monkeypatch.context() as mp:
        spy = Spy(model, mp)
        tabs = [[i * 4 + j for j in range(4)] for i in range(6)]
        for tab in tabs:
            model(torch.tensor([5, 6, 7]), torch.arange(3), PagedBatch(cache, [SeqChunk(0, 3, [tab])]))
        model(torch.tensor([9] * 5), torch.tensor([3] * 5), PagedBatch(cache, [SeqChunk(3, 1, [t]) for t in tabs[:5]]))
        mixed = [SeqChunk(3, 1, [tabs[0]]), SeqChunk(0, 3, [tabs[5]])]
        model(torch.tensor([9, 1, 2, 3]), torch.tensor([3, 0, 1, 2]), PagedBatch(cache, mixed))
        mp.setattr(cpu_native, "ENABLED", False)
        kv = ContiguousKVCache(model.config, 8)
        model(torch.tensor([4]), torch.tensor([0]), kv)
        assert spy.calls == 0
    assert LLM(str(tiny_gguf(tmp_path / "f.gguf", "llama", layers=2)), dtype="bfloat16").model.native_decoder() is None
    assert LLM(str(tiny_gguf(tmp_path / "g.gguf", "gemma3", layers=2)), dtype="bfloat16").model.native_decoder() is None


def test_fused_step_errors(models):
    """A full contiguous cache raises ContextOverflowError before anything runs; out-of-range slots
    and lengths raise ValueError with the caches and the inputs untouched; weights of the other mode,
    wrong dtypes and caches of the wrong geometry are refused by name."""
    model = models("llama", "bfloat16")
    plan = model.native_decoder()
    cfg = model.config
    kv = ContiguousKVCache(cfg, 2)
    with torch.inference_mode():
        model(torch.tensor([4, 5]), torch.arange(2), kv)
        kv.advance(2)
        with pytest.raises(ContextOverflowError, match="capacity of 2"):
            model(torch.tensor([4]), torch.tensor([2]), kv)

    g = torch.Generator().manual_seed(3)
    S, KV, D = 16, cfg.layers[0].num_kv_heads, cfg.layers[0].head_dim
    k = [torch.randn(S, KV, D, generator=g) for _ in cfg.layers]
    v = [torch.randn(S, KV, D, generator=g) for _ in cfg.layers]
    before = [t.clone() for t in k + v]
    ptrs = cpu_native.KVPointers(k, v)
    x = torch.randn(2, cfg.hidden_size, generator=g).bfloat16()
    x0 = x.clone()
    cos, sin = model.rope_tables(torch.tensor([3, 4]), torch.bfloat16)[0]
    idx = torch.arange(8).view(2, 4)
    bad = [(dict(idx=idx, lens=torch.tensor([4, 5]), write_slots=torch.tensor([8, 9])), "length"),
           (dict(idx=idx + 10, lens=torch.tensor([4, 4]), write_slots=torch.tensor([8, 9])), "slot"),
           (dict(idx=idx, lens=torch.tensor([4, 4]), write_slots=torch.tensor([8, 16])), "slot")]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            plan(x, None, cos, sin, cpu_native.NativeKV(ptrs, L=4, **kw))
    assert all(torch.equal(a, b) for a, b in zip(k + v, before)) and torch.equal(x, x0)
    good = cpu_native.NativeKV(ptrs, L=4, idx=idx, lens=torch.tensor([4, 2]), write_slots=torch.tensor([8, 9]))
    out, s = plan(x, None, cos, sin, good)
    assert out.shape == x.shape and s.dtype == torch.float32 and torch.isfinite(out.float()).all()
    assert torch.equal(x, x0)  # the input is not modified
    with pytest.raises(ValueError, match="x torch.bfloat16"):
        plan(x.float(), None, cos, sin, good)
    with pytest.raises(ValueError, match="cos/sin"):
        plan(x, None, cos[:, :4], sin[:, :4], good)
    wrong = cpu_native.KVPointers([torch.zeros(S, KV, D + 2)] * len(k), [torch.zeros(S, KV, D + 2)] * len(k))
    with pytest.raises(ValueError, match="cache slot 0"):
        plan(x, None, cos, sin, cpu_native.NativeKV(wrong, L=4, idx=idx, lens=torch.tensor([4, 2]),
                                                     write_slots=torch.tensor([8, 9])))
    with pytest.raises(ValueError, match="fp32"):
        cpu_native.KVPointers([torch.zeros(S, KV, D, dtype=torch.bfloat16)], [torch.zeros(S, KV, D)])
    layers = model.native_decoder_layers()
    exact = models("llama", "float32").native_decoder_layers()
    with pytest.raises(ValueError, match="packed fp16"):
        cpu_native.DecoderLayers([layers[0], exact[1]], torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        cpu_native.DecoderLayers(layers, torch.float16)


def test_engine_greedy_with_the_fused_step(models, monkeypatch):
    """The serving engine over the paged cache, 3 prompts decoded together, greedy: the same tokens
    with the fused step as without it, and the fused step did run."""
    from memra import SamplingParams

    llm = models("qwen2", "bfloat16", llm=True)
    prompts = [{"prompt_token_ids": p} for p in ([3, 9, 27, 11], [5, 6], [40, 41, 42, 43, 44, 45, 46])]
    runs = {}
    for fused in (True, False):
        with monkeypatch.context() as mp:
            spy = Spy(llm.model, mp, off=not fused)
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
            runs[fused] = ([o.outputs[0].token_ids for o in outs], spy.calls)
    assert all(len(t) == 10 for t in runs[True][0])
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] >= 9 and runs[False][1] == 0
