"""Split-KV decode over int8/int4 K/V with several KV heads' query rows in one MMA tile.

Same partial outputs as `decode_warp.py` (`reduce.py` merges them), but a program serves
HP KV heads of one sequence: grid `(B * H_kv / HP, num_splits)`, one warp each.

Status: correct (interpreter and H200 tests) but opt-in: on the H200 at 128k it took
0.156-0.273 ms where decode_warp takes 0.087 (int8; int4 0.129-0.253 vs 0.070) although
its sm_90 loop issues 11% fewer instructions per slot. The likely cause, from the SASS
(Triton 3.9): a 16-slot tile's metadata is 2 bytes per lane, too narrow for cp.async, so
16 metadata loads per tile (4 heads x 4 arrays) are plain LDGs the warp waits on
(docs/KERNELS.md).

Why: mma.sync's smallest M is 16 rows and decode at G = 4 query heads per KV head has 4
rows; decode_warp pads them to 16, so three quarters of its score tile, of the softmax and
scale arithmetic on it (~380 of the ~1,040 instructions per 32-slot tile in its sm_90
loop), of its query operand and of its output accumulator are padding. Here the rows of
HP = 16 / (G * L) heads share the tile. Each head's K tile still goes through its own QK
MMA (the other heads' rows of that product are discarded by a row select), so the MMA
count per slot is decode_warp's, while the softmax runs once for HP heads and the
accumulator and query operand hold only real rows.

Why the dequantization moves onto the operands (codes centered, then `s * c + b` in fp16,
the prefill kernel's arithmetic) instead of folding the scales onto the scores as
decode_warp does: the scales differ per head, i.e. per row block of the packed tile.
fp16 rounds the dequantized values as an fp16 cache would (relative 2^-11).

Tiles are walked in strided order (split s takes tiles s, s + S, ...; decode_warp's
`_first`), so all programs sweep the cache together.
"""

import triton
import triton.language as tl

from kvtax.attention.kernels.common import (
    _dot_acc, _tanh, head_pointers, sequence_of, visible,
)
from kvtax.attention.kernels.decode_warp import _first, _meta, _operands, _v_pairs


@triton.jit
def _dequant(c, s, b):
    """fp16 operand `s * c + b` of centered codes c `[BLOCK_N, W]` (s, b `[BLOCK_N]`)."""
    return c * s.to(tl.float16)[:, None] + b.to(tl.float16)[:, None]


@triton.jit
def _packed_step(acc_a, acc_b, acc_c, acc_d, m_i, l_i, q_lo, q_hi, row_hh, q_pos, start, hi,
                 length, kv0, b, h0, Kc, Ks, Kb, Vc, Vs, Vb,
                 s_kc_b, s_kc_h, s_kc_t, s_km_b, s_km_h, s_km_t,
                 s_vc_b, s_vc_h, s_vc_t, s_vm_b, s_vm_h, s_vm_t,
                 sinks, ring, window, qk_scale, cap_log2,
                 HP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, K_FMT: tl.constexpr, K_NG: tl.constexpr,
                 V_FMT: tl.constexpr, V_NG: tl.constexpr, MASKED: tl.constexpr,
                 IS_RING: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                 IEEE: tl.constexpr, HAS_KV_START: tl.constexpr, ASM: tl.constexpr):
    """One online-softmax step over slots `[start, start + BLOCK_N)` of the HP heads.

    acc_a..acc_d `[BLOCK_M, D/4]` f32 (dims 2j, 2j + 1, D/2 + 2j, D/2 + 2j + 1, as
    decode_warp's `_v_pairs`), m_i / l_i `[BLOCK_M]` (base 2). row_hh: each row's head
    within the program. MASKED=False: every row sees every slot of the tile.
    """
    o_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        m_n = o_n < hi
    else:
        m_n = None
    zeros_s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    s = zeros_s
    for hh in tl.static_range(HP):
        p_kc, p_ks, p_kb, p_vc, p_vs, p_vb = head_pointers(
            Kc, Ks, Kb, Vc, Vs, Vb, b, h0 + hh, s_kc_b, s_kc_h, s_km_b, s_km_h, s_vc_b,
            s_vc_h, s_vm_b, s_vm_h)
        k_lo, k_hi = _operands(p_kc, o_n, m_n, s_kc_t, HEAD_DIM, K_FMT, tl.float16, ASM)
        ks_lo, kb_lo, ks_hi, kb_hi = _meta(p_ks, p_kb, start, m_n, s_km_t, BLOCK_N, K_FMT,
                                           K_NG)
        k_lo = _dequant(k_lo, ks_lo, kb_lo)
        k_hi = _dequant(k_hi, ks_hi, kb_hi)
        d = _dot_acc(q_hi, tl.trans(k_hi), _dot_acc(q_lo, tl.trans(k_lo), zeros_s, IEEE), IEEE)
        s = tl.where(row_hh[:, None] == hh, d, s)
    s = s * qk_scale
    if SOFTCAP:
        s = cap_log2 * _tanh(s)
    if MASKED:  # padded rows (q = 0) see finite zeros and are never stored
        vis = visible(o_n, m_n, q_pos, length, kv0, sinks, ring, window, IS_RING, HAS_WINDOW,
                      HAS_KV_START, 0, 0, False)
        s = tl.where(vis, s, float("-inf"))
    # lazy rescaling as in decode_warp: the running max moves only when some row's max
    # grew by more than 2^8 (P stays <= 2^8, well inside fp16)
    m_tile = tl.max(s, 1)
    if tl.max((m_tile > m_i + 8.0).to(tl.int32), 0) > 0:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m_i - m_new))
        acc_a = acc_a * alpha[:, None]
        acc_b = acc_b * alpha[:, None]
        acc_c = acc_c * alpha[:, None]
        acc_d = acc_d * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    m_base = tl.where(m_i == float("-inf"), 0.0, m_i)
    p = tl.exp2(s - m_base[:, None])
    l_i += tl.sum(p, 1)
    for hh in tl.static_range(HP):
        p_kc, p_ks, p_kb, p_vc, p_vs, p_vb = head_pointers(
            Kc, Ks, Kb, Vc, Vs, Vb, b, h0 + hh, s_kc_b, s_kc_h, s_km_b, s_km_h, s_vc_b,
            s_vc_h, s_vm_b, s_vm_h)
        v_a, v_b, v_c, v_d = _v_pairs(p_vc, o_n, m_n, s_vc_t, HEAD_DIM, V_FMT, tl.float16, ASM)
        vs_lo, vb_lo, vs_hi, vb_hi = _meta(p_vs, p_vb, start, m_n, s_vm_t, BLOCK_N, V_FMT,
                                           V_NG)
        p_h = tl.where(row_hh[:, None] == hh, p, 0.0).to(tl.float16)
        acc_a = _dot_acc(p_h, _dequant(v_a, vs_lo, vb_lo), acc_a, IEEE)
        acc_b = _dot_acc(p_h, _dequant(v_b, vs_lo, vb_lo), acc_b, IEEE)
        acc_c = _dot_acc(p_h, _dequant(v_c, vs_hi, vb_hi), acc_c, IEEE)
        acc_d = _dot_acc(p_h, _dequant(v_d, vs_hi, vb_hi), acc_d, IEEE)
    return acc_a, acc_b, acc_c, acc_d, m_i, l_i


@triton.jit(do_not_specialize=["length_host", "n_q", "num_splits"])
def _decode_packed_kernel(
    Q, PartO, PartM, PartL, Kc, Ks, Kb, Vc, Vs, Vb, Lens, KvStart,
    length_host, n_q, num_splits, n_kv_heads, sinks, ring, window, qk_scale, cap_log2,
    s_qb, s_qh, s_ql, s_qd,
    s_kc_b, s_kc_h, s_kc_t, s_km_b, s_km_h, s_km_t,
    s_vc_b, s_vc_h, s_vc_t, s_vm_b, s_vm_h, s_vm_t,
    G: tl.constexpr, HP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, K_FMT: tl.constexpr, K_NG: tl.constexpr, V_FMT: tl.constexpr,
    V_NG: tl.constexpr, IS_RING: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_LENS: tl.constexpr, IEEE: tl.constexpr,
    HAS_KV_START: tl.constexpr, ASM: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_grp = n_kv_heads // HP
    h0 = (pid % n_grp) * HP
    b, _, length, num_slots, kv0 = sequence_of(
        (pid // n_grp) * n_kv_heads + h0, n_kv_heads, Lens, KvStart, length_host, sinks, ring,
        IS_RING, HAS_LENS, HAS_KV_START)

    DH: tl.constexpr = HEAD_DIM // 2
    rows_per_head = G * n_q
    o_m = tl.arange(0, BLOCK_M)
    row_hh = o_m // rows_per_head  # the row's head within the program
    o_r = o_m % rows_per_head  # its row within that head's partials: l * G + g
    o_l = o_r // G
    m_row = o_m < HP * rows_per_head
    q_pos = length - n_q + o_l
    o_d = tl.arange(0, DH)
    p_q = (Q + b * s_qb + ((h0 + row_hh) * G + o_r % G).to(tl.int64)[:, None] * s_qh
           + o_l.to(tl.int64)[:, None] * s_ql)
    q_lo = tl.load(p_q + o_d[None, :] * s_qd, mask=m_row[:, None], other=0.0).to(tl.float16)
    q_hi = tl.load(p_q + (o_d + DH)[None, :] * s_qd, mask=m_row[:, None],
                   other=0.0).to(tl.float16)

    DQ: tl.constexpr = HEAD_DIM // 4
    acc_a = tl.zeros([BLOCK_M, DQ], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, DQ], dtype=tl.float32)
    acc_c = tl.zeros([BLOCK_M, DQ], dtype=tl.float32)
    acc_d = tl.zeros([BLOCK_M, DQ], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    off = split * BLOCK_N
    step = num_splits * BLOCK_N
    hi = num_slots
    # tiles every row sees whole run unmasked; the causal edge, rings, windows, padding masked
    if IS_RING or HAS_WINDOW or HAS_KV_START:
        full_end = 0
    else:
        full_end = tl.minimum(hi, ((length - n_q + 1) // BLOCK_N) * BLOCK_N)
    # two passes over this split's tiles: unmasked below full_end, masked from there on
    for masked in tl.static_range(2):
        if masked:
            first = _first(full_end, off, step)
            end = hi
        else:
            first = off
            end = full_end
        for start in range(first, end, step):
            acc_a, acc_b, acc_c, acc_d, m_i, l_i = _packed_step(
                acc_a, acc_b, acc_c, acc_d, m_i, l_i, q_lo, q_hi, row_hh, q_pos, start, hi,
                length, kv0, b, h0, Kc, Ks, Kb, Vc, Vs, Vb,
                s_kc_b, s_kc_h, s_kc_t, s_km_b, s_km_h, s_km_t,
                s_vc_b, s_vc_h, s_vc_t, s_vm_b, s_vm_h, s_vm_t,
                sinks, ring, window, qk_scale, cap_log2, HP, HEAD_DIM, BLOCK_M, BLOCK_N,
                K_FMT, K_NG, V_FMT, V_NG, masked == 1, IS_RING, HAS_WINDOW, SOFTCAP, IEEE,
                HAS_KV_START, ASM)

    # partials: PartO [B*H_kv, splits, R, D], PartM / PartL [B*H_kv, splits, R]
    bh = b * n_kv_heads + h0 + row_hh
    row = (bh * num_splits + split) * rows_per_head + o_r
    tl.store(PartM + row, m_i, mask=m_row)
    tl.store(PartL + row, l_i, mask=m_row)
    p_o = PartO + row[:, None] * HEAD_DIM
    o_e = 2 * tl.arange(0, DQ)[None, :]
    tl.store(p_o + o_e, acc_a, mask=m_row[:, None])
    tl.store(p_o + o_e + 1, acc_b, mask=m_row[:, None])
    tl.store(p_o + DH + o_e, acc_c, mask=m_row[:, None])
    tl.store(p_o + DH + o_e + 1, acc_d, mask=m_row[:, None])
