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

import torch


def _block_size(head_dim: int) -> int:
    return head_dim & -head_dim  # largest power of two dividing head_dim


# (head_dim, device, dtype) → H, filled by eager calls. Compiled code reads an entry that
# exists when it is traced as a constant of the graph, so a compiled or captured decode
# step rebuilds nothing per call.
_MATRICES: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def hadamard(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal, symmetric `[head_dim, head_dim]` float32 rotation matrix.

    Cached per device: a copy from the host on every call would be a transfer per
    attention call, and one a CUDA graph cannot capture (rotated decode steps are
    captured once and replayed)."""
    return _matrix(head_dim, torch.device(device), torch.float32)


def _matrix(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (head_dim, device, dtype)
    h = _MATRICES.get(key)
    if h is None:
        h = _hadamard_built(head_dim, device, dtype)
        tracing = torch.compiler.is_compiling() or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        if not tracing:  # never keep graph memory or a traced value
            _MATRICES[key] = h
    return h


def _hadamard_built(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """H computed on `device` from index arithmetic, no host tensor (so also inside a
    compiled region or a CUDA-graph capture): entry (i, j) of a Sylvester block is
    (-1)^popcount(i & j) / sqrt(n), zero across blocks."""
    n = _block_size(head_dim)
    i = torch.arange(head_dim, device=device)
    both = (i % n)[:, None] & (i % n)[None, :]
    parity = torch.zeros_like(both)
    for bit in range(n.bit_length() - 1):
        parity ^= (both >> bit) & 1
    same_block = (i // n)[:, None] == (i // n)[None, :]
    h = torch.where(same_block, 1.0 - 2.0 * parity.float(), 0.0) * n**-0.5
    return h.to(dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """`x H` along the last dim, returned in x.dtype. H is its own inverse.

    On CPU, and for float32, in float32. fp16/bf16 on CUDA multiply by H in x's dtype with
    float32 accumulation: one GEMM launch instead of cast + float32 GEMM + cast (measured
    ~9 µs of extra kernels per decode call on the H200); the result is rounded
    to x.dtype either way.
    """
    half = x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
    h = _matrix(x.shape[-1], x.device, x.dtype if half else torch.float32)
    return x @ h if half else (x.float() @ h).to(x.dtype)
