"""Split-KV decode (flash-decoding): 1..16 query rows against the cache, in parallel splits.

Grid `(B * H_kv, num_splits)`. The G query heads of a KV head times the L query rows
(R = G * L <= BLOCK_M, padded to at least 16 for tl.dot) share one program, which scans
one contiguous range of slots and writes an unnormalized partial: acc `[R, D]`, the
base-2 running max m `[R]` and denominator l `[R]`. `reduce.py` merges the splits.

The split ranges are computed in the kernel from the sequence length, which may come
from a device tensor, so one CUDA graph serves every decode step: the grid depends only
on the cache's capacity.

HAS_MIN_DIST (constexpr, off by default) hides keys closer than `min_dist` to the query
or before `min_key` (one part of a hybrid cache); `reduce.py` then may also return the
rows' log-sum-exp.
"""

import triton
import triton.language as tl

from kvtax.attention.kernels.common import (
    attn_step, head_pointers, load_queries, pdl_enter, pdl_exit, sequence_of, split_range,
    tile_meta,
)


@triton.jit(do_not_specialize=["length_host", "n_q", "num_splits", "split_base",
                             "splits_total"])
def decode_attn_split_kernel(
    Q, PartO, PartM, PartL, Kc, Ks, Kb, Vc, Vs, Vb, Lens, KvStart,
    length_host, n_q, num_splits, n_kv_heads, sinks, ring, window, qk_scale, cap_log2,
    s_qb, s_qh, s_ql, s_qd,
    s_kc_b, s_kc_h, s_kc_t, s_km_b, s_km_h, s_km_t,
    s_vc_b, s_vc_h, s_vc_t, s_vm_b, s_vm_h, s_vm_t,
    min_dist, min_key, split_base, splits_total,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_GS: tl.constexpr, V_FMT: tl.constexpr, V_GS: tl.constexpr,
    IS_RING: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_LENS: tl.constexpr, IEEE: tl.constexpr, FOLD_K: tl.constexpr, FOLD_V: tl.constexpr,
    HAS_KV_START: tl.constexpr, HAS_MIN_DIST: tl.constexpr,
    PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False,
):
    pdl_enter(PDL, PDL_LATE, False)
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b, h, length, num_slots, kv0 = sequence_of(
        pid_bh, n_kv_heads, Lens, KvStart, length_host, sinks, ring, IS_RING, HAS_LENS,
        HAS_KV_START)
    lo, hi = split_range(num_slots, split, num_splits, BLOCK_N)
    if HAS_MIN_DIST:
        if not IS_RING:  # slots are positions: skip tiles no row may read
            lo = tl.maximum(lo, (min_key // BLOCK_N) * BLOCK_N)
            hi = tl.minimum(hi, tl.maximum(length - min_dist, 0))

    DH: tl.constexpr = HEAD_DIM // 2
    n_rows = G * n_q
    o_m = tl.arange(0, BLOCK_M)
    o_l = o_m // G
    m_row = o_m < n_rows
    q_pos = length - n_q + o_l
    p_kc, p_ks, p_kb, p_vc, p_vs, p_vb = head_pointers(
        Kc, Ks, Kb, Vc, Vs, Vb, b, h, s_kc_b, s_kc_h, s_km_b, s_km_h, s_vc_b, s_vc_h, s_vm_b,
        s_vm_h)
    q_lo, q_hi = load_queries(Q, b, h, o_m, o_l, m_row, s_qb, s_qh, s_ql, s_qd, p_kc, s_kc_t,
                              G, HEAD_DIM, HALF, K_FMT, IEEE)  # [BLOCK_M, HALF]

    acc_lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    ks_lo, kb_lo, ks_hi, kb_hi, vs_lo, vb_lo, vs_hi, vb_hi = tile_meta(
        p_ks, p_kb, p_vs, p_vb, lo, num_slots, s_km_t, s_vm_t,
        HEAD_DIM, HALF, BLOCK_N, K_FMT, K_GS, V_FMT, V_GS)
    for start in range(lo, hi, BLOCK_N):
        (acc_lo, acc_hi, m_i, l_i, ks_lo, kb_lo, ks_hi, kb_hi,
         vs_lo, vb_lo, vs_hi, vb_hi) = attn_step(
            acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_pos, start, num_slots, length, kv0,
            p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc_t, s_km_t, s_vc_t, s_vm_t,
            ks_lo, kb_lo, ks_hi, kb_hi, vs_lo, vb_lo, vs_hi, vb_hi,
            sinks, ring, window, qk_scale, cap_log2,
            HEAD_DIM, HALF, BLOCK_N, K_FMT, K_GS, V_FMT, V_GS,
            True, IS_RING, HAS_WINDOW, SOFTCAP, IEEE, FOLD_K, FOLD_V, HAS_KV_START,
            min_dist, min_key, HAS_MIN_DIST)

    # partials: PartO [B*H_kv, splits_total, R, D], PartM / PartL [B*H_kv, splits_total, R];
    # this launch's splits sit at [split_base, split_base + num_splits) (see decode_warp.py)
    row = (pid_bh.to(tl.int64) * splits_total + split_base + split) * n_rows + o_m
    tl.store(PartM + row, m_i, mask=m_row)
    tl.store(PartL + row, l_i, mask=m_row)
    p_o = PartO + row[:, None] * HEAD_DIM
    o_d = tl.arange(0, HALF)
    m_q = m_row[:, None] & (o_d < DH)[None, :]
    tl.store(p_o + o_d[None, :], acc_lo, mask=m_q)
    tl.store(p_o + (o_d + DH)[None, :], acc_hi, mask=m_q)
    pdl_exit(PDL, PDL_LATE, False)
