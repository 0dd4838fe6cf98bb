"""KV bytes relative to fp16 after 8k / 16k / 32k tokens (bf16 model, `used_nbytes` summed
over the layers, as docs/QUALITY.md counts them) of Gemma-3-270M (18 layers, 1 KV head,
head_dim 256, window 512 on all but 5, 11, 17) or Qwen2.5-Coder-0.5B (24 global layers,
2 KV heads, head_dim 64). python bytes.py gemma|qwen SPEC [SPEC ...]"""
import sys

import torch

from kvtax.cache import make_caches

MODELS = {"gemma": ([None if i in (5, 11, 17) else 512 for i in range(18)], 1, 256),
          "qwen": ([None] * 24, 2, 64)}
windows, heads, dim = MODELS[sys.argv[1]]


def held(spec: str, c: int, chunk: int = 2048) -> int:
    base, *layers = spec.split(":L")  # the quality command's per-layer overrides
    overrides = {int(i): f for i, f in (x.split("=", 1) for x in layers)}
    caches = make_caches(windows, base, overrides=overrides, max_chunk=chunk)
    for cache in caches:
        for p in range(0, c, chunk):
            x = torch.randn(1, heads, min(chunk, c - p), dim, dtype=torch.bfloat16)
            cache.append(x, x)
    return sum(c.used_nbytes for c in caches)


for spec in sys.argv[2:]:
    print(sys.argv[1], spec, *(f"{c // 1024}k {held(spec, c) / held('fp16', c):.4f}"
                               for c in (8192, 16384, 32768)), flush=True)
