"""``memra bench prefill`` (memra/bench/prefill.py) on the CPU: the roofline accounting against
hand-computed numbers at a tiny geometry (sliding windows smaller than the chunk, a prefix,
fp8 vs bf16 expert ceilings), argument errors, the CLI's help and its no-GPU error, and the
GPU-free parts of the run (chunk inputs through the model, the phase split's routing, the
engine TTFT loop) on the tiny synthetic model on the CPU. The GPU run itself is on the H200."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from memra.bench import prefill as pf
from memra.bench.common import expert_nbytes
from memra.io.synthetic import load_geometry, model_config

BF16, FP8, FP32, BW = 800e12, 1600e12, 50e12, 4e12


def _memra(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="" if not torch.cuda.is_available() else os.environ.get(
        "CUDA_VISIBLE_DEVICES", ""))
    return subprocess.run([sys.executable, "-m", "memra", "bench", "prefill", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    pf.add_prefill_args(p)
    return p.parse_args(list(argv))


# ---------------------------------------------------------------------------------------
# attention key counts


def _brute_visible(t, prefix, window):
    return sum(min(p + 1, window) if window else p + 1 for p in range(prefix, prefix + t))


@pytest.mark.parametrize("t", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("prefix", [0, 1, 5, 8, 40])
@pytest.mark.parametrize("window", [None, 1, 3, 8, 64])
def test_visible_keys_matches_brute_force(t, prefix, window):
    assert pf.visible_keys(t, prefix, window) == _brute_visible(t, prefix, window)


def test_visible_and_read_keys_by_hand():
    # full layer, 4 queries at positions 0..3: 1 + 2 + 3 + 4
    assert pf.visible_keys(4, 0, None) == 10
    # window 2 smaller than the chunk: 1 + 2 + 2 + 2
    assert pf.visible_keys(4, 0, 2) == 7
    # prefix 3, window 2: positions 3..6 each see 2
    assert pf.visible_keys(4, 3, 2) == 8 and pf.keys_read(4, 3, 2) == 5  # keys 2..6
    assert pf.keys_read(4, 3, None) == 7 and pf.keys_read(4, 0, 8) == 4
    # the flagship's sliding layer at T = 4096: 512 * 513 / 2 + (4096 - 512) * 512
    assert pf.visible_keys(4096, 0, 512) == 512 * 513 // 2 + 3584 * 512
    for bad in ((0, 0, None), (4, -1, None), (4, 0, 0)):
        with pytest.raises(ValueError):
            pf.visible_keys(*bad)


def test_gemm_cost():
    c = pf.gemm_cost(3, 4, 5)
    assert c == dict(flops=2.0 * 3 * 4 * 5, bytes=2 * 4 * 5 + 2 * 3 * 4 + 2 * 3 * 5)
    c = pf.gemm_cost(3, 4, 5, weight_bytes=80, out_bytes=4)
    assert c["bytes"] == 80 + 24 + 60


# ---------------------------------------------------------------------------------------
# the roofline, by hand at the tiny geometry

# tiny: hidden 256, 6 layers (3 dense, 3 MoE), full every 4 (layers 0 and 4 full: 4 heads;
# 1, 2, 3, 5 sliding window 8: 8 heads), 2 KV heads, head_dim 64, 16 experts top-4 x 128,
# shared 128, dense 384, vocab 512
TINY = load_geometry("tiny") | {"mtp_layers": 0}


def _roof(t=16, prefix=0, fmt="bf16", active=10, **kw):
    kw = dict(bf16_flops_per_s=BF16, copy_bytes_per_s=BW, fp8_flops_per_s=FP8, fp32_flops_per_s=FP32) | kw
    return pf.prefill_roofline(TINY, t, prefix, expert_format=fmt, active_experts=active, **kw)


def _floor(flops, nbytes, fps):
    return max(flops / fps, nbytes / BW) * 1e3


def test_tiny_geometry_is_what_the_hand_numbers_assume():
    c = model_config(TINY)
    assert [lc.sliding_window for lc in c.layers] == [None, 8, 8, 8, None, 8]
    assert [lc.num_heads for lc in c.layers] == [4, 8, 8, 8, 4, 8]
    assert [lc.mlp for lc in c.layers] == ["dense"] * 3 + ["moe"] * 3
    assert (c.hidden_size, c.vocab_size, c.intermediate_size) == (256, 512, 384)
    m = c.moe
    assert (m.num_experts, m.top_k, m.expert_intermediate_size, m.shared_intermediate_size) == (16, 4, 128, 128)


def test_attention_pieces_by_hand_with_a_prefix_and_windows_smaller_than_t():
    t, prefix = 16, 5
    r = _roof(t, prefix)
    D, KV, Dh = 256, 2, 64
    flops = nbytes = ms = 0.0
    for H, W in ((4, None), (8, 8), (8, 8), (8, 8), (4, None), (8, 8)):
        # queries at 5..20 see p + 1 keys (full) or min(p + 1, 8) (sliding: 6, 7, then 8 x 14)
        vis = sum(range(6, 22)) if W is None else 6 + 7 + 8 * 14
        read = 21 if W is None else 21 - max(0, 5 - 8 + 1)
        f = 4.0 * Dh * H * vis
        b = 2 * KV * Dh * 2 * (read + t) + 2 * t * H * Dh * 2
        flops, nbytes, ms = flops + f, nbytes + b, ms + _floor(f, b, BF16)
    core = r["pieces"]["attn_core"]
    assert core["flops"] == flops and core["bytes"] == nbytes
    assert core["ms"] == pytest.approx(ms) and core["ops"] == 6 and core["ceiling"] == "bf16"
    # prefix past the window: keys read start at prefix - window + 1
    r2 = _roof(16, 20)
    sl = 2 * KV * Dh * 2 * ((36 - 13) + 16) + 2 * 16 * 8 * Dh * 2
    fl = 2 * KV * Dh * 2 * (36 + 16) + 2 * 16 * 4 * Dh * 2
    assert r2["pieces"]["attn_core"]["bytes"] == 4 * sl + 2 * fl
    assert r2["pieces"]["attn_core"]["flops"] == 4.0 * Dh * (4 * 8 * 8 * 16 + 2 * 4 * sum(range(21, 37)))

    proj = r["pieces"]["attn_proj"]
    want_f = want_ms = 0.0
    for H in (4, 8, 8, 8, 4, 8):
        n = H * Dh + 2 * KV * Dh + H
        f1, b1 = 2.0 * t * D * n, 2 * D * n + 2 * t * D + 2 * t * n
        f2, b2 = 2.0 * t * H * Dh * D, 2 * H * Dh * D + 2 * t * H * Dh + 2 * t * D
        want_f += f1 + f2
        want_ms += _floor(f1, b1, BF16) + _floor(f2, b2, BF16)
    assert proj["flops"] == want_f and proj["ms"] == pytest.approx(want_ms) and proj["ops"] == 12
    assert r["phases"]["attention"] == pytest.approx(proj["ms"] + core["ms"])


def test_mlp_router_head_embed_pieces_by_hand():
    t = 16
    r = _roof(t, 0, "bf16", active=[10, 12, 16])
    D, V, E, k, I, Is, Id = 256, 512, 16, 4, 128, 128, 384
    p = r["pieces"]
    # routed experts: per layer gate+up [pairs, D] x [D, 2I] and down, weights of the active experts
    want_f = want_ms = 0.0
    for a in (10, 12, 16):
        pairs = t * k
        gu_f, dn_f = 2.0 * pairs * 2 * I * D, 2.0 * pairs * D * I
        gu_b = a * 2 * 2 * I * D + t * D * 2 + pairs * I * 2
        dn_b = a * 2 * D * I + pairs * I * 2 + t * D * 2
        want_f += gu_f + dn_f
        want_ms += _floor(gu_f, gu_b, BF16) + _floor(dn_f, dn_b, BF16)
    assert p["routed_experts"]["flops"] == want_f == 3 * 2.0 * t * k * 3 * I * D
    assert p["routed_experts"]["ms"] == pytest.approx(want_ms) and p["routed_experts"]["ceiling"] == "bf16"
    # router: fp32 logits at the fp32 ceiling
    rf, rb = 2.0 * t * D * E, 4 * D * E + 2 * t * D + 4 * t * E
    assert p["router"]["flops"] == 3 * rf and p["router"]["bytes"] == 3 * rb
    assert p["router"]["ms"] == pytest.approx(3 * _floor(rf, rb, FP32)) and p["router"]["ceiling"] == "fp32"
    # shared experts (3 MoE layers) and dense MLPs (3 dense layers): two bf16 GEMMs each
    sh = _floor(2.0 * t * D * 2 * Is, 2 * D * 2 * Is + 2 * t * D + 2 * t * 2 * Is, BF16) + \
        _floor(2.0 * t * Is * D, 2 * Is * D + 2 * t * Is + 2 * t * D, BF16)
    assert p["shared_experts"]["ms"] == pytest.approx(3 * sh) and p["shared_experts"]["ops"] == 6
    dn = _floor(2.0 * t * D * 2 * Id, 2 * D * 2 * Id + 2 * t * D + 2 * t * 2 * Id, BF16) + \
        _floor(2.0 * t * Id * D, 2 * Id * D + 2 * t * Id + 2 * t * D, BF16)
    assert p["dense_mlp"]["ms"] == pytest.approx(3 * dn)
    # LM head on the last token only; embedding gather bytes only
    assert p["lm_head"]["flops"] == 2.0 * D * V and p["lm_head"]["bytes"] == 2 * D * V + 2 * D + 2 * V
    assert p["embed"]["flops"] == 0 and p["embed"]["bytes"] == 2 * t * D * 2
    # totals
    assert r["total_ms"] == pytest.approx(sum(v["ms"] for v in p.values()))
    assert r["total_ms"] == pytest.approx(sum(r["phases"].values()))
    assert r["tok_s"] == pytest.approx(t / r["total_ms"] * 1e3)
    assert r["active_experts"] == [10, 12, 16]


def test_fp8_experts_use_the_fp8_ceiling_and_nvfp4_the_bf16_one():
    t = 512  # compute bound at these ceilings: the ceiling choice shows
    D, I, k = 256, 128, 4
    flops = 3 * 2.0 * t * k * 3 * I * D
    r8 = _roof(t, 0, "fp8", 16, copy_bytes_per_s=1e18)
    assert r8["expert_ceiling"] == "fp8" and r8["pieces"]["routed_experts"]["ceiling"] == "fp8"
    assert r8["pieces"]["routed_experts"]["ms"] == pytest.approx(flops / FP8 * 1e3)
    r4 = _roof(t, 0, "nvfp4", 16, copy_bytes_per_s=1e18)
    assert r4["expert_ceiling"] == "bf16"
    assert r4["pieces"]["routed_experts"]["ms"] == pytest.approx(flops / BF16 * 1e3)
    # fp8 without a measured fp8 ceiling falls back to bf16
    assert _roof(t, 0, "fp8", 16, fp8_flops_per_s=None)["expert_ceiling"] == "bf16"
    # byte-bound: the weights as stored (fp8 codes + block scales vs nvfp4 packing)
    rb8, rb4 = _roof(16, 0, "fp8", 16, bf16_flops_per_s=1e20, fp8_flops_per_s=1e20), \
        _roof(16, 0, "nvfp4", 16, bf16_flops_per_s=1e20)
    w8 = 3 * 16 * (expert_nbytes("fp8", 2 * I, D) + expert_nbytes("fp8", D, I))
    w4 = 3 * 16 * (expert_nbytes("nvfp4", 2 * I, D) + expert_nbytes("nvfp4", D, I))
    assert rb8["pieces"]["routed_experts"]["bytes"] - rb4["pieces"]["routed_experts"]["bytes"] \
        == w8 - w4 + 3 * 2 * (16 * 4 * I * 1 + 16 * 4 * (I // 128) * 4 - 16 * 4 * I * 2)
    # the router without a measured fp32 ceiling uses bf16
    assert _roof(fp32_flops_per_s=None)["router_ceiling"] == "bf16"


def test_roofline_accepts_a_config_and_the_full_geometry_is_plausible():
    a = _roof(16, 3)
    b = pf.prefill_roofline(model_config(TINY), 16, 3, expert_format="bf16", active_experts=10,
                            bf16_flops_per_s=BF16, copy_bytes_per_s=BW, fp8_flops_per_s=FP8, fp32_flops_per_s=FP32)
    assert a == b
    # the flagship at 4096 tokens: ~90 TFLOP of linear layers (GPU.md), ~6.5 TFLOP of attention
    full = pf.prefill_roofline(load_geometry("full") | {"mtp_layers": 0}, 4096, 0, expert_format="nvfp4",
                               active_experts=284, bf16_flops_per_s=BF16, copy_bytes_per_s=BW)
    lin = full["total_flops"] - full["pieces"]["attn_core"]["flops"]
    assert 85e12 < lin < 95e12 and 6e12 < full["pieces"]["attn_core"]["flops"] < 7e12
    assert 100 < full["total_ms"] < 150


def test_roofline_errors():
    with pytest.raises(ValueError, match="format"):
        _roof(fmt="fp4")
    with pytest.raises(ValueError, match="MoE layers"):
        _roof(active=[1, 2])
    with pytest.raises(ValueError, match="out of range"):
        _roof(active=17)
    with pytest.raises(ValueError, match="out of range"):
        _roof(t=1, active=5)  # 1 token x top-4 reaches at most 4 experts
    with pytest.raises(ValueError, match="t ="):
        _roof(t=0)
    with pytest.raises(ValueError, match="prefix"):
        _roof(prefix=-1)
    with pytest.raises(ValueError, match="copy_bytes_per_s"):
        _roof(copy_bytes_per_s=0)


# ---------------------------------------------------------------------------------------
# arguments and the CLI


def test_defaults_parse():
    a = _args()
    assert (a.geometry, a.layers, a.expert_format, a.chunk, a.prefix, a.reps, a.seed, a.ttft_prompt, a.no_ttft,
            a.json_out) == ("full", None, "nvfp4", 4096, 0, 5, 0, 4096, False, None)
    pf.check_args(a)


def test_batch_invariant_flag_sets_the_mode_and_none_leaves_the_environment(monkeypatch):
    from memra.bench.common import apply_batch_invariant
    from memra.kernels.batch_invariant import batch_invariant, set_batch_invariant

    try:
        monkeypatch.setenv("MEMRA_BATCH_INVARIANT", "0")
        assert apply_batch_invariant(_args("--batch-invariant", "on")) is True and batch_invariant()
        monkeypatch.setenv("MEMRA_BATCH_INVARIANT", "1")
        assert apply_batch_invariant(_args("--batch-invariant", "off")) is False and not batch_invariant()
        set_batch_invariant(None)
        assert _args().batch_invariant is None
        assert apply_batch_invariant(_args()) is True  # no flag: the environment's 1
        monkeypatch.setenv("MEMRA_BATCH_INVARIANT", "0")
        assert apply_batch_invariant(_args()) is False
        with pytest.raises(SystemExit):
            _args("--batch-invariant", "yes")
    finally:
        set_batch_invariant(None)


@pytest.mark.parametrize("argv, msg", [(("--chunk", "0"), "--chunk"), (("--chunk", "-5"), "--chunk"),
                                       (("--prefix", "-1"), "--prefix"), (("--reps", "0"), "--reps"),
                                       (("--layers", "0"), "--layers"), (("--ttft-prompt", "0"), "--ttft-prompt")])
def test_bad_arguments_are_clear_errors(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        pf.check_args(_args(*argv))


def test_bad_expert_format():
    a = _args()
    a.expert_format = "fp8"  # no GPU-memory builder for it
    with pytest.raises(SystemExit, match="--expert-format 'fp8'.*nvfp4, bf16"):
        pf.check_args(a)
    r = _memra("--expert-format", "fp8")
    assert r.returncode == 2 and "--expert-format" in r.stderr and "invalid choice" in r.stderr
    r = _memra("--chunk", "x")
    assert r.returncode == 2 and "--chunk" in r.stderr


def test_cli_help():
    r = _memra("--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--geometry", "--layers", "--expert-format", "--chunk", "--prefix", "--reps", "--seed", "--json-out",
                "--no-ttft", "--ttft-prompt"):
        assert opt in r.stdout
    r = subprocess.run([sys.executable, "-m", "memra", "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "prefill" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_cli_without_cuda_is_a_clear_error():
    r = _memra("--no-ttft")
    assert r.returncode == 1 and "memra bench prefill: needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    r = _memra("--chunk", "0")  # argument errors come first
    assert r.returncode == 1 and "--chunk" in r.stderr


# ---------------------------------------------------------------------------------------
# the GPU-free parts of the run, on the tiny model on the CPU


@pytest.fixture(scope="module")
def tiny_model():
    from memra.io.synthetic import build_model

    return build_model(TINY, seed=3)


@pytest.mark.parametrize("prefix", [0, 12])
def test_chunk_inputs_run_the_model_as_the_engine_does(tiny_model, prefix):
    from memra.engine.kv_cache import ContiguousKVCache

    m = tiny_model
    t = 20
    _, kv, ids, pos = pf.chunk_inputs(m, t, prefix, seed=1, device="cpu")
    assert ids.shape == (t,) and int(ids.min()) >= 3 and int(ids.max()) < m.config.vocab_size
    assert pos.tolist() == list(range(prefix, prefix + t))
    with torch.inference_mode():
        h1 = m(ids, pos, kv)
        h2 = m(ids, pos, kv)  # the same PagedBatch again: the same result (reusable, as the bench times it)
        logits = m.logits(h1[-1:])
    assert torch.equal(h1, h2) and logits.shape == (1, m.config.vocab_size) and bool(torch.isfinite(logits).all())
    if prefix == 0:  # nothing cached: equals a fresh contiguous cache
        ref = ContiguousKVCache(m.config, t)
        with torch.inference_mode():
            torch.testing.assert_close(m(ids, pos, ref), h1)


def test_phase_split_routes_and_times_every_phase(tiny_model, monkeypatch):
    calls = []

    def fake_time(fn, reps, warm=2):
        fn()
        calls.append(fn.__name__)
        return 1.0

    monkeypatch.setattr(pf, "_time", fake_time)
    _, kv, ids, pos = pf.chunk_inputs(tiny_model, 16, 0, seed=0, device="cpu")
    phases, distinct = pf._phases(tiny_model, ids, pos, kv, reps=1)
    assert list(phases) == list(pf.PHASES) and calls == ["embed", "attention", "router", "routed", "shared", "dense",
                                                         "head"]
    assert len(distinct) == 3 and all(4 <= d <= 16 for d in distinct)  # 16 tokens x top-4 over 16 experts
    pf.prefill_roofline(tiny_model.config, 16, 0, expert_format="bf16", active_experts=distinct,
                        bf16_flops_per_s=BF16, copy_bytes_per_s=BW)


def test_ttft_through_the_engine_on_the_cpu(tiny_model):
    a = _args("--geometry", "tiny", "--chunk", "16", "--ttft-prompt", "40")
    res = pf._ttft(tiny_model, a, device="cpu")
    assert res["prompt_tokens"] == 40 and res["steps"] == 3  # 16 + 16 + 8
    assert res["ttft_ms"] > 0 and res["first_run_ttft_ms"] > 0 and "KV cache" in res["kv_cache"]


def test_print_table_renders(capsys):
    roof = _roof(16, 0, "nvfp4", 10)
    res = dict(machine="H200", torch="x", commit="c", geometry="tiny", layers=6, layers_full=45, cut=True,
               expert_format="nvfp4", chunk=16, prefix=0, copy_bandwidth_Bps=BW,
               ceilings=dict(bf16_flops_per_s=BF16, fp8_flops_per_s=None, fp32_flops_per_s=FP32),
               chunk_ms=2 * roof["total_ms"], tok_s=1.0, logits_finite=True, phases_ms={p: 0.1 for p in pf.PHASES},
               phases_sum_ms=0.7, active_experts_mean=10.0, skewed_routing_active=12, roofline=roof,
               roofline_ms=roof["total_ms"], roofline_tok_s=roof["tok_s"], pct_of_roofline=50.0,
               ttft=dict(prompt_tokens=40, max_num_batched_tokens=16, ttft_ms=5.0, steps=3, prefill_tok_s=8000.0,
                         first_run_ttft_ms=9.0))
    pf.print_table(res)
    out = capsys.readouterr().out
    assert "(CUT)" in out and "50.0 pct of roofline" in out and "in 3 steps" in out and "routed_experts" in out
