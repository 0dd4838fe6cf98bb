"""Gluon version of decode_swap.py for the CUDA path: the same algorithm (slots as the
MMA's M, two 4-row streams per 32-slot step, block-diagonal Q, folded scales, streams
merged at the end of the split) with explicit layouts, for int8 or int4 K and V in
groups of 64 at head_dim 128, G * L <= 4, full caches; and for int4-c64 keys (KC64: one
scale and bias vector per 64-slot block, folded into the queries, `_block_scores`) beside
int4 g64 values, or int4w-c64 keys (KW, with KC64: the same in the sequence's channel
order, plus a fifth bit on the low nibbles of bytes [0, 48) of each 72-byte row,
`_fifth_bytes`).

Why a second implementation. Triton picks the layouts of decode_swap.py itself: it moves
P and the operands through shared memory (~770 instructions per 32-slot step, ~250
registers), and measured no faster than decode_warp.py on the H200. Written in Gluon
(Triton's explicit-layout dialect) the step is ~580 instructions in ~168 registers: the
codes go from shared memory to the MMA operands by ldmatrix and one prmt per two codes,
P reaches its operand layout through warp shuffles. H200, 128k, one Llama-3.1-8B layer
(docs/KERNELS.md): int8 0.083 ms vs decode_warp's 0.091, int4 0.056 vs 0.070
(12 programs per SM, which its register count allows).

Gluon does not run in Triton's interpreter, so CI cannot execute this kernel:
decode_swap.py is its twin (every formula the same) and runs there; this file is checked
on the GPU (tests/attention/test_kernels_swap_gpu.py; int4-c64 keys:
test_kernels_channel_swap_gpu.py) and compiled for sm_90 by benchmarks/compile_check.py.
Works on Triton 3.6 (the H200 image) and 3.9.

Codes: K as fp16 1024 + c (offset folded into the bias); V centered (c - 128, int4
c - 8); scales and biases read as 32-bit words (the lo- and hi-half values of a slot);
int4-c64 key metadata copied by cp.async beside the codes, one [D] vector each per step.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from kvtax.attention.kernels.common import pdl_enter, pdl_exit  # scalar-only: Gluon calls them
from kvtax.attention.kernels.ring_part_gluon import ring_part_split
from kvtax.attention.kernels.swap_gluon_codes import (
    fifth_bytes, halves, x4, x4_pairs, x4w, x8, x8_pairs,
)

# version bridges: cp.async global->shared is `async_copy_global_to_shared` on 3.6 and
# `async_load` on 3.9 (the old name raises there); the partition barrier `thread_barrier`
# became `barrier`
if hasattr(async_copy, "async_load"):
    _cp_async = async_copy.async_load
else:
    _cp_async = async_copy.async_copy_global_to_shared
_bar = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.jit
def _issue(k_smem, v_smem, p_kc, p_vc, rows8, cols8, rows16, cols16, tile, length,
           s_kc_t, s_vc_t, STAGES: gl.constexpr, i, BN: gl.constexpr, KB: gl.constexpr,
           VP: gl.constexpr):
    """cp.async of one step's K codes [BN, KB] uint8 and V pairs [BN, VP] uint16 into
    stage i % STAGES (16 B per lane per copy; slots >= length zero-fill); the caller
    commits the group."""
    s = i % STAGES
    slot8 = tile * BN + rows8
    _cp_async(k_smem.index(s), p_kc + slot8.to(gl.int64)[:, None] * s_kc_t + cols8[None, :],
              mask=(slot8 < length)[:, None] & (cols8 < KB)[None, :])
    slot16 = tile * BN + rows16
    _cp_async(v_smem.index(s), p_vc + slot16.to(gl.int64)[:, None] * s_vc_t + cols16[None, :],
              mask=(slot16 < length)[:, None] & (cols16 < VP)[None, :])


@gluon.jit
def _issue_block(ks_smem, kb_smem, p_ks, p_kb, dims, tile, length, STAGES: gl.constexpr, i,
                 BN: gl.constexpr, D: gl.constexpr):
    """cp.async of the int4-c64 scale and bias vectors [D] of the 64-slot block holding
    step `tile` (its 32 slots lie in one block) into stage i % STAGES; zeros for a step
    past `length` (storage is block-aligned, so a step with a slot below it has its block)."""
    s = i % STAGES
    off = (tile * BN // 64).to(gl.int64) * D + dims
    ok = (dims * 0 + tile * BN) < length
    _cp_async(ks_smem.index(s), p_ks + off, mask=ok)
    _cp_async(kb_smem.index(s), p_kb + off, mask=ok)


@gluon.jit
def _block_scores(k_st, ks_st, kb_st, f_st, q_lo, q_hi, first, qk_scale, ka_l: gl.constexpr,
                  qb_l: gl.constexpr, mma: gl.constexpr, SUB: gl.constexpr,
                  DH: gl.constexpr, NC: gl.constexpr, KW: gl.constexpr):
    """Scaled scores S^T [16, 8] of one step of int4-c64 keys (codes k_st [32, D/2] uint8,
    the block's scale and bias vectors ks_st, kb_st [D] in shared memory; q_lo, q_hi
    [D/2, 8] fp16, q in all 8 columns; first [1, 8] True in stream 0's columns):
    q.(s c + b) = (q s).(1024 + c) + q.b - 1024 sum(q s).
    The block's s goes into the query operand (q s rounded once to fp16: 16 values a lane
    per half instead of scaling 64 codes a lane), so the codes enter the MMA as plain
    int4's do; q.b and the offset are MMAs of b broadcast and of -1024 (exact in fp16), so
    every term lands in the accumulator's layout without shuffles, and the offset cancels
    against the same rounded q s the codes meet. Each stream's codes meet q s in all 8
    columns and the score tile keeps stream 0's columns from the first product, stream 1's
    from the second: 4 selects a lane, where block-diagonal operands (q s times the
    column masks) took 32 HMUL2. KW (int4w-c64): f_st [32, D/2] holds each low nibble's
    fifth bit at bit 4 (`_fifth_bytes`), OR'd in before the codes become fp16."""
    s_lo = ks_st.slice(0, DH).load(gl.SliceLayout(1, qb_l)).to(gl.float16)
    s_hi = ks_st.slice(DH, DH).load(gl.SliceLayout(1, qb_l)).to(gl.float16)
    b_lo = kb_st.slice(0, DH).load(gl.SliceLayout(0, ka_l)).to(gl.float16)
    b_hi = kb_st.slice(DH, DH).load(gl.SliceLayout(0, ka_l)).to(gl.float16)
    qs_lo = q_lo * s_lo[:, None]  # [D/2, 8]
    qs_hi = q_hi * s_hi[:, None]
    off = gl.full([SUB, DH], -1024.0, gl.float16, ka_l)
    ab_lo, _ = gl.broadcast(b_lo[None, :], off)  # [16, D/2]: every row b
    ab_hi, _ = gl.broadcast(b_hi[None, :], off)
    # four independent accumulations (two dots deep each, as plain int4's two), summed in fp32
    zs = gl.zeros([SUB, NC], gl.float32, mma)
    t_b = mma_v2(ab_hi, q_hi, mma_v2(ab_lo, q_lo, zs))
    t_off = mma_v2(off, qs_hi, mma_v2(off, qs_lo, zs))
    if KW:
        a0_lo, a0_hi = x4w(k_st.slice(0, SUB, 0).load(ka_l), f_st.slice(0, SUB, 0).load(ka_l))
        a1_lo, a1_hi = x4w(k_st.slice(SUB, SUB, 0).load(ka_l),
                            f_st.slice(SUB, SUB, 0).load(ka_l))
    else:
        a0_lo, a0_hi = x4(k_st.slice(0, SUB, 0).load(ka_l))
        a1_lo, a1_hi = x4(k_st.slice(SUB, SUB, 0).load(ka_l))
    d0 = mma_v2(a0_hi, qs_hi, mma_v2(a0_lo, qs_lo, zs))  # stream 0's slots, every column
    d1 = mma_v2(a1_hi, qs_hi, mma_v2(a1_lo, qs_lo, zs))
    return (gl.where(first, d0, d1) + (t_off + t_b)) * qk_scale


@gluon.jit
def _fold_streams(x, PH: gl.constexpr, st_l: gl.constexpr):
    """[PH, 8] (columns = 2 streams x 4 rows, already weighted) -> [PH, 4] in st_l."""
    return gl.convert_layout(gl.sum(gl.reshape(x, [PH, 2, 4]), 1), st_l)


@gluon.jit
def decode_swap_gluon_kernel(
    q_ptr, part_o, part_m, part_l, kc, vc, ksw, kbw, vsw, vbw, lens,
    length_host, n_q, num_splits, n_kv_heads, qk_scale,
    s_qb, s_qh, s_ql, s_qd,
    s_kc_b, s_kc_h, s_kc_t, s_km_b, s_km_h,
    s_vc_b, s_vc_h, s_vc_t, s_vm_b, s_vm_h,
    min_dist, min_key, split_base, splits_total,
    fk, fv, f_splits, f_base, sinks, ring, window,
    s_fk_b, s_fk_h, s_fk_t, s_fv_b, s_fv_h, s_fv_t,
    G: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, MDT: gl.constexpr,
    INT4: gl.constexpr, HAS_LENS: gl.constexpr,
    PDL: gl.constexpr = False, PDL_LATE: gl.constexpr = False, KC64: gl.constexpr = False,
    HAS_MIN_DIST: gl.constexpr = False, PDL_BESIDE: gl.constexpr = False,
    KW: gl.constexpr = False, FOLD: gl.constexpr = False,
):
    """Grid (B * H_kv, S), one warp. kc: uint8 codes [B, H, slots, row bytes]; vc: the V
    codes as uint16 pairs [B, H, slots, row bytes / 2] (strides in their elements);
    ksw ... vbw: int32 words [B, H, slots] (lo-half value | hi-half value << 16, in MDT);
    with KC64, ksw / kbw are the keys' block scales / biases in MDT, [slots / 64, D] per
    (batch, head) (s_km_b, s_km_h in MDT elements); KW (with KC64): int4w-c64 keys, kc's
    rows D/2 + D/16 bytes (a multiple of 8, not of 16: the codes go by 8-byte copies).
    Writes PartO [B*H_kv, S_total, R, D], PartM / PartL [B*H_kv, S_total, R] (R = G * n_q
    <= 4), this launch's S splits at `[split_base, split_base + S)` of `splits_total` (a
    hybrid cache's parts share one reduce). HAS_MIN_DIST: a query at p reads only keys k
    with min_key <= k <= p - min_dist (the hybrid body; decode_swap.py's masks).
    FOLD (q4's two parts in one launch): programs with split < f_splits read the hybrid
    cache's fp16 part instead (fk, fv: its K / V, a ring of `ring` slots past `sinks`
    read through `window`; ring_part_gluon.py), their partials at split slots
    `[f_base, f_base + f_splits)`; the others are the body's splits 0 .. S - 1.

    Over 80 lines: the shared-memory ring and its cp.async issue / wait / consume span the
    whole loop, and a gluon.jit helper would take most of the kernel's layouts and buffers.
    """
    pdl_enter(PDL, PDL_LATE, PDL_BESIDE)
    SUB: gl.constexpr = 16
    BN: gl.constexpr = 32
    NC: gl.constexpr = 8
    DH: gl.constexpr = D // 2
    PH: gl.constexpr = D // 4
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])
    # K's operands hold 4 consecutive codes per 32-bit register (one prmt pair each)
    ka_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    qb_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    va_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    pb_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)

    pid_bh = gl.program_id(0)
    split = gl.program_id(1)
    b = (pid_bh // n_kv_heads).to(gl.int64)
    h = (pid_bh % n_kv_heads).to(gl.int64)
    if HAS_LENS:
        length = gl.load(lens + b)
    else:
        length = length_host
    if FOLD:
        if split < f_splits:  # the fp16 part's programs come first, as its launch did
            ring_part_split(q_ptr, part_o, part_m, part_l, fk, fv, b, h,
                            (pid_bh.to(gl.int64) * splits_total + f_base + split) * (G * n_q),
                            length, n_q, split, f_splits, sinks, ring, window, qk_scale,
                            s_qb, s_qh, s_ql, s_qd, s_fk_b, s_fk_h, s_fk_t,
                            s_fv_b, s_fv_h, s_fv_t, G, D)
            pdl_exit(PDL, PDL_LATE, PDL_BESIDE)
            return
        split = split - f_splits
    if HAS_MIN_DIST:  # tiles at or past length - min_dist hold no key any row sees
        n_tiles = gl.cdiv(gl.maximum(length - min_dist, 0), BN)
    else:
        n_tiles = gl.cdiv(length, BN)
    n_my = gl.maximum(n_tiles - split + num_splits - 1, 0) // num_splits  # strided steps
    n_rows = G * n_q

    p_kc = kc + b * s_kc_b + h * s_kc_h
    # ---- queries: block-diagonal B operands [D/2, 8] per scale half; column c is
    # stream c // 4, row c % 4 (query head h * G + row % G at position row // G);
    # int4w-c64: query dim order[j] meets stored channel j (the first block's rows hold
    # order[u + 64 m] in byte D/2 + 3D/64 + m of row u)
    qk = gl.arange(0, DH, layout=gl.SliceLayout(1, qb_l))
    qc = gl.arange(0, NC, layout=gl.SliceLayout(0, qb_l))
    qr = qc % 4
    if KW:
        # gathered in a plain layout, then moved to the operand's: gathered straight into
        # qb_l, the kernel spilled 48-56 bytes under the 168-register cap that 12
        # programs per SM need (ptxas, sm_90, Triton 3.6 / 3.9); this way it spills none
        o_col: gl.constexpr = DH + 3 * D // 64
        qg_l: gl.constexpr = gl.BlockedLayout([2, NC], [32, 1], [1, 1], [1, 0])
        gk = gl.arange(0, DH, layout=gl.SliceLayout(1, qg_l))
        gr = gl.arange(0, NC, layout=gl.SliceLayout(0, qg_l)) % 4
        gd_lo = gl.load(p_kc + (gk % 64).to(gl.int64) * s_kc_t + o_col + gk // 64).to(gl.int64)
        gd_hi = gl.load(p_kc + ((gk + DH) % 64).to(gl.int64) * s_kc_t + o_col
                        + (gk + DH) // 64).to(gl.int64)
        p_g = (q_ptr + b * s_qb + (h * G + gr % G).to(gl.int64)[None, :] * s_qh
               + (gr // G).to(gl.int64)[None, :] * s_ql)
        mg = (gr < n_rows)[None, :] & (gk < DH)[:, None]
        q_lo = gl.convert_layout(
            gl.load(p_g + gd_lo[:, None] * s_qd, mask=mg, other=0.0).to(gl.float16), qb_l)
        q_hi = gl.convert_layout(
            gl.load(p_g + gd_hi[:, None] * s_qd, mask=mg, other=0.0).to(gl.float16), qb_l)
    else:
        p_q = (q_ptr + b * s_qb + (h * G + qr % G).to(gl.int64)[None, :] * s_qh
               + (qr // G).to(gl.int64)[None, :] * s_ql)
        mq = (qr < n_rows)[None, :] & (qk < DH)[:, None]
        q_lo = gl.load(p_q + qk.to(gl.int64)[:, None] * s_qd, mask=mq,
                       other=0.0).to(gl.float16)
        q_hi = gl.load(p_q + (qk + DH).to(gl.int64)[:, None] * s_qd, mask=mq,
                       other=0.0).to(gl.float16)
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
    p_vc = vc + b * s_vc_b + h * s_vc_h
    if KW:  # 72-byte rows: tell the copies each row starts 8-byte aligned
        s_krow = (s_kc_t // 8) * 8
        R: gl.constexpr = 3 * D // 8
        sp_l: gl.constexpr = gl.BlockedLayout([1, DH // 4], [32, 1], [1, 1], [1, 0])
        swz32: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=PER, max_phase=PHASES,
                                                      order=[1, 0])
        f_smem = gl.allocate_shared_memory(gl.uint8, [BN, DH], swz8)
        jj = gl.arange(0, DH // 4, layout=gl.SliceLayout(0, sp_l))
        wrow = gl.arange(0, BN, layout=gl.SliceLayout(1, sp_l))
        p_kw = (p_kc + DH).to(gl.pointer_type(gl.int32), bitcast=True)  # bits [0, 64) of a row
    else:
        s_krow = s_kc_t
        f_smem = k_smem
    if KC64:  # the block vectors ride in the ring beside the codes
        mvec: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1,
                                                     order=[0])
        ks_smem = gl.allocate_shared_memory(MDT, [STAGES, D], mvec)
        kb_smem = gl.allocate_shared_memory(MDT, [STAGES, D], mvec)
        dims = gl.arange(0, D, layout=gl.BlockedLayout([D // 32], [32], [1], [0]))
        first_s = (mc < 4)[None, :]  # [1, 8] in the scores' layout: stream 0's columns
    for j in gl.static_range(STAGES - 1):  # tiles past n_my lie past length: zero-filled
        _issue(k_smem, v_smem, p_kc, p_vc, rows8, cols8, rows16, cols16,
               split + j * num_splits, length, s_krow, s_vc_t, STAGES, j, BN, KB, VP)
        if KC64:
            _issue_block(ks_smem, kb_smem, p_ksw, p_kbw, dims, split + j * num_splits,
                         length, STAGES, j, BN, D)
        async_copy.commit_group()

    # metadata of step 0 (registers, one step ahead)
    slot_m = split * BN + moff
    mm = slot_m < length
    if not KC64:
        ksw_n = gl.load(p_ksw + slot_m, mask=mm, other=0)
        kbw_n = gl.load(p_kbw + slot_m, mask=mm, other=0)
    vsw_n = gl.load(p_vsw + slot_m, mask=mm, other=0)
    vbw_n = gl.load(p_vbw + slot_m, mask=mm, other=0)
    if KW:  # the fifth-bit words of step 0, one row a lane
        slot_w = split * BN + wrow
        w0_n = gl.load(p_kw + slot_w.to(gl.int64) * (s_kc_t // 4), mask=slot_w < length, other=0)
        w1_n = gl.load(p_kw + slot_w.to(gl.int64) * (s_kc_t // 4) + 1, mask=slot_w < length,
                       other=0)

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
        async_copy.wait_group(STAGES - 2)
        _bar()  # every lane's copies of stage s landed; stage (i - 1) % STAGES is free
        _issue(k_smem, v_smem, p_kc, p_vc, rows8, cols8, rows16, cols16,
               tile + (STAGES - 1) * num_splits, length, s_krow, s_vc_t, STAGES,
               i + STAGES - 1, BN, KB, VP)
        if KC64:
            _issue_block(ks_smem, kb_smem, p_ksw, p_kbw, dims, tile + (STAGES - 1) * num_splits,
                         length, STAGES, i + STAGES - 1, BN, D)
        async_copy.commit_group()
        vsw_c = vsw_n
        vbw_c = vbw_n
        slot_m = (tile + num_splits) * BN + moff
        mm = slot_m < length
        if not KC64:
            ksw_c = ksw_n
            kbw_c = kbw_n
            ksw_n = gl.load(p_ksw + slot_m, mask=mm, other=0)
            kbw_n = gl.load(p_kbw + slot_m, mask=mm, other=0)
        vsw_n = gl.load(p_vsw + slot_m, mask=mm, other=0)
        vbw_n = gl.load(p_vbw + slot_m, mask=mm, other=0)
        if KW:  # this step's fifth bits into f_smem, the next step's words in flight
            fifth_bytes(f_smem, w0_n, w1_n, jj, R, BN, DH, sp_l, swz32)
            slot_w = (tile + num_splits) * BN + wrow
            w0_n = gl.load(p_kw + slot_w.to(gl.int64) * (s_kc_t // 4), mask=slot_w < length,
                           other=0)
            w1_n = gl.load(p_kw + slot_w.to(gl.int64) * (s_kc_t // 4) + 1,
                           mask=slot_w < length, other=0)
            _bar()  # every lane's spread bytes are in f_smem

        # ---- scores S^T [16, 8]: two streams through block-diagonal Q
        k_st = k_smem.index(s)
        if KC64:
            sc = _block_scores(k_st, ks_smem.index(s), kb_smem.index(s), f_smem, q_lo, q_hi,
                               first_s, qk_scale, ka_l, qb_l, mma, SUB, DH, NC, KW)
        elif INT4:  # one byte tile per stream holds both halves
            a0_lo, a0_hi = x4(k_st.slice(0, SUB, 0).load(ka_l))
            a1_lo, a1_hi = x4(k_st.slice(SUB, SUB, 0).load(ka_l))
            d_lo = mma_v2(a1_lo, bq_lo1, mma_v2(a0_lo, bq_lo0, zs))
            d_hi = mma_v2(a1_hi, bq_hi1, mma_v2(a0_hi, bq_hi0, zs))
        else:
            d_lo = mma_v2(x8(k_st.slice(0, SUB, 0).slice(0, DH, 1).load(ka_l)), bq_lo0, zs)
            d_lo = mma_v2(x8(k_st.slice(SUB, SUB, 0).slice(0, DH, 1).load(ka_l)), bq_lo1,
                          d_lo)
            d_hi = mma_v2(x8(k_st.slice(0, SUB, 0).slice(DH, DH, 1).load(ka_l)), bq_hi0, zs)
            d_hi = mma_v2(x8(k_st.slice(SUB, SUB, 0).slice(DH, DH, 1).load(ka_l)), bq_hi1,
                          d_hi)
        if not KC64:
            ks_lo, ks_hi = halves(ksw_c, MDT)
            kb_lo, kb_hi = halves(kbw_c, MDT)
            sc = (d_lo * (ks_lo * qk_scale) + d_hi * (ks_hi * qk_scale)
                  + qs_lo[None, :] * ((kb_lo - 1024.0 * ks_lo) * qk_scale)
                  + qs_hi[None, :] * ((kb_hi - 1024.0 * ks_hi) * qk_scale))
        if HAS_MIN_DIST:
            vis = (((tile * BN + moff) <= (q_pos - min_dist)[None, :])
                   & ((tile * BN + moff) >= min_key))
        else:
            vis = (tile * BN + moff) <= q_pos[None, :]
        sc = gl.where(vis, sc, float("-inf"))

        # ---- online softmax per column
        vs_lo, vs_hi = halves(vsw_c, MDT)  # past length: 0 (masked loads)
        vb_lo, vb_hi = halves(vbw_c, MDT)
        # one warp-wide max decides whether to rescale: only when a score passes its
        # column's reference max by 2^8 or a V scale the reference t_v by 2^6 (the
        # first step always does); otherwise P <= 2^8 and P * s / t_v <= 2^14 in fp16
        m_ref = gl.where(m_i == float("-inf"), -3.0e38, m_i)
        z = gl.maximum(sc - m_ref[None, :] - 8.0,
                       gl.where(gl.maximum(vs_lo, vs_hi) > 64.0 * t_v, 1.0, -1.0))
        if gl.max(gl.max(z, 1), 0) > 0.0:
            m_new = gl.maximum(m_i, gl.max(sc, 0))
            t_new = gl.maximum(t_v, gl.max(gl.max(gl.maximum(vs_lo, vs_hi), 1), 0))
            alpha = gl.where(m_new == float("-inf"), 1.0, gl.exp2(m_i - m_new))
            al = alpha[None, :]
            fr = (alpha * (t_v / t_new))[None, :]
            acc_e_lo = acc_e_lo * fr
            acc_o_lo = acc_o_lo * fr
            acc_e_hi = acc_e_hi * fr
            acc_o_hi = acc_o_hi * fr
            l_acc = l_acc * al
            b_lo = b_lo * al
            b_hi = b_hi * al
            m_i = m_new
            t_v = t_new
        m_base = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = gl.exp2(sc - m_base[None, :])  # hidden slots: exactly 0
        l_acc = l_acc + p
        b_lo = b_lo + p * (vb_lo + VOFF * vs_lo)
        b_hi = b_hi + p * (vb_hi + VOFF * vs_hi)
        inv_t = 1.0 / t_v
        pt_lo = gl.convert_layout((p * (vs_lo * inv_t)).to(gl.float16), pb_l)
        pt_hi = gl.convert_layout((p * (vs_hi * inv_t)).to(gl.float16), pb_l)
        p0_lo = gl.where(first, pt_lo, zp)
        p1_lo = gl.where(first, zp, pt_lo)
        p0_hi = gl.where(first, pt_hi, zp)
        p1_hi = gl.where(first, zp, pt_hi)

        # ---- O^T [D, 8] += V^T @ P^T, per stream, even / odd dims, lo / hi halves
        v_st = v_smem.index(s)
        if INT4:  # one pair tile per stream holds all four dim quarters
            e, o, e2, o2 = x4_pairs(v_st.slice(0, SUB, 0).permute((1, 0)).load(va_l))
            acc_e_lo = mma_v2(e, p0_lo, acc_e_lo)
            acc_o_lo = mma_v2(o, p0_lo, acc_o_lo)
            acc_e_hi = mma_v2(e2, p0_hi, acc_e_hi)
            acc_o_hi = mma_v2(o2, p0_hi, acc_o_hi)
            e, o, e2, o2 = x4_pairs(v_st.slice(SUB, SUB, 0).permute((1, 0)).load(va_l))
            acc_e_lo = mma_v2(e, p1_lo, acc_e_lo)
            acc_o_lo = mma_v2(o, p1_lo, acc_o_lo)
            acc_e_hi = mma_v2(e2, p1_hi, acc_e_hi)
            acc_o_hi = mma_v2(o2, p1_hi, acc_o_hi)
        else:
            e, o = x8_pairs(v_st.slice(0, SUB, 0).slice(0, PH, 1).permute((1, 0)).load(va_l))
            acc_e_lo = mma_v2(e, p0_lo, acc_e_lo)
            acc_o_lo = mma_v2(o, p0_lo, acc_o_lo)
            e, o = x8_pairs(v_st.slice(0, SUB, 0).slice(PH, PH, 1).permute((1, 0)).load(va_l))
            acc_e_hi = mma_v2(e, p0_hi, acc_e_hi)
            acc_o_hi = mma_v2(o, p0_hi, acc_o_hi)
            e, o = x8_pairs(v_st.slice(SUB, SUB, 0).slice(0, PH, 1).permute((1, 0))
                             .load(va_l))
            acc_e_lo = mma_v2(e, p1_lo, acc_e_lo)
            acc_o_lo = mma_v2(o, p1_lo, acc_o_lo)
            e, o = x8_pairs(v_st.slice(SUB, SUB, 0).slice(PH, PH, 1).permute((1, 0))
                             .load(va_l))
            acc_e_hi = mma_v2(e, p1_hi, acc_e_hi)
            acc_o_hi = mma_v2(o, p1_hi, acc_o_hi)

    async_copy.wait_group(0)  # no copy may land after the program exits

    # ---- merge the two streams (columns c and c + 4): one partial per split, row r
    l_c = gl.sum(l_acc, 0)
    bl = gl.sum(b_lo, 0)[None, :]
    bh = gl.sum(b_hi, 0)[None, :]
    m2 = gl.reshape(m_i, [2, 4])
    mx = gl.max(m2, 0)
    mxb = gl.where(mx == float("-inf"), 0.0, mx)
    w = gl.convert_layout(gl.reshape(gl.exp2(m2 - mxb[None, :]), [NC]), col_l)
    st_l: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0])
    r4 = gl.arange(0, 4, layout=gl.SliceLayout(0, st_l))
    d4 = 2 * gl.arange(0, PH, layout=gl.SliceLayout(1, st_l))[:, None]
    prow = (pid_bh.to(gl.int64) * splits_total + split_base + split) * n_rows + r4
    ok = r4 < n_rows
    gl.store(part_m + prow, gl.convert_layout(mx, gl.SliceLayout(0, st_l)), mask=ok)
    l4 = gl.sum(gl.reshape(l_c * w, [2, 4]), 0)
    gl.store(part_l + prow, gl.convert_layout(l4, gl.SliceLayout(0, st_l)), mask=ok)
    po = part_o + prow[None, :] * D + d4
    mo = ok[None, :] & (d4 < D)
    ww = w[None, :]
    gl.store(po, _fold_streams((acc_e_lo * t_v + bl) * ww, PH, st_l), mask=mo)
    gl.store(po + 1, _fold_streams((acc_o_lo * t_v + bl) * ww, PH, st_l), mask=mo)
    gl.store(po + DH, _fold_streams((acc_e_hi * t_v + bh) * ww, PH, st_l), mask=mo)
    gl.store(po + DH + 1, _fold_streams((acc_o_hi * t_v + bh) * ww, PH, st_l), mask=mo)
    pdl_exit(PDL, PDL_LATE, PDL_BESIDE)
