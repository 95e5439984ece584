"""llama.cpp of 2026-10-01 (built from the ``llama-cpp-python==0.3.36`` sdist, memra.bench.llamacpp)
as a second, independent oracle, and its step35 file convention.

* llama.cpp's own converter (unmodified, under its pinned transformers) turns memra's
  synthetic Step-3.5 HF directory into a GGUF; memra must read that file to the logits of
  the HF directory (fp32, 1e-5 relative to the largest logit), prefill and decode across
  the sliding window: the rotary-width and ``rope_freqs`` conventions (issue: real-world
  step35 files loaded silently wrong).
* llama.cpp runs that file and memra's own step35 GGUFs (Q8_0, NVFP4): its logits must
  agree with memra's (fp32 file: 1e-5; quantized files: top-1 everywhere and a relative
  error bounded by llama.cpp's 8-bit activation quantization, which memra does not do).
* smollm2-135m, qwen2.5-coder-0.5b and gemma3-270m over a 300-token text: top-1 >= 99 %.
* A GGUF without a vocabulary runs in both from token ids.

The first test of a fresh machine builds llama.cpp's library (minutes; cached in the memra
cache afterwards) and installs the converter's transformers into the same place.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memra.engine.kv_cache import ContiguousKVCache
from memra.models import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lc():
    from memra.bench import llamacpp

    llamacpp.ensure_llama_cpp()  # a failure here fails the tests: the oracle is required
    return llamacpp


def memra_logits(model, ids: list[int], split: int) -> torch.Tensor:
    """Prefill ``ids[:split]`` in one step, then decode the rest one token at a time."""
    ids_t = torch.tensor(ids)
    cache = ContiguousKVCache(model.config, len(ids))
    out = []
    with torch.no_grad():
        out.append(model.logits(model(ids_t[:split], torch.arange(split), cache)))
        cache.advance(split)
        for t in range(split, len(ids)):
            out.append(model.logits(model(ids_t[t:t + 1], torch.tensor([t]), cache)))
            cache.advance(1)
    return torch.cat(out)


def rel_max(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def rel_norm(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


# tiny geometry: sliding window 8, so 40 tokens cross it many times, in prefill (first 20) and decode
N_TOKENS, SPLIT = 40, 20


@pytest.fixture(scope="module")
def converted(tmp_path_factory, lc):
    """memra synth HF dir (smollm2's vocabulary, which the converter recognises) -> llama.cpp's
    convert_hf_to_gguf.py -> f32 and bf16 GGUFs."""
    from memra.hub import resolve_model
    from memra.io.synthetic import load_geometry, with_vocabulary, write_synthetic

    d = tmp_path_factory.mktemp("converted")
    g = with_vocabulary(load_geometry("tiny"), resolve_model("smollm2-135m"))
    hf = write_synthetic(g, "hf-bf16", 5, d / "hf")
    files = {t: lc.convert_hf_to_gguf(hf, d / f"step35-{t}.gguf", t) for t in ("f32", "bf16")}
    ids = torch.randint(3, g["vocab"], (N_TOKENS,), generator=torch.Generator().manual_seed(11)).tolist()
    model, _ = load_model(hf, torch.float32)
    return hf, files, ids, memra_logits(model, ids, SPLIT)


def test_converter_output_has_llamacpp_conventions(converted):
    """What the converter writes (and memra therefore must read as llama.cpp does)."""
    from memra.io.gguf import read_metadata

    _, files, _, _ = converted
    meta = read_metadata(files["f32"])
    assert "step35.rope.dimension_count" not in meta  # llama.cpp: head_dim, halved for full layers in code
    assert meta["tokenizer.ggml.pre"] == "smollm"
    from memra.io.gguf import read_gguf

    ck = read_gguf(files["f32"])
    assert tuple(ck.tensor("rope_freqs.weight").shape) == (32,)  # head_dim / 2, not the full layers' 16


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_converted_gguf_equals_hf_dir(converted, outtype):
    _, files, ids, ref = converted
    model, _ = load_model(files[outtype], torch.float32)
    ours = memra_logits(model, ids, SPLIT)
    err = rel_max(ours, ref)
    print(f"\nconverter {outtype}: memra GGUF vs memra HF dir, rel max error {err:.2e}")
    assert err <= 1e-5
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_llamacpp_logits_on_converted_step35(converted, lc):
    """llama.cpp on its own converter's f32 file (f32 KV cache) == memra, prefill and decode."""
    _, files, ids, ref = converted
    for n_batch in (512, 1):  # one prefill batch; one token per eval (llama.cpp's decode path)
        theirs = torch.from_numpy(lc.logits(files["f32"], ids, n_batch=n_batch))
        err = rel_max(theirs, ref)
        print(f"\nllama.cpp n_batch={n_batch} vs memra: rel max error {err:.2e}")
        assert err <= 1e-5


def _rewrite(src: Path, dst: Path, meta_over: dict | None = None, drop_prefix: str | None = None,
             dequantize: bool = False, tensor_over: dict | None = None) -> Path:
    """A copy of GGUF ``src`` with metadata changed / dropped and tensors dequantized to f32 or replaced."""
    from memra.io.gguf import read_gguf
    from memra.io.gguf_writer import write_gguf

    ck = read_gguf(src)
    meta = {k: v for k, v in ck.metadata.items()
            if k != "general.architecture" and not (drop_prefix and k.startswith(drop_prefix))}
    tensors = {n: ck.tensor(n).dequantize(torch.float32) if dequantize else ck.tensor(n) for n in ck.infos}
    return write_gguf(dst, ck.architecture, meta | (meta_over or {}), tensors | (tensor_over or {}))


@pytest.mark.parametrize("fmt", ["gguf-q8_0", "gguf-nvfp4"])
def test_llamacpp_reads_memra_step35_gguf(fmt, tmp_path, lc):
    """memra's own writer -> llama.cpp, in two parts:

    * exact: llama.cpp on an f32 copy of the file (every tensor dequantized by memra) gives
      memra's logits on the quantized file to 1e-5: the metadata and tensor conventions agree;
    * quantized: llama.cpp on the file itself. Its CPU dot products quantize the activations to
      8 bits (q8_0 / q8_K blocks) for quantized weights, memra keeps them fp32, so its logits
      are a few % off its own f32-copy logits (measured 1-4.5 %): bounded at 6 % relative,
      top-1 >= 90 % (measured 95-100 %: this random model has near-ties). A convention or
      block-layout mismatch gives errors of order 1.
    """
    from memra.io.synthetic import write_synthetic

    path = write_synthetic("tiny", fmt, 5, tmp_path / f"{fmt}.gguf")
    f32 = _rewrite(path, tmp_path / f"{fmt}-dequantized.gguf", dequantize=True)
    ids = torch.randint(3, 512, (N_TOKENS,), generator=torch.Generator().manual_seed(12)).tolist()
    model, _ = load_model(path, torch.float32)
    ours = memra_logits(model, ids, SPLIT)
    for n_batch in (512, 1):
        exact = torch.from_numpy(lc.logits(f32, ids, n_batch=n_batch))
        quant = torch.from_numpy(lc.logits(path, ids, n_batch=n_batch))
        e_exact, e_quant = rel_max(exact, ours), rel_norm(quant, exact)
        top1 = float((quant.argmax(-1) == exact.argmax(-1)).float().mean())
        print(f"\n{fmt} n_batch={n_batch}: llama.cpp(f32 copy) vs memra rel max {e_exact:.2e}; "
              f"llama.cpp(quantized) vs llama.cpp(f32 copy) rel error {e_quant:.4f}, top-1 {top1:.3f}")
        assert e_exact <= 1e-5
        assert e_quant < 0.06 and top1 >= 0.9


TEXT_MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]


@pytest.mark.parametrize("key", TEXT_MODELS)
def test_llamacpp_logits_on_real_models(key, tmp_path, lc):
    """300 tokens teacher-forced through llama.cpp and memra (fp32 compute). llama.cpp runs an f32
    copy of the model's GGUF (weights dequantized by memra, bit-exact with the gguf package), so
    both compute with the same numbers: top-1 >= 99 % and the max error printed. On the quantized
    file itself llama.cpp quantizes its activations to 8 bits; that agreement is printed too."""
    from test_models_vs_transformers import TEXT

    from memra import LLM

    llm = LLM(key)
    ids = llm.tokenizer.encode(TEXT + "\n\n" + TEXT)[:300]
    assert len(ids) == 300
    with torch.no_grad():
        kv = ContiguousKVCache(llm.config, len(ids))
        ours = llm.model.logits(llm.model(torch.tensor(ids), torch.arange(len(ids)), kv))
    f32 = _rewrite(llm.checkpoint.path, tmp_path / f"{key}-f32.gguf", dequantize=True)
    theirs = torch.from_numpy(lc.logits(f32, ids, n_batch=512))
    quant = torch.from_numpy(lc.logits(llm.checkpoint.path, ids, n_batch=512))
    f32.unlink()
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    q_top1 = float((ours.argmax(-1) == quant.argmax(-1)).float().mean())
    diff = float((ours - theirs).abs().max())
    print(f"\n{key}: 300 tokens, llama.cpp (f32 copy) vs memra top-1 {top1:.4f}, max|diff| {diff:.3e} "
          f"(max|memra| {float(ours.abs().max()):.2f}); llama.cpp on the quantized file: top-1 {q_top1:.4f}, "
          f"rel error {rel_norm(quant, ours):.4f}")
    assert top1 >= 0.99
    assert diff <= 1e-3 * float(ours.abs().max())


def test_gguf_without_vocabulary(tmp_path, lc):
    """tokenizer.ggml.model = 'none' (an f32 copy of a synthetic file, no tokenizer keys): memra
    loads it, generates from token ids what the file with a vocabulary generates, refuses text
    with a clear error; llama.cpp runs the same file to the same logits (1e-5)."""
    from memra import LLM, SamplingParams
    from memra.io.synthetic import write_synthetic
    from memra.io.tokenizer import TokenizerError

    src = write_synthetic("tiny", "gguf-q8_0", 6, tmp_path / "with-vocab.gguf")
    path = _rewrite(src, tmp_path / "no-vocab.gguf", drop_prefix="tokenizer.", dequantize=True,
                    meta_over={"tokenizer.ggml.model": "none", "step35.vocab_size": 512})

    llm = LLM(str(path))
    out = llm.generate([[5, 9, 17, 33]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.token_ids) == 6 and c.text == ""
    with_vocab = _rewrite(src, tmp_path / "f32.gguf", dequantize=True)
    ref = LLM(str(with_vocab)).generate([[5, 9, 17, 33]], SamplingParams(temperature=0, max_tokens=6,
                                                                        ignore_eos=True))
    assert c.token_ids == ref[0].outputs[0].token_ids
    with pytest.raises(TokenizerError, match="no vocabulary.*token ids"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))
    ids = [5, 9, 17, 33, 40, 41, 42, 43, 44, 45, 46, 47]
    model, _ = load_model(path, torch.float32)
    ours = memra_logits(model, ids, len(ids))
    theirs = torch.from_numpy(lc.logits(path, ids))
    assert rel_max(theirs, ours) <= 1e-5


def test_rope_freqs_contradicting_the_rotary_metadata_is_refused(tmp_path):
    """A rope_freqs tensor whose length is not max rotary width / 2 (e.g. a file written with the
    pre-2026-12 memra convention) is refused, naming the tensor and the keys it contradicts."""
    from memra.io.gguf import CheckpointError
    from memra.io.synthetic import write_synthetic

    src = write_synthetic("tiny", "gguf-q8_0", 6, tmp_path / "ok.gguf")
    bad = _rewrite(src, tmp_path / "bad.gguf", tensor_over={"rope_freqs.weight": torch.ones(16)})
    with pytest.raises(CheckpointError, match=r"rope_freqs.*step35\.rope\.dimension_count"):
        load_model(bad, torch.float32)
