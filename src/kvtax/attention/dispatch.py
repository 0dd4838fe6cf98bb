"""`attention(q, view)`: fused Triton kernels on CUDA, the blockwise reference elsewhere.

A CUDA call the kernels cannot serve (an unsupported head_dim, say) falls back to the
reference and warns once per reason, so a slow path is never taken silently.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch

from kvtax.attention.reference import attention_blockwise
from kvtax.attention.view import CacheView

Impl = Literal["auto", "reference", "triton"]
_warned: set[str] = set()


def attention(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Attention of the last `L` positions' queries over a (quantized) cache view.

    q:     `[B, H_q, L, D]` in fp16/bf16/fp32; H_q a multiple of the cache's KV heads.
    view:  `cache.view()` of the layer's cache, already holding these L tokens' K/V.
    Returns `[B, H_q, L, D]` in q.dtype. Causal masking is bottom-right aligned; the
    view's window and sinks apply. `impl="triton"` raises where the kernels can't run.

    Example:
        cache.append(k, v)
        out = attention(q, cache.view(), softcap=None)
    """
    if impl == "reference":
        return attention_blockwise(q, view, scale=scale, softcap=softcap, causal=causal)
    reason = _kernel_unavailable(q, view, causal)
    if reason is None:
        from kvtax.attention.triton_api import triton_attention

        return triton_attention(q, view, scale=scale, softcap=softcap)
    if impl == "triton":
        raise RuntimeError(f"Triton attention cannot run this call: {reason}")
    if q.is_cuda and reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"kvtax: using the torch reference attention on CUDA ({reason}); "
            "it is correct but slower than the fused kernels",
            stacklevel=2,
        )
    return attention_blockwise(q, view, scale=scale, softcap=softcap, causal=causal)


def _kernel_unavailable(q: torch.Tensor, view: CacheView, causal: bool) -> str | None:
    """None when the fused kernels can serve this call, else why not."""
    if not q.is_cuda:
        return "tensors are not on a CUDA device"
    if not causal:
        return "the kernels implement causal attention only"
    try:
        from kvtax.attention.triton_api import unsupported_reason
    except ImportError as exc:  # triton missing or broken
        return f"Triton kernels unavailable ({exc})"
    return unsupported_reason(q, view)
