"""The attention paths kvtax is measured against, as functions over a `CacheView`.

All take `(q, view, *, scale=None, softcap=None, causal=True)` like `kvtax.attention`,
with q `[B, H_q, L, D]` (the last L positions) and return `[B, H_q, L, D]` in q.dtype:

- `attention_unfused`: mlx-lm's quantized path (`quantized_scaled_dot_product_attention`):
  scores `[B, H_q, L, ctx]` materialized in the model dtype, softmax, then a second
  matmul. The transient grows with chunk x context (seed 002 measured 1.216 GB of it).
- `attention_dequant`: transformers' QuantizedCache: dequantize the whole cache to the
  model dtype on every call, then `scaled_dot_product_attention`.
- `attention_sdpa`: the stock fp16 baseline: SDPA straight over unquantized storage.

    >>> from kvtax.harness.baselines import ATTENTION_PATHS
    >>> out = ATTENTION_PATHS["unfused"](q, cache.view())
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvtax.attention import CacheView, attention, visible
from kvtax.attention.reference import check_query
from kvtax.formats import FloatFormat, QTensor

AttentionFn = Callable[..., torch.Tensor]


def _positions(q: torch.Tensor, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
    n_q = q.shape[2]
    q_pos = torch.arange(view.length - n_q, view.length, device=q.device)
    return q_pos, view.slot_positions()


def _mask(
    q: torch.Tensor, view: CacheView, causal: bool
) -> torch.Tensor | None:
    """Bool `[L, slots]` visibility, or None when every slot is visible (plain decode)."""
    if q.shape[2] == 1 and view.window is None:
        return None  # one query at the newest position sees the whole full cache
    q_pos, k_pos = _positions(q, view)
    return visible(q_pos, k_pos, causal=causal, window=view.window, sinks=view.sinks)


def _dequantized(part: QTensor, fmt, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first n slots of one K or V storage, decoded to `dtype` (a fresh tensor)."""
    return fmt.dequantize(part.slice_tokens(0, n), dtype)


def attention_unfused(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """mlx-lm's composition: decode K, scores = q·Kᵀ materialized, softmax, scores·V.

    Like mlx-lm, queries are grouped per KV head (no K/V repeat) and the scores live in
    the model dtype with a float32 softmax (`precise=True`). Memory: the full
    `[B, H_q, L, slots]` score tensor plus the decoded K and V.
    """
    n_q, group = check_query(q, view)
    b, hq, _, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    n = view.num_slots
    k = _dequantized(view.k, view.spec.key, n, q.dtype)       # [B, Hkv, n, D]
    v = _dequantized(view.v, view.spec.value, n, q.dtype)
    qg = (q * scale).view(b, view.num_kv_heads, group, n_q, d)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2))  # [B, Hkv, G, L, n]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    mask = _mask(q, view, causal)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, v.unsqueeze(2))                    # [B, Hkv, G, L, D]
    return out.reshape(b, hq, n_q, d)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    view: CacheView,
    scale: float | None,
    softcap: float | None,
    causal: bool,
) -> torch.Tensor:
    if softcap:
        raise NotImplementedError(
            "torch SDPA has no logit soft-capping; this baseline cannot run a softcap model "
            "(use the fused or unfused path)"
        )
    mask = _mask(q, view, causal)
    if mask is not None:
        mask = mask.to(q.device)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def attention_dequant(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """transformers QuantizedCache's way: decode the whole cache every call, then SDPA.

    The decoded copy `[B, H_kv, slots, D]` x 2 in the model dtype is allocated per call,
    which is exactly the traffic and transient a fused kernel avoids.
    """
    check_query(q, view)
    n = view.num_slots
    k = _dequantized(view.k, view.spec.key, n, q.dtype)
    v = _dequantized(view.v, view.spec.value, n, q.dtype)
    return _sdpa(q, k, v, view, scale, softcap, causal)


def attention_sdpa(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """The fp16 baseline: SDPA reads the unquantized storage in place (no decode copy).

    The query is cast to the storage dtype (a few KB) rather than the cache to the
    query's, so an fp16 cache under an fp32 CPU model is still read without a copy.
    """
    check_query(q, view)
    if not (isinstance(view.spec.key, FloatFormat) and isinstance(view.spec.value, FloatFormat)):
        raise ValueError(
            f"the fp16 path needs an unquantized cache, got {view.spec.name}; "
            "use the dequant path for quantized formats"
        )
    n = view.num_slots
    k = view.k.codes[:, :, :n]
    v = view.v.codes[:, :, :n]
    out = _sdpa(q.to(k.dtype), k, v.to(k.dtype), view, scale, softcap, causal)
    return out.to(q.dtype)


ATTENTION_PATHS: dict[str, AttentionFn] = {
    "fused": attention,  # kvtax's own: Triton kernels on CUDA, blockwise reference on CPU
    "fp16": attention_sdpa,
    "unfused": attention_unfused,
    "dequant": attention_dequant,
}


def attention_for(path: str) -> AttentionFn:
    """The attention function of a path name; hf-quantized is not a view function."""
    try:
        return ATTENTION_PATHS[path]
    except KeyError:
        raise ValueError(
            f"path {path!r} has no CacheView attention function "
            f"(known: {', '.join(ATTENTION_PATHS)}; hf-quantized runs transformers' own cache)"
        ) from None
