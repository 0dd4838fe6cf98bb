"""q4's int4-c64 key error before and after RoPE (KVQuant quantizes keys pre-RoPE): keys
taken back through the inverse rotation of each layer's own RoPE (a rotation, exact)."""
import torch

from capture import forward
from kvtax.formats.spec import parse_format

model, keys, _ = forward()
types = getattr(model.config, "layer_types", None)
per_type = isinstance(getattr(model.model.rotary_emb, "rope_type", None), dict)  # Gemma-3
fmt = parse_format("int4-c64")


def unrope(k: torch.Tensor, layer_type) -> torch.Tensor:
    pos = torch.arange(k.shape[2])[None]
    args = (k, pos, layer_type) if per_type else (k, pos)
    cos, sin = (t[:, None] for t in model.model.rotary_emb(*args))
    half = k.shape[-1] // 2  # k = x cos + rot_half(x) sin  =>  x = k cos - rot_half(k) sin
    return k * cos - torch.cat([-k[..., half:], k[..., :half]], -1) * sin


def mse(x: torch.Tensor) -> float:
    return (fmt.dequantize(fmt.quantize(x)) - x).pow(2).mean().item()


print("layer | attention | key MSE post-RoPE | pre-RoPE | pre / post")
for i, k in enumerate(keys):
    lt = types[i] if types else "full_attention"
    post, pre = mse(k), mse(unrope(k, lt))
    print(i, lt, f"{post:.4g}", f"{pre:.4g}", f"{pre / post:.3f}", sep=" | ")
