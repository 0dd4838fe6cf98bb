"""Attention over quantized cache views.

    >>> from kvtax.attention import attention
    >>> out = attention(q, cache.view())     # q [B, H_q, L, D] → [B, H_q, L, D]

`attention` dispatches to the fused Triton kernels on CUDA and to the blockwise torch
path (`attention_blockwise`) elsewhere. The test oracle, `attention_naive`, lives in
`kvtax.attention.reference`, which production code never imports.
"""

from kvtax.attention.blockwise import attention_blockwise, visible
from kvtax.attention.dispatch import attention
from kvtax.attention.view import CacheView

__all__ = ["CacheView", "attention", "attention_blockwise", "visible"]
