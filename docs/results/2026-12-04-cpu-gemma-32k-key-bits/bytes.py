"""KV bytes relative to fp16 of Gemma-3-270M's caches (18 layers, 1 KV head, head_dim 256,
window 512 on all but 5, 11, 17) for a bf16 model after c tokens: `used_nbytes` summed
over the layers, as docs/QUALITY.md counts them. python bytes.py SPEC [SPEC ...]"""
import sys

import torch

from kvtax.cache import make_caches

WINDOWS = [None if i in (5, 11, 17) else 512 for i in range(18)]


def held(spec: str, c: int, chunk: int = 2048) -> int:
    base, *layers = spec.split(":L")  # the quality command's per-layer overrides
    overrides = {int(i): f for i, f in (x.split("=", 1) for x in layers)}
    caches = make_caches(WINDOWS, base, overrides=overrides, max_chunk=chunk)
    for cache in caches:
        for p in range(0, c, chunk):
            x = torch.randn(1, 1, min(chunk, c - p), 256, dtype=torch.bfloat16)
            cache.append(x, x)
    return sum(c.used_nbytes for c in caches)


for spec in sys.argv[1:]:
    print(spec, *(f"{c // 1024}k {held(spec, c) / held('fp16', c):.4f}" for c in (8192, 16384, 32768)),
          flush=True)
