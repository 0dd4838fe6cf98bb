"""The stock fp16 arm with lengths from device tensors: torch's flash attention, varlen form.

`attention_sdpa`'s captured form reads the presized storage behind a mask, which rules out
SDPA's flash backend (it takes no mask). torch's public `varlen_attn` runs the same flash
kernels with a per-row used length read from the device (`seqused_k`), so a captured
decode step can take flash over exactly the held keys: the other way to put stock torch
attention in a CUDA graph, measured beside the masked one (benchmarks/stock_check.py).

Served inside a graph: CUDA, batch 1, a full (non-ring) fp16/bf16 cache, head_dim <= 256.
Eager calls (no `view.length_t`) are `attention_sdpa`'s.

    >>> with use_attention(model, attention_sdpa_varlen):
    ...     runner.decode_greedy(tok, caches)     # on CUDA: one replay, flash inside
"""

from __future__ import annotations

import torch

from kvtax.attention import CacheView
from kvtax.attention.reference import check_query
from kvtax.harness.baselines import attention_sdpa
from kvtax.harness.masks import storage_slots


def attention_sdpa_varlen(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """q `[1, H_q, L, D]` over the first `view.length_t[0]` slots of the fp16 storage →
    `[1, H_q, L, D]`; flash's causal mask is aligned to the used length (bottom right)."""
    if view.length_t is None:
        return attention_sdpa(q, view, scale=scale, softcap=softcap, causal=causal)
    reason = varlen_blocker(q, view) or (
        "torch SDPA has no logit soft-capping" if softcap else None)
    if reason is not None:
        raise ValueError(f"varlen flash attention cannot serve this call: {reason}")
    from torch.nn.attention.varlen import varlen_attn

    n_q, slots = q.shape[2], storage_slots(view)
    # cumulative lengths built on the device: a host-to-device copy cannot be captured
    edges = torch.arange(2, dtype=torch.int32, device=q.device)
    # token-major views of the head-major storage: [slots, H_kv, D], rows D elements apart
    k = view.k.codes[0].transpose(0, 1)
    v = view.v.codes[0].transpose(0, 1)
    out = varlen_attn(
        q[0].transpose(0, 1).to(k.dtype),                             # [L, H_q, D]
        k, v,
        edges * n_q, edges * slots,
        n_q, slots, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        window_size=(-1, 0) if causal else (-1, -1), seqused_k=view.length_t,
    )                                                                 # [L, H_q, D]
    return out.transpose(0, 1).unsqueeze(0).to(q.dtype)


def varlen_blocker(q: torch.Tensor, view: object) -> str | None:
    """Why `attention_sdpa_varlen` cannot run `(q, view)` in a captured step (None: it can)."""
    if not isinstance(view, CacheView):
        return f"it reads a CacheView, not a {type(view).__name__}"
    if not q.is_cuda:
        return "flash varlen attention needs a CUDA device"
    if view.batch != 1:
        return f"batch {view.batch} (it serves batch 1: the storage is head-major)"
    if view.ring or view.window is not None:
        return "a sliding-window ring (slots are not in position order)"
    if view.k.codes.dtype not in (torch.float16, torch.bfloat16) or view.k.scales is not None:
        return f"{view.spec.name} storage (it reads fp16/bf16 K/V in place)"
    if view.head_dim > 256:
        return f"head_dim {view.head_dim} > 256"
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError as exc:
        return f"torch has no varlen attention ({exc})"
    check_query(q, view)
    return None


attention_sdpa_varlen.graph_blocker = varlen_blocker  # type: ignore[attr-defined]
