"""Attention over a hybrid cache: fp16 sinks + recent window, quantized body, merged by LSE.

A `HybridView` is a list of parts, each a `CacheView` plus the extra masks that make
the parts' visible key sets disjoint for every query (see kvtax.cache.hybrid). Each part
is read as stored (no dequantized copy of the whole cache) and the partial results are
merged exactly with `merge_lse`. On CUDA each part goes through the fused kernels
(`triton_api.triton_attention_lse`); elsewhere, or for a part the kernels cannot serve,
through the torch reference `attention_lse` (on CUDA with a one-time warning per reason).

`hybrid_attention` has the signature of `kvtax.attention.attention`, so a model layer's
`attn_fn` can be set to it: plain `CacheView`s go straight to `attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtax.attention.dispatch import (
    attention,
    kernel_unavailable,
    refuse_centered_softcap,
    warn_reference_once,
)
from kvtax.attention.lse import attention_lse, merge_lse
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

    @property
    def head_dim(self) -> int:
        return self.parts[0].view.head_dim


def hybrid_attention(
    q: torch.Tensor,
    view: "CacheView | HybridView",
    *,
    scale: float | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """`attention(q, view)` for a plain view; for a HybridView the LSE merge of its parts.

    q `[B, H_q, L, D]` → `[B, H_q, L, D]` in q.dtype (queries are the last L positions).
    """
    if isinstance(view, CacheView):
        return attention(q, view, scale=scale, softcap=softcap, **kwargs)  # type: ignore[arg-type]
    if kwargs:
        raise ValueError(f"hybrid attention takes no {sorted(kwargs)}")
    parts = [part_attention(q, p, scale=scale, softcap=softcap) for p in view.parts]
    out, _ = merge_lse(parts)
    return out.to(q.dtype)


def part_attention(
    q: torch.Tensor, part: HybridPart, *, scale: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out [B, H_q, L, D], lse [B, H_q, L])` float32 of `q` over one part, masks applied:
    the fused kernels where they serve the part's view (CUDA), else `attention_lse`."""
    refuse_centered_softcap(part.view, softcap)
    kw = dict(scale=scale, softcap=softcap, min_distance=part.min_distance,
              min_key=part.min_key)
    reason = kernel_unavailable(q, part.view, True)
    if reason is None:
        from kvtax.attention.triton_api import triton_attention_lse

        return triton_attention_lse(q, part.view, **kw)
    warn_reference_once(q, reason, "hybrid-cache attention", stacklevel=4)
    return attention_lse(q, part.view, **kw)
