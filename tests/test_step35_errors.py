"""Bad Step-3.5 checkpoints and configs fail with messages naming the file, tensor or key, and the expectation."""

from __future__ import annotations

import json

import pytest
import torch
from step35_tiny import I_EXP, E, hub_config, make_tensors, per_expert, write_checkpoint

from memra.config import ConfigError, ModelConfig
from memra.io.gguf import CheckpointError
from memra.models import load_model
from memra.quant.fp8 import quantize_fp8_block
from memra.quant.types import UnsupportedQTypeError


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tensors():
    return make_tensors()


@pytest.fixture(scope="module")
def good(tmp_path_factory, tensors):
    return write_checkpoint(tmp_path_factory.mktemp("good"), tensors)


def with_config(tmp_path, good, **over):
    """The good weights (symlinked) under a modified config.json."""
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "model.safetensors").symlink_to(good / "model.safetensors")
    cfg = hub_config(**over)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_good_checkpoint_loads(good):
    model, ckpt = load_model(good)
    assert model.config.arch == "step35" and len(model.mtp) == 3


# ---------------------------------------------------------------------------- weights


def test_wrong_shape(tmp_path, tensors):
    t = dict(tensors)
    t["model.layers.1.self_attn.q_proj.weight"] = torch.randn(192, 256)
    d = write_checkpoint(tmp_path / "c", t)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.1\.self_attn\.q_proj\.weight' "
                       r"has shape \(192, 256\), expected \(256, 256\) from the config \(layer 1 \(sliding\): "
                       r"heads=8, kv_heads=2, head_dim=32"):
        load_model(d)


def test_missing_expert(tmp_path, tensors):
    t = per_expert(tensors)
    del t["model.layers.4.moe.experts.5.up_proj.weight"]
    d = write_checkpoint(tmp_path / "c", t)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.4\.moe\.experts\.5\.up_proj\.weight' "
                       r"\(needed for expert 5 of layer 4: moe_num_experts=16"):
        load_model(d)


def test_missing_stacked_experts(tmp_path, tensors):
    t = {k: v for k, v in tensors.items() if not k.startswith("model.layers.6.moe.") or "gate." in k or "bias" in k}
    d = write_checkpoint(tmp_path / "c", t)
    with pytest.raises(CheckpointError, match=r"layer 6 is an MoE layer but has no routed expert weights: expected "
                       r"stacked 'model\.layers\.6\.moe\.gate_proj\.weight' \[E, I, D\] or per-expert"):
        load_model(d)


def test_missing_tensor(tmp_path, tensors):
    t = dict(tensors)
    del t["model.layers.9.transformer.shared_head.norm.weight"]
    d = write_checkpoint(tmp_path / "c", t)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.9\.transformer\.shared_head\.norm\.weight' "
                       r"\(needed for MTP layer 1"):
        load_model(d)


def _fp8(tensors, bad_scale=None, drop_scale=None):
    t = dict(tensors)
    for k, v in tensors.items():
        if ".moe." in k and k.endswith("_proj.weight"):
            q = quantize_fp8_block(v)
            t[k], t[k + "_scale_inv"] = q.codes, q.scale_inv
    if bad_scale:
        t[bad_scale] = torch.ones(E, 2, 2)
    if drop_scale:
        del t[drop_scale]
    return t


def test_wrong_scale_shape(tmp_path, tensors):
    d = write_checkpoint(tmp_path / "c", _fp8(tensors, bad_scale="model.layers.5.moe.gate_proj.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"scale tensor 'model\.layers\.5\.moe\.gate_proj\.weight_scale_inv' has "
                       rf"shape \({E}, 2, 2\), expected \({E}, 1, 2\) \(one fp32 scale per 128x128 block of the "
                       rf"\({E}, {I_EXP}, 256\) weight"):
        load_model(d)


def test_fp8_without_scale(tmp_path, tensors):
    d = write_checkpoint(tmp_path / "c", _fp8(tensors, drop_scale="model.layers.3.moe.down_proj.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=r"FP8 tensor 'model\.layers\.3\.moe\.down_proj\.weight' has no scale "
                       rf"tensor 'model\.layers\.3\.moe\.down_proj\.weight_scale_inv' \(expected fp32 \({E}, 2, 1\)\)"):
        load_model(d)


def test_unsupported_dtype(tmp_path, tensors):
    t = dict(tensors)
    d = write_checkpoint(tmp_path / "c", t)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"] = torch.arange(256, dtype=torch.int64)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(UnsupportedQTypeError, match=r"tensor 'model\.norm\.weight' has dtype I64; supported: BF16"):
        load_model(d)


# ---------------------------------------------------------------------------- config vs weights


def test_config_expert_count_contradicts_weights(tmp_path, good):
    d = with_config(tmp_path, good, moe_num_experts=12)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.3\.moe\.gate\.weight' has shape \(16, 256\), "
                       r"expected \(12, 256\) from the config \(layer 3: moe_num_experts=12"):
        load_model(d)


def test_config_sliding_heads_contradict_weights(tmp_path, good):
    d = with_config(tmp_path, good, attention_other_setting={"num_attention_heads": 4, "num_attention_groups": 2})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.q_proj\.weight' has shape \(256, 256\), "
                       r"expected \(128, 256\) from the config \(layer 1 \(sliding\): heads=4"):
        load_model(d)


def test_config_without_mtp_rejects_mtp_tensors(tmp_path, good):
    cfg = {k: (v[:8] if isinstance(v, list) and len(v) == 11 else v) for k, v in hub_config().items()}
    d = with_config(tmp_path, good, **(cfg | {"num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors for step35 with 8 layers and 0 MTP layers.*"
                       r"model\.layers\.10\."):
        load_model(d)


# ---------------------------------------------------------------------------- directory layout


def test_index_names_missing_shard(tmp_path, tensors):
    d = write_checkpoint(tmp_path / "c", tensors, shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: shard 'model-00002-of-00002\.safetensors' "
                       r"\(holding '.*' and \d+ more\) does not exist"):
        load_model(d)


def test_index_maps_tensor_to_wrong_shard(tmp_path, tensors):
    d = write_checkpoint(tmp_path / "c", tensors, shards=2)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors" \
        if idx["weight_map"]["model.norm.weight"].startswith("model-00002") else "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' is mapped to 'model-0000\d-of-00002\."
                       r"safetensors', which does not contain it \(found in"):
        load_model(d)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"needs a config\.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no such file or directory"):
        load_model(tmp_path / "nothing")


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hub_config()))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file"):
        load_model(tmp_path)


# ---------------------------------------------------------------------------- config.json alone


def _drop(key):
    cfg = hub_config()
    del cfg[key]
    return cfg


@pytest.mark.parametrize("cfg, message", [
    (_drop("moe_router_scaling_factor"), r"required key 'moe_router_scaling_factor' is missing"),
    (_drop("rms_norm_eps"), r"required key 'rms_norm_eps' is missing"),
    (_drop("moe_layers_enum"), r"'moe_layers_enum' \(or 'mlp_layer_types'\) is missing"),
    (hub_config(num_key_value_heads=4), r"contradictory values num_key_value_heads=4, num_attention_groups=2"),
    (hub_config(num_sliding_attention_heads=4),
     r"contradictory values num_sliding_attention_heads=4 and attention_other_setting\.num_attention_heads=8"),
    (hub_config(swiglu_limits=[0.0] * 9), r"swiglu_limits has 9 entries, expected num_hidden_layers = 8 or "
                                          r"num_hidden_layers \+ num_nextn_predict_layers = 11"),
    (hub_config(layer_types=hub_config()["layer_types"][:8]),
     r"layer_types has 8 entries but num_nextn_predict_layers = 3: the MTP layers' types are missing"),
    (hub_config(layer_types=["linear_attention"] * 11), r"layer_types\[0\] = 'linear_attention'"),
    (hub_config(moe_router_activation="softmax"), r"moe_router_activation = 'softmax' is not supported"),
    (hub_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}), r"rope_scaling rope_type 'yarn' is not supported"),
    (hub_config(rope_scaling={"rope_type": "llama3", "factor": 2.0}), r"rope_scaling \(llama3\) lacks 'low_freq_factor'"),
    (hub_config(moe_layers_enum="3,4,40"), r"moe_layers_enum names layer 40, outside \[0, 11\)"),
    (hub_config(moe_top_k=20), r"moe_top_k = 20 exceeds moe_num_experts = 16"),
    (hub_config(hidden_size="256"), r"key 'hidden_size' = '256' has the wrong type \(expected int\)"),
    (hub_config(partial_rotary_factors=[0.3] * 11), r"partial rotary factor 0\.3 gives 9 rotary dims of head_dim 32"),
    (hub_config(model_type="llama"), r"model_type 'llama' is not supported \(supported: step3p5, step3p7\)"),
])
def test_config_errors(cfg, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_config(cfg, where="x/config.json")
    with pytest.raises(ConfigError, match=r"^x/config\.json"):
        ModelConfig.from_hf_config(cfg, where="x/config.json")
