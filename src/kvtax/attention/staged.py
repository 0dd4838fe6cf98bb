"""Staged prefill: a long prefill chunk over a quantized full cache as fp16 attention
over the cache dequantized one bounded chunk at a time.

The fused prefill kernel dequantizes every K/V tile once per block of query rows (a
2048-row chunk of a 32-head, 8-KV-head model: 64 row blocks read each tile), in the
registers its score and output tiles need: on an H200 its int4 body ran at 0.6-0.8x
FlashAttention-2's TFLOP/s while the same kernel over fp16 storage ran at 1.4x. Here
each slot is dequantized once (kernels/stage.py: the kernels' own dequantization) into
a scratch of STAGE_BYTES, the fp16 prefill kernel attends over it, and the chunks chain
through the kernel's prior epilogue (a running (out, log-sum-exp) pair, as a hybrid
cache's parts do). The causal edge, which only some rows see, is staged too, in the
last chunk, where the fp16 kernel's causal mask and early exit apply (on the fused
kernel it held a third of a 2048-row chunk's FLOPs at 4k). Exactly the function
`launch_attention` computes, up to float rounding of the chunked softmax.

Transient memory: the scratch (STAGE_BYTES at most) plus the float32 pair, both bounded
whatever the context. It pays only when many query rows share each dequantized slot:
STAGE_MIN_ROWS.
"""

from __future__ import annotations

import torch

from kvtax.attention.view import CacheView
from kvtax.formats import KVSpec, QTensor

STAGE_BYTES = 32 << 20  # fp16 K + V scratch of one chunk
# G * L query rows from which staging is used: on an H200 it beat the fused kernel in every
# measured cell, from 64 rows x 4 heads (256) at 4k to 2048 x 4 at 128k, every format
# (benchmarks/staged_prefill.py, 2026-12-04); fewer rows were not measured.
STAGE_MIN_ROWS = 256
ALIGN = 128  # chunk bounds: the prefill kernel's widest key tile, two int4-c64 blocks
_FLOAT = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def staged_reason(q: torch.Tensor, view: CacheView, kv_start: torch.Tensor | None = None
                  ) -> str | None:
    """None when `staged_launch` serves this prefill call (q `[B, H_q, L, D]`), else why
    not (the fused kernel over the quantized storage serves it instead)."""
    rows = q.shape[1] // view.num_kv_heads * q.shape[2]
    if not view.spec.is_quantized:
        return "the cache is not quantized"
    if view.ring or view.window is not None:
        return "a ring or window cache (its rows read few slots)"
    if kv_start is not None or view.length_t is not None:
        return "left padding or device lengths"
    if q.dtype not in _FLOAT:
        return f"{q.dtype} queries"
    if rows < STAGE_MIN_ROWS:
        return f"{rows} query rows (staging pays from {STAGE_MIN_ROWS})"
    return None


def chunk_slots(view: CacheView, dtype: torch.dtype) -> int:
    """Slots per staged chunk: STAGE_BYTES of K + V in `dtype`, a multiple of ALIGN."""
    per_slot = 2 * view.batch * view.num_kv_heads * view.head_dim * dtype.itemsize
    return max(STAGE_BYTES // per_slot // ALIGN, 1) * ALIGN


def staged_launch(
    q: torch.Tensor, view: CacheView, *, out: torch.Tensor, lse: torch.Tensor | None = None,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None, scale: float | None = None,
    softcap: float | None = None, min_distance: int = 0, min_key: int = 0,
) -> torch.Tensor:
    """`launch.launch_attention` of a prefill call, staged (`staged_reason` must be None):
    the same arguments and result (q `[B, H_q, L, D]` in the stored keys' domain; out
    `[B, H_q, L, D]` in q.dtype or float32; lse, prior and the min_distance / min_key
    masks as there). Every slot from min_key on goes through fp16 chunks, the causal edge
    (`[last, length)`, which holds every query row) in the last one, whose launch writes
    out; an edge longer than the scratch stays on the fused kernel over the quantized
    storage."""
    from kvtax.attention.launch import launch_attention, workspace
    from kvtax.attention.stage_launch import STAGE_TILE

    n_q = q.shape[2]
    kw = dict(scale=scale, softcap=softcap, min_distance=min_distance)
    begin, size = min_key // ALIGN * ALIGN, chunk_slots(view, q.dtype)
    last = max((view.length - n_q) // ALIGN * ALIGN, begin)  # [last, length) holds every row
    if view.length - last <= size:  # the causal edge fits one chunk: staged, it writes out
        stop, tail = last, view.length - last
    else:  # a chunk longer than the scratch: the slots every row sees, the edge fused
        stop, tail = max((view.length - n_q + 1 - min_distance) // ALIGN * ALIGN, begin), 0
    # nothing to stage, or no row sees a key (the fused kernel's empty rows): all fused
    if (stop == begin and not tail) or view.length - min_distance <= min_key:
        return launch_attention(q, view, out=out, lse=lse, prior=prior, min_key=min_key, **kw)
    rows = -(-min(size, max(stop - begin, tail)) // STAGE_TILE) * STAGE_TILE
    shape = (view.batch, view.num_kv_heads, rows, view.head_dim)
    bufs = (torch.empty(shape, dtype=q.dtype, device=q.device),
            torch.empty(shape, dtype=q.dtype, device=q.device))
    if prior is None and out.dtype == torch.float32 and lse is not None:
        pair = (out, lse)  # the caller's float32 pair carries the chunks in place
    else:
        pair = prior or (workspace(tuple(q.shape), q.device),
                         workspace(tuple(q.shape[:3]), q.device))
    acc = prior
    for s in range(begin, stop, size):  # multiples of ALIGN: max_key caps the fp16 launch
        n = min(size, stop - s)
        part = _stage(view, s, n, bufs)
        launch_attention(q, part, out=pair[0], lse=pair[1], prior=acc,
                         min_key=max(min_key - s, 0), max_key=n, **kw)
        acc = pair
    if tail:
        return launch_attention(q, _stage(view, last, tail, bufs), out=out, lse=lse, prior=acc,
                                min_key=max(min_key - last, 0), **kw)
    return launch_attention(q, view, out=out, lse=lse, prior=acc, min_key=max(min_key, stop),
                            **kw)


def _stage(view: CacheView, start: int, n: int, bufs: tuple[torch.Tensor, torch.Tensor]
           ) -> CacheView:
    """Slots `[start, start + n)` of `view` dequantized into the scratch `bufs`, as a plain
    view whose `length` (`view.length - start`) keeps every query row's position."""
    from kvtax.attention.stage_launch import STAGE_TILE, launch_stage

    n_pad = -(-n // STAGE_TILE) * STAGE_TILE
    k, v = (b[:, :, :n_pad] for b in bufs)
    launch_stage(view.k, view.spec.key, start, n, k)
    launch_stage(view.v, view.spec.value, start, n, v)
    spec = KVSpec.of(_FLOAT[k.dtype])
    return CacheView(QTensor(k), QTensor(v), spec, view.head_dim, view.length - start,
                     dtype=view.dtype)
