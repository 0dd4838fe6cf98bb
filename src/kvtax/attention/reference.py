"""The test oracle: attention computed the obvious way, for tests to compare against.

`attention_naive` dequantizes the whole cache (in logical order) and materializes the
score matrix `[B, H_q, L, context]` (what mlx-lm's quantized path does), then one
softmax. It shares only the definition of which keys a query sees (`blockwise.visible`,
the padding mask) with the product's blockwise path, not the streaming or the online
softmax it checks. Production code never imports this module; tests do.
"""

from __future__ import annotations

import math

import torch

from kvtax.attention.blockwise import grouped_query, padding_mask, softcap_scores, visible
from kvtax.attention.checks import check_kv_start, check_query, unrotate_output
from kvtax.attention.view import CacheView


def attention_naive(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    kv_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same function as `attention_blockwise`, materializing `[B, H_q, L, context]` scores.

    Dequantizes the whole cache (in logical order) first; small shapes only (its memory
    grows with L · context).
    """
    n_q, _ = check_query(q, view)
    scale = 1.0 / math.sqrt(view.head_dim) if scale is None else scale
    qg = grouped_query(q, view, scale)
    order = view.logical_order()
    k = view.spec.key.read_index(view.k, order)
    v = view.spec.value.read_index(view.v, order)
    k_pos = view.slot_positions()[order]
    q_pos = torch.arange(view.length - n_q, view.length, device=q.device)
    mask = visible(q_pos, k_pos, causal=causal, window=view.window, sinks=view.sinks)
    pad = padding_mask(check_kv_start(kv_start, view), k_pos)
    mask = mask if pad is None else mask & pad
    s = softcap_scores(torch.einsum("bhgld,bhtd->bhglt", qg, k), softcap)
    s = s.masked_fill(~mask, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see nothing → zeros
    out = torch.einsum("bhglt,bhtd->bhgld", p, v)
    return unrotate_output(out.flatten(1, 2), view).to(q.dtype)
