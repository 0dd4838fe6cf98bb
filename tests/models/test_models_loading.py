"""Checkpoint loading (sharded, errors), HF config translation and the named configs."""

from __future__ import annotations

import json

import pytest
import torch

from kvtax.models import (
    CONFIG_NAMES, CheckpointError, ModelConfig, Runner, get_config, hf_name_map, load_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # one intra-op thread (tests/conftest.py)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _save_qwen2(folder, **save_kw) -> None:
    """A 2-layer Qwen2 (qkv bias, untied head) saved with save_pretrained."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(folder, **save_kw)


def _logits(model) -> torch.Tensor:
    runner = Runner(model, kv="fp32")
    ids = torch.arange(1, 20).view(1, -1)
    return runner.prefill(ids, runner.make_caches())


def test_sharded_checkpoint_loads_like_single_file(tmp_path) -> None:
    _save_qwen2(tmp_path / "one")
    _save_qwen2(tmp_path / "many", max_shard_size="30KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    one, many = load_model(tmp_path / "one"), load_model(tmp_path / "many")
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 2
    assert torch.equal(_logits(one), _logits(many))


def _tamper(folder, edit) -> None:
    """Rewrite model.safetensors after applying `edit` to its tensor dict."""
    path = folder / "model.safetensors"
    tensors = safetensors_torch.load_file(str(path))
    edit(tensors)
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path) -> None:
    _save_qwen2(tmp_path)
    _tamper(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.self_attn\.k_proj\.bias"):
        load_model(tmp_path)


def test_wrong_shape_is_named_with_both_shapes(tmp_path) -> None:
    _save_qwen2(tmp_path)
    bad = "model.layers.0.mlp.up_proj.weight"
    _tamper(tmp_path, lambda t: t.__setitem__(bad, torch.zeros(81, 64)))
    want = r"up_proj\.weight has shape \(81, 64\), expected \(80, 64\)"
    with pytest.raises(CheckpointError, match=want):
        load_model(tmp_path)


def test_unexpected_tensor_is_named(tmp_path) -> None:
    _save_qwen2(tmp_path)
    extra = "model.layers.0.self_attn.extra.weight"
    _tamper(tmp_path, lambda t: t.__setitem__(extra, torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected.*self_attn\.extra\.weight"):
        load_model(tmp_path)


def test_folder_without_config_or_weights(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(get_config_json()))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tmp_path)


def get_config_json() -> dict:
    return {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 1, "num_attention_heads": 2}


def test_unknown_source_and_offline_hub_id(monkeypatch) -> None:
    with pytest.raises(FileNotFoundError, match="built-in config"):
        load_model("no-such-model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="kvtax-test/definitely-absent"):
        load_model("kvtax-test/definitely-absent")


def test_unsupported_model_type_is_refused() -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelConfig.from_hf({"model_type": "gpt2"})


def test_transformers4_config_layouts() -> None:
    """config.json files on the Hub mostly predate transformers 5's rope_parameters."""
    llama = ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "eos_token_id": [128001, 128008, 128009], "bos_token_id": 128000, "rms_norm_eps": 1e-5,
    })
    named = get_config("llama-3.1-8b")
    assert llama.replace(name=named.name) == named
    gemma = ModelConfig.from_hf({
        "model_type": "gemma3", "text_config": {
            "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560,
            "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 256, "rope_theta": 1e6,
            "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}})
    assert gemma.family == "gemma3" and gemma.rope_local_theta == 1e4
    assert gemma.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert gemma.layer_windows() == get_config("gemma-3-4b").layer_windows()
    assert gemma.layer_windows()[:6] == [1024] * 5 + [None]


@pytest.mark.parametrize(
    "name, billions",
    [("llama-3.1-8b", 8.03), ("mistral-7b", 7.25), ("qwen3-8b", 8.19), ("qwen2.5-7b", 7.62),
     ("gemma-2-2b", 2.61), ("gemma-3-4b", 3.88), ("llama-2-7b", 6.74)],
)
def test_named_config_parameter_counts(name: str, billions: float) -> None:
    """Counts match the published model sizes (Gemma 3: its text decoder only)."""
    assert abs(get_config(name).weight_params() / 1e9 - billions) < 0.02


def test_every_named_config_builds_its_name_map() -> None:
    for name in CONFIG_NAMES:
        cfg = get_config(name)
        plan = hf_name_map(cfg)
        per_layer = 6 + (2 if cfg.qk_norm else 0) + (1 if cfg.qkv_bias else 0) + (
            2 if cfg.sandwich_norm else 0)
        assert len(plan) == 2 + (0 if cfg.tie_word_embeddings else 1) + per_layer * cfg.num_layers


def test_bf16_weights_keep_float32_rope() -> None:
    model = load_model("tiny-gemma3", dtype=torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32 and model.inv_freq_local.dtype == torch.float32
    runner = Runner(model, kv="int8", sliding_kv="bf16")
    out = runner.generate(torch.arange(1, 30), 4, ignore_eos=True)
    assert len(out.tokens) == 4
