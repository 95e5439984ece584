"""Synthetic Step-3.5 checkpoints (memra.io.synthetic), the GGUF ``step35`` loader and byte accounting.

The tiny geometry is written in every format; each file must load to the logits of its own
dequantized weights run through memra's fp32 HF path (built in memory, no file), the GGUF
path must agree with the HF path on identical weights, and the quantization error of each
format against bf16 is printed (``pytest -s``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from memra.cli import main as cli_main
from memra.config import ConfigError, ModelConfig
from memra.engine.kv_cache import ContiguousKVCache
from memra.io.gguf import read_gguf
from memra.io.synthetic import (
    GEOMETRIES,
    SynthError,
    build_model,
    gguf_tokenizer_metadata,
    load_geometry,
    model_config,
    synth_tensor,
    write_synthetic,
)
from memra.layers.rope import rope_cos_sin
from memra.models import load_model
from memra.roofline import format_bytes_table, step35_bytes

SEED = 7
FILES = {"hf-bf16": "hf-bf16", "hf-fp8": "hf-fp8", "gguf-q8_0": "tiny-q8_0.gguf", "gguf-nvfp4": "tiny-nvfp4.gguf"}
EXPERT_FORMAT = {"hf-bf16": "bf16", "hf-fp8": "fp8", "gguf-q8_0": "q8_0", "gguf-nvfp4": "nvfp4"}
IDS = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(3))


_MODELS: dict[str, object] = {}


def mem_model(ef: str):
    """The in-memory tiny model with routed experts in ``ef`` (cached: models are not mutated)."""
    if ef not in _MODELS:
        _MODELS[ef] = build_model("tiny", SEED, expert_format=ef)
    return _MODELS[ef]


def run_logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(len(ids)), ContiguousKVCache(model.config, len(ids))))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    out = {}
    for fmt, name in FILES.items():
        if fmt == "gguf-q8_0":  # one format through the CLI
            assert cli_main(["convert", "synth", "--geometry", "tiny", "--format", fmt, "--seed", str(SEED),
                             "--out", str(d / name)]) == 0
            out[fmt] = d / name
        else:
            out[fmt] = write_synthetic("tiny", fmt, SEED, d / name)
    return out


@pytest.fixture(scope="module")
def refs():
    """Logits of the in-memory model per expert format (the dequantized reference of each file)."""
    return {fmt: run_logits(mem_model(ef)) for fmt, ef in EXPERT_FORMAT.items()}


@pytest.mark.parametrize("fmt", list(FILES))
def test_file_loads_to_its_dequantized_reference(fmt, files, refs):
    model, _ = load_model(files[fmt])
    got = run_logits(model)
    assert torch.isfinite(got).all()
    assert rel(got, refs[fmt]) < 1e-5, fmt
    err = rel(refs[fmt], refs["hf-bf16"])
    print(f"\n{fmt}: logits vs own dequantized weights rel {rel(got, refs[fmt]):.2e}; "
          f"quantization error vs bf16: rel {err:.4f}, top-1 agreement "
          f"{float((refs[fmt].argmax(-1) == refs['hf-bf16'].argmax(-1)).float().mean()):.2f}")
    if fmt != "hf-bf16":
        assert 1e-4 < err < 0.5  # quantized, but not garbage


def test_memory_model_equals_hf_bf16_file(files, refs):
    model, _ = load_model(files["hf-bf16"])
    assert torch.equal(run_logits(model), refs["hf-bf16"])


@pytest.mark.parametrize("fmt,ef", [("gguf-q8_0", "q8_0"), ("gguf-nvfp4", "nvfp4")])
def test_gguf_path_equals_hf_path_on_identical_weights(fmt, ef, files):
    """Same numbers through from_gguf (GGUF names, 1 + w norms, rope_freqs, no q/k permutation)
    and from_hf (hub names, w norms, llama3 scaling from the config): also the MTP drafts."""
    g_model, _ = load_model(files[fmt])
    h_model = mem_model(ef)
    def plain(layers):  # llama3 scaling: from the config (HF) vs from the rope_freqs tensor (GGUF)
        return [dataclasses.replace(lc, rope_scaling=None, rope_freq_factors=None) for lc in layers]

    gc, hc = g_model.config, h_model.config
    assert plain(gc.layers) == plain(hc.layers) and plain(gc.mtp_layers) == plain(hc.mtp_layers)
    assert gc.moe == hc.moe and gc.vocab_size == hc.vocab_size
    assert math.isclose(gc.rms_norm_eps, hc.rms_norm_eps, rel_tol=1e-6)  # GGUF stores it as float32
    assert all(lc.rope_freq_factors is not None for lc in gc.layers if lc.attention == "full")
    ids = IDS[:16]
    with torch.no_grad():
        hg = g_model(ids, torch.arange(16), ContiguousKVCache(g_model.config, 16), prenorm=True)
        hh = h_model(ids, torch.arange(16), ContiguousKVCache(h_model.config, 16), prenorm=True)
        assert rel(g_model.logits(g_model.norm(hg)), h_model.logits(h_model.norm(hh))) < 1e-5
        tg, lg = g_model.draft(hg, ids[1:].tolist() + [5], 2, return_logits=True)
        th, lh = h_model.draft(hh, ids[1:].tolist() + [5], 2, return_logits=True)
    assert torch.equal(tg, th) and rel(lg, lh) < 1e-5


def test_gguf_file_reads_with_the_gguf_package(files):
    """Expert banks are 3-D [E, I, D] in torch order (ggml ne = [D, I, E]) and dequantize alike."""
    import gguf

    r = gguf.GGUFReader(str(files["gguf-nvfp4"]))
    t = {x.name: x for x in r.tensors}["blk.3.ffn_gate_exps.weight"]
    g = GEOMETRIES["tiny"]
    assert list(t.shape) == [g["hidden"], g["expert_inter"], g["experts"]]
    ours = read_gguf(files["gguf-nvfp4"]).tensor("blk.3.ffn_down_exps.weight")
    assert ours.shape == (g["experts"], g["hidden"], g["expert_inter"])
    q8 = read_gguf(files["gguf-q8_0"]).tensor("blk.4.ffn_up_exps.weight")
    t8 = {x.name: x for x in gguf.GGUFReader(str(files["gguf-q8_0"])).tensors}["blk.4.ffn_up_exps.weight"]
    ref = gguf.quants.dequantize(t8.data, t8.tensor_type)
    np.testing.assert_array_equal(q8.dequantize().numpy(), ref.reshape(q8.shape))
    meta = read_gguf(files["gguf-q8_0"]).metadata
    assert meta["step35.attention.sliding_window_pattern"][:5] == [False, True, True, True, False]
    # norms hold 1 + w
    w = synth_tensor("model.layers.2.input_layernorm.weight", (g["hidden"],), SEED).float()
    stored = read_gguf(files["gguf-q8_0"]).tensor("blk.2.attn_norm.weight").dequantize()
    assert torch.equal(stored, w + 1.0)


def test_activations_stay_sane_and_routing_is_skewed(capsys):
    model = mem_model("bf16")
    ids = torch.randint(3, 512, (256,), generator=torch.Generator().manual_seed(5))
    rms = []
    with torch.no_grad():
        x = model.embed(ids)
        kv = ContiguousKVCache(model.config, len(ids))
        for i, layer in enumerate(model.layers):
            cos, sin = rope_cos_sin(model.config.layers[i], torch.arange(len(ids)), x.dtype)
            pending, stream = layer(x, None, cos, sin, kv)  # the layer's output is their sum
            x = pending + stream
            rms.append(float(x.pow(2).mean().sqrt()))
        logits = model.logits(model.norm(x))
    assert all(0.3 < r < 30 for r in rms), rms
    assert torch.isfinite(logits).all() and float(logits.std()) > 0.3
    assert float(logits.std(dim=0).mean()) > 0.3  # not constant across positions
    shares = {}
    for i, c in model.routing_stats().items():
        shares[i] = float(c.max() / c.sum())
        assert int((c > 0).sum()) >= c.numel() // 2  # long tail: most experts get tokens
        assert shares[i] > 1.5 / c.numel()  # a hot expert: well above the uniform share
    with capsys.disabled():
        print(f"\nresidual RMS after each layer: {[round(r, 2) for r in rms]}")
        print(f"top-expert share of (token, expert) pairs per MoE layer (uniform {1 / 16:.4f}): "
              f"{ {k: round(v, 3) for k, v in shares.items()} }")


def test_synthetic_is_deterministic_and_nonzero():
    a = synth_tensor("model.layers.3.moe.gate_proj.weight", (16, 128, 256), 1)
    assert torch.equal(a, synth_tensor("model.layers.3.moe.gate_proj.weight", (16, 128, 256), 1))
    assert not torch.equal(a, synth_tensor("model.layers.3.moe.gate_proj.weight", (16, 128, 256), 2))
    assert not torch.equal(a, synth_tensor("model.layers.4.moe.gate_proj.weight", (16, 128, 256), 1))
    assert int((a == 0).sum()) < a.numel() // 1000


def test_full_geometry_matches_step35():
    c = model_config(load_geometry("full"))
    assert (c.hidden_size, c.num_layers, len(c.mtp_layers), c.vocab_size, c.intermediate_size) == \
        (4096, 45, 3, 128896, 11264)
    for i, lc in enumerate(c.layers + c.mtp_layers):
        full = i < 45 and i % 4 == 0
        assert lc.attention == ("full" if full else "sliding")
        assert (lc.num_heads, lc.num_kv_heads, lc.head_dim) == (64 if full else 96, 8, 128)
        assert lc.rotary_dim == (64 if full else 128) and lc.rope_theta == (5e6 if full else 1e4)
        assert (lc.rope_scaling is not None) == full and lc.sliding_window == (None if full else 512)
        assert lc.mlp == ("moe" if 3 <= i < 45 else "dense")
        assert lc.swiglu_limit == (7.0 if i in (43, 44) else None)
        assert lc.swiglu_limit_shared == (16.0 if i in (43, 44) else None)
    sc = c.layers[0].rope_scaling
    assert (sc.kind, sc.factor, sc.low_freq_factor, sc.high_freq_factor, sc.original_max_position) == \
        ("llama3", 2.0, 1.0, 32.0, 131072)
    m = c.moe
    assert (m.num_experts, m.top_k, m.expert_intermediate_size, m.shared_intermediate_size,
            m.routed_scaling_factor) == (288, 8, 1280, 1280, 3.0)
    assert c.rms_norm_eps == 1e-5 and c.bos_token_id == 0 and c.eos_token_ids == [1, 2, 128007]


def test_full_geometry_byte_accounting(capsys):
    a = step35_bytes(model_config(load_geometry("full")), context=4096)
    D, V = 4096, 128896
    full_attn = 64 * 128 * D * 2 + 2 * 8 * 128 * D + 64 * D
    swa_attn = 96 * 128 * D * 2 + 2 * 8 * 128 * D + 96 * D
    assert a["params"]["attention"] == 12 * full_attn + 33 * swa_attn
    assert a["params"]["routed_experts"] == 42 * 288 * 3 * D * 1280
    assert a["decode"]["nvfp4"]["routed_experts"] == 42 * 8 * 3 * D * 1280 * 36 / 64
    assert a["decode"]["bf16"]["lm_head"] == 2 * V * D and a["decode"]["bf16"]["embed"] == 2 * D
    main = a["param_total"] - a["params"]["mtp"]
    assert 196e9 < main < 197.5e9  # "196B parameters"
    assert 118e9 < a["resident"]["nvfp4"]["total_without_mtp"] < 126e9  # GPU.md: ~122 GB
    assert 14.5e9 < a["decode"]["nvfp4"]["total"] < 16e9  # GPU.md: ~15 GB per batch-1 decode step
    assert 200e9 < a["resident"]["fp8"]["total_without_mtp"] < 210e9  # GPU.md: ~205 GB
    with capsys.disabled():
        print("\n" + format_bytes_table(a))


def test_inspect_geometry_and_step35_gguf(files, capsys):
    assert cli_main(["inspect", "--geometry", "full"]) == 0
    out = capsys.readouterr().out
    assert "routed_experts" in out and "total (no MTP)" in out
    assert cli_main(["inspect", str(files["gguf-nvfp4"])]) == 0
    out = capsys.readouterr().out
    assert "arch        step35" in out and "NVFP4" in out and "routed_experts" in out
    assert cli_main(["inspect", str(files["hf-fp8"])]) == 0
    assert "experts=16" in capsys.readouterr().out


def test_generate_cli_on_synthetic_gguf(files, capsys):
    from memra.io.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(files["gguf-q8_0"])
    ids = tok.encode("the cat sat", add_special_tokens=False)
    assert tok.decode(ids) == "the cat sat" and len(ids) < len("the cat sat")  # merges apply
    assert cli_main(["generate", "--model", str(files["gguf-q8_0"]), "--prompt", "hello", "--max-tokens", "4",
                     "--temperature", "0", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_on_synthetic_hf_dir(files):
    """An hf-* directory carries tokenizer.json; LLM generates from it, greedy equal to the GGUF's tokenizer."""
    from memra import LLM, SamplingParams
    from memra.io.tokenizer import Tokenizer

    llm = LLM(str(files["hf-bf16"]))
    gguf_tok = Tokenizer.from_gguf(files["gguf-q8_0"])
    assert llm.tokenizer.encode("the cat sat") == gguf_tok.encode("the cat sat")
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4


def test_tokenizer_metadata_sizes():
    for v in (259, 512, 2000):
        m = gguf_tokenizer_metadata(v)
        assert len(m["tokenizer.ggml.tokens"]) == v == len(set(m["tokenizer.ggml.tokens"]))
        have = set(m["tokenizer.ggml.tokens"])
        assert all(a in have and b in have for a, b in (x.split(" ") for x in m["tokenizer.ggml.merges"]))
    with pytest.raises(SynthError, match="too small"):
        gguf_tokenizer_metadata(100)


def test_quantize_q4_k_against_gguf_dequantize():
    """memra's Q4_K encoder produces blocks gguf.quants decodes to within the expected error
    (no reference quantizer exists in the gguf package to compare bytes with)."""
    import gguf

    from memra.quant.dequant import quantize_q4_k, quantize_q8_0
    from memra.quant.tensor import QTensor
    from memra.quant.types import QType

    g = torch.Generator().manual_seed(11)
    w = torch.randn(48, 1024, generator=g) * 0.05
    w[1] += 0.5  # all-positive rows (min 0), and a row with one outlier
    w[2, 7] = 3.0
    w[3] = 0.0  # all-zero super-blocks decode to exactly zero
    raw = quantize_q4_k(w)
    assert raw.shape == (48, 1024 // 256 * 144) and raw.dtype == torch.uint8
    ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_K))
    assert torch.equal(QTensor("w", QType.Q4_K, (48, 1024), raw).dequantize(), ref)
    assert torch.equal(ref[3], torch.zeros(1024))
    err = rel(ref, w)
    rows = [rel(ref[i], w[i]) for i in range(4, 48)]
    q8 = rel(QTensor("w", QType.Q8_0, (48, 1024), quantize_q8_0(w)).dequantize(), w)
    print(f"\nQ4_K round-trip rel error {err:.4f} (max row {max(rows):.4f}); Q8_0 {q8:.4f}")
    assert err < 0.1 and max(rows) < 0.1 and q8 < err  # Gaussian rows: ~ (range / 15) / sqrt(12) = 8%
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q4_k(torch.randn(4, 128))


def test_gguf_q4_k_synthetic(tmp_path):
    geo = {"expert_inter": 256, "experts": 8, "top_k": 2, "layers": 4, "mtp_layers": 1}
    with pytest.raises(SynthError, match="multiples of the 256-weight block"):
        write_synthetic("tiny", "gguf-q4_k", 0, tmp_path / "x.gguf")
    path = write_synthetic(geo, "gguf-q4_k", 3, tmp_path / "q4k.gguf")
    model, ck = load_model(path)
    assert ck.tensor("blk.3.ffn_down_exps.weight").qtype.name == "Q4_K"
    got = run_logits(model)
    ref = run_logits(build_model(geo, 3, expert_format="q4_k"))
    assert rel(got, ref) < 1e-5
    err = rel(ref, run_logits(build_model(geo, 3)))
    print(f"\ngguf-q4_k: quantization error vs bf16: rel {err:.4f}")
    assert 1e-4 < err < 0.5


def test_unsupported_format_and_bad_geometry(tmp_path):
    with pytest.raises(SynthError, match="unknown format"):
        write_synthetic("tiny", "gguf-q2", 0, tmp_path / "x.gguf")
    with pytest.raises(SynthError, match="unknown geometry keys"):
        load_geometry({"hiden": 3})
    with pytest.raises(SynthError, match="neither"):
        load_geometry("huge")
    assert cli_main(["convert", "synth", "--format", "gguf-q4_k", "--out", str(tmp_path / "y.gguf")]) == 2  # tiny


def test_step35_gguf_metadata_errors(files):
    ck = read_gguf(files["gguf-q8_0"])
    meta = dict(ck.metadata)
    names = set(ck.infos)
    ModelConfig.from_gguf(meta, names, "x")
    for key, val, msg in [("step35.attention.head_count", [4, 8], "array of block_count"),
                          ("step35.expert_gating_func", 1, "expert_gating_func"),
                          ("step35.nextn_predict_layers", 99, "nextn_predict_layers"),
                          # llama.cpp's convention: full layers rotate dimension_count / 2
                          ("step35.rope.dimension_count", 66, "rope.dimension_count = 66 must be a positive multiple of 4"),
                          ("step35.rope.dimension_count", 256, "half of it .* at most head_dim = 64"),
                          ("step35.rope.dimension_count_swa", 96, "rope.dimension_count_swa = 96 .* head_dim = 64")]:
        with pytest.raises(ConfigError, match=msg):
            ModelConfig.from_gguf(meta | {key: val}, names, "x")
    bad = {k: v for k, v in meta.items() if k != "step35.rope.freq_base"}
    with pytest.raises(ConfigError, match="rope.freq_base"):
        ModelConfig.from_gguf(bad, names, "x")
    assert math.isclose(ModelConfig.from_gguf(meta, names, "x").moe.routed_scaling_factor, 3.0)
