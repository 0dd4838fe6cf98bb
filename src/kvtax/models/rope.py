"""Rotary position embeddings in Hugging Face's half-split layout; Llama 3.1 and linear scaling.

Checkpoints on the Hub store q/k projections permuted for the `rotate_half` layout, so
this module rotates pairs (i, i + D/2), exactly as transformers does.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """float32 `[head_dim / 2]` inverse frequencies, scaled as the HF rope_scaling dict says.

    Supported rope types: default, linear (positions / factor), llama3 (Llama 3.1's
    wavelength-dependent interpolation).
    """
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv
    assert scaling is not None
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv, scaling)
    raise ValueError(
        f"rope_type {kind!r} is not supported (default, linear, llama3 are); "
        "the model would produce wrong positions"
    )


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and *signed* sin `[T, head_dim]` in `dtype` for int `positions` `[T]`.

    With f = positions x inv_freq: cos = [cos f, cos f] and sin = [-sin f, sin f] (the
    sign of rotate_half folded in, once per step instead of once per layer). `positions`
    may be a device tensor: graph-safe.
    """
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[..., D]` by tables from `rope_cos_sin`, broadcastable to it.

    HF's x·cos + rotate_half(x)·sin, with rotate_half(x)·sin computed as
    roll(x, D/2)·signed_sin: the same products (a sign flip is exact), three kernels.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)
