"""Hadamard rotation along head_dim: spreads outlier channels before quantization.

Keys carry a few channels far larger than the rest; one such channel sets the range of
its whole quantization group. Rotating every key row by an orthonormal Hadamard matrix H
mixes each outlier into all channels, shrinking group ranges. Scores are unchanged in
exact arithmetic because `(q H)·(k H) = q·k`, so attention rotates queries the same way;
rotated values are un-rotated on the output (`out = (Σ p·vH) Hᵀ`). vLLM's int4 KV and
llama.cpp do the same.

H is Sylvester's construction, normalised (H = Hᵀ = H⁻¹); for head dims that are not a
power of two (80, 96) it is block-diagonal with the largest power-of-two block dividing D.
"""

from __future__ import annotations

import functools

import torch


def _block_size(head_dim: int) -> int:
    return head_dim & -head_dim  # largest power of two dividing head_dim


@functools.lru_cache(maxsize=32)
def _hadamard_cpu(head_dim: int) -> torch.Tensor:
    n = _block_size(head_dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / n**0.5
    return torch.block_diag(*[h] * (head_dim // n)).float()


def hadamard(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal, symmetric `[head_dim, head_dim]` float32 rotation matrix."""
    return _hadamard_cpu(head_dim).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """`x H` along the last dim, computed in float32, returned in x.dtype. H is its own inverse."""
    h = hadamard(x.shape[-1], x.device)
    return (x.float() @ h).to(x.dtype)
