"""Attention over quantized cache views.

    >>> from kvtax.attention import attention
    >>> out = attention(q, cache.view())     # q [B, H_q, L, D] → [B, H_q, L, D]

`attention` dispatches to the fused Triton kernels on CUDA and to the blockwise torch
reference elsewhere; `attention_naive` materializes scores and exists for tests.
"""

from kvtax.attention.dispatch import attention
from kvtax.attention.reference import attention_blockwise, attention_naive, visible
from kvtax.attention.view import CacheView

__all__ = ["CacheView", "attention", "attention_blockwise", "attention_naive", "visible"]
