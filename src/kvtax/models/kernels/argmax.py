"""Greedy decoding's argmax over each row of the logits, in one launch.

Why a kernel: torch's argmax over one 128,256-wide row (Llama-3's vocabulary) runs as a
single-block reduction, 27 µs on the H200 (benchmarks/decode.py's profile) —
half a percent of a batch-1 decode step. Here `n_prog` programs per row each reduce one
chunk to (max, its first index, the first NaN's index); the last program of the row to
finish (an acq_rel counter per row) merges the partials, writes the token id, and sets
the counter back to zero for the next call, so the whole argmax is one kernel.

ADVANCE (greedy CUDA-graph decode, kvtax.models.runner): the merging program also moves
the decode step's device counters on (the row's length + 1; row 0 also the write
position + 1), so a captured step feeds the next replay itself, with no launches between.

Semantics are torch.argmax's: the first index of the maximum; a NaN counts as larger
than everything, so a row holding NaNs gives its first NaN's index.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def argmax_kernel(X, PartV, PartI, PartN, Count, Out, Pos, Len, V, CHUNK, stride_x, n_prog,
                   BLOCK: tl.constexpr, P_BLOCK: tl.constexpr, ADVANCE: tl.constexpr = False):
    """Grid (n_prog, B). X `[B, V]` float; PartV / PartI / PartN `[B, n_prog]` (max,
    its first index, first NaN index or V) float32 / int32 / int32; Count `[B]` int32,
    zero on entry and on exit; Out `[B]` int64. Program p covers columns
    [p * CHUNK, (p + 1) * CHUNK), CHUNK a multiple of BLOCK. ADVANCE: Pos `[1]` int64
    and Len `[B]` int32 each go up by one once the row's token is written."""
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], V, tl.int32)
    nan_i = tl.full([BLOCK], V, tl.int32)
    lo = pid * CHUNK
    for start in range(lo, lo + CHUNK, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < V
        x = tl.load(X + row * stride_x + o, mask=m, other=float("-inf")).to(tl.float32)
        nan_i = tl.minimum(nan_i, tl.where(x != x, o, V))
        # strictly greater: lanes see their columns in increasing order, so on a tie the
        # earlier column stays
        up = (x > best_v) | ((best_i == V) & m & (x == x))
        best_v = tl.where(up, x, best_v)
        best_i = tl.where(up, o, best_i)
    v = tl.max(best_v, 0)
    i = tl.min(tl.where((best_v == v) & (best_i < V), best_i, V), 0)
    p = row * n_prog + pid
    tl.store(PartV + p, v)
    tl.store(PartI + p, i)
    tl.store(PartN + p, tl.min(nan_i, 0))
    tl.debug_barrier()  # every lane's partial stores come before this program's release
    done = tl.atomic_add(Count + row, 1, sem="acq_rel")
    if done == n_prog - 1:  # the row's last program: merge the partials
        q = tl.arange(0, P_BLOCK)
        mq = q < n_prog
        pv = tl.load(PartV + row * n_prog + q, mask=mq, other=float("-inf"), cache_modifier=".cg")
        pi = tl.load(PartI + row * n_prog + q, mask=mq, other=V, cache_modifier=".cg")
        pn = tl.load(PartN + row * n_prog + q, mask=mq, other=V, cache_modifier=".cg")
        first_nan = tl.min(pn, 0)
        top = tl.max(pv, 0)
        # programs cover increasing columns, so the smallest index among the maxima wins;
        # a row of only -inf keeps index 0 (torch.argmax's answer)
        idx = tl.min(tl.where((pv == top) & (pi < V), pi, V), 0)
        idx = tl.where(idx == V, 0, idx)
        idx = tl.where(first_nan < V, first_nan, idx)
        tl.store(Out + row, idx.to(tl.int64))
        tl.store(Count + row, 0)
        if ADVANCE:  # only this program of the row touches them
            tl.store(Len + row, tl.load(Len + row) + 1)
            if row == 0:
                tl.store(Pos, tl.load(Pos) + 1)
