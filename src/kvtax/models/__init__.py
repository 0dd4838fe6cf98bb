"""Lean decoders (Llama, Mistral, Qwen2/3, Gemma 2/3) and a runner over kvtax caches.

    >>> from kvtax.models import load_model, Runner
    >>> model = load_model("tiny")                      # or a HF folder / hub id
    >>> runner = Runner(model, kv="int8")
    >>> caches = runner.make_caches(capacity=1024)
    >>> logits = runner.prefill(ids, caches)            # ids [B, T] → [B, vocab]
    >>> logits = runner.decode_step(next_ids, caches)   # [B, 1] → [B, vocab]
    >>> next_ids = runner.decode_greedy(next_ids, caches)  # [B, 1] → [B, 1], one replay
    >>> Runner(model, launch=DecodeLaunch.parse("o.block_n=2"))  # an experiment's launches
"""

from kvtax.models.config import CONFIG_NAMES, ModelConfig, get_config
from kvtax.models.decoder import DecoderModel
from kvtax.models.launch import DecodeLaunch
from kvtax.models.loading import (
    CheckpointError,
    hf_name_map,
    load_model,
    locate,
    model_config,
    random_model,
)
from kvtax.models.runner import GenerationResult, Runner
from kvtax.models.sampling import sample
from kvtax.models.tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "CONFIG_NAMES",
    "ByteTokenizer",
    "CheckpointError",
    "DecodeLaunch",
    "DecoderModel",
    "GenerationResult",
    "ModelConfig",
    "Runner",
    "get_config",
    "hf_name_map",
    "load_model",
    "load_tokenizer",
    "locate",
    "model_config",
    "random_model",
    "sample",
]
