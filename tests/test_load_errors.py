"""Model-level checkpoint errors: each names the file, the tensor or key, and the expectation."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_gguf

from memra.config import ConfigError
from memra.io.gguf import CheckpointError, read_gguf
from memra.models import load_gguf_model


def _rewrite(src, dst, arch=None, drop=(), reshape=None, meta_over=None):
    """Copy a GGUF file with changes: other arch name, tensors dropped or replaced, metadata changed."""
    from memra.io.gguf_writer import write_gguf

    ck = read_gguf(src)
    old_arch = ck.architecture
    arch = arch or old_arch
    meta = {}
    for k, v in ck.metadata.items():
        if k.startswith("general.architecture"):
            continue
        meta[k.replace(f"{old_arch}.", f"{arch}.", 1) if k.startswith(old_arch + ".") else k] = v
    meta.update(meta_over or {})
    tensors = {n: ck.tensor(n).dequantize() for n in ck.infos if n not in drop}
    if reshape:
        name, shape = reshape
        tensors[name] = torch.randn(*shape)
    return write_gguf(dst, arch, meta, tensors)


def test_unknown_architecture(tmp_path):
    p = _rewrite(tiny_gguf(tmp_path / "a.gguf", "llama"), tmp_path / "b.gguf", arch="mamba9")
    with pytest.raises(ConfigError, match=r"b\.gguf.*architecture 'mamba9' is not supported.*llama"):
        load_gguf_model(p)


def test_missing_tensor(tmp_path):
    p = _rewrite(tiny_gguf(tmp_path / "a.gguf", "llama"), tmp_path / "b.gguf", drop=["blk.3.ffn_up.weight"])
    with pytest.raises(CheckpointError, match=r"b\.gguf: missing tensor 'blk\.3\.ffn_up\.weight'"):
        load_gguf_model(p)


def test_config_contradicts_tensor_shape(tmp_path):
    # embedding_length says 64; make one projection 64 -> 72 outputs instead of 64
    p = _rewrite(tiny_gguf(tmp_path / "a.gguf", "qwen2"), tmp_path / "b.gguf",
                 reshape=("blk.2.attn_q.weight", (72, 64)))
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.2\.attn_q\.weight' has shape \(72, 64\), expected \(64, 64\)"
                       r".*heads=4"):
        load_gguf_model(p)


def test_config_value_contradicts_weights(tmp_path):
    # head_count changed in metadata while the weights stay: every q projection now mismatches
    p = _rewrite(tiny_gguf(tmp_path / "a.gguf", "llama"), tmp_path / "b.gguf",
                 meta_over={"llama.attention.head_count": 8, "llama.attention.key_length": 16})
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_q\.weight' has shape \(64, 64\), expected \(128, 64\)"):
        load_gguf_model(p)


def test_missing_and_malformed_metadata(tmp_path):
    src = tiny_gguf(tmp_path / "a.gguf", "llama")
    ck = read_gguf(src)
    meta = dict(ck.metadata)
    del meta["llama.block_count"]
    from memra.config import ModelConfig

    with pytest.raises(ConfigError, match=r"required metadata key 'llama.block_count' is missing"):
        ModelConfig.from_gguf(meta, set(ck.infos), "x.gguf")
    meta = dict(ck.metadata, **{"llama.attention.head_count_kv": 3})
    with pytest.raises(ConfigError, match=r"head_count 4 is not a multiple of head_count_kv 3"):
        ModelConfig.from_gguf(meta, set(ck.infos), "x.gguf")


def test_unexpected_tensor(tmp_path):
    from memra.io.gguf_writer import write_gguf

    src = tiny_gguf(tmp_path / "a.gguf", "llama")
    ck = read_gguf(src)
    tensors = {n: ck.tensor(n).dequantize() for n in ck.infos}
    tensors["blk.99.attn_q.weight"] = torch.randn(64, 64)
    p = write_gguf(tmp_path / "b.gguf", "llama", {k: v for k, v in ck.metadata.items() if k != "general.architecture"},
                   tensors)
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*blk\.99\.attn_q\.weight"):
        load_gguf_model(p)


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from memra.config import RopeScaling
    from memra.layers.rope import inv_frequencies

    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=params,
                      max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inv_frequencies(500000.0, 128, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, inv_frequencies(500000.0, 128))  # scaling changed something


