"""Model configs the adapter's tests and benchmark build random-weight models from (no download).

`tiny_config(family)` gives a 2-3 layer model of each tested family that builds and runs
on a CPU in well under a second; `llama31_8b_config()` has Llama-3.1-8B's shapes.

    >>> from transformers import AutoModelForCausalLM
    >>> model = AutoModelForCausalLM.from_config(tiny_config("gemma3", window=8)).eval()
"""

from __future__ import annotations

from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")


def tiny_config(family: str, *, window: int = 8, vocab: int = 97, **overrides) -> PretrainedConfig:
    """A tiny random-model config: hidden 64, 4 query / 2 KV heads of head_dim 64 (GQA 2).

    window: the sliding window of Mistral (every layer), Gemma 2 (alternate layers) and
    Gemma 3 (layers 0-1 slide, layer 2 is global: the 5:1 pattern cut short).
    Gemma 2 brings logit soft-capping and Gemma 2/3 a custom attention scale
    (`query_pre_attn_scalar`), so those paths are exercised too.
    """
    common: dict = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=window)
    if family == "gemma2":
        return Gemma2Config(**common, sliding_window=window, query_pre_attn_scalar=32)
    if family == "gemma3":
        common["num_hidden_layers"] = overrides.get("num_hidden_layers", 3)
        types = ["sliding_attention"] * (common["num_hidden_layers"] - 1) + ["full_attention"]
        return Gemma3TextConfig(
            **common, sliding_window=window, layer_types=types, query_pre_attn_scalar=48
        )
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


def llama31_8b_config(**overrides) -> PretrainedConfig:
    """Llama-3.1-8B's shapes: 32 layers, 32 query / 8 KV heads of 128, llama3 RoPE."""
    cfg: dict = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    return LlamaConfig(**cfg)
