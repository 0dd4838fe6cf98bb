"""int4-c64 keys with scale and bias stored in float32 vs bfloat16 (what a bf16 model
stores): RMS and max key error per layer, and the largest |offset| / block range.
python bf16_meta.py MODEL.gguf TOKENS"""
import torch
from kvtax.formats.channel import ChannelBlockFormat
from keys import layer_keys
keys = layer_keys()
fmt = ChannelBlockFormat()
for i, k in enumerate(keys):  # k [1, H, T, D]
    kb = k.to(torch.bfloat16).float()
    e32 = fmt.dequantize(fmt.quantize(kb)) - kb
    e16 = fmt.dequantize(fmt.quantize(kb.to(torch.bfloat16))) - kb
    g = kb.unflatten(-2, (-1, 64))
    rng = (g.amax(-2) - g.amin(-2))
    off = g.abs().amax(-2)
    print(f"L{i:2d} |k|max {k.abs().max():7.1f} max off/range {(off/rng.clamp_min(1e-6)).max():7.1f} "
          f"rms err f32-meta {e32.pow(2).mean().sqrt():.4f} bf16-meta {e16.pow(2).mean().sqrt():.4f} "
          f"max {e32.abs().max():.3f} / {e16.abs().max():.3f}  ratio {e16.pow(2).mean().sqrt()/e32.pow(2).mean().sqrt():.2f}")
