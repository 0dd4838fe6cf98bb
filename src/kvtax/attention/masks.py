"""Which cache slots the last L queries may see: from the host length, or from the device one.

The baselines (`kvtax.attention.baselines`) attend in torch over a prefix of the storage.
Eager, they read the first `view.num_slots` slots with a mask built from `view.length`
(`host_mask`). Inside a captured CUDA graph the host length is frozen at capture, so they
read every physical slot with a mask computed from `view.length_t` on the device
(`capacity_mask`); the cache is presized to prompt + new tokens, so that is ~the same
bytes. The slot → position map is the one of `kvtax.attention.view`.

    >>> mask = capacity_mask(1, view, causal=True)   # bool [B, 1, 1, slots]
"""

from __future__ import annotations

import torch

from kvtax.attention.blockwise import visible
from kvtax.attention.view import CacheView

# Masks built while a graph is captured: every layer of one captured step sees the same
# length tensor, so layers of one geometry share one mask (built once a step, as
# transformers builds its mask once a forward). Each capture brings its own length tensor
# (`Runner`'s graphs do), which resets this, so no graph reads another graph's mask.
_captured: dict[object, object] = {}


def storage_slots(view: CacheView) -> int:
    """Physical slots of the storage (capacity, rounded up to the storage alignment)."""
    return view.k.codes.shape[2]


def host_mask(n_q: int, view: CacheView, causal: bool) -> torch.Tensor | None:
    """Bool `[L, num_slots]` visibility from the host length, or None when every slot is
    visible (one query at the newest position over a full cache: plain decode)."""
    if n_q == 1 and view.window is None:
        return None
    q_pos = torch.arange(view.length - n_q, view.length, device=view.device)
    return visible(q_pos, view.slot_positions(), causal=causal, window=view.window,
                   sinks=view.sinks)


def capacity_mask(
    n_q: int, view: CacheView, causal: bool, *, repeat: int = 1, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Visibility `[B, 1, repeat · L, slots]` over every physical slot, from `view.length_t`
    `[B]` only (no host read: graph-safe); slots never written (past the held tokens) are
    masked out. Rows `r · L + i` are query i's. dtype None: bool (True = visible); else
    SDPA's additive form in that dtype (0 visible, -inf not), so SDPA converts nothing."""
    if view.length_t is None:
        raise ValueError("capacity_mask needs view.length_t (the device lengths)")
    key = (view.ring, view.sinks, view.window, n_q, causal, storage_slots(view), repeat, dtype)
    if torch.compiler.is_compiling() or not (
        view.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    ):  # (a compiled step is traced once, outside capture: no shared state in the trace)
        return _finish(_build(n_q, view, causal), repeat, dtype)
    if _captured.get("length_t") is not view.length_t:
        _captured.clear()
        _captured["length_t"] = view.length_t
    if key not in _captured:
        _captured[key] = _finish(_build(n_q, view, causal), repeat, dtype)
    return _captured[key]  # type: ignore[return-value]


def _finish(ok: torch.Tensor, repeat: int, dtype: torch.dtype | None) -> torch.Tensor:
    ok = ok.repeat(1, 1, repeat, 1) if repeat > 1 else ok
    if dtype is None:
        return ok
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))


def _build(n_q: int, view: CacheView, causal: bool) -> torch.Tensor:
    n = view.length_t.to(torch.int64)[:, None]                       # [B, 1]
    slots = torch.arange(storage_slots(view), device=view.device)[None, :]  # [1, S]
    if view.ring:
        ring_tokens = (n - view.sinks).clamp(min=0)
        held = n.clamp(max=view.sinks) + ring_tokens.clamp(max=view.ring)
        t = (ring_tokens - 1) - torch.remainder(
            (ring_tokens - 1) - (slots - view.sinks), view.ring)
        k_pos = torch.where(slots < view.sinks, slots, view.sinks + t)   # [B, S]
    else:
        held, k_pos = n, slots
    q_pos = n - n_q + torch.arange(n_q, device=view.device)[None, :]   # [B, L]
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]                    # [B, L, 1], [B, 1, S]
    ok = (slots < held)[:, None, :] & (kp >= 0)
    if causal:
        ok = ok & (kp <= qp)
    if view.window is not None:
        ok = ok & ((qp - kp < view.window) | (kp < view.sinks))
    return ok[:, None]                                               # [B, 1, L, S]
