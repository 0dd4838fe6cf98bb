"""Per layer: int4-c64 key MSE relative to the keys' within-block variance, the median
range / std of a channel's 64-token block and its kurtosis. python relative.py MODEL.gguf TOKENS"""
import torch
from keys import layer_keys
keys = layer_keys()
for i, k in enumerate(keys):  # k [1, H, T, D]
    T = k.shape[-2] // 64 * 64
    g = k[..., :T, :].unflatten(-2, (-1, 64))
    lo, hi = g.amin(-2, keepdim=True), g.amax(-2, keepdim=True)
    s = ((hi - lo) / 15).clamp_min(1e-8)
    r = ((g - lo) / s).round().clamp(0, 15) * s + lo
    mse = (r - g).pow(2).mean()
    var_tok = (g - g.mean(-2, keepdim=True)).pow(2).mean()   # within-block variance
    kurt = ((g - g.mean(-2, keepdim=True)).pow(4).mean(-2) / (g - g.mean(-2, keepdim=True)).pow(2).mean(-2).pow(2).clamp_min(1e-12)).median()
    rng_over_std = ((hi - lo).squeeze(-2) / (g.std(-2) + 1e-9)).median()
    print(f"L{i:2d} mean k^2 {k.pow(2).mean():8.3f} within-block var {var_tok:8.4f} mse {mse:.4f} "
          f"mse/var {mse/var_tok:.4f} range/std med {rng_over_std:.2f} kurt med {kurt:.2f}")
