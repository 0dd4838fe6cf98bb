"""What attention reads from a hybrid cache: fp16 sinks + recent window, quantized body.

A `HybridView` is a list of parts, each a `CacheView` plus the extra masks that make
the parts' visible key sets disjoint for every query (see kvtax.cache.hybrid).
`kvtax.attention.attention(q, view)` routes a HybridView by its type: each part is read
as stored (no dequantized copy of the whole cache). Decode rows run one split kernel per
part into a shared workspace and one reduce (kvtax.attention.dispatch.hybrid_decode);
other calls merge the parts' results exactly with `merge_lse`
(kvtax.attention.dispatch.part_attention).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvtax.attention.view import CacheView


@dataclass(frozen=True)
class HybridPart:
    """One part of a hybrid cache: its view and the keys it may show each query."""

    view: CacheView
    min_distance: int = 0  # a query at p reads a key at k only if p - k >= min_distance
    min_key: int = 0       # ... and only if k >= min_key


@dataclass(frozen=True)
class HybridView:
    """What attention reads from a `HybridCache`: parts whose visible keys are disjoint."""

    parts: tuple[HybridPart, ...]
    length: int

    def at_length(self, length: int, length_t: torch.Tensor | None) -> "HybridView":
        """Every part at host `length`, the kernels reading `length_t` int32 `[B]` (CUDA-graph
        decode: `launch.launch_parts_decode` reads each part's)."""
        parts = tuple(dataclasses.replace(p, view=p.view.at_length(length, length_t))
                      for p in self.parts)
        return HybridView(parts, length)

    @property
    def head_dim(self) -> int:
        return self.parts[0].view.head_dim

    @property
    def batch(self) -> int:
        return self.parts[0].view.batch

    @property
    def device(self) -> torch.device:
        return self.parts[0].view.device

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].view.dtype
