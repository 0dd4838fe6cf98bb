"""Swapped-orientation Gluon decode-attention split kernel for int8 K and V (DRAFT).

Not part of the kvtax package (kvtax never imports it). Case served (anything else
raises ValueError): int8 K and V, group size 64 (one scale + bias group per half row),
head_dim 128, full cache, G * L <= 4 query rows per KV head, fp16 / bf16 queries,
lengths from a device int32 tensor `[B]`.

Why this orientation. decode_warp.py (kvtax's fast decode kernel) computes scores as
Q [16 rows, D] @ K^T: mma.sync's M = 16 rows, of which G * L = 4 are real at Llama's GQA,
so three quarters of the score tile, the accumulator and the softmax math are padding,
and the [16, D] fp32 accumulator alone takes 64 registers per lane. Here the slots are
the MMA's M and the query rows its N (m16n8k16, N = 8):

    S^T [16 slots, 8 cols] = K [16 slots, D] @ Q^T [D, 8 cols]
    O^T [D, 8 cols]       += V^T [D, 16 slots] @ P^T [16 slots, 8 cols]

and the 8 columns hold two *streams* of 4 rows: a 32-slot step is two 16-slot sub-tiles,
stream 0 (slots 0..15) scored against Q in columns 0..3, stream 1 (slots 16..31) against
Q in columns 4..7 — block-diagonal B operands (zeros in the other stream's columns), two
accumulating MMAs. Every column of the score tile is real; each stream keeps its own
softmax state (per column) and is written as a split of its own, which kvtax's reduce
merges. The accumulator is [D, 8] fp32: 32 registers per lane instead of 64.

K codes enter the MMAs as fp16 1024 + c (the 0x6400 trick, one `prmt` per two codes, no
subtraction): the offset goes into the bias term (k = s c + b = s x + (b - 1024 s) for
x = 1024 + c). V codes are centered (c - 128, c - 8: one more sub.f16x2 per two codes),
as in decode_warp: uncentered, P @ (1024 + c) summed over 128k tokens kept fp32 rounding
of the offset (int4 at 70k tokens failed the fp16 bound, session 9). V is read as uint16
pairs of dims (ldmatrix-able), split into even-dim / odd-dim operands by `prmt`; the
output dims are interleaved back at the store. P^T reaches the B-operand layout through
Gluon's convert_layout (warp shuffles within the one warp).

Usage:
    out = swap_decode(q, cache.view(), num_splits=None, lengths=None)
    python swap_decode.py --compile        # sm_90 compile-only (no GPU): regs, SASS census
    python swap_decode.py --bench          # H200: vs triton_attention at 32k / 128k
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# ---- version bridge (3.6 vs 3.9) ---------------------------------------------------------
if hasattr(async_copy, "async_load"):
    cp_async_load = async_copy.async_load
else:
    cp_async_load = async_copy.async_copy_global_to_shared
_bar = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# TMA global->shared: 3.6 `async_copy_global_to_shared`, 3.9 `async_load`
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

HEAD_DIM = 128
GROUP = 64
STEP = 32  # slots per step: two 16-slot streams
ROWS = 4   # query rows per stream (columns of the MMA's N = 8)


@gluon.jit
def _x8(c):
    """uint8 codes (4 per 32-bit word) -> fp16 1024 + c: two prmt per 4 codes."""
    return gl.inline_asm_elementwise(
        asm="""{
        prmt.b32 $0, $2, 0x64646464, 0x4140;
        prmt.b32 $1, $2, 0x64646464, 0x4342;
        }""",
        constraints="=r,=r,r", args=[c], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _x8_pairs(w):
    """uint16 pairs (dim 2p, dim 2p + 1) of int8 codes, two slots per word -> fp16
    (even-dim code - 128, odd-dim code - 128): one prmt and one sub.f16x2 per two codes.
    V codes are centered (unlike K's): P @ (1024 + c) accumulated over a long context
    carries fp32 rounding of the 1024 offset (int4 at 70k tokens: over the fp16 bound)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, m;
        mov.b32 m, 0x64806480;
        prmt.b32 t0, $2, 0x64646464, 0x4240;
        prmt.b32 t1, $2, 0x64646464, 0x4341;
        sub.f16x2 $0, t0, m;
        sub.f16x2 $1, t1, m;
        }""",
        constraints="=r,=r,r", args=[w], dtype=(gl.float16, gl.float16), is_pure=True,
        pack=2)


@gluon.jit
def _x4(c):
    """Packed int4 bytes (4 per 32-bit word; low nibble = a lo-half dim, high nibble the
    dim D/2 further) -> (fp16 1024 + lo nibble, fp16 1024 + hi nibble)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 lo, hi;
        and.b32 lo, $4, 0x0F0F0F0F;
        shr.b32 hi, $4, 4;
        and.b32 hi, hi, 0x0F0F0F0F;
        prmt.b32 $0, lo, 0x64646464, 0x4140;
        prmt.b32 $1, lo, 0x64646464, 0x4342;
        prmt.b32 $2, hi, 0x64646464, 0x4140;
        prmt.b32 $3, hi, 0x64646464, 0x4342;
        }""",
        constraints="=r,=r,=r,=r,r", args=[c], dtype=(gl.float16, gl.float16), is_pure=True,
        pack=4)


@gluon.jit
def _x4_pairs(w):
    """uint16 = packed int4 bytes (2j, 2j + 1), two slots per word -> fp16 nibble - 8
    for dims 2j, 2j + 1 (low nibbles), D/2 + 2j, D/2 + 2j + 1 (high nibbles)."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 lo, hi, lo0, lo1, hi0, hi1, m;
        mov.b32 m, 0x64086408;
        and.b32 lo, $4, 0x0F0F0F0F;
        shr.b32 hi, $4, 4;
        and.b32 hi, hi, 0x0F0F0F0F;
        prmt.b32 lo0, lo, 0x64646464, 0x4240;
        prmt.b32 lo1, lo, 0x64646464, 0x4341;
        prmt.b32 hi0, hi, 0x64646464, 0x4240;
        prmt.b32 hi1, hi, 0x64646464, 0x4341;
        sub.f16x2 $0, lo0, m;
        sub.f16x2 $1, lo1, m;
        sub.f16x2 $2, hi0, m;
        sub.f16x2 $3, hi1, m;
        }""",
        constraints="=r,=r,=r,=r,r", args=[w],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=2)


@gluon.jit
def _halves(w, MDT: gl.constexpr):
    """uint32 words (lo-half value, hi-half value) in the model dtype -> two fp32."""
    lo = w.to(gl.int16).to(MDT, bitcast=True).to(gl.float32)
    hi = (w >> 16).to(gl.int16).to(MDT, bitcast=True).to(gl.float32)
    return lo, hi


@gluon.jit
def _issue(k_smem, v_smem, p_kc, p_vc, rows8, cols8, rows16, cols16, tile, length,
           STAGES: gl.constexpr, i, BN: gl.constexpr, KB: gl.constexpr, VP: gl.constexpr):
    """cp.async of one step's K codes [BN, KB] uint8 and V pairs [BN, VP] uint16 into
    stage i % STAGES (16 B per lane per copy; slots >= length zero-fill), one group."""
    s = i % STAGES
    slot8 = tile * BN + rows8
    cp_async_load(k_smem.index(s), p_kc + slot8.to(gl.int64)[:, None] * KB + cols8[None, :],
                  mask=(slot8 < length)[:, None] & (cols8 < KB)[None, :])
    slot16 = tile * BN + rows16
    cp_async_load(v_smem.index(s),
                  p_vc + slot16.to(gl.int64)[:, None] * VP + cols16[None, :],
                  mask=(slot16 < length)[:, None] & (cols16 < VP)[None, :])
    async_copy.commit_group()


@gluon.jit
def _issue_tma(kl_desc, kh_desc, vl_desc, vh_desc, kl_s, kh_s, vl_s, vh_s, bars, row0, tile,
               pred, STAGES: gl.constexpr, i, BN: gl.constexpr, D: gl.constexpr):
    """Four TMA box copies (K lo / hi halves [BN, D/2] uint8, V lo / hi pairs [BN, D/4]
    uint16) of one step into stage i % STAGES, counted on that stage's mbarrier. Rows past
    the tensor zero-fill; rows past length are hidden by the scores' mask."""
    s = i % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, 2 * BN * D, pred=pred)
    row = row0 + tile * BN
    tma_load(kl_desc, [row, 0], bar, kl_s.index(s), pred=pred)
    tma_load(kh_desc, [row, D // 2], bar, kh_s.index(s), pred=pred)
    tma_load(vl_desc, [row, 0], bar, vl_s.index(s), pred=pred)
    tma_load(vh_desc, [row, D // 4], bar, vh_s.index(s), pred=pred)


@gluon.jit
def swap_decode_kernel(
    q_ptr, part_o, part_m, part_l, kc, vc, ksw, kbw, vsw, vbw, lens,
    n_q, num_splits, n_kv_heads, qk_scale,
    s_qb, s_qh, s_ql, s_qd,
    s_kc_b, s_kc_h, s_vc_b, s_vc_h, s_km_b, s_km_h, s_vm_b, s_vm_h,
    kl_desc, kh_desc, vl_desc, vh_desc, cap,
    G: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, MDT: gl.constexpr,
    KW: gl.constexpr, LATE: gl.constexpr, MERGE: gl.constexpr, TMA: gl.constexpr,
    FENCE: gl.constexpr, INT4: gl.constexpr,
):
    """Grid (B * H_kv, S), one warp. kc: uint8 codes [B, H, slots, D]; vc: the V codes
    as uint16 pairs [B, H, slots, D/2]; ksw ... vbw: uint32 words [B, H, slots] (lo-half
    value | hi-half value << 16). Partials: PartO [B*H_kv, 2S, R, D], PartM / PartL
    [B*H_kv, 2S, R] (split s, stream t -> partial 2s + t; R = G * L)."""
    SUB: gl.constexpr = 16
    BN: gl.constexpr = 32
    NC: gl.constexpr = 8
    DH: gl.constexpr = D // 2
    PH: gl.constexpr = D // 4
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])
    ka_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    qb_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    va_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    pb_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)

    pid_bh = gl.program_id(0)
    split = gl.program_id(1)
    b = (pid_bh // n_kv_heads).to(gl.int64)
    h = (pid_bh % n_kv_heads).to(gl.int64)
    length = gl.load(lens + b)
    n_tiles = gl.cdiv(length, BN)
    n_my = gl.maximum(n_tiles - split + num_splits - 1, 0) // num_splits
    n_rows = G * n_q

    # ---- queries: block-diagonal B operands [D/2, 8] per scale half; column c is
    # stream c // 4, row c % 4 (query head h * G + row % G at position row // G)
    qk = gl.arange(0, DH, layout=gl.SliceLayout(1, qb_l))
    qc = gl.arange(0, NC, layout=gl.SliceLayout(0, qb_l))
    qr = qc % 4
    p_q = (q_ptr + b * s_qb + (h * G + qr % G).to(gl.int64)[None, :] * s_qh
           + (qr // G).to(gl.int64)[None, :] * s_ql)
    mq = (qr < n_rows)[None, :] & (qk < DH)[:, None]
    q_lo = gl.load(p_q + qk[:, None] * s_qd, mask=mq, other=0.0).to(gl.float16)
    q_hi = gl.load(p_q + (qk + DH)[:, None] * s_qd, mask=mq, other=0.0).to(gl.float16)
    top = (qc < 4)[None, :]
    zq = gl.zeros([DH, NC], gl.float16, qb_l)
    bq_lo0 = gl.where(top, q_lo, zq)
    bq_lo1 = gl.where(top, zq, q_lo)
    bq_hi0 = gl.where(top, q_hi, zq)
    bq_hi1 = gl.where(top, zq, q_hi)
    qs_lo = gl.convert_layout(gl.sum(q_lo.to(gl.float32), 0), col_l)  # what the MMA sees
    qs_hi = gl.convert_layout(gl.sum(q_hi.to(gl.float32), 0), col_l)

    mc = gl.arange(0, NC, layout=col_l)
    mi = gl.arange(0, SUB, layout=row_l)
    q_pos = length - n_q + (mc % 4) // G  # causal bottom-right; padded columns never stored
    moff = mi[:, None] + SUB * (mc // 4)[None, :]  # [16, 8]: slot of each score element

    p_ksw = ksw + b * s_km_b + h * s_km_h
    p_kbw = kbw + b * s_km_b + h * s_km_h
    p_vsw = vsw + b * s_vm_b + h * s_vm_h
    p_vbw = vbw + b * s_vm_b + h * s_vm_h
    if TMA:
        # ---- staging through TMA: four box copies per step, one mbarrier per stage
        kl_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, D // 2], kl_desc.layout)
        kh_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, D // 2], kh_desc.layout)
        vl_s = gl.allocate_shared_memory(gl.uint16, [STAGES, BN, D // 4], vl_desc.layout)
        vh_s = gl.allocate_shared_memory(gl.uint16, [STAGES, BN, D // 4], vh_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(bars.index(j), count=1)
        row0 = pid_bh * cap
        for j in gl.static_range(STAGES - 1):
            _issue_tma(kl_desc, kh_desc, vl_desc, vh_desc, kl_s, kh_s, vl_s, vh_s, bars, row0,
                       split + j * num_splits, j < n_my, STAGES, j, BN, D)
    else:
        # ---- staging: K codes and V pairs through a STAGES-deep cp.async ring
        # row widths: int8 K D bytes, V D/2 pairs; int4 (split halves) K D/2 bytes, V D/4
        KB: gl.constexpr = D // 2 if INT4 else D
        VP: gl.constexpr = D // 4 if INT4 else D // 2
        PHASES: gl.constexpr = 8 if KB == 128 else 4  # 16-byte chunks per 128-byte line
        PER: gl.constexpr = 1 if KB == 128 else 2     # rows per 128-byte line
        swz8: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=PER, max_phase=PHASES,
                                                     order=[1, 0])
        swz16: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=PER, max_phase=PHASES,
                                                      order=[1, 0])
        k_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, KB], swz8)
        v_smem = gl.allocate_shared_memory(gl.uint16, [STAGES, BN, VP], swz16)
        LANES: gl.constexpr = KB // 16  # lanes across a row (16 B each)
        ld8: gl.constexpr = gl.BlockedLayout([1, 16], [32 // LANES, LANES], [1, 1], [1, 0])
        ld16: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES, LANES], [1, 1], [1, 0])
        rows8 = gl.arange(0, BN, layout=gl.SliceLayout(1, ld8))
        cols8 = gl.arange(0, KB, layout=gl.SliceLayout(0, ld8))
        rows16 = gl.arange(0, BN, layout=gl.SliceLayout(1, ld16))
        cols16 = gl.arange(0, VP, layout=gl.SliceLayout(0, ld16))
        p_kc = kc + b * s_kc_b + h * s_kc_h
        p_vc = vc + b * s_vc_b + h * s_vc_h
        for j in gl.static_range(STAGES - 1):  # tiles past n_my lie past length: zero-filled
            _issue(k_smem, v_smem, p_kc, p_vc, rows8, cols8, rows16, cols16,
                   split + j * num_splits, length, STAGES, j, BN, KB, VP)

    # metadata of step 0 (registers, one step ahead)
    slot_m = split * BN + moff
    mm = slot_m < length
    ksw_n = gl.load(p_ksw + slot_m, mask=mm, other=0)
    kbw_n = gl.load(p_kbw + slot_m, mask=mm, other=0)
    vsw_n = gl.load(p_vsw + slot_m, mask=mm, other=0)
    vbw_n = gl.load(p_vbw + slot_m, mask=mm, other=0)

    acc_e_lo = gl.zeros([PH, NC], gl.float32, mma)  # dims 2p        (p < D/4)
    acc_o_lo = gl.zeros([PH, NC], gl.float32, mma)  # dims 2p + 1
    acc_e_hi = gl.zeros([PH, NC], gl.float32, mma)  # dims D/2 + 2p
    acc_o_hi = gl.zeros([PH, NC], gl.float32, mma)  # dims D/2 + 2p + 1
    m_i = gl.full([NC], float("-inf"), gl.float32, col_l)
    l_acc = gl.zeros([SUB, NC], gl.float32, mma)   # per-lane partial sums (reduced at the end)
    b_lo = gl.zeros([SUB, NC], gl.float32, mma)    # sum p * (vb + VOFF * vs), lo half
    b_hi = gl.zeros([SUB, NC], gl.float32, mma)
    VOFF: gl.constexpr = 8.0 if INT4 else 128.0     # V codes enter centered: c - VOFF
    t_v = 1e-30  # running largest V scale: acc holds P @ (V / t_v)
    zs = gl.zeros([SUB, NC], gl.float32, mma)
    zp = gl.zeros([SUB, NC], gl.float16, pb_l)
    pcol = gl.arange(0, NC, layout=gl.SliceLayout(0, pb_l))
    first = (pcol < 4)[None, :]

    for i in range(n_my):
        tile = split + i * num_splits
        s = i % STAGES
        if TMA:
            mbarrier.wait(bars.index(s), (i // STAGES) & 1)
            _bar()  # every lane is done with stage (i - 1) % STAGES
            if FENCE:
                fence_async_shared()  # generic-proxy reads before the async-proxy refill
            _issue_tma(kl_desc, kh_desc, vl_desc, vh_desc, kl_s, kh_s, vl_s, vh_s, bars, row0,
                       tile + (STAGES - 1) * num_splits, i + STAGES - 1 < n_my, STAGES,
                       i + STAGES - 1, BN, D)
        else:
            async_copy.wait_group(STAGES - 2)
            _bar()  # every lane's copies of stage s landed; stage (i - 1) % STAGES is free
            if not LATE:
                _issue(k_smem, v_smem, p_kc, p_vc, rows8, cols8, rows16, cols16,
                       tile + (STAGES - 1) * num_splits, length, STAGES, i + STAGES - 1, BN,
                       KB, VP)
        ksw_c = ksw_n
        kbw_c = kbw_n
        vsw_c = vsw_n
        vbw_c = vbw_n
        slot_m = (tile + num_splits) * BN + moff
        mm = slot_m < length
        ksw_n = gl.load(p_ksw + slot_m, mask=mm, other=0)
        kbw_n = gl.load(p_kbw + slot_m, mask=mm, other=0)
        vsw_n = gl.load(p_vsw + slot_m, mask=mm, other=0)
        vbw_n = gl.load(p_vbw + slot_m, mask=mm, other=0)

        # ---- scores S^T [16, 8]: two streams through block-diagonal Q
        if TMA:
            k0l = kl_s.index(s).slice(0, SUB, 0)
            k1l = kl_s.index(s).slice(SUB, SUB, 0)
            k0h = kh_s.index(s).slice(0, SUB, 0)
            k1h = kh_s.index(s).slice(SUB, SUB, 0)
        elif not INT4:
            k_st = k_smem.index(s)
            k0l = k_st.slice(0, SUB, 0).slice(0, DH, 1)
            k1l = k_st.slice(SUB, SUB, 0).slice(0, DH, 1)
            k0h = k_st.slice(0, SUB, 0).slice(DH, DH, 1)
            k1h = k_st.slice(SUB, SUB, 0).slice(DH, DH, 1)
        if INT4:  # one byte tile per stream holds both halves
            a0_lo, a0_hi = _x4(k_smem.index(s).slice(0, SUB, 0).load(ka_l))
            a1_lo, a1_hi = _x4(k_smem.index(s).slice(SUB, SUB, 0).load(ka_l))
            d_lo = mma_v2(a1_lo, bq_lo1, mma_v2(a0_lo, bq_lo0, zs))
            d_hi = mma_v2(a1_hi, bq_hi1, mma_v2(a0_hi, bq_hi0, zs))
        else:
            d_lo = mma_v2(_x8(k0l.load(ka_l)), bq_lo0, zs)
            d_lo = mma_v2(_x8(k1l.load(ka_l)), bq_lo1, d_lo)
            d_hi = mma_v2(_x8(k0h.load(ka_l)), bq_hi0, zs)
            d_hi = mma_v2(_x8(k1h.load(ka_l)), bq_hi1, d_hi)
        ks_lo, ks_hi = _halves(ksw_c, MDT)
        kb_lo, kb_hi = _halves(kbw_c, MDT)
        sc = (d_lo * (ks_lo * qk_scale) + d_hi * (ks_hi * qk_scale)
              + qs_lo[None, :] * ((kb_lo - 1024.0 * ks_lo) * qk_scale)
              + qs_hi[None, :] * ((kb_hi - 1024.0 * ks_hi) * qk_scale))
        vis = (tile * BN + moff) <= q_pos[None, :]
        sc = gl.where(vis, sc, float("-inf"))

        # ---- online softmax per column (eager rescale)
        m_new = gl.maximum(m_i, gl.max(sc, 0))
        alpha = gl.where(m_new == float("-inf"), 1.0, gl.exp2(m_i - m_new))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sc - m_base[None, :])  # hidden slots: exactly 0
        vs_lo, vs_hi = _halves(vsw_c, MDT)  # past length: 0 (masked loads)
        vb_lo, vb_hi = _halves(vbw_c, MDT)
        al = alpha[None, :]
        l_acc = l_acc * al + p
        b_lo = b_lo * al + p * (vb_lo + VOFF * vs_lo)
        b_hi = b_hi * al + p * (vb_hi + VOFF * vs_hi)
        v_top = gl.max(gl.max(gl.maximum(vs_lo, vs_hi), 1), 0)
        t_new = gl.maximum(t_v, v_top)
        f = (alpha * (t_v / t_new))[None, :]
        inv_t = 1.0 / t_new
        t_v = t_new
        m_i = m_new
        p16_lo = (p * (vs_lo * inv_t)).to(gl.float16)
        p16_hi = (p * (vs_hi * inv_t)).to(gl.float16)
        pt_lo = gl.convert_layout(p16_lo, pb_l)
        pt_hi = gl.convert_layout(p16_hi, pb_l)
        p0_lo = gl.where(first, pt_lo, zp)
        p1_lo = gl.where(first, zp, pt_lo)
        p0_hi = gl.where(first, pt_hi, zp)
        p1_hi = gl.where(first, zp, pt_hi)

        # ---- O^T [D, 8] += V^T @ P^T, per stream, even / odd dims, lo / hi halves
        if TMA:
            v0l = vl_s.index(s).slice(0, SUB, 0)
            v1l = vl_s.index(s).slice(SUB, SUB, 0)
            v0h = vh_s.index(s).slice(0, SUB, 0)
            v1h = vh_s.index(s).slice(SUB, SUB, 0)
        elif not INT4:
            v_st = v_smem.index(s)
            v0l = v_st.slice(0, SUB, 0).slice(0, PH, 1)
            v1l = v_st.slice(SUB, SUB, 0).slice(0, PH, 1)
            v0h = v_st.slice(0, SUB, 0).slice(PH, PH, 1)
            v1h = v_st.slice(SUB, SUB, 0).slice(PH, PH, 1)
        if INT4:  # one pair tile per stream holds all four dim quarters
            e, o, e2, o2 = _x4_pairs(v_smem.index(s).slice(0, SUB, 0).permute((1, 0))
                                     .load(va_l))
            acc_e_lo = mma_v2(e, p0_lo, acc_e_lo * f)
            acc_o_lo = mma_v2(o, p0_lo, acc_o_lo * f)
            acc_e_hi = mma_v2(e2, p0_hi, acc_e_hi * f)
            acc_o_hi = mma_v2(o2, p0_hi, acc_o_hi * f)
            e, o, e2, o2 = _x4_pairs(v_smem.index(s).slice(SUB, SUB, 0).permute((1, 0))
                                     .load(va_l))
            acc_e_lo = mma_v2(e, p1_lo, acc_e_lo)
            acc_o_lo = mma_v2(o, p1_lo, acc_o_lo)
            acc_e_hi = mma_v2(e2, p1_hi, acc_e_hi)
            acc_o_hi = mma_v2(o2, p1_hi, acc_o_hi)
        else:
            e, o = _x8_pairs(v0l.permute((1, 0)).load(va_l))
            acc_e_lo = mma_v2(e, p0_lo, acc_e_lo * f)
            acc_o_lo = mma_v2(o, p0_lo, acc_o_lo * f)
            e, o = _x8_pairs(v0h.permute((1, 0)).load(va_l))
            acc_e_hi = mma_v2(e, p0_hi, acc_e_hi * f)
            acc_o_hi = mma_v2(o, p0_hi, acc_o_hi * f)
            e, o = _x8_pairs(v1l.permute((1, 0)).load(va_l))
            acc_e_lo = mma_v2(e, p1_lo, acc_e_lo)
            acc_o_lo = mma_v2(o, p1_lo, acc_o_lo)
            e, o = _x8_pairs(v1h.permute((1, 0)).load(va_l))
            acc_e_hi = mma_v2(e, p1_hi, acc_e_hi)
            acc_o_hi = mma_v2(o, p1_hi, acc_o_hi)
        if LATE and not TMA:  # after the step's shuffles and ldmatrix (STAGES >= 3)
            _issue(k_smem, v_smem, p_kc, p_vc, rows8, cols8, rows16, cols16,
                   tile + (STAGES - 1) * num_splits, length, STAGES, i + STAGES - 1, BN,
                   KB, VP)

    if not TMA:
        async_copy.wait_group(0)  # no copy may land after the CTA exits

    l_c = gl.sum(l_acc, 0)
    bl = gl.sum(b_lo, 0)[None, :]
    bh = gl.sum(b_hi, 0)[None, :]
    o_el = acc_e_lo * t_v + bl
    o_ol = acc_o_lo * t_v + bl
    o_eh = acc_e_hi * t_v + bh
    o_oh = acc_o_hi * t_v + bh
    if MERGE:
        # ---- the two streams merged here: one partial per split, row r
        m2 = gl.reshape(m_i, [2, 4])
        mx = gl.max(m2, 0)
        mxb = gl.where(mx == float("-inf"), 0.0, mx)
        w8 = gl.convert_layout(gl.reshape(gl.exp2(m2 - mxb[None, :]), [NC]), col_l)
        st_l: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0])
        r4 = gl.arange(0, 4, layout=gl.SliceLayout(0, st_l))
        d4 = 2 * gl.arange(0, PH, layout=gl.SliceLayout(1, st_l))[:, None]
        prow = (pid_bh.to(gl.int64) * num_splits + split) * n_rows + r4
        ok = r4 < n_rows
        gl.store(part_m + prow, gl.convert_layout(mx, gl.SliceLayout(0, st_l)), mask=ok)
        l4 = gl.sum(gl.reshape(l_c * w8, [2, 4]), 0)
        gl.store(part_l + prow, gl.convert_layout(l4, gl.SliceLayout(0, st_l)), mask=ok)
        po = part_o + prow[None, :] * D + d4
        mo = ok[None, :] & (d4 < D)
        w = w8[None, :]
        gl.store(po, _fold_streams(o_el * w, PH, st_l), mask=mo)
        gl.store(po + 1, _fold_streams(o_ol * w, PH, st_l), mask=mo)
        gl.store(po + DH, _fold_streams(o_eh * w, PH, st_l), mask=mo)
        gl.store(po + DH + 1, _fold_streams(o_oh * w, PH, st_l), mask=mo)
    else:
        # ---- column c -> partial 2 * split + c // 4, row c % 4
        prow = ((pid_bh.to(gl.int64) * num_splits + split) * 2 + mc // 4) * n_rows + mc % 4
        ok = (mc % 4) < n_rows
        gl.store(part_m + prow, m_i, mask=ok)
        gl.store(part_l + prow, l_c, mask=ok)
        pd = 2 * gl.arange(0, PH, layout=row_l)[:, None]
        po = part_o + prow[None, :] * D + pd
        mo = ok[None, :] & (pd < D)
        gl.store(po, o_el, mask=mo)
        gl.store(po + 1, o_ol, mask=mo)
        gl.store(po + DH, o_eh, mask=mo)
        gl.store(po + DH + 1, o_oh, mask=mo)


@gluon.jit
def _fold_streams(x, PH: gl.constexpr, st_l: gl.constexpr):
    """[PH, 8] (columns = 2 streams x 4 rows, already weighted) -> [PH, 4] in st_l."""
    return gl.convert_layout(gl.sum(gl.reshape(x, [PH, 2, 4]), 1), st_l)


# ---- launcher ------------------------------------------------------------------------------
def _check(q: torch.Tensor, view) -> tuple[int, int]:
    from kvtax.formats import AffineFormat

    if q.dim() != 4 or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("q must be [B, H_q, L, D] float16 / bfloat16")
    b, hq, n_q, d = q.shape
    fmts = (view.spec.key, view.spec.value)
    if not (all(isinstance(f, AffineFormat) and f.group_size == GROUP for f in fmts)
            and fmts[0].n_bits == fmts[1].n_bits and fmts[0].n_bits in (4, 8)):
        raise ValueError(f"int8 or int4 K and V with group size {GROUP} only, got {view.spec}")
    if d != HEAD_DIM or view.head_dim != HEAD_DIM:
        raise ValueError(f"head_dim {HEAD_DIM} only")
    if view.ring or view.window is not None or view.sinks:
        raise ValueError("full caches only (no ring / window / sinks)")
    if view.spec.rotate_keys or view.spec.rotate_values:
        raise ValueError("rotated specs not handled")
    if hq % view.num_kv_heads or b != view.batch:
        raise ValueError("q does not match the cache")
    group = hq // view.num_kv_heads
    if group * n_q > ROWS:
        raise ValueError(f"G * L = {group * n_q} > {ROWS}")
    for qt in (view.k, view.v):
        if qt.codes.stride(-1) != 1 or qt.codes.stride(-2) != qt.codes.shape[-1]:
            raise ValueError("code rows must be packed (stride D)")
        if qt.scales.stride() != qt.biases.stride() or qt.scales.stride()[-2:] != (2, 1):
            raise ValueError("scales / biases must be packed [B, H, slots, 2] with equal strides")
        if qt.scales.dtype != q.dtype or qt.biases.dtype != q.dtype:
            raise ValueError("scales / biases must be in q's dtype")
    return n_q, group


def _words(t: torch.Tensor) -> torch.Tensor:
    """[B, H, slots, 2] fp16/bf16 -> [B, H, slots] int32 words (lo half | hi half << 16)."""
    if t.storage_offset() % 2 or any(s % 2 for s in t.stride()[:-1]):
        raise ValueError("scale / bias rows are not 4-byte aligned")
    return t.view(torch.int32)[..., 0]


def _descriptors(kc: torch.Tensor, vc16: torch.Tensor) -> list:
    """TMA descriptors over the codes flattened to rows (b, h, slot): K lo / hi halves
    [32, D/2] uint8 boxes, V lo / hi [32, D/4] uint16-pair boxes (64-byte rows, 64-byte
    swizzle). The tensors must be contiguous (each head's slots back to back)."""
    from triton.experimental.gluon.language import NVMMASharedLayout

    if not (kc.is_contiguous() and vc16.is_contiguous()):
        raise ValueError("TMA path needs contiguous code tensors [B, H, slots, D]")
    d = kc.shape[-1]
    k2 = kc.reshape(-1, d)
    v2 = vc16.view(torch.uint16).reshape(-1, d // 2) if hasattr(torch, "uint16") else None
    if v2 is None:
        v2 = vc16.reshape(-1, d // 2)
    l8 = NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    l16 = NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    kd = [TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [STEP, d // 2], l8)
          for _ in range(2)]
    vd = [TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [STEP, d // 4], l16)
          for _ in range(2)]
    return kd + vd


def default_splits(q: torch.Tensor, view, capacity: int, per_sm: int = 12) -> int:
    """Splits so that about per_sm one-warp programs run per SM; >= 4 steps each."""
    sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
           if q.is_cuda else 132)
    bh = q.shape[0] * view.num_kv_heads
    tiles = triton.cdiv(max(capacity, 1), STEP)
    return max(1, min(per_sm * sms // bh, triton.cdiv(tiles, 4), 512))


def swap_decode(q: torch.Tensor, view, num_splits: int | None = None,
                lengths: torch.Tensor | None = None, *, stages: int = 3, k_width: int = 4,
                out: torch.Tensor | None = None, poison: bool = False,
                maxnreg: int | None = None, per_sm: int = 8, late: bool = False,
                merge: bool = False, reduce: bool = True, use_tma: bool = False,
                fence: bool = True) -> torch.Tensor:
    """Attention of q [B, H_q, L, D] over an int8 (g64, D=128) FullCache view through the
    swapped split kernel and kvtax's reduce kernel. lengths: int32 [B] on q's device
    (default: view.length_t, else view.length for every row)."""
    from kvtax.attention.kernels.reduce import _decode_attn_reduce_kernel
    from kvtax.attention.triton_api import _parts

    n_q, group = _check(q, view)
    b, hq, _, d = q.shape
    h_kv = view.num_kv_heads
    if lengths is None:
        lengths = getattr(view, "length_t", None)
    if lengths is None:
        lengths = torch.full((b,), view.length, dtype=torch.int32, device=q.device)
    if lengths.dtype != torch.int32 or lengths.shape != (b,):
        raise ValueError("lengths must be int32 [B]")
    capacity = view.k.codes.shape[2]
    if num_splits is None:
        num_splits = default_splits(q, view, capacity, per_sm)
    kc, ks, kb = _parts(view.k)
    vc, vs, vb = _parts(view.v)
    vc16 = vc.view(torch.int16)  # [B, H, slots, D/2]: pairs of dims
    ksw, kbw, vsw, vbw = _words(ks), _words(kb), _words(vs), _words(vb)
    rows = group * n_q
    if use_tma and view.spec.key.n_bits == 4:
        raise ValueError("the TMA variant reads int8 only")
    if late and stages < 3:
        raise ValueError("late issue needs stages >= 3 (else no copy overlaps a step)")
    parts = num_splits if merge else 2 * num_splits
    fill = torch.full if poison else (lambda shape, v, **kw: torch.empty(shape, **kw))
    f32 = dict(dtype=torch.float32, device=q.device)
    part_o = fill((b * h_kv, parts, rows, d), float("nan"), **f32)
    part_m = fill((b * h_kv, parts, rows), float("nan"), **f32)
    part_l = fill((b * h_kv, parts, rows), float("nan"), **f32)
    if out is None:
        out = torch.empty_like(q)
    qk_scale = 1.4426950408889634 / math.sqrt(d)
    mdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    # TMA descriptors only for the TMA variant (the other never reads those arguments)
    descs = _descriptors(kc, vc16) if use_tma else [kc] * 4
    swap_decode_kernel[(b * h_kv, num_splits)](
        q, part_o, part_m, part_l, kc, vc16, ksw, kbw, vsw, vbw, lengths,
        n_q, num_splits, h_kv, qk_scale,
        *q.stride(),
        kc.stride(0), kc.stride(1), vc16.stride(0), vc16.stride(1),
        ksw.stride(0), ksw.stride(1), vsw.stride(0), vsw.stride(1),
        *descs, capacity,
        G=group, D=d, STAGES=stages, MDT=mdt, KW=k_width, LATE=late, MERGE=merge,
        TMA=use_tma, FENCE=fence, INT4=view.spec.key.n_bits == 4, num_warps=1,
        **({} if maxnreg is None else {"maxnreg": int(maxnreg)}),
    )
    if not reduce:  # split kernel alone (timing)
        return out
    splits_pad = triton.next_power_of_2(parts)
    d_block = min(32, triton.next_power_of_2(d))
    _decode_attn_reduce_kernel[(b * h_kv, rows, triton.cdiv(d, d_block))](
        part_o, part_m, part_l, out, n_q, parts, h_kv, *out.stride()[:3],
        Lse=out, HAS_LSE=False, G=group, HEAD_DIM=d, D_BLOCK=d_block,
        SPLITS_PAD=splits_pad, SPLIT_BLOCK=splits_pad if splits_pad <= 256 else 64,
        num_warps=4,
    )
    return out


# ---- command line: compile-only check, GPU bench ---------------------------------------------
def _sass(kernel) -> str:
    import os
    import subprocess
    import tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout


def compile_check(dtype: torch.dtype, stages: int, k_width: int, dump: str | None = None,
                  maxnreg: int | None = None, n_q: int = 1, group: int = 4,
                  late: bool = False, merge: bool = False, use_tma: bool = False,
                  spec: str = "int8") -> None:
    import collections
    import re

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import compile_check as cc
    from kvtax.cache import FullCache

    if not getattr(cc, "_swap_installed", False):
        cc._compile_only(90)
        cc._swap_installed = True
    cc.COMPILED.clear()
    cache = FullCache(spec, capacity=300)
    cache.fused_store = False
    k = torch.randn(1, 2, 300, HEAD_DIM, dtype=dtype)
    cache.append(k, k)
    q = torch.randn(1, 2 * group, n_q, HEAD_DIM, dtype=dtype)
    lengths = torch.full((1,), 300, dtype=torch.int32)
    swap_decode(q, cache.view(), num_splits=4, lengths=lengths, stages=stages,
                k_width=k_width, maxnreg=maxnreg, late=late, merge=merge, use_tma=use_tma)
    for name, kern in cc.COMPILED:
        if name != "swap_decode_kernel":
            continue
        sass = _sass(kern)
        # loop body: the instructions between the last backward branch's target and it
        lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
        ops = [re.sub(r"^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?", "", ln).split()[0]
               for ln in lines]
        census = collections.Counter(o.split(".")[0] for o in ops)
        print(triton.__version__, dtype, f"G={group} L={n_q} stages={stages} KW={k_width} "
              f"maxnreg={maxnreg} late={late} merge={merge} tma={use_tma} {spec}",
              cc._resources(kern),
              "smem", kern.metadata.shared,
              "total instr", len(ops), "STL", sass.count("STL"), "LDL", sass.count("LDL"))
        print("  census:", " ".join(f"{k} {v}" for k, v in census.most_common(24)))
        if dump:
            for ext in ("ttgir", "ptx"):
                with open(f"{dump}.{ext}", "w") as f:
                    f.write(kern.asm[ext])
            with open(f"{dump}.sass", "w") as f:
                f.write(sass)


def bench(reps: int = 20) -> None:
    """H200: swap_decode variants vs kvtax's triton_attention (decode_warp), Llama-3.1-8B
    layer (32 q heads, 8 KV heads, D 128, batch 1, L 1), CUDA graphs, L2 flushed."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from timing import Timer

    from kvtax.attention.triton_api import triton_attention
    from kvtax.cache import FullCache

    # (late, merge, stages, per_sm, reduce, tma, fence)
    variants = [(False, True, 2, 8, True, False, True), (False, False, 2, 8, False, False, True),
                (False, True, 2, 8, True, True, True), (False, True, 2, 8, False, True, True),
                (False, True, 3, 8, True, True, True), (False, True, 2, 8, True, True, False),
                (False, True, 3, 8, True, True, False), (False, True, 2, 12, True, True, True),
                (False, True, 2, 12, True, False, True)]
    timer = Timer(reps, dry=False)
    for dtype, ctx in ((torch.float16, 131072), (torch.bfloat16, 131072),
                       (torch.float16, 32768)):
        cap = ctx + 52  # runner-like capacity (not a power of two)
        cache = FullCache("int8", capacity=cap)
        chunk = 8192
        for t0 in range(0, ctx, chunk):
            kv = torch.randn(1, 8, min(chunk, ctx - t0), HEAD_DIM, dtype=dtype, device="cuda")
            cache.append(kv, kv)
        view = cache.view()
        q = torch.randn(1, 32, 1, HEAD_DIM, dtype=dtype, device="cuda")
        lengths = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
        ref = triton_attention(q, view, lengths=lengths)
        t_ref = timer(lambda q=q, v=view, n=lengths: triton_attention(q, v, lengths=n))
        print(f"{dtype} ctx {ctx}: triton_attention {t_ref[0]:.4f} ms (p20 {t_ref[1]:.4f}, "
              f"p80 {t_ref[2]:.4f})", flush=True)
        for late, merge, stages, per_sm, red, tm, fe in variants:
            splits = default_splits(q, view, cap, per_sm)

            def fn(q=q, v=view, s=splits, n=lengths, st=stages, la=late, me=merge, r=red,
                   tm=tm, fe=fe):
                return swap_decode(q, v, s, n, stages=st, late=la, merge=me, reduce=r,
                                   use_tma=tm, fence=fe)

            tag = (f"tma={tm} fence={fe} late={late} merge={merge} stages={stages} "
                   f"splits={splits} ({per_sm}/SM){'' if red else ' SPLIT KERNEL ONLY'}")
            try:
                got = fn()
                torch.cuda.synchronize()
                err = (got.float() - ref.float()).abs().max().item() if red else float("nan")
                t = timer(fn)
            except Exception as e:  # noqa: BLE001
                print(f"  {tag}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            print(f"  swap {tag}: {t[0]:.4f} ms (p20 {t[1]:.4f}, p80 {t[2]:.4f}) "
                  f"max|diff| vs triton {err:.2e}", flush=True)


def compare_formats(reps: int = 20) -> None:
    """H200, fp16, Llama-3.1-8B layer, batch 1, L 1, one process: for int8 and int4 g64 at
    32k / 128k, kvtax's default decode (decode_warp), kvtax's Triton decode_swap (2 and 3
    stages), and this Gluon kernel (streams merged, 2 / 3 stages, 8 / 12 / 16 per SM)
    against SDPA fp16 cuDNN; CUDA graphs, L2 flushed by a 256 MiB write."""
    import dataclasses

    from torch.nn.attention import SDPBackend

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from arms import sdpa_arm
    from timing import Timer

    from kvtax.attention import triton_api as ta
    from kvtax.cache import FullCache

    timer = Timer(reps, dry=False)
    for ctx in (32768, 131072):
        k = torch.randn(1, 8, ctx, HEAD_DIM, dtype=torch.float16, device="cuda")
        v = torch.randn_like(k)
        q = torch.randn(1, 32, 1, HEAD_DIM, dtype=torch.float16, device="cuda")
        lengths = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
        expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        t = timer(sdpa_arm(q, k, v, SDPBackend.CUDNN_ATTENTION, expect)[0])
        print(f"ctx {ctx} sdpa cudnn fp16: {t[0]:.4f} ms", flush=True)
        for spec in ("int8", "int4"):
            cache = FullCache(spec, capacity=ctx + 52)
            for t0 in range(0, ctx, 8192):
                cache.append(k[:, :, t0:t0 + 8192], v[:, :, t0:t0 + 8192])
            view = cache.view()
            ref = ta.triton_attention(q, view, lengths=lengths)
            arms = {"default (decode_warp)":
                    lambda: ta.triton_attention(q, view, lengths=lengths)}
            for st in (2, 3):
                cfg = dataclasses.replace(ta.swap_decode_config(q, view, lengths), num_stages=st)
                arms[f"triton swap s{st}"] = (
                    lambda c=cfg: ta.triton_attention(q, view, lengths=lengths, config=c))
            for st, per_sm, mr in ((2, 8, None), (3, 8, None), (2, 12, None), (3, 12, None),
                                   (2, 16, 128)):
                arms[f"gluon swap s{st} {per_sm}/SM maxnreg={mr}"] = (
                    lambda st=st, ps=per_sm, mr=mr: swap_decode(
                        q, view, None, lengths, stages=st, merge=True, per_sm=ps, maxnreg=mr))
            for name, fn in arms.items():
                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    t = timer(fn)
                except Exception as e:  # noqa: BLE001
                    print(f"ctx {ctx} {spec} {name}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                print(f"ctx {ctx} {spec} {name}: {t[0]:.4f} ms (p20 {t[1]:.4f}, p80 "
                      f"{t[2]:.4f}) max|diff| vs default {err:.1e}", flush=True)


def compare(reps: int = 20) -> None:
    """H200, fp16, Llama-3.1-8B layer, batch 1, L 1, contexts 32k / 128k, one process:
    swap_decode (streams merged, cp.async, 2 stages, 8/SM) and kvtax's triton_attention
    over int8 g64, against torch SDPA fp16 (cuDNN and flash) over the fp16 K / V the cache
    was quantized from; CUDA graphs, both L2-flush modes of benchmarks/timing.py."""
    from torch.nn.attention import SDPBackend

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from arms import sdpa_arm
    from timing import Timer

    from kvtax.attention.triton_api import triton_attention
    from kvtax.cache import FullCache

    for ctx in (32768, 131072):
        cap = ctx + 52
        k = torch.randn(1, 8, ctx, HEAD_DIM, dtype=torch.float16, device="cuda")
        v = torch.randn_like(k)
        cache = FullCache("int8", capacity=cap)
        for t0 in range(0, ctx, 8192):
            cache.append(k[:, :, t0:t0 + 8192], v[:, :, t0:t0 + 8192])
        view = cache.view()
        q = torch.randn(1, 32, 1, HEAD_DIM, dtype=torch.float16, device="cuda")
        lengths = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
        expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        arms = {"swap int8": lambda: swap_decode(q, view, None, lengths, stages=2, merge=True),
                "triton_attention int8": lambda: triton_attention(q, view, lengths=lengths)}
        for name, backend in (("sdpa cudnn fp16", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa flash fp16", SDPBackend.FLASH_ATTENTION)):
            try:
                arms[name] = sdpa_arm(q, k, v, backend, expect)[0]
            except RuntimeError as e:
                print(f"ctx {ctx} {name}: {e}", flush=True)
        for flush in ("write", "read"):
            timer = Timer(reps, dry=False, flush=flush)
            for name, fn in arms.items():
                t = timer(fn)
                print(f"ctx {ctx} flush={flush} {name}: {t[0]:.4f} ms (p20 {t[1]:.4f}, "
                      f"p80 {t[2]:.4f})", flush=True)


def ncu_run(context: int = 131072, calls: int = 4, stages: int = 2, per_sm: int = 8,
            late: bool = False, merge: bool = False) -> None:
    """A few swap_decode calls over a Llama-3.1-8B layer's int8 cache, for Nsight Compute."""
    from kvtax.cache import FullCache

    cache = FullCache("int8", capacity=context + 52)
    for start in range(0, context, 8192):
        k = torch.randn(1, 8, min(8192, context - start), HEAD_DIM, device="cuda",
                        dtype=torch.bfloat16)
        cache.append(k, torch.randn_like(k))
    q = torch.randn(1, 32, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    lengths = torch.full((1,), context, dtype=torch.int32, device="cuda")
    for _ in range(calls):
        swap_decode(q, cache.view(), None, lengths, stages=stages, per_sm=per_sm, late=late,
                    merge=merge)
    torch.cuda.synchronize()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="sm_90 compile-only check (no GPU)")
    ap.add_argument("--bench", action="store_true", help="time on the GPU at 32k / 128k")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--kw", type=int, default=4)
    ap.add_argument("--dump", default=None, help="write ttgir / ptx / sass to this prefix")
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--ncu", action="store_true", help="four 128k calls (for Nsight Compute)")
    ap.add_argument("--late", action="store_true")
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--tma", action="store_true")
    ap.add_argument("--spec", default="int8", choices=["int8", "int4"])
    ap.add_argument("--compare", action="store_true", help="vs SDPA fp16 at 32k / 128k")
    ap.add_argument("--compare-formats", action="store_true",
                    help="int8 / int4: default, Triton swap, this kernel, cuDNN")
    a = ap.parse_args()
    if a.compare_formats:
        compare_formats()
    elif a.compare:
        compare()
    elif a.ncu:
        ncu_run(stages=a.stages, late=a.late, merge=a.merge)
    elif a.bench:
        bench()
    else:
        for dtype in (torch.float16, torch.bfloat16):
            compile_check(dtype, a.stages, a.kw, dump=a.dump, maxnreg=a.maxnreg, late=a.late,
                          merge=a.merge, use_tma=a.tma, spec=a.spec)


if __name__ == "__main__":
    main()
