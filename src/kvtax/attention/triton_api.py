"""Checked entry points to the fused Triton attention kernels over quantized KV.

    >>> from kvtax.attention.triton_api import triton_attention, unsupported_reason
    >>> unsupported_reason(q, cache.view())          # None: the kernels can serve it
    >>> out = triton_attention(q, cache.view())      # q [B, H_q, L, D] → [B, H_q, L, D]
    >>> out, lse = triton_attention_lse(q, view, min_distance=128)  # a hybrid cache's part

L <= 16 query rows take a split-KV decode kernel plus a reduction; longer chunks take
the prefill kernel (`launch_table` says which, `launch` runs it). Both read the cache's
quantized storage directly and dequantize tiles in registers. On CPU the kernels run
through Triton's interpreter when `TRITON_INTERPRET=1` was set when this module was
imported (how CI tests them); `unsupported_reason` still reports CPU tensors as
unsupported, so dispatch and callers that choose a path keep using the reference there.

CUDA graphs: pass `lengths` (int32 `[B]` on q's device) and keep the storage fixed
(a preallocated FullCache, or a SlidingCache with `max_chunk`); launch shapes then
depend only on the cache's capacity, and the kernels read the lengths at run time.
"""

from __future__ import annotations

import torch

from kvtax.attention.checks import rotate_query, unrotate_output
from kvtax.attention.launch import launch_attention, workspace
from kvtax.attention.launch_table import (
    MAX_DECODE_ROWS, MAX_DECODE_TILE, LaunchConfig, launch_config, swap_decode_config,
    tile_decode_config, warp_decode_config,
)
from kvtax.attention.op import attention_op
from kvtax.attention.support import gluon_swap_reason, swap_reason, unsupported_reason
from kvtax.attention.view import CacheView

__all__ = [
    "MAX_DECODE_ROWS", "MAX_DECODE_TILE", "LaunchConfig", "gluon_swap_reason",
    "launch_config", "swap_decode_config", "swap_reason", "tile_decode_config",
    "triton_attention", "triton_attention_lse", "unsupported_reason", "warp_decode_config",
]


def triton_attention(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    lengths: torch.Tensor | None = None,
    kv_start: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Causal attention of the last L positions' queries over a quantized cache view.

    q:       `[B, H_q, L, D]` fp16/bf16/fp32 (any strides); H_q a multiple of H_kv.
    view:    `cache.view()`; K and V formats may differ (e.g. k8v4).
    scale:   softmax scale, default 1/sqrt(D). softcap: Gemma 2's `c * tanh(s / c)`.
    lengths: optional int32 `[B]` on q's device: each sequence's length, read by the
             kernels at run time (CUDA-graph decode); default `view.length_t` when the
             view carries one, else `view.length` for all.
    kv_start: optional integer `[B]`: each row's first valid key position (left
             padding); keys before it are hidden.
    out:     optional `[B, H_q, L, D]` contiguous output buffer in q.dtype.
    config:  override the heuristic `launch_config` (benchmarks, tuning).
    Returns `[B, H_q, L, D]` in q.dtype.

    Example:
        cache.append(k, v)
        o = triton_attention(q, cache.view(), softcap=50.0)
    """
    if torch.compiler.is_compiling() and out is None and config is None:
        return attention_op(q, view, lengths, kv_start, scale, softcap)
    return launch_attention(q, view, scale=scale, softcap=softcap, lengths=lengths,
                            kv_start=kv_start, out=out, config=config)


def triton_attention_lse(
    q: torch.Tensor,
    view: CacheView,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    min_distance: int = 0,
    min_key: int = 0,
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kvtax.attention.lse.attention_lse` on the fused kernels (one part of a hybrid cache).

    q `[B, H_q, L, D]` (the last L positions) over `view`, which may be Hadamard-rotated
    (`+hk`: q is rotated here; `+hkv`: the output is rotated back). Keys closer than
    `min_distance` to a query, or at positions < `min_key`, are hidden on top of the
    view's causal/window/sink rule. Returns `(out, lse)`: out `[B, H_q, L, D]` float32 in
    the model's value domain, lse `[B, H_q, L]` float32 (natural log of the sum of
    exp(scaled, soft-capped scores)); a row that sees no key has out 0 and lse -inf.
    Raises ShapeError where the kernels cannot serve the call (`unsupported_reason`).

    Example:
        o_fp, l_fp = triton_attention_lse(q, fp16_part_view)
        o_q, l_q = triton_attention_lse(q, body_view, min_distance=128, min_key=4)
        out, _ = merge_lse([(o_fp, l_fp), (o_q, l_q)])
    """
    rows = tuple(q.shape[:3]) if q.dim() == 4 else (0, 0, 0)
    out = workspace(tuple(q.shape), q.device)  # float32: the merge stays exact
    lse = workspace(rows, q.device)
    launch_attention(rotate_query(q, view), view, scale=scale, softcap=softcap, out=out,
                     config=config, lse=lse, min_distance=min_distance, min_key=min_key)
    return unrotate_output(out, view), lse
