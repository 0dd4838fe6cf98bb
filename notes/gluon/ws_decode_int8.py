"""Warp-specialized Gluon decode-attention split kernel for int8 K and V (DRAFT).

DRAFT: compiled for sm_90 on Triton 3.6 and 3.9 (benchmarks/compile_check.py's
compile-only driver, `python ws_decode_int8.py --compile`), NEVER RUN on a GPU; not part
of the kvtax package (kvtax never imports it). Its mbarrier protocol, data flow and
numbers are unchecked until `test_ws_decode_int8_gpu.py` passes on an H200.

Case served (anything else raises ValueError): int8 K and V with group size 64 (one
scale + bias group per half row), head_dim 128, full (non-ring, non-window) cache,
G * L <= 16 query rows per KV head, fp16 / bf16 queries, lengths from a device int32
tensor `[B]` (slots >= length are never read: their cp.async is masked and zero-fills),
causal bottom-right masking for L > 1 (query row l at position length - L + l).

Same partials as decode_warp.py (kvtax/attention/kernels/decode_warp.py), merged by
kvtax's `_decode_attn_reduce_kernel`: PartO [B*H_kv, S, R, D] unnormalized acc, PartM
base-2 running max, PartL denominator; a split that sees no tile writes m = -inf,
l = 0, acc = 0.

One CTA per (b * H_kv + h, split); split s takes tiles s, s + S, s + 2S, ... (strided,
as decode_warp). Partitions (gl.warp_specialize):
  * producer (1 worker warp, `WORKER_REGS` registers via setmaxnreg): per tile, cp.async
    of the [32, 128] uint8 K and V code tiles (16 B per lane) and the tile's four
    metadata runs (K scales, K biases, V scales, V biases) as 32 uint32 words, a word
    being one slot's (lo-half, hi-half) fp16/bf16 pair, into a STAGES-deep ring; each
    lane's copies arrive on `ready[s]` through cp.async.mbarrier.arrive.noinc (ready's
    count = 32 lanes); waits on `empty[s]` before refilling a stage.
  * consumer (default partition, 4 warps, mma_v2 with warps side by side along N):
    waits `ready[s]`, loads the stage into registers, partition barrier, arrives
    `empty[s]`; then the folded-scale math of decode_warp:
        score = qk_scale * (ks_lo (q_lo . c_lo) + ks_hi (q_hi . c_hi)
                            + kb'_lo sum(q_lo) + kb'_hi sum(q_hi))
        acc_h += (P * vs_h / t_v) @ c_h,  bias_h += P . vb'_h        (h = lo, hi)
    with c = code - 128 (exact in fp16 via the 0x6400 trick), b' = b + 128 s, t_v the
    running largest V scale (so the fp16 operand P * s / t_v <= 1), output
    acc_h * t_v + bias_h. Rescale is eager (every tile), not decode_warp's lazy branch.

Known cost: V is read from shared memory as bytes straight into the mma B-operand layout
(LDS.U8 + PRMT per code, session 8's finding); `V_PAIRS=True` instead reinterprets the
V stage as uint16 pairs of dims (decode_warp's `_v_pairs`: ldmatrix-able 16-bit
operand, one split per two codes, output dims interleaved and stored back in place).

Usage:
    out = ws_decode_int8(q, cache.view(), num_splits=None, lengths=None)
    python ws_decode_int8.py --compile [--v-pairs]   # sm_90 compile-only, no GPU
    PYTHONPATH=/tmp/t36 python ws_decode_int8.py --compile
    python ws_decode_int8.py --bench                 # H200: vs triton_attention, 32k/128k
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
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

# ---- version bridge (3.6 vs 3.9) ---------------------------------------------------------
# cp.async global->shared: 3.6 `async_copy_global_to_shared`; 3.9 `async_load` (the old
# name still exists in 3.9 but raises).
if hasattr(async_copy, "async_load"):
    cp_async_load = async_copy.async_load
else:
    cp_async_load = async_copy.async_copy_global_to_shared
# partition-wide barrier: 3.6 `thread_barrier`, 3.9 `barrier`
_bar = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# shared-memory reinterpret: 3.6 `_reinterpret`, 3.9 `reinterpret` (a constexpr flag picks)
from triton.experimental.gluon.language._core import shared_memory_descriptor as _smd  # noqa: E402

NEW_REINTERPRET = hasattr(_smd, "reinterpret")

BLOCK_N = 32  # slots per tile
BLOCK_M = 16  # query rows per tile (the mma's M); G * L <= 16
HEAD_DIM = 128
GROUP = 64


# ---- producer -----------------------------------------------------------------------------
@gluon.jit
def _producer(p_kc, p_vc, p_ksw, p_kbw, p_vsw, p_vbw,
              k_smem, v_smem, ks_smem, kb_smem, vs_smem, vb_smem, ready, empty,
              split, num_splits, n_my, length,
              D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    # one warp: 16 B per lane per cp.async, 4 rows x 128 B per pass, 8 passes per tile
    ld: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [1, 1], [1, 0])
    wl: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])  # 32 words, one per lane
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    srow = gl.arange(0, BN, layout=wl)
    for i in range(n_my):
        s = i % STAGES
        ph = (i // STAGES) & 1
        # wait until the consumer released this stage (first pass: parity 1 passes at once)
        mbarrier.wait(empty.index(s), ph ^ 1)
        base = (split + i * num_splits) * BN
        slot = base + rows
        offs = slot.to(gl.int64)[:, None] * D + cols[None, :]
        m2 = (slot < length)[:, None] & (cols < D)[None, :]
        cp_async_load(k_smem.index(s), p_kc + offs, mask=m2)
        cp_async_load(v_smem.index(s), p_vc + offs, mask=m2)
        wslot = base + srow
        mw = wslot < length
        cp_async_load(ks_smem.index(s), p_ksw + wslot, mask=mw)
        cp_async_load(kb_smem.index(s), p_kbw + wslot, mask=mw)
        cp_async_load(vs_smem.index(s), p_vsw + wslot, mask=mw)
        cp_async_load(vb_smem.index(s), p_vbw + wslot, mask=mw)
        # each lane's arrival (ready count = 32) fires when its own cp.asyncs land
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


# ---- consumer helpers -----------------------------------------------------------------------
@gluon.jit
def _centered(x):
    """uint8 codes -> fp16 code - 128: 0x6400 | c is the fp16 1024 + c (exact)."""
    return (x.to(gl.uint16) | 0x6400).to(gl.float16, bitcast=True) - 1152.0


@gluon.jit
def _halves(w, MDT: gl.constexpr):
    """uint32 words (lo-half value, hi-half value) in the model dtype -> two fp32."""
    lo = w.to(gl.int16).to(MDT, bitcast=True).to(gl.float32)
    hi = (w >> 16).to(gl.int16).to(MDT, bitcast=True).to(gl.float32)
    return lo, hi


@gluon.jit
def _v_operand(v_stage, j: gl.constexpr, b_l: gl.constexpr, BN: gl.constexpr,
               D: gl.constexpr, NEW_REINT: gl.constexpr):
    """Half j of a V stage viewed as uint16 pairs: [BN, D/4] uint16 in the B layout
    (pair p = dims 2p, 2p + 1; half j holds pairs j*D/4 .. (j+1)*D/4 - 1, i.e. dims
    j*D/2 .. (j+1)*D/2 - 1). Needs the stage stored unswizzled (see the kernel)."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    if NEW_REINT:
        w = v_stage.reinterpret(gl.uint16, [BN, D // 2], plain)
    else:
        w = v_stage._reinterpret(gl.uint16, [BN, D // 2], plain)
    return w.slice(j * (D // 4), D // 4, 1).load(b_l)


@gluon.jit
def _consumer(q_ptr, part_o, part_m, part_l,
              k_smem, v_smem, ks_smem, kb_smem, vs_smem, vb_smem, ready, empty,
              pid_bh, b, h, split, num_splits, n_my, length, n_q, qk_scale,
              s_qb, s_qh, s_ql, s_qd,
              G: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
              STAGES: gl.constexpr, CW: gl.constexpr, MDT: gl.constexpr,
              V_PAIRS: gl.constexpr, NEW_REINT: gl.constexpr):
    DH: gl.constexpr = D // 2
    DQ: gl.constexpr = D // 4
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, CW],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)

    # ---- queries: rows r = l * G + g (query head h * G + g, position l) as A operands
    n_rows = G * n_q
    qm = gl.arange(0, BM, layout=gl.SliceLayout(1, a_l))
    qd = gl.arange(0, DH, layout=gl.SliceLayout(0, a_l))
    p_q = (q_ptr + b * s_qb + (h * G + qm % G).to(gl.int64)[:, None] * s_qh
           + (qm // G).to(gl.int64)[:, None] * s_ql)
    mq = (qm < n_rows)[:, None] & (qd < DH)[None, :]
    q_lo = gl.load(p_q + qd[None, :] * s_qd, mask=mq, other=0.0).to(gl.float16)
    q_hi = gl.load(p_q + (qd + DH)[None, :] * s_qd, mask=mq, other=0.0).to(gl.float16)
    # sum(q) per half of the operand the dots see, for the folded K biases
    qs_lo = gl.convert_layout(gl.sum(q_lo.to(gl.float32), 1), row_l)
    qs_hi = gl.convert_layout(gl.sum(q_hi.to(gl.float32), 1), row_l)

    o_m = gl.arange(0, BM, layout=row_l)
    q_pos = length - n_q + o_m // G  # causal bottom-right; padded rows are never stored
    o_c = gl.arange(0, BN, layout=col_l)

    if V_PAIRS:
        acc_a = gl.zeros([BM, DQ], gl.float32, mma)  # dims 2j        (j < D/4)
        acc_b = gl.zeros([BM, DQ], gl.float32, mma)  # dims 2j + 1
        acc_c = gl.zeros([BM, DQ], gl.float32, mma)  # dims D/2 + 2j
        acc_d = gl.zeros([BM, DQ], gl.float32, mma)  # dims D/2 + 2j + 1
    else:
        acc_a = gl.zeros([BM, DH], gl.float32, mma)  # dims 0 .. D/2 - 1
        acc_b = gl.zeros([BM, DH], gl.float32, mma)  # dims D/2 .. D - 1
        acc_c = acc_a
        acc_d = acc_b
    m_i = gl.full([BM], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([BM], gl.float32, row_l)
    bias_lo = gl.zeros([BM], gl.float32, row_l)
    bias_hi = gl.zeros([BM], gl.float32, row_l)
    t_v = 1e-30  # running largest V scale (acc holds P @ (V / t_v))
    zeros_s = gl.zeros([BM, BN], gl.float32, mma)

    for i in range(n_my):
        s = i % STAGES
        ph = (i // STAGES) & 1
        base = (split + i * num_splits) * BN
        mbarrier.wait(ready.index(s), ph)
        k_st = k_smem.index(s)
        v_st = v_smem.index(s)
        # K^T halves [D/2, BN] as B operands (codes contiguous along the reduction)
        kc_lo = k_st.slice(0, DH, 1).permute((1, 0)).load(b_l)
        kc_hi = k_st.slice(DH, DH, 1).permute((1, 0)).load(b_l)
        if V_PAIRS:
            w_lo = _v_operand(v_st, 0, b_l, BN, D, NEW_REINT)  # pairs of dims < D/2
            w_hi = _v_operand(v_st, 1, b_l, BN, D, NEW_REINT)  # pairs of dims >= D/2
        else:
            vc_lo = v_st.slice(0, DH, 1).load(b_l)  # [BN, D/2] uint8: byte loads
            vc_hi = v_st.slice(DH, DH, 1).load(b_l)
        ksw = ks_smem.index(s).load(col_l)
        kbw = kb_smem.index(s).load(col_l)
        vsw = vs_smem.index(s).load(col_l)
        vbw = vb_smem.index(s).load(col_l)
        # every consumer warp has its copy of the stage in registers: release it
        _bar()
        mbarrier.arrive(empty.index(s))

        ks_lo, ks_hi = _halves(ksw, MDT)
        kb_lo, kb_hi = _halves(kbw, MDT)
        vs_lo, vs_hi = _halves(vsw, MDT)
        vb_lo, vb_hi = _halves(vbw, MDT)
        kb_lo = kb_lo + 128.0 * ks_lo  # centered codes: b' = b + 128 s
        kb_hi = kb_hi + 128.0 * ks_hi
        vb_lo = vb_lo + 128.0 * vs_lo
        vb_hi = vb_hi + 128.0 * vs_hi

        # ---- scores (base 2), K scales and biases folded onto the [BM, BN] tile
        d_lo = mma_v2(q_lo, _centered(kc_lo), zeros_s)
        d_hi = mma_v2(q_hi, _centered(kc_hi), zeros_s)
        sc = (d_lo * (ks_lo * qk_scale)[None, :] + d_hi * (ks_hi * qk_scale)[None, :]
              + qs_lo[:, None] * (kb_lo * qk_scale)[None, :]
              + qs_hi[:, None] * (kb_hi * qk_scale)[None, :])
        o_n = base + o_c
        vis = (o_n < length)[None, :] & (o_n[None, :] <= q_pos[:, None])
        sc = gl.where(vis, sc, float("-inf"))

        # ---- online softmax, eager rescale (every tile)
        m_new = gl.maximum(m_i, gl.max(sc, 1))
        alpha = gl.where(m_new == float("-inf"), 1.0, gl.exp2(m_i - m_new))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sc - m_base[:, None])  # masked slots: exactly 0
        l_i = l_i * alpha + gl.sum(p, 1)
        bias_lo = bias_lo * alpha + gl.sum(p * vb_lo[None, :], 1)
        bias_hi = bias_hi * alpha + gl.sum(p * vb_hi[None, :], 1)
        v_top = gl.maximum(gl.max(vs_lo, 0), gl.max(vs_hi, 0))  # masked slots: scale 0
        t_new = gl.maximum(t_v, v_top)
        f = (alpha * (t_v / t_new))[:, None]
        inv_t = 1.0 / t_new
        t_v = t_new
        m_i = m_new
        p_lo = gl.convert_layout((p * (vs_lo * inv_t)[None, :]).to(gl.float16), a_l)
        p_hi = gl.convert_layout((p * (vs_hi * inv_t)[None, :]).to(gl.float16), a_l)
        if V_PAIRS:
            acc_a = mma_v2(p_lo, _centered(w_lo & 0xFF), acc_a * f)  # dims 2j
            acc_b = mma_v2(p_lo, _centered(w_lo >> 8), acc_b * f)    # dims 2j + 1
            acc_c = mma_v2(p_hi, _centered(w_hi & 0xFF), acc_c * f)  # dims D/2 + 2j
            acc_d = mma_v2(p_hi, _centered(w_hi >> 8), acc_d * f)    # dims D/2 + 2j + 1
        else:
            acc_a = mma_v2(p_lo, _centered(vc_lo), acc_a * f)
            acc_b = mma_v2(p_hi, _centered(vc_hi), acc_b * f)

    # ---- partials: PartO [B*H_kv, S, R, D], PartM / PartL [B*H_kv, S, R]
    row = (pid_bh.to(gl.int64) * num_splits + split) * n_rows + o_m
    m_row = o_m < n_rows
    gl.store(part_m + row, m_i, mask=m_row)
    gl.store(part_l + row, l_i, mask=m_row)
    p_o = part_o + row[:, None] * D
    if V_PAIRS:
        o_e = 2 * gl.arange(0, DQ, layout=col_l)[None, :]
        mo = m_row[:, None] & (o_e < D)
        gl.store(p_o + o_e, acc_a * t_v + bias_lo[:, None], mask=mo)
        gl.store(p_o + o_e + 1, acc_b * t_v + bias_lo[:, None], mask=mo)
        gl.store(p_o + DH + o_e, acc_c * t_v + bias_hi[:, None], mask=mo)
        gl.store(p_o + DH + o_e + 1, acc_d * t_v + bias_hi[:, None], mask=mo)
    else:
        o_d = gl.arange(0, DH, layout=col_l)[None, :]
        mo = m_row[:, None] & (o_d < DH)
        gl.store(p_o + o_d, acc_a * t_v + bias_lo[:, None], mask=mo)
        gl.store(p_o + DH + o_d, acc_b * t_v + bias_hi[:, None], mask=mo)


# ---- kernel ------------------------------------------------------------------------------------
@gluon.jit
def ws_decode_int8_kernel(
    q_ptr, part_o, part_m, part_l, kc, vc, ksw, kbw, vsw, vbw, lens,
    n_q, num_splits, n_kv_heads, qk_scale,
    s_qb, s_qh, s_ql, s_qd,
    s_kc_b, s_kc_h, s_vc_b, s_vc_h, s_km_b, s_km_h, s_vm_b, s_vm_h,
    G: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, BM: gl.constexpr,
    STAGES: gl.constexpr, MDT: gl.constexpr, V_PAIRS: gl.constexpr,
    NEW_REINT: gl.constexpr, WORKER_REGS: gl.constexpr,
):
    """Grid (B * H_kv, S). Code rows are D bytes (packed); metadata as uint32 words, one
    per slot ([B, H_kv, slots] words: the lo / hi half's fp16 or bf16 value)."""
    CW: gl.constexpr = gl.num_warps()
    pid_bh = gl.program_id(0)
    split = gl.program_id(1)
    b = (pid_bh // n_kv_heads).to(gl.int64)
    h = (pid_bh % n_kv_heads).to(gl.int64)
    length = gl.load(lens + b)
    n_tiles = gl.cdiv(length, BN)
    # tiles split, split + S, ... below n_tiles (both partitions derive the same count)
    n_my = gl.maximum(n_tiles - split + num_splits - 1, 0) // num_splits

    p_kc = kc + b * s_kc_b + h * s_kc_h
    p_vc = vc + b * s_vc_b + h * s_vc_h
    p_ksw = ksw + b * s_km_b + h * s_km_h
    p_kbw = kbw + b * s_km_b + h * s_km_h
    p_vsw = vsw + b * s_vm_b + h * s_vm_h
    p_vbw = vbw + b * s_vm_b + h * s_vm_h

    swz: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    w_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    k_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, D], swz)
    if V_PAIRS:  # reinterpreted as uint16 pairs: keep it unswizzled
        v_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, D], plain)
    else:
        v_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BN, D], swz)
    ks_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN], w_l)
    kb_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN], w_l)
    vs_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN], w_l)
    vb_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN], w_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=32)  # one .noinc cp.async arrival per producer lane
        mbarrier.init(empty.index(s), count=1)   # one arrival by the consumer partition
    _bar()  # inits visible to every warp before the partitions start

    gl.warp_specialize(
        [(_consumer, (q_ptr, part_o, part_m, part_l,
                      k_smem, v_smem, ks_smem, kb_smem, vs_smem, vb_smem, ready, empty,
                      pid_bh, b, h, split, num_splits, n_my, length, n_q, qk_scale,
                      s_qb, s_qh, s_ql, s_qd,
                      G, D, BN, BM, STAGES, CW, MDT, V_PAIRS, NEW_REINT)),
         (_producer, (p_kc, p_vc, p_ksw, p_kbw, p_vsw, p_vbw,
                      k_smem, v_smem, ks_smem, kb_smem, vs_smem, vb_smem, ready, empty,
                      split, num_splits, n_my, length, D, BN, STAGES))],
        [1],
        [WORKER_REGS],  # always an int: 3.6 requires worker_num_regs
    )


# ---- launcher ------------------------------------------------------------------------------
def _check(q: torch.Tensor, view) -> tuple[int, int]:
    from kvtax.formats import AffineFormat

    if q.dim() != 4 or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError("q must be [B, H_q, L, D] float16 / bfloat16")
    b, hq, n_q, d = q.shape
    for fmt in (view.spec.key, view.spec.value):
        if not (isinstance(fmt, AffineFormat) and fmt.n_bits == 8 and fmt.group_size == GROUP):
            raise ValueError(f"int8 K and V with group size {GROUP} only, got {view.spec}")
    if d != HEAD_DIM or view.head_dim != HEAD_DIM:
        raise ValueError(f"head_dim {HEAD_DIM} only")
    if view.ring or view.window is not None or view.sinks:
        raise ValueError("full caches only (no ring / window / sinks)")
    if view.spec.rotate_keys or view.spec.rotate_values:
        raise ValueError("rotated specs not handled")
    if hq % view.num_kv_heads or b != view.batch:
        raise ValueError("q does not match the cache")
    group = hq // view.num_kv_heads
    if group * n_q > BLOCK_M:
        raise ValueError(f"G * L = {group * n_q} > {BLOCK_M}")
    for qt in (view.k, view.v):
        if qt.codes.stride(-1) != 1 or qt.codes.stride(-2) != HEAD_DIM:
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


def default_splits(q: torch.Tensor, view, lengths_max: int, per_sm: int = 2) -> int:
    """Splits so that about per_sm CTAs (of 5 warps) run per SM; splits of >= 4 tiles."""
    sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
           if q.is_cuda else 132)
    bh = q.shape[0] * view.num_kv_heads
    tiles = triton.cdiv(max(lengths_max, 1), BLOCK_N)
    return max(1, min(per_sm * sms // bh, triton.cdiv(tiles, 4), 1024))


def ws_decode_int8(q: torch.Tensor, view, num_splits: int | None = None,
                   lengths: torch.Tensor | None = None, *, stages: int = 3,
                   worker_regs: int = 48, num_warps: int = 4, v_pairs: bool = False,
                   out: torch.Tensor | None = None, poison: bool = False,
                   maxnreg: int | None = None) -> torch.Tensor:
    """Attention of q [B, H_q, L, D] over an int8 (g64, D=128) FullCache view, through the
    warp-specialized split kernel and kvtax's reduce kernel. lengths: int32 [B] on q's
    device (default: view.length_t, else view.length for every row)."""
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
        num_splits = default_splits(q, view, capacity)
    kc, ks, kb = _parts(view.k)
    vc, vs, vb = _parts(view.v)
    ksw, kbw, vsw, vbw = _words(ks), _words(kb), _words(vs), _words(vb)
    rows = group * n_q
    fill = torch.full if poison else (lambda shape, v, **kw: torch.empty(shape, **kw))
    part_o = fill((b * h_kv, num_splits, rows, d), float("nan"), dtype=torch.float32,
                  device=q.device)
    part_m = fill((b * h_kv, num_splits, rows), float("nan"), dtype=torch.float32,
                  device=q.device)
    part_l = fill((b * h_kv, num_splits, rows), float("nan"), dtype=torch.float32,
                  device=q.device)
    if out is None:
        out = torch.empty_like(q)
    qk_scale = 1.4426950408889634 / math.sqrt(d)
    mdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    ws_decode_int8_kernel[(b * h_kv, num_splits)](
        q, part_o, part_m, part_l, kc, vc, ksw, kbw, vsw, vbw, lengths,
        n_q, num_splits, h_kv, qk_scale,
        *q.stride(),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        ksw.stride(0), ksw.stride(1), vsw.stride(0), vsw.stride(1),
        G=group, D=d, BN=BLOCK_N, BM=BLOCK_M, STAGES=stages, MDT=mdt, V_PAIRS=v_pairs,
        NEW_REINT=NEW_REINTERPRET, WORKER_REGS=int(worker_regs), num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": int(maxnreg)}),
    )
    # kvtax's merge, launched as triton_api._triton_attention does
    splits_pad = triton.next_power_of_2(num_splits)
    d_block = min(32, triton.next_power_of_2(d))
    _decode_attn_reduce_kernel[(b * h_kv, rows, triton.cdiv(d, d_block))](
        part_o, part_m, part_l, out, n_q, num_splits, h_kv, *out.stride()[:3],
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


def compile_check(v_pairs: bool, dtype: torch.dtype, worker_regs: int, stages: int,
                  n_q: int = 1, group: int = 4, dump: str | None = None,
                  maxnreg: int | None = None) -> None:
    import re

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import compile_check as cc
    from kvtax.cache import FullCache

    if not getattr(cc, "_ws_installed", False):  # install the fake driver once
        cc._compile_only(90)
        cc._ws_installed = True
    cc.COMPILED.clear()
    cache = FullCache("int8", capacity=300)
    cache.fused_store = False
    k = torch.randn(1, 2, 300, HEAD_DIM, dtype=dtype)
    cache.append(k, k)
    q = torch.randn(1, 2 * group, n_q, HEAD_DIM, dtype=dtype)
    lengths = torch.full((1,), 300, dtype=torch.int32)
    ws_decode_int8(q, cache.view(), num_splits=4, lengths=lengths, v_pairs=v_pairs,
                   worker_regs=worker_regs, stages=stages, maxnreg=maxnreg)
    for name, kern in cc.COMPILED:
        if name != "ws_decode_int8_kernel":
            continue
        sass = _sass(kern)
        ptx = kern.asm["ptx"]
        print(triton.__version__, f"v_pairs={v_pairs}", dtype, f"G={group} L={n_q}",
              f"wregs={worker_regs} stages={stages} maxnreg={maxnreg}", cc._resources(kern),
              "smem", kern.metadata.shared,
              "reqntid", (re.search(r"reqntid (\d+)", ptx) or [None, "?"])[1],
              "STL", sass.count("STL"), "LDL", sass.count("LDL"), "HMMA", sass.count("HMMA"),
              "LDSM", sass.count("LDSM"), "LDS.U8", sass.count("LDS.U8"),
              "LDGSTS", sass.count("LDGSTS"), "setmaxnreg", ptx.count("setmaxnreg"),
              "cp.async.mbarrier.arrive", ptx.count("cp.async.mbarrier.arrive"),
              "setmaxnreg values", sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx))),
              "maxnreg", (re.search(r"\.maxnreg (\d+)", ptx) or [None, "-"])[1])
        if dump:
            for ext in ("ttgir", "ptx"):
                with open(f"{dump}.{ext}", "w") as f:
                    f.write(kern.asm[ext])
            with open(f"{dump}.sass", "w") as f:
                f.write(sass)


def bench(reps: int = 20) -> None:
    """H200: ws_decode_int8 vs kvtax's default triton_attention (decode_warp), Llama-3.1-8B
    layer (32 q heads, 8 KV heads, D 128, batch 1, L 1), CUDA graphs, L2 flushed."""
    import itertools

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from timing import Timer

    from kvtax.attention.triton_api import triton_attention
    from kvtax.cache import FullCache

    timer = Timer(reps, dry=False)
    dtype = torch.bfloat16
    for ctx in (32768, 131072):
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
        print(f"ctx {ctx}: triton_attention {t_ref[0]:.4f} ms (p20 {t_ref[1]:.4f}, "
              f"p80 {t_ref[2]:.4f})", flush=True)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        # maxnreg None: 255 registers x 256 threads (4 consumer + 1 producer warps, padded
        # to 2 warp groups) = 1 CTA per SM; 128: 2 per SM (consumer setmaxnreg 208)
        for v_pairs, maxnreg, per_sm, stages in itertools.product(
                (False, True), (None, 128), (1, 2, 3, 4), (2, 3, 4)):
            splits = default_splits(q, view, cap, per_sm)

            def fn(q=q, v=view, s=splits, n=lengths, st=stages, vp=v_pairs, mr=maxnreg):
                return ws_decode_int8(q, v, s, n, stages=st, v_pairs=vp, maxnreg=mr)

            try:
                got = fn()
                torch.cuda.synchronize()
                err = (got.float() - ref.float()).abs().max().item()
                t = timer(fn)
            except Exception as e:  # noqa: BLE001
                print(f"  v_pairs={v_pairs} maxnreg={maxnreg} per_sm={per_sm} stages={stages}: "
                      f"{type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            print(f"  ws v_pairs={v_pairs} maxnreg={maxnreg} splits={splits} ({per_sm}/SM of "
                  f"{sms}) stages={stages}: {t[0]:.4f} ms (p20 {t[1]:.4f}, p80 {t[2]:.4f}) "
                  f"max|diff| vs triton {err:.2e}", flush=True)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="sm_90 compile-only check (no GPU)")
    ap.add_argument("--bench", action="store_true", help="time on the GPU at 32k / 128k")
    ap.add_argument("--v-pairs", action="store_true")
    ap.add_argument("--regs", type=int, default=48, help="producer setmaxnreg")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--dump", default=None, help="write ttgir / ptx / sass to this prefix")
    ap.add_argument("--maxnreg", type=int, default=None, help="kernel register cap (occupancy)")
    a = ap.parse_args()
    if a.bench:
        bench()
    else:
        for dtype in (torch.float16, torch.bfloat16):
            for group, n_q in ((4, 1), (8, 2)):
                compile_check(a.v_pairs, dtype, a.regs, a.stages, n_q=n_q, group=group,
                              dump=a.dump, maxnreg=a.maxnreg)


if __name__ == "__main__":
    main()
