"""The GPU path (packed weights, Triton decode kernels, paged decode attention, CUDA graphs,
GPU sampling) against the CPU path.

CPU (CI): the tiny synthetic Step-3.5 model moved to the "GPU path" on the CPU under the
Triton interpreter (fp32 compute): a prefill through the paged cache, then decode steps
through :class:`~memra.engine.cuda_graph.DecodeKV` (the kernels the CUDA graphs replay),
compared with the fp32 CPU model.

GPU (``-m gpu``, the H200): smollm2-135m (GGUF path in ``$MEMRA_SMOLLM2_GGUF``, else the
model key) and the tiny Step model with NVFP4 and bf16 experts: bf16 logits on the GPU vs
fp32 on the CPU (top-1 agreement >= 99%), greedy generation through the engine's CUDA
graphs vs the CPU model's argmax on the same tokens, and ``memra serve --device cuda``
answering a completion.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from memra.engine.block_manager import kv_groups  # noqa: E402
from memra.engine.kv_cache import ContiguousKVCache, PagedBatch, PagedKVCache, SeqChunk  # noqa: E402
from memra.io.synthetic import build_model  # noqa: E402


def _ref_logits(model, ids: list[int]) -> torch.Tensor:
    kv = ContiguousKVCache(model.config, len(ids), model.dtype)
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), kv)
        return model.logits(h).float()


def _paged_run(model, ids: list[int], n_prefill: int, device) -> torch.Tensor:
    """Logits of every position of ``ids``: the first ``n_prefill`` by two prefill chunks through
    PagedBatch (the paged Triton flash kernel; the second chunk after a cached prefix), then one
    token per step through DecodeKV (the graph path's kv, run eagerly)."""
    from memra.engine.cuda_graph import DecodeKV

    cfg = model.config
    groups = kv_groups(cfg)
    bs = 4
    nblk = -(-len(ids) // bs) + 1
    cache = PagedKVCache(groups, [nblk + 1] * len(groups), bs, model.dtype, device=device)
    table = list(range(nblk))[::-1]  # non-trivial block order
    out = []
    with torch.inference_mode():
        n1 = n_prefill // 2
        for lo, hi in ((0, n1), (n1, n_prefill)):
            kv = PagedBatch(cache, [SeqChunk(lo, hi - lo, [table] * len(groups))], use_kernels=True)
            h = model(torch.tensor(ids[lo:hi], device=device), torch.arange(lo, hi, device=device), kv)
            out.append(model.logits(h).float().cpu())
        for p in range(n_prefill, len(ids)):
            tab = torch.full((1, nblk), -1, dtype=torch.int32, device=device)
            tab[0, :len(table)] = torch.tensor(table, dtype=torch.int32)
            slot = torch.tensor([table[p // bs] * bs + p % bs], device=device)
            kv = DecodeKV(cache, [tab] * len(groups), torch.tensor([p + 1], dtype=torch.int32, device=device),
                          [slot] * len(groups))
            h = model(torch.tensor([ids[p]], device=device), torch.tensor([p], device=device), kv)
            out.append(model.logits(h).float().cpu())
    return torch.cat(out)


# the tiny geometry cut to 2 dense + 2 MoE layers of 8 experts, top-2 (the interpreter is slow)
_SMALL = {"layers": 4, "dense_layers": 2, "experts": 8, "top_k": 2, "clamp_layers": [3], "mtp_layers": 1}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU stand-in for the GPU tests")
def test_gpu_path_under_interpreter_matches_cpu():
    ref_model = build_model(_SMALL, seed=3, expert_format="nvfp4")
    model = copy.deepcopy(ref_model).to_gpu("cpu", torch.float32)
    assert model.lm_head.kernel == "gpu" and model.layers[3].mlp.experts.on_gpu
    ids = [5, 77, 300, 12, 9, 401, 33]
    ref = _ref_logits(ref_model, ids)
    got = _paged_run(model, ids, n_prefill=5, device="cpu")  # a 5-token prefill, then 2 decode steps
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 1e-3, f"relative error {err:.2e}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU stand-in for the GPU tests")
def test_paged_batch_kernel_paths_match_the_sdpa_path():
    """PagedBatch with use_kernels (the paged Triton flash kernel, head gate fused) vs the CPU path
    (SDPA over gathered pages with masks, gate applied after) on a fresh prefill, a chunk after a
    cached prefix and a mixed decode + prefill step, with and without a sliding window; random
    K/V written into shuffled pages, fp32."""
    from memra.engine.block_manager import KVGroupSpec

    g = torch.Generator().manual_seed(4)
    H, KV, D, bs = 6, 2, 16, 4
    for window in (None, 5):
        groups = [KVGroupSpec(layers=[0], num_kv_heads=KV, head_dim=D, window=window)]
        cache = PagedKVCache(groups, [40], bs, torch.float32)
        for t in cache.k + cache.v:
            t.copy_(torch.randn(t.shape, generator=g))
        perm = torch.randperm(40, generator=g).tolist()
        steps = [
            [SeqChunk(0, 9, [perm[0:3]])],  # fresh
            [SeqChunk(9, 6, [perm[0:4]])],  # chunk after a 9-token prefix
            # mixed: a decode row (with a window of 5, its pages before the window released: -1),
            # a fresh prefill and a chunk after a prefix; block tables of different widths
            [SeqChunk(15, 1, [([-1, -1] if window else perm[0:2]) + perm[2:4]]), SeqChunk(0, 7, [perm[10:12]]),
             SeqChunk(3, 5, [perm[20:22]])],
        ]
        for chunks in steps:
            n = sum(c.num_new for c in chunks)
            q = torch.randn(n, H, D, generator=g)
            k = torch.randn(n, KV, D, generator=g)
            v = torch.randn(n, KV, D, generator=g)
            gate = torch.randn(n, H, generator=g)
            ref = PagedBatch(cache, chunks, use_kernels=False).attend(0, q, k, v, window, 0.3)
            ref = ref * torch.sigmoid(gate)[..., None]
            kvb = PagedBatch(cache, chunks, use_kernels=True)
            assert kvb.fuses_gate
            got = kvb.attend(0, q, k, v, window, 0.3, gate=gate)
            assert float((got - ref).abs().max()) <= 1e-4 * float(ref.abs().max()), (window, len(chunks))
    for use in (False, True):  # a released page inside the visible range; an empty step
        with pytest.raises(RuntimeError, match="released KV block"):
            PagedBatch(cache, [SeqChunk(15, 1, [[-1, -1, -1] + perm[3:4]])], use_kernels=use)
        with pytest.raises(ValueError, match="at least one sequence"):
            PagedBatch(cache, [], use_kernels=use)
    with pytest.raises(ValueError, match="gate is not fused"):
        PagedBatch(cache, steps[0], use_kernels=False).attend(0, q[:9], k[:9], v[:9], window, 0.3, gate=gate[:9])


def test_to_gpu_refuses_the_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = build_model("tiny", seed=0)
    with pytest.raises(ValueError, match="CUDA device"):
        m.to_gpu("cpu")


def test_engine_config_checks_device_and_memory_fraction():
    from memra.engine.engine import EngineConfig

    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            EngineConfig(device="cuda")
    assert EngineConfig().dtype == "float32"


# ---------------------------------------------------------------------------------------- GPU


def _smollm2_path() -> str:
    return os.environ.get("MEMRA_SMOLLM2_GGUF", "smollm2-135m")


def _check_teacher_forced(cpu_model, cpu_bf16_model, gpu_model, ids, n_prefill, min_decided: float = 0.0,
                          min_agree: float = 0.99, max_median_ratio: float = 1.5):
    """bf16 logits on the GPU vs fp32 on the CPU, with the tolerance of the dtype measured on the
    same tokens, per position: the CPU path run in bf16 gives each position's bf16 error scale
    ``e`` (max over the vocabulary of |logit - fp32 logit|). Checks: at >= ``min_agree`` of the
    positions the GPU's top-1 token is within 2 e of the fp32 maximum; at the positions whose fp32
    top-1/top-2 gap exceeds 2 e (where bf16 can decide the argmax; at least ``min_decided`` of
    them) the top-1 agrees at >= ``min_agree``; the GPU's median per-position error is within
    ``max_median_ratio`` x the CPU bf16 path's."""
    ref = _ref_logits(cpu_model, ids)
    bf = _ref_logits(cpu_bf16_model, ids)
    got = _paged_run(gpu_model, ids, n_prefill, "cuda")
    e_cpu = (bf - ref).abs().amax(-1)
    e_gpu = (got - ref).abs().amax(-1)
    top2 = ref.topk(2, dim=-1)
    gap = top2.values[:, 0] - top2.values[:, 1]
    g_top = got.argmax(-1)
    same = g_top == top2.indices[:, 0]
    within = ref.gather(1, g_top[:, None])[:, 0] >= top2.values[:, 0] - 2 * e_cpu
    decided = gap > 2 * e_cpu
    agree = float(same[decided].float().mean()) if bool(decided.any()) else 1.0
    print(f"{len(ids)} positions: top-1 agreement {float(same.float().mean()):.4f} (CPU bf16: "
          f"{float((bf.argmax(-1) == top2.indices[:, 0]).float().mean()):.4f}); within the bf16 tolerance "
          f"{float(within.float().mean()):.4f}; {int(decided.sum())} decided positions: agreement {agree:.4f}; "
          f"median per-position error GPU {float(e_gpu.median()):.3f}, CPU bf16 {float(e_cpu.median()):.3f}")
    assert float(within.float().mean()) >= min_agree
    assert float(decided.float().mean()) >= min_decided
    assert agree >= min_agree
    assert float(e_gpu.median()) <= max_median_ratio * float(e_cpu.median())


_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
         "movable metal type, oil-based ink and a wooden press adapted from those used for wine. Within a few "
         "decades printing shops had spread across Europe, books became cheaper, and literacy rose. Scholars "
         "could compare identical copies of a text, which changed how knowledge was checked and shared. ")


@pytest.mark.gpu
def test_smollm2_logits_gpu_vs_cpu():
    from memra.hub import resolve_model
    from memra.io.tokenizer import Tokenizer
    from memra.models import load_model

    path = _smollm2_path()
    path = path if os.path.exists(path) else resolve_model(path)
    cpu_model, ckpt = load_model(path, torch.float32)
    cpu_bf16, _ = load_model(path, torch.bfloat16)
    gpu_model, _ = load_model(path, torch.bfloat16)
    gpu_model.to_gpu("cuda")
    ids = Tokenizer.from_gguf_metadata(ckpt.metadata).encode(_TEXT * 3)[:200]
    _check_teacher_forced(cpu_model, cpu_bf16, gpu_model, ids, n_prefill=120, min_decided=0.3)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["nvfp4", "bf16", "q8_0", "fp8"])
def test_tiny_step_logits_gpu_vs_cpu(experts):
    cpu_model = build_model("tiny", seed=1, expert_format=experts)  # (fp8 banks need I % 128 == 0: tiny's is 128)
    cpu_bf16 = build_model("tiny", seed=1, expert_format=experts, dtype=torch.bfloat16)
    gpu_model = copy.deepcopy(cpu_model).to_gpu("cuda")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (200,), generator=g).tolist()
    # this random model amplifies rounding: its CPU bf16 path picks the fp32 top-1 at only 93-96 % of
    # the positions, so 97 % here (measured on the H200: 98.4-98.5 % where these checks bind)
    # fp8 experts: the two 75-token prefill chunks run the FP8 block recipe (moe_prefill, fp8_act:
    # activations quantized to E4M3 per 1x128 group, 3 mantissa bits; the CPU path keeps bf16
    # activations). Measured on the H200: 2.4x the CPU bf16 path's median error (0.102 vs 0.043),
    # agreement 0.963-0.970 where bf16 decides; so 3x and 95 % for fp8 (set after that measurement).
    # The recipe's own exactness is tested against its emulation in tests/test_kernels_moe_prefill.py.
    f8 = experts == "fp8"
    _check_teacher_forced(cpu_model, cpu_bf16, gpu_model, ids, n_prefill=150, min_agree=0.95 if f8 else 0.97,
                          max_median_ratio=3.0 if f8 else 1.5)


@pytest.mark.gpu
def test_engine_on_gpu_greedy_matches_cpu_argmax():
    """Greedy generation through the GPU engine (CUDA graphs, batch of 4) vs the fp32 CPU model's
    argmax on the generated tokens (teacher forced)."""
    from memra.engine.engine import EngineConfig, LLMEngine
    from memra.engine.sampling import SamplingParams
    from memra.hub import resolve_model
    from memra.models import load_model

    path = _smollm2_path()
    path = path if os.path.exists(path) else resolve_model(path)
    eng = LLMEngine(EngineConfig(model=path, device="cuda", max_model_len=512, max_num_seqs=8,
                                 gpu_memory_utilization=0.3))
    assert eng.graphs is not None
    print(eng.kv_cache_summary())
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    outs = {}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), eng.encode_prompt(p), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        for ev in eng.step():
            for d in ev.deltas:
                outs.setdefault(ev.request_id, []).extend(d.token_ids)
    assert eng.runner.num_graph_steps > 0
    cpu_model, _ = load_model(path, torch.float32)
    total = agree = 0
    for i, p in enumerate(prompts):
        ids = eng.encode_prompt(p)
        gen = outs[str(i)]
        assert len(gen) == 24
        ref = _ref_logits(cpu_model, ids + gen)[len(ids) - 1:-1]
        top = ref.argmax(-1)
        for j, t in enumerate(gen):
            total += 1
            # a bf16 near-tie may flip the choice: the chosen token must then be within 0.1 of the max
            if int(top[j]) == t:
                agree += 1
            else:
                assert float(ref[j, top[j]] - ref[j, t]) < 0.1, (p, j, t, int(top[j]))
            if int(top[j]) != t:
                break  # after a flip the continuation differs legitimately
    print(f"greedy agreement {agree}/{total}")
    assert agree / total >= 0.95
    del eng  # its KV cache takes most of the GPU: free it for the tests that follow
    import gc

    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_serve_on_gpu_answers():
    import json
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    path = _smollm2_path()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, "-m", "memra", "serve", "--model", path, "--device", "cuda",
                             "--port", str(port), "--max-model-len", "1024", "--max-num-seqs", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:  # a server that exits fails at once
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(1)
        body = json.dumps({"model": path, "prompt": "The capital of France is", "max_tokens": 12,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        print(out)
        assert out["choices"][0]["text"].strip()
        assert out["usage"]["completion_tokens"] == 12
    finally:
        proc.terminate()
        try:
            log = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0]
        print(log[-3000:])


# ---------------------------------------------------------------------------------------- fused kernels


@pytest.mark.parametrize("limit", [None, 0.7])
def test_fused_swiglu_matches_reference(limit):
    from memra.kernels.fused import swiglu, swiglu_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    gu = (torch.randn(5, 2 * 1280 if dev == "cuda" else 2 * 96, generator=g) * 2).to(dev)
    ref = swiglu_ref(gu, limit)
    assert torch.allclose(swiglu(gu, limit), ref, atol=1e-6, rtol=1e-5)
    from memra.layers.activations import swiglu as model_swiglu

    a, b = gu.chunk(2, dim=-1)
    assert torch.allclose(ref, model_swiglu(a, b, limit), atol=1e-6, rtol=1e-5)  # the twin is the model's math


@pytest.mark.parametrize("bias", [True, False])
def test_fused_router_topk_matches_reference(bias):
    from memra.kernels.fused import router_topk, router_topk_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    E, k = (288, 8) if dev == "cuda" else (40, 5)
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(7, E, generator=g) * 3).to(dev)
    b = (torch.randn(E, generator=g) * 0.2).to(dev) if bias else None
    i_ref, w_ref = router_topk_ref(logits, b, k, 2.5)
    i, w = router_topk(logits, b, k, 2.5)
    assert torch.equal(i, i_ref)
    assert torch.allclose(w, w_ref, atol=1e-6, rtol=1e-5)
    assert torch.allclose(w.sum(-1), torch.full((7,), 2.5, device=dev))


def test_fused_kv_write_matches_reference():
    from memra.kernels.fused import kv_write, kv_write_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(6)
    kc = torch.randn(6, 4, 2, 16, generator=g).to(dev)
    vc = torch.randn(6, 4, 2, 16, generator=g).to(dev)
    kv = torch.randn(3, 2 * 2 * 16 + 8, generator=g).to(dev)  # strided views of a fused projection output
    k, v = kv[:, :32].view(3, 2, 16), kv[:, 32:64].view(3, 2, 16)
    slots = torch.tensor([5, 17, 0], device=dev)
    kc2, vc2 = kc.clone(), vc.clone()
    kv_write(k, v, kc, vc, slots)
    kv_write_ref(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert not torch.equal(kc2, torch.zeros_like(kc2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU stand-in for the GPU tests")
@pytest.mark.parametrize("arch", ["llama", "gemma3", "step35", "step35-hf-fp8"])
def test_load_with_device_moves_layer_by_layer(tmp_path, arch, monkeypatch):
    """load_model(..., device=) reads each tensor through the staging reader, builds each layer and
    packs it where its bytes are; the result equals a model built on the CPU and moved afterwards
    (same packed weights and expert banks, same logits). A model loaded for a device never builds
    the CPU path's dense expert copies."""
    from tiny_models import tiny_gguf

    from memra.io.synthetic import write_synthetic
    from memra.layers.moe import RoutedExperts
    from memra.models import load_model

    if arch == "step35":
        path = write_synthetic("tiny", "gguf-nvfp4", 0, tmp_path / "m.gguf", expert_codes="random")
    elif arch == "step35-hf-fp8":  # safetensors shards read through the same staging reader
        path = write_synthetic("tiny", "hf-fp8", 0, tmp_path / "hf")
    else:
        path = tiny_gguf(tmp_path / "m.gguf", arch, layers=2)
    built = []
    build = RoutedExperts.build
    monkeypatch.setattr(RoutedExperts, "build", lambda self: built.append(self) or build(self))
    a, _ = load_model(path, torch.float32, device="cpu")
    assert not built  # the dense expert copies are the CPU path's, never made for a device load
    b, _ = load_model(path, torch.float32)
    assert len(built) == sum(isinstance(m, RoutedExperts) for m in b.modules())  # a CPU load builds them
    b.to_gpu("cpu", torch.float32)
    assert a.lm_head.kernel == "gpu" and a.layers[0].attn.kernels and not hasattr(a.lm_head, "stored")
    n = 0
    for pa, pb in zip(a.modules(), b.modules()):
        if getattr(pa, "kernel", None) == "gpu":
            assert torch.equal(pa.packed_weight.data, pb.packed_weight.data)
            n += 1
        if isinstance(pa, RoutedExperts):
            assert pa.kernels and getattr(pa, "w_gate_up", None) is None
            for bank in ("gate_up_bank", "down_bank"):
                assert torch.equal(getattr(pa, bank).data, getattr(pb, bank).data)
                assert torch.equal(getattr(pa, bank).scale, getattr(pb, bank).scale)
            n += 1
    assert n >= 3 and (not arch.startswith("step35") or built)
    bufs_a, bufs_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert bufs_a.keys() == bufs_b.keys() and all(torch.equal(bufs_a[k], bufs_b[k]) for k in bufs_a)  # norms, routers
    if arch.startswith("step35"):
        return  # every packed weight, expert bank and buffer is equal byte for byte: the same model (its
        # interpreted forward costs ~45 s here; the dense models below check the logits)
    ids = [1, 5, 9, 3]
    assert torch.equal(_paged_run(a, ids, 3, "cpu"), _paged_run(b, ids, 3, "cpu"))


@pytest.mark.gpu
def test_engine_loads_a_step35_gguf_to_the_gpu(tmp_path):
    """A synthetic step35 GGUF with NVFP4 experts loaded by the engine with device= (each layer
    moved to the GPU as it is built), greedy decode through the CUDA graphs, vs the fp32 CPU engine.
    (H200, 2026-11-30: 11 graph steps; the 3 prompts' 12 tokens equal the CPU's for 12, 12 and 9.)"""
    from memra.engine.llm import LLM
    from memra.engine.sampling import SamplingParams
    from memra.io.synthetic import write_synthetic

    p = str(write_synthetic("tiny", "gguf-nvfp4", 0, tmp_path / "tiny-nvfp4.gguf"))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 77, 300, 12], [9, 401, 33], [250, 3, 3, 3, 7, 8]]
    gpu = LLM(p, device="cuda", max_model_len=256, gpu_memory_utilization=0.2)
    print(gpu.engine.kv_cache_summary())
    assert gpu.model.layers[4].mlp.experts.on_gpu and gpu.model.lm_head.kernel == "gpu"
    g = [o.outputs[0].token_ids for o in gpu.generate(prompts, sp)]
    assert gpu.engine.runner.num_graph_steps > 0
    del gpu
    cpu = LLM(p, max_model_len=256)
    c = [o.outputs[0].token_ids for o in cpu.generate(prompts, sp)]
    for a, b in zip(g, c):  # a bf16 near-tie may flip a later token of this random model
        assert a[:4] == b[:4], (a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU stand-in for the GPU tests")
def test_long_prefill_takes_the_grouped_moe_gemm_under_interpreter(monkeypatch):
    """A prefill chunk wider than MOE_DECODE_MAX_T goes through moe_prefill; logits match the CPU."""
    import memra.layers.moe as moe_layer

    monkeypatch.setattr(moe_layer, "MOE_DECODE_MAX_T", 4)  # the 5-token second prefill chunk takes the grouped GEMM
    calls = []
    import memra.kernels.moe_prefill as mp

    real = mp.moe_prefill
    monkeypatch.setattr(mp, "moe_prefill", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    ref_model = build_model(_SMALL, seed=4, expert_format="q8_0")
    model = copy.deepcopy(ref_model).to_gpu("cpu", torch.float32)
    ids = [7, 300, 12, 9, 401, 33, 250, 5, 77, 3]
    ref = _ref_logits(ref_model, ids)
    got = _paged_run(model, ids, n_prefill=9, device="cpu")
    assert calls and set(calls) == {5}  # _paged_run prefills 4 tokens (decode kernels), then 5 (grouped GEMM)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 1e-3, f"relative error {err:.2e}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_graph_runner_fills_static_inputs_padded_to_the_bucket():
    """CudaGraphRunner.prepare (host side of a decode step; runs on any device): ids, positions,
    context lengths, block tables and slots, padding rows pointing at the scratch block."""
    from memra.engine.cuda_graph import CudaGraphRunner

    model = build_model(_SMALL, seed=0)
    groups = kv_groups(model.config)
    cache = PagedKVCache(groups, [9] * len(groups), 4, torch.float32)
    r = CudaGraphRunner(model, cache, max_batch=8, max_blocks=5, scratch_blocks=[8] * len(groups))
    assert r.buckets == [1, 2, 4, 8]
    tables = [[[3, 1, 0]] * len(groups), [[-1, 2, 5, 6]] * len(groups), [[7]] * len(groups)]
    b = r.prepare([11, 12, 13], [9, 13, 2], tables)
    assert b == 4
    assert r.ids[:4].tolist() == [11, 12, 13, 0] and r.pos[:4].tolist() == [9, 13, 2, 0]
    assert r.seq_lens[:4].tolist() == [10, 14, 3, 0]
    for g in range(len(groups)):
        assert r.tables[g][:4].tolist() == [[3, 1, 0, -1, -1], [-1, 2, 5, 6, -1], [7, -1, -1, -1, -1], [-1] * 5]
        assert r.slots[g][:4].tolist() == [0 * 4 + 1, 6 * 4 + 1, 7 * 4 + 2, 8 * 4]
    with pytest.raises(ValueError, match="no KV block"):
        r.prepare([1], [4], [[[-1, -1]] * len(groups)])
    with pytest.raises(ValueError, match="exceeds the largest"):
        r.prepare([1] * 9, [0] * 9, [[[0]] * len(groups)] * 9)
    with pytest.raises(ValueError, match="captured width"):
        r.prepare([1], [0], [[[0] * 6] * len(groups)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU stand-in for the GPU tests")
def test_decode_bench_weight_accounting_walks_the_gpu_model():
    """memra bench decode's per-part byte count reads the layers' attributes (it broke silently on the
    GPU once when a layer attribute was renamed): every part of the moved tiny model is counted,
    and the parts add up to the packed bytes of its Linear layers, expert banks, router and table."""
    from memra.bench.decode import _weight_bytes
    from memra.layers.linear import Linear

    model = build_model(_SMALL, seed=3, expert_format="nvfp4").to_gpu("cpu", torch.float32)
    w = _weight_bytes(model)
    assert all(w[k] > 0 for k in ("attention", "dense_mlp", "shared_experts", "routed_experts", "router",
                                  "lm_head", "embed", "norms")), w
    linear = sum(m.packed_weight.nbytes for m in model.modules() if isinstance(m, Linear)) - sum(
        m.packed_weight.nbytes for mtp in model.mtp for m in mtp.modules() if isinstance(m, Linear))
    banks = sum(layer.mlp.experts.gate_up_bank.nbytes + layer.mlp.experts.down_bank.nbytes
                for layer in model.layers if hasattr(layer.mlp, "experts"))
    assert w["attention"] + w["dense_mlp"] + w["shared_experts"] + w["lm_head"] == linear
    assert w["routed_experts"] == banks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_structured_output_on_gpu_masks_in_one_device_op():
    """Grammar-constrained decoding through the GPU engine (CUDA graphs for the decode steps):
    greedy rows (the device argmax after the batched mask) and sampled rows (host sampler on the
    masked logits) in one batch, every output valid under its JSON schema."""
    import json

    from memra.engine.llm import LLM
    from memra.engine.sampling import SamplingParams
    from memra.engine.structured import GrammarBackend

    llm = LLM(_smollm2_path(), max_model_len=512, device="cuda", max_num_seqs=8)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "pet": {"enum": ["cat", "dog"]}},
              "required": ["name", "age", "pet"], "additionalProperties": False}
    g = GrammarBackend(llm.tokenizer, llm.config.vocab_size, llm.eos_ids)
    grammar = g.json_schema(schema)
    prompts = ["A person as JSON:", "Describe Ann as JSON:", "JSON of a pet owner:", "Some JSON:"]
    for temperature in (0.0, 0.8):
        outs = llm.generate(prompts, SamplingParams(max_tokens=80, temperature=temperature, seed=1,
                                                    structured=grammar))
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "stop", c.text
            v = json.loads(c.text)  # the schema, checked by hand (the GPU machine has no jsonschema)
            assert set(v) == {"name", "age", "pet"} and isinstance(v["name"], str) and len(v["name"]) <= 16
            assert type(v["age"]) is int and 0 <= v["age"] <= 120 and v["pet"] in ("cat", "dog"), v
    assert llm.engine.runner.num_graph_steps > 0


@pytest.mark.gpu
def _spec_vs_plain_on_gpu(path, prompts, params, methods, **common):
    """Greedy decode on the GPU with each speculative ``methods`` entry (EngineConfig kwargs) against
    speculation off. The GPU's bf16 results depend on the batch shape (plain decode through CUDA
    graphs vs plain eager already differ on some prompts), so the bound is that baseline: a
    speculative run may differ from plain eager decode on no more prompts than plain decode's own
    two paths differ from each other (at least 1). Returns {name: (accepted, drafted, graph steps, MTP layers run from CUDA graphs)}."""
    from memra.engine.llm import LLM

    def run(**kw):
        llm = LLM(path, device="cuda", **common, **kw)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        e = llm.engine
        stats = (sum(e.spec_accepted), sum(e.spec_drafted), e.runner.num_graph_steps,
                 getattr(e.proposer, "num_graph_layers", 0))
        del llm, e
        torch.cuda.empty_cache()
        return out, stats

    def diverged(a, b):
        return [(i, next(j for j, (x, y) in enumerate(zip(u, v)) if x != y))
                for i, (u, v) in enumerate(zip(a, b)) if u != v]

    graph, _ = run()
    eager, _ = run(enforce_eager=True)
    base = diverged(graph, eager)
    print(f"\nplain graphs vs plain eager: {base} (prompt, first differing token)")
    out = {}
    for name, kw in methods.items():
        spec, stats = run(**kw)
        d = diverged(spec, eager)
        print(f"{name} vs plain eager: {d}; accepted {stats[0]} of {stats[1]}, {stats[2]} graph steps")
        assert len(d) <= max(1, len(base)), (name, d, base)
        out[name] = stats
    return out


@pytest.mark.gpu
def test_speculation_on_gpu_keeps_greedy_output():
    """smollm2-135m with ngram and with a draft model (itself: drafts nearly always accepted);
    verify steps replay the decode CUDA graphs (one row per query token)."""
    from memra.engine.sampling import SamplingParams

    prompts = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "1, 2, 3, 4, 5, 6, 7, 8,",
               "The cat sat on the mat. The cat sat on the mat. The", "<ul>\n  <li>one</li>\n  <li>",
               "for i in range(3):\n    print(i)\nfor j in range(3):\n", "Once upon a time",
               "SELECT a FROM t; SELECT b FROM t; SELECT", "red green blue red green", "Monday, Tuesday,",
               "The capital of France is"]
    p = _smollm2_path()
    stats = _spec_vs_plain_on_gpu(p, prompts, SamplingParams(max_tokens=48, temperature=0.0),
                                  {"ngram": dict(speculative_method="ngram", num_speculative_tokens=3),
                                   "draft": dict(speculative_method="draft", speculative_model=p,
                                                 num_speculative_tokens=4)},
                                  max_model_len=512, max_num_seqs=4)
    for accepted, _, graph_steps, _ in stats.values():
        assert accepted > 0 and graph_steps > 0
    assert stats["draft"][0] > 0.8 * stats["draft"][1]


@pytest.mark.gpu
def test_mtp_speculation_on_gpu_keeps_greedy_output(tmp_path):
    """The tiny Step model (bf16) with MTP K = 1 and 3 (random weights: drafts are rarely accepted;
    the point is that the output does not change), 8 requests at a time, so that the verify steps
    and the MTP layers' drafting replay their CUDA graphs."""
    import random

    from step35_tiny import VOCAB, make_tensors, write_llm_dir

    from memra.engine.sampling import SamplingParams

    d = write_llm_dir(tmp_path / "tiny", make_tensors(3))
    g = random.Random(0)
    prompts = [[0] + [g.randrange(3, VOCAB) for _ in range(g.randrange(1, 50))] for _ in range(20)]
    stats = _spec_vs_plain_on_gpu(str(d), prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
                                  {f"mtp{k}": dict(speculative_method="mtp", num_speculative_tokens=k,
                                                   speculative_max_batch=8) for k in (1, 3)},
                                  max_model_len=256, max_num_seqs=8)
    for _, drafted, graph_steps, mtp_graph_layers in stats.values():
        assert drafted > 20 * 64 // 2 and graph_steps > 0
        assert mtp_graph_layers > 0  # steady-state drafting replays the MTP layers' CUDA graphs

@pytest.mark.gpu
def test_fp8_attention_weights_on_gpu(tmp_path):
    """``attention_weights="fp8"``: every attention projection (MTP layers' too) requantized to FP8
    block; the tiny Step model's teacher-forced logits over 256 tokens against bf16 (printed; the
    issue's accuracy report) must agree with a CPU fp32 emulation of the same quantization (weights
    FP8-rounded, the prefill's activations rounded per 1x128 group as the FP8 block recipe does,
    then plain torch): random tiny models amplify the rounding (about 82 % top-1 either
    way), so the check is that the GPU kernels add nothing to it. Then the engine generates with it."""
    from step35_tiny import N_LAYERS, N_MTP, make_tensors, write_llm_dir

    from memra.bench.decode import fp8_attention_accuracy
    from memra.engine.kv_cache import ContiguousKVCache
    from memra.engine.llm import LLM
    from memra.engine.sampling import SamplingParams
    from memra.kernels.fp8_linear import FP8_ACT_MIN_T
    from memra.kernels.moe_prefill import _fp8_roundtrip
    from memra.layers.attention import Attention
    from memra.models import load_model
    from memra.quant.fp8 import quantize_fp8_block
    from memra.quant.tensor import QTensor
    from memra.quant.types import QType

    d = write_llm_dir(tmp_path / "tiny", make_tensors(3))
    model, _ = load_model(d, torch.bfloat16, device="cuda")
    acc = fp8_attention_accuracy(model, 0)
    print(f"\ntiny Step, FP8 attention vs bf16 (GPU): {acc}")
    assert acc["requantized"] == 2 * (N_LAYERS + N_MTP)
    del model
    # the CPU emulation on the same tokens (fp8_attention_accuracy's seed 0 + 3)
    cpu, _ = load_model(d, torch.float32)
    ids = torch.randint(3, cpu.config.vocab_size, (256,), generator=torch.Generator().manual_seed(3))

    def logits():
        with torch.no_grad():
            return cpu.logits(cpu(ids, torch.arange(256), ContiguousKVCache(cpu.config, 256)))

    ref = logits()
    assert 256 >= FP8_ACT_MIN_T
    for m in cpu.modules():
        if isinstance(m, Attention):
            for lin in (m.qkv, m.o):
                q = quantize_fp8_block(lin.weight.to(torch.bfloat16)).dequantize(torch.float32)
                lin.__init__(QTensor("w", QType.F32, tuple(q.shape), q), None, torch.float32)
                # the 256-token prefill runs the FP8 block recipe (memra/kernels/fp8_linear.py):
                # activations rounded per 1x128 group as well
                lin.register_forward_pre_hook(lambda m, args: (_fp8_roundtrip(args[0].reshape(-1, args[0].shape[-1]))
                                                               .reshape(args[0].shape),))
    got = logits()
    emu_top1 = float((ref.argmax(-1) == got.argmax(-1)).float().mean())
    emu_err = float((ref - got).abs().max())
    print(f"CPU fp32 emulation: top-1 {emu_top1:.4f}, max |logit error| {emu_err:.4f}")
    assert abs(acc["top1_agreement"] - emu_top1) <= 0.05, (acc, emu_top1)
    assert 0.5 * emu_err <= acc["max_abs_logit_error"] <= 1.5 * emu_err, (acc, emu_err)
    llm = LLM(str(d), device="cuda", max_model_len=256, attention_weights="fp8")
    assert llm.engine.model.layers[0].attn.qkv.packed_weight.fmt == "fp8"
    out = llm.generate([[0, 5, 9, 17]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="not yet batch-invariant (H200, 040063f: 10 of 16 prompts differ; with "
                   "every MoE call on one path 7 in graphs, 4 eager): cuBLAS GEMMs and the attention kernels "
                   "choose their reduction order by batch shape (memra/kernels/NOTES.md)")
def test_tiny_step_greedy_is_batch_invariant_on_gpu(tmp_path):
    """Issue 14's batch invariance: the tiny Step model's greedy tokens on the GPU are the same
    when each of 16 prompts decodes alone (batch 1) as when all 16 decode together (batch 16).
    Strict xfail: it tracks the open target and fails the run the day it starts to pass. (In
    batch-invariant mode, MEMRA_BATCH_INVARIANT=1, it holds: tests/test_batch_invariant.py.)"""
    from step35_tiny import greedy_alone_vs_batch

    diverged = greedy_alone_vs_batch(tmp_path)
    print(f"\nbatch 1 vs batch 16: {len(diverged)} of 16 prompts differ (prompt, first token): {diverged}")
    assert not diverged


@pytest.mark.gpu
def test_shared_expert_overlap_is_bit_identical():
    """``MoE.overlap_shared`` (the shared expert on a second CUDA stream) runs the same kernels in
    another order: a MoE layer's output, eager and replayed from a CUDA graph captured with the
    fork and join, and the whole model's logits, must equal the one-stream order bit for bit."""
    from memra.io.synthetic import build_gpu_model
    from memra.layers.moe import MoE

    default = MoE.overlap_shared
    model = build_gpu_model("tiny", 3, "cuda", "nvfp4")
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    assert moe.shared is not None
    g = torch.Generator(device="cuda").manual_seed(4)
    d = model.config.hidden_size
    try:
        for t in (1, 4, 40):
            h = torch.randn(t, d, device="cuda", generator=g).to(torch.bfloat16)
            moe.overlap_shared = False
            serial = moe(h)
            moe.overlap_shared = True
            assert torch.equal(moe(h), serial), t
            static_h, graph = h.clone(), torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                moe(static_h)  # warm-up off the capture stream
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                static_out = moe(static_h)
            for _ in range(2):
                h2 = torch.randn(t, d, device="cuda", generator=g).to(torch.bfloat16)
                static_h.copy_(h2)
                graph.replay()
                moe.overlap_shared = False
                want = moe(h2)
                moe.overlap_shared = True
                torch.cuda.synchronize()
                assert torch.equal(static_out, want), t
            del graph
        moe.__dict__.pop("overlap_shared", None)  # the class attribute decides again, for every layer
        ids = torch.randint(3, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(5)).cuda()

        def logits():
            with torch.inference_mode():
                kv = ContiguousKVCache(model.config, 64, torch.bfloat16, "cuda")
                return model.logits(model(ids, torch.arange(64, device="cuda"), kv))

        MoE.overlap_shared = True
        with_overlap = logits()
        MoE.overlap_shared = False
        assert torch.equal(with_overlap, logits())
    finally:
        MoE.overlap_shared = default  # restore the class default (on) for the tests that follow
        moe.__dict__.pop("overlap_shared", None)


@pytest.mark.gpu
def test_shared_expert_overlap_joins_its_stream_on_error(monkeypatch):
    """If the routed experts raise after the fork, the main stream still waits for the shared
    expert's side stream (join) before the error propagates, and the current stream is the main
    one again."""
    from memra.io.synthetic import build_gpu_model
    from memra.layers.moe import MoE, _side_stream

    model = build_gpu_model("tiny", 3, "cuda", "nvfp4")
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    assert moe.shared is not None and MoE.overlap_shared
    h = torch.randn(4, model.config.hidden_size, device="cuda").to(torch.bfloat16)
    want = moe(h)
    main, side = torch.cuda.current_stream(), _side_stream(h.device)
    joins = []
    wait = torch.cuda.Stream.wait_stream

    def spy(self, other):
        joins.append((self, other))
        return wait(self, other)

    def fail(*args, **kwargs):
        raise RuntimeError("routed experts failed")

    monkeypatch.setattr(torch.cuda.Stream, "wait_stream", spy)
    monkeypatch.setattr(moe.experts, "forward", fail)
    with pytest.raises(RuntimeError, match="routed experts failed"):
        moe(h)
    assert joins[0] == (side, main) and joins[-1] == (main, side), joins
    assert torch.cuda.current_stream() == main
    monkeypatch.undo()
    assert torch.equal(moe(h), want)  # the layer works again afterwards
