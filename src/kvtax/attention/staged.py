"""Staged prefill: a long prefill chunk over a quantized full cache as fp16 attention
over the cache dequantized one bounded chunk at a time.

The fused prefill kernel dequantizes every K/V tile once per block of query rows (a
2048-row chunk of a 32-head, 8-KV-head model: 64 row blocks read each tile), in the
registers its score and output tiles need: on an H200 its int4 body ran at 0.6-0.8x
FlashAttention-2's TFLOP/s while the same kernel over fp16 storage ran at 1.4x. Here
each slot is dequantized once (kernels/stage.py: the kernels' own dequantization) into
a scratch of STAGE_BYTES, the fp16 prefill kernel attends over it, and the chunks chain
through the kernel's prior epilogue (a running (out, log-sum-exp) pair, as a hybrid
cache's parts do); the causal edge, which only some rows see, stays on the fused
kernel over the quantized storage. Exactly the function `launch_attention` computes,
up to float rounding of the chunked softmax.

Transient memory: the scratch (STAGE_BYTES at most) plus the float32 pair, both bounded
whatever the context. It pays only when many query rows share each dequantized slot:
STAGE_MIN_ROWS.
"""

from __future__ import annotations

import torch

from kvtax.attention.view import CacheView
from kvtax.formats import KVSpec, QTensor

STAGE_BYTES = 32 << 20  # fp16 K + V scratch of one chunk
STAGE_MIN_ROWS = 1024  # G * L query rows from which staging pays (the 8th row block)
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
    masks as there). Keys every row sees, `[min_key, edge)`, go through fp16 chunks;
    `[edge, ...)` through the fused kernel, which writes out."""
    from kvtax.attention.launch import launch_attention, workspace
    from kvtax.attention.stage_launch import launch_stage

    n_q = q.shape[2]
    kw = dict(scale=scale, softcap=softcap, min_distance=min_distance)
    edge = (view.length - n_q + 1 - min_distance) // ALIGN * ALIGN
    begin = min_key // ALIGN * ALIGN
    if edge <= begin:
        return launch_attention(q, view, out=out, lse=lse, prior=prior, min_key=min_key, **kw)
    chunk = min(chunk_slots(view, q.dtype), edge - begin)
    shape = (view.batch, view.num_kv_heads, chunk, view.head_dim)
    k_buf = torch.empty(shape, dtype=q.dtype, device=q.device)
    v_buf = torch.empty(shape, dtype=q.dtype, device=q.device)
    spec = KVSpec.of(_FLOAT[q.dtype])
    if prior is None and out.dtype == torch.float32 and lse is not None:
        prior_t = (out, lse)  # the caller's float32 pair carries the chunks in place
    else:
        prior_t = prior
    pair = prior_t or (workspace(tuple(q.shape), q.device),
                       workspace(tuple(q.shape[:3]), q.device))
    first = prior is None
    for s in range(begin, edge, chunk):
        n = min(chunk, edge - s)  # a multiple of ALIGN
        launch_stage(view.k, view.spec.key, s, n, k_buf[:, :, :n])
        launch_stage(view.v, view.spec.value, s, n, v_buf[:, :, :n])
        part = CacheView(QTensor(k_buf[:, :, :n]), QTensor(v_buf[:, :, :n]), spec,
                         view.head_dim, view.length - s, dtype=view.dtype)
        launch_attention(q, part, out=pair[0], lse=pair[1], prior=None if first else pair,
                         min_key=max(min_key - s, 0), max_key=n, **kw)
        first = False
    return launch_attention(q, view, out=out, lse=lse, prior=pair, min_key=max(min_key, edge),
                            **kw)
