"""Chunked-prefill attention: a block of query rows against every cached slot.

Grid `(cdiv(G * L, BLOCK_M), B * H_kv)`. Row m of a tile is query `l = m // G` of head
`g = m % G` in the KV head's group, so the G heads sharing a KV head sit in one tile and
each K/V tile is loaded and dequantized once for all of them. Rows are position-major,
so a tile spans BLOCK_M / G consecutive positions and its causal bound stays tight.

Per program: slots every row sees whole run without masks; the causal edge, windows
and ring caches run masked. Extra memory: none beyond the output.

Optional (constexpr, off by default): HAS_LSE also stores each row's log-sum-exp of
scores to `Lse` `[B, H_q, L]` float32; HAS_MIN_DIST hides keys closer than `min_dist` to
the query or before `min_key` (one part of a hybrid cache, see kvtax.attention.lse), and
on a full cache (no ring, window or padding) reads no slot at or past `max_key`, a
multiple of BLOCK_N (one chunk of a staged prefill, kvtax.attention.staged);
HAS_PRIOR merges the row with an earlier part's `(Prior [B, H_q, L, D] float32,
PriorLse [B, H_q, L])` before storing (`merge_lse`'s sum, done in the epilogue), so a
hybrid cache's parts chain into one output without a torch merge. A ring read through
a window scans only the sinks and the window's slots of its rows (`window_runs`).
"""

import triton
import triton.language as tl

from kvtax.attention.kernels.common import (
    attn_step, head_pointers, load_queries, sequence_of, tile_meta, window_runs,
)


@triton.jit(do_not_specialize=["length_host", "n_q"])
def prefill_attn_fwd_kernel(
    Q, Out, Kc, Ks, Kb, Vc, Vs, Vb, Lens, KvStart,
    length_host, n_q, n_kv_heads, sinks, ring, window, qk_scale, cap_log2,
    s_qb, s_qh, s_ql, s_qd, s_ob, s_oh, s_ol,
    s_kc_b, s_kc_h, s_kc_t, s_km_b, s_km_h, s_km_t,
    s_vc_b, s_vc_h, s_vc_t, s_vm_b, s_vm_h, s_vm_t,
    Lse, min_dist, min_key, max_key, Prior, PriorLse,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_GS: tl.constexpr, V_FMT: tl.constexpr, V_GS: tl.constexpr,
    IS_RING: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_LENS: tl.constexpr, IEEE: tl.constexpr, FOLD_K: tl.constexpr, FOLD_V: tl.constexpr,
    HAS_KV_START: tl.constexpr,
    HAS_LSE: tl.constexpr, HAS_MIN_DIST: tl.constexpr, HAS_PRIOR: tl.constexpr = False,
):
    """Grid (cdiv(G * L, BLOCK_M), B * H_kv): one block of packed query rows against the cache.

    Over 80 lines: the prologue, the masked / unmasked / masked tile loops and the epilogue
    share one register state; the per-tile work is `common.attn_step`.
    """
    # heaviest (latest) row blocks first: they scan the most slots
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b, h, length, num_slots, kv0 = sequence_of(
        tl.program_id(1), n_kv_heads, Lens, KvStart, length_host, sinks, ring, IS_RING,
        HAS_LENS, HAS_KV_START)

    DH: tl.constexpr = HEAD_DIM // 2
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_l = o_m // G
    m_row = o_l < n_q
    q_pos = length - n_q + o_l  # [BLOCK_M]
    p_kc, p_ks, p_kb, p_vc, p_vs, p_vb = head_pointers(
        Kc, Ks, Kb, Vc, Vs, Vb, b, h, s_kc_b, s_kc_h, s_km_b, s_km_h, s_vc_b, s_vc_h, s_vm_b,
        s_vm_h)
    q_lo, q_hi = load_queries(Q, b, h, o_m, o_l, m_row, s_qb, s_qh, s_ql, s_qd, p_kc, s_kc_t,
                              G, HEAD_DIM, HALF, K_FMT, IEEE)  # [BLOCK_M, HALF]

    acc_lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # slots [0, full_end) are visible to every row; [full_end, hi) need masks
    q_first = length - n_q + (pid_m * BLOCK_M) // G
    q_last = length - n_q + tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, n_q - 1)
    if IS_RING or HAS_WINDOW or HAS_KV_START:
        full_end = 0
        hi = num_slots
    else:
        full_end = ((q_first + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(q_last + 1, num_slots)
    lo = 0
    full_lo = 0
    # a ring read through a window: the sinks and this block's window slots, <= 2 runs
    b_lo = hi
    b_hi = hi
    if IS_RING and HAS_WINDOW and not HAS_KV_START:
        hi, b_lo, b_hi = window_runs(q_last + 1, q_last + 1 - q_first, num_slots, sinks, ring,
                                     window, BLOCK_N)
    if HAS_MIN_DIST:
        if not (IS_RING or HAS_WINDOW or HAS_KV_START):
            # keys [min_key, q - min_dist] below max_key (a multiple of BLOCK_N): masked
            # head tile(s), whole middle, masked tail
            lo = (min_key // BLOCK_N) * BLOCK_N
            full_lo = tl.cdiv(min_key, BLOCK_N) * BLOCK_N
            full_end = tl.maximum(q_first + 1 - min_dist, 0) // BLOCK_N * BLOCK_N
            full_end = tl.minimum(tl.maximum(full_end, full_lo), max_key)
            hi = tl.minimum(tl.minimum(tl.maximum(q_last + 1 - min_dist, 0), num_slots),
                            max_key)
    # scales/biases of the first tile; each step fetches the next tile's
    ks_lo, kb_lo, ks_hi, kb_hi, vs_lo, vb_lo, vs_hi, vb_hi = tile_meta(
        p_ks, p_kb, p_vs, p_vb, lo, num_slots, s_km_t, s_vm_t,
        HEAD_DIM, HALF, BLOCK_N, K_FMT, K_GS, V_FMT, V_GS)
    if HAS_MIN_DIST:
        for start in range(lo, tl.minimum(full_lo, hi), BLOCK_N):
            (acc_lo, acc_hi, m_i, l_i, ks_lo, kb_lo, ks_hi, kb_hi,
             vs_lo, vb_lo, vs_hi, vb_hi) = attn_step(
                acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_pos, start, num_slots, length, kv0,
                p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc_t, s_km_t, s_vc_t, s_vm_t,
                ks_lo, kb_lo, ks_hi, kb_hi, vs_lo, vb_lo, vs_hi, vb_hi,
                sinks, ring, window, qk_scale, cap_log2,
                HEAD_DIM, HALF, BLOCK_N, K_FMT, K_GS, V_FMT, V_GS,
                True, IS_RING, HAS_WINDOW, SOFTCAP, IEEE, FOLD_K, FOLD_V,
                HAS_KV_START, min_dist, min_key, HAS_MIN_DIST)
    for start in range(full_lo, full_end, BLOCK_N):
        (acc_lo, acc_hi, m_i, l_i, ks_lo, kb_lo, ks_hi, kb_hi,
         vs_lo, vb_lo, vs_hi, vb_hi) = attn_step(
            acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_pos, start, num_slots, length, kv0,
            p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc_t, s_km_t, s_vc_t, s_vm_t,
            ks_lo, kb_lo, ks_hi, kb_hi, vs_lo, vb_lo, vs_hi, vb_hi,
            sinks, ring, window, qk_scale, cap_log2,
            HEAD_DIM, HALF, BLOCK_N, K_FMT, K_GS, V_FMT, V_GS,
            False, IS_RING, HAS_WINDOW, SOFTCAP, IEEE, FOLD_K, FOLD_V, HAS_KV_START,
            min_dist, min_key, HAS_MIN_DIST)
    for start in range(full_end, hi, BLOCK_N):
        (acc_lo, acc_hi, m_i, l_i, ks_lo, kb_lo, ks_hi, kb_hi,
         vs_lo, vb_lo, vs_hi, vb_hi) = attn_step(
            acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_pos, start, num_slots, length, kv0,
            p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc_t, s_km_t, s_vc_t, s_vm_t,
            ks_lo, kb_lo, ks_hi, kb_hi, vs_lo, vb_lo, vs_hi, vb_hi,
            sinks, ring, window, qk_scale, cap_log2,
            HEAD_DIM, HALF, BLOCK_N, K_FMT, K_GS, V_FMT, V_GS,
            True, IS_RING, HAS_WINDOW, SOFTCAP, IEEE, FOLD_K, FOLD_V, HAS_KV_START,
            min_dist, min_key, HAS_MIN_DIST)
    if IS_RING and HAS_WINDOW and not HAS_KV_START:
        # the window's run that did not wrap; its first tile's metadata anew
        ks_lo, kb_lo, ks_hi, kb_hi, vs_lo, vb_lo, vs_hi, vb_hi = tile_meta(
            p_ks, p_kb, p_vs, p_vb, b_lo, num_slots, s_km_t, s_vm_t,
            HEAD_DIM, HALF, BLOCK_N, K_FMT, K_GS, V_FMT, V_GS)
        for start in range(b_lo, b_hi, BLOCK_N):
            (acc_lo, acc_hi, m_i, l_i, ks_lo, kb_lo, ks_hi, kb_hi,
             vs_lo, vb_lo, vs_hi, vb_hi) = attn_step(
                acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_pos, start, num_slots, length, kv0,
                p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc_t, s_km_t, s_vc_t, s_vm_t,
                ks_lo, kb_lo, ks_hi, kb_hi, vs_lo, vb_lo, vs_hi, vb_hi,
                sinks, ring, window, qk_scale, cap_log2,
                HEAD_DIM, HALF, BLOCK_N, K_FMT, K_GS, V_FMT, V_GS,
                True, IS_RING, HAS_WINDOW, SOFTCAP, IEEE, FOLD_K, FOLD_V, HAS_KV_START,
                min_dist, min_key, HAS_MIN_DIST)

    o_d = tl.arange(0, HALF)
    m_q = m_row[:, None] & (o_d < DH)[None, :]
    row = b * (n_kv_heads * G) + h * G + o_m % G  # [BLOCK_M] flat (batch, q head)
    if HAS_PRIOR:
        acc_lo, acc_hi, m_i, l_i = _merge_prior(acc_lo, acc_hi, m_i, l_i, Prior, PriorLse, row,
                                                o_l, n_q, m_q, o_d, DH)
    # rows that saw no key (odd windows, hybrid masks) return zeros, like the reference
    inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
    p_o = Out + b * s_ob + (h * G + o_m % G)[:, None] * s_oh + o_l.to(tl.int64)[:, None] * s_ol
    dtype = Out.dtype.element_ty
    tl.store(p_o + o_d[None, :], (acc_lo * inv[:, None]).to(dtype), mask=m_q)
    tl.store(p_o + (o_d + DH)[None, :], (acc_hi * inv[:, None]).to(dtype), mask=m_q)
    if HAS_LSE:  # natural-log sum of exp(scores) per row, Lse [B, H_q, L]; -inf: no key
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        tl.store(Lse + row * n_q + o_l, lse, mask=m_row)


@triton.jit
def _merge_prior(acc_lo, acc_hi, m_i, l_i, Prior, PriorLse, row, o_l, n_q, m_q, o_d,
                 DH: tl.constexpr):
    """Fold an earlier part's normalised rows `Prior` (contiguous `[B, H_q, L, D]` float32)
    and natural-log `PriorLse` (`[B, H_q, L]`; -inf: it saw no key) into this part's
    running state (acc `[BLOCK_M, HALF]` x 2, base-2 max m_i and sum l_i `[BLOCK_M]`):
    the prior is one more block of keys whose max is its lse and whose sum is 1. The
    caller may have Prior alias Out / PriorLse alias Lse: each row is read before the
    program that owns it stores it."""
    m_row = o_l < n_q
    p_lse = tl.load(PriorLse + row * n_q + o_l, mask=m_row, other=float("-inf"))
    p_lse = p_lse * 1.4426950408889634  # base 2, as m_i
    m_new = tl.maximum(m_i, p_lse)
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)  # 0 where this part saw no key
    beta = tl.exp2(p_lse - m_base)  # 0 where the prior saw none
    p_row = Prior + (row * n_q + o_l).to(tl.int64)[:, None] * (2 * DH)
    o_lo = tl.load(p_row + o_d[None, :], mask=m_q, other=0.0)
    o_hi = tl.load(p_row + (o_d + DH)[None, :], mask=m_q, other=0.0)
    acc_lo = acc_lo * alpha[:, None] + o_lo * beta[:, None]
    acc_hi = acc_hi * alpha[:, None] + o_hi * beta[:, None]
    return acc_lo, acc_hi, m_new, l_i * alpha + beta
