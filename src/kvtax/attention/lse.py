"""Attention that also returns its log-sum-exp, so partial attentions can be merged exactly.

Softmax attention over a key set split into disjoint parts A and B is recovered from
each part's normalised output and log-sum-exp of scores:
`lse = logaddexp(lse_A, lse_B)`, `out = e^(lse_A - lse) out_A + e^(lse_B - lse) out_B`
(FlashAttention's split-KV reduction). This is how a cache holding some tokens in fp16
and the rest quantized is read without ever building one dequantized copy.

`attention_lse` is the blockwise torch path (CPU; float32 math; `blockwise.online_step`)
with two extra masks on top of the view's own causal/window/sink rule, so two parts of
one cache can each see exactly their own keys:
  min_distance: a query at p sees a key at k only if p - k >= min_distance;
  min_key:      only keys at positions k >= min_key.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvtax.attention.blockwise import online_step, visible
from kvtax.attention.view import CacheView
from kvtax.errors import ShapeError
from kvtax.formats import rotate


def attention_lse(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    min_distance: int = 0,
    min_key: int = 0,
    block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` `[B, H_q, L, D]` (the last L positions) over `view`.

    Returns `(out, lse)`: out `[B, H_q, L, D]` float32 in the un-rotated value domain,
    lse `[B, H_q, L]` float32, the log of the sum of exp(scaled, soft-capped scores) over
    the visible keys; a row that sees no key has out 0 and lse -inf. Rotated specs
    (`+hk`, `+hkv`) are handled here: q is rotated for the scores, which are unchanged.

    Example: `out, lse = attention_lse(q, cache.view(), min_distance=128)` reads only
    keys at least 128 positions behind each query.
    """
    b, hq, n_q, d = _check(q, view)
    n_kv = view.num_kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.float()
    qf = rotate(qf) if view.spec.rotate_keys else qf
    qg = (qf * scale).view(b, n_kv, hq // n_kv, n_q, d)  # [B, Hkv, G, L, D]
    q_pos = torch.arange(view.length - n_q, view.length, device=q.device)
    m = torch.full(qg.shape[:-1], -math.inf, device=q.device)  # running max [B, Hkv, G, L]
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(qg)
    for start in range(0, view.num_slots, block):
        end = min(start + block, view.num_slots)
        k_pos = view.slot_positions(start, end)
        mask = visible(q_pos, k_pos, causal=True, window=view.window, sinks=view.sinks)
        mask &= (q_pos[:, None] - k_pos[None, :] >= min_distance) & (k_pos[None, :] >= min_key)
        if not bool(mask.any()):
            continue  # a tile no query of this part may read costs nothing
        m, denom, acc = online_step(qg, view, start, end, mask, softcap, m, denom, acc)
    out = acc / denom.clamp_min(1e-30)[..., None]
    lse = torch.where(denom > 0, m + torch.log(denom.clamp_min(1e-30)), -math.inf)
    out = out.flatten(1, 2)
    out = rotate(out) if view.spec.rotate_values else out  # H is its own inverse
    return out, lse.flatten(1, 2)


def merge_lse(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine `(out [..., L, D], lse [..., L])` over disjoint key sets into one attention.

    Rows no part could see stay out 0, lse -inf.
    """
    if not parts:
        raise ValueError("merge_lse needs at least one part")
    lses = torch.stack([lse for _, lse in parts])  # [P, ..., L]
    total = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    out = torch.zeros_like(parts[0][0])
    for (o, lse) in parts:
        out = out + torch.exp(lse - safe)[..., None] * o  # exp(-inf) = 0: an empty part adds 0
    return out, total


def _check(q: torch.Tensor, view: CacheView) -> tuple[int, int, int, int]:
    if q.dim() != 4:
        raise ShapeError(f"q must be [batch, q_heads, queries, head_dim], got {tuple(q.shape)}")
    b, hq, n_q, d = q.shape
    if d != view.head_dim or b != view.batch or hq % view.num_kv_heads:
        raise ShapeError(
            f"q {tuple(q.shape)} does not fit a cache of batch {view.batch}, "
            f"{view.num_kv_heads} KV heads, head_dim {view.head_dim}"
        )
    if n_q > view.length:
        raise ShapeError(f"{n_q} queries but the cache holds only {view.length} positions")
    return b, hq, n_q, d
