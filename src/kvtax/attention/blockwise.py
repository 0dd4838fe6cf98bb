"""Blockwise pure-torch attention over a quantized cache view: the product's CPU path.

`attention_blockwise` streams the cache in tiles of `block` slots, dequantizing one tile
at a time inside an online softmax, so its extra memory is O(query_len · block) whatever
the context. `kvtax.attention.attention` runs it wherever the fused kernels cannot, and
`lse.attention_lse` builds on `online_step`. It is production code, not the test oracle:
`reference.attention_naive` (tests only) computes the same function by materializing
every score, so the two check each other.

Queries are the last L positions of the cache (`length - L .. length - 1`): causal
masking is aligned bottom-right, so a prefill chunk and a decode row use the same code.
"""

from __future__ import annotations

import math

import torch

from kvtax.attention.checks import check_kv_start, check_query, unrotate_output
from kvtax.attention.view import CacheView
from kvtax.formats import rotate


def visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    sinks: int,
) -> torch.Tensor:
    """Bool mask `[L, T]`: may the query at `q_pos[i]` see the key at `k_pos[j]`?"""
    qp, kp = q_pos[:, None], k_pos[None, :]
    ok = kp >= 0
    if causal:
        ok = ok & (kp <= qp)
    if window is not None:
        ok = ok & ((qp - kp < window) | (kp < sinks))
    return ok


def softcap_scores(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's `c * tanh(s / c)` on scores `s` (any shape); s itself when off."""
    return s if not softcap else softcap * torch.tanh(s / softcap)


def padding_mask(kv_start: torch.Tensor | None, k_pos: torch.Tensor) -> torch.Tensor | None:
    """Bool `[B, 1, 1, 1, T]`: key position >= the row's first valid position, or None."""
    if kv_start is None:
        return None
    return (k_pos[None, :] >= kv_start[:, None])[:, None, None, None, :]


def grouped_query(q: torch.Tensor, view: CacheView, scale: float) -> torch.Tensor:
    """`[B, H_q, L, D]` → float32 `[B, H_kv, G, L, D]`, pre-scaled, in the keys' domain."""
    b, hq, n_q, d = q.shape
    n_kv = view.num_kv_heads
    qf = q.float()
    qf = rotate(qf) if view.spec.rotate_keys else qf
    return (qf * scale).view(b, n_kv, hq // n_kv, n_q, d)


def attention_blockwise(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    block: int = 256,
    kv_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `q` `[B, H_q, L, D]` over `view`; returns `[B, H_q, L, D]` in q.dtype.

    Computes in float32, one tile of `block` slots at a time (online softmax). Rows that
    see no key at all return zeros. `scale` defaults to 1/sqrt(D); `softcap` applies
    Gemma 2's `c * tanh(s / c)` to the scores before masking. `kv_start` (int `[B]`,
    optional) hides keys at positions below it in each batch row: left padding.

    Example: `attention_blockwise(q, cache.view(), softcap=50.0)`.
    """
    n_q, _ = check_query(q, view)
    kv_start = check_kv_start(kv_start, view)
    scale = 1.0 / math.sqrt(view.head_dim) if scale is None else scale
    qg = grouped_query(q, view, scale)
    q_pos = torch.arange(view.length - n_q, view.length, device=q.device)
    m = torch.full(qg.shape[:-1], -math.inf, device=q.device)  # [B, Hkv, G, L]
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(qg)  # [B, Hkv, G, L, D]
    for start in range(0, view.num_slots, block):
        end = min(start + block, view.num_slots)
        k_pos = view.slot_positions(start, end)
        mask = visible(q_pos, k_pos, causal=causal, window=view.window, sinks=view.sinks)
        if not bool(mask.any()):
            continue  # a tile wholly outside the causal band or window costs nothing
        pad = padding_mask(kv_start, k_pos)
        mask = mask if pad is None else mask & pad  # [L, T] or [B, 1, 1, L, T]
        m, denom, acc = online_step(qg, view, start, end, mask, softcap, m, denom, acc)
    out = acc / denom.clamp_min(1e-30)[..., None]
    return unrotate_output(out.flatten(1, 2), view).to(q.dtype)


def online_step(
    qg: torch.Tensor, view: CacheView, start: int, end: int, mask: torch.Tensor,
    softcap: float | None, m: torch.Tensor, denom: torch.Tensor, acc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One online-softmax step of the blockwise references over slots `[start, end)`.

    qg `[B, Hkv, G, L, D]` float32 (scaled, rotated as the stored keys are); mask
    broadcastable to the scores `[B, Hkv, G, L, T]`; state m, denom `[B, Hkv, G, L]`
    (running max, sum of exp) and acc `[B, Hkv, G, L, D]`. Only this tile is dequantized.
    """
    kt = view.spec.key.read(view.k, start, end)  # [B, Hkv, T, D]
    vt = view.spec.value.read(view.v, start, end)
    s = softcap_scores(torch.einsum("bhgld,bhtd->bhglt", qg, kt), softcap)
    s = s.masked_fill(~mask, -math.inf)
    m_new = torch.maximum(m, s.amax(-1))
    base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    p = torch.exp(s - base[..., None])
    alpha = torch.exp(m - base)
    denom = denom * alpha + p.sum(-1)
    acc = acc * alpha[..., None] + torch.einsum("bhglt,bhtd->bhgld", p, vt)
    return m_new, denom, acc
