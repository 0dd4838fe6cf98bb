"""Post-RoPE keys (and values) of one float32 forward over the first TOKENS tokens of the
usual text (CPython's pydoc_data/topics.py), from transformers' DynamicCache: the scripts'
input, here and in ../2026-12-04-cpu-gemma-32k-kv-split/."""
import sys

import pydoc_data.topics as topics
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


def forward():
    """(model, per layer `[1, H_kv, TOKENS, D]` float32 keys, values) for `sys.argv[1]` (a
    .gguf) at TOKENS = argv[2]."""
    path, n = sys.argv[1], int(sys.argv[2])
    folder, name = path.rsplit("/", 1)
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=torch.float32).eval()
    ids = tok(open(topics.__file__).read(), return_tensors="pt").input_ids[:, :n]
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return model, [c.keys.float() for c in cache.layers], [c.values.float() for c in cache.layers]


def layer_keys() -> list[torch.Tensor]:
    """Per layer `[1, H_kv, TOKENS, D]` float32 keys (`forward`'s)."""
    return forward()[1]
