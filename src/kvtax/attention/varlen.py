"""The stock fp16 arm with lengths from device tensors: torch's flash kernel, varlen form.

`attention_sdpa`'s captured form reads the presized storage behind a mask, which rules out
SDPA's flash backend (it takes no mask). The op behind that backend (and behind
`torch.nn.attention.varlen`), `aten._flash_attention_forward`, also takes each row's used
key count from the device (`seqused_k`), so a captured decode step can run flash over
exactly the held keys: the other way to put stock torch attention in a CUDA graph,
measured beside the masked one (benchmarks/stock_check.py). The op has taken `seqused_k`
since torch 2.4; the public `varlen_attn` exposes it only in later releases.

Served inside a graph: CUDA, batch 1, one query row (decode), a full (non-ring) fp16/bf16
cache, head_dim <= 256. Eager calls (no `view.length_t`) are `attention_sdpa`'s.

    >>> with use_attention(model, attention_sdpa_varlen):
    ...     runner.decode_greedy(tok, caches)     # on CUDA: one replay, flash inside
"""

from __future__ import annotations

import torch

from kvtax.attention.view import CacheView
from kvtax.attention.checks import check_query
from kvtax.attention.baselines import attention_sdpa
from kvtax.attention.masks import storage_slots


def attention_sdpa_varlen(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """q `[1, H_q, 1, D]` over the first `view.length_t[0]` slots of the fp16 storage →
    `[1, H_q, 1, D]` (a decode row sees every held key: no causal mask needed); GQA is
    flash's own (H_q a multiple of H_kv)."""
    if view.length_t is None:
        return attention_sdpa(q, view, scale=scale, softcap=softcap, causal=causal)
    reason = varlen_blocker(q, view) or (
        "torch SDPA has no logit soft-capping" if softcap else None)
    if reason is not None:
        raise ValueError(f"varlen flash attention cannot serve this call: {reason}")
    slots, hq, d = storage_slots(view), q.shape[1], q.shape[3]
    # token-major views of the head-major storage: [slots, H_kv, D], rows D elements apart
    k = view.k.codes[0].transpose(0, 1)
    v = view.v.codes[0].transpose(0, 1)
    # cumulative lengths built on the device: a host-to-device copy cannot be captured
    edges = torch.arange(2, dtype=torch.int32, device=q.device)
    out = torch.ops.aten._flash_attention_forward(
        q.reshape(1, hq, d).to(k.dtype), k, v, edges, edges * slots, 1, slots,
        0.0, False, False, scale=scale, seqused_k=view.length_t,
    )[0]                                                              # [1, H_q, D]
    return out.view(1, hq, 1, d).to(q.dtype)


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
    if view.spec.rotate_keys or view.spec.rotate_values:
        return f"{view.spec.name}: Hadamard-rotated storage"
    if view.head_dim > 256:
        return f"head_dim {view.head_dim} > 256"
    if q.shape[2] != 1:
        return f"{q.shape[2]} query rows (it serves decode: one)"
    if "seqused_k" not in str(torch.ops.aten._flash_attention_forward.default._schema):
        return f"torch {torch.__version__}'s flash op takes no seqused_k"
    check_query(q, view)
    return None


attention_sdpa_varlen.graph_blocker = varlen_blocker  # type: ignore[attr-defined]
