"""Single-warp split-KV decode over quantized K/V with the scales folded out of the tiles.

Same grid, arguments and partial outputs as `decode.py` (`(B * H_kv, num_splits)`
programs; `reduce.py` merges them), built for what decode is: 1..16 query rows against a
long cache, where the work per byte read must be tiny for the read to stay the limit.

Why one warp per program: with 4 warps the slots of a tile were spread over the warps,
so every tile paid a cross-warp max/sum through shared memory, a barrier, and a shared
memory round trip for P; a program of one warp keeps the whole online softmax in its
registers (the score tile's row reductions are quad shuffles), and the SM instead runs
many independent programs, which is what hides DRAM latency.

Why folded scales: with one scale group per half row (group size >= D/2) and fp8's one
scale per row, dequantization moves off the K/V elements and onto the tiny score tile:
    q . (s c + b)  = s (q . c) + b sum(q)               (K, per half)
    P (s c + b)    = (P * s) c + P b                    (V, per half)
so each code only becomes an fp16 number. Codes are centered (int8: c - 128, int4:
c - 8) with the offset moved into the bias, so the MMA inputs are small exact integers
and nothing large cancels in the float32 accumulator. `P * s` is taken relative to the
tile's largest scale so the fp16 operand keeps its precision.

Formats: 0 float (the cache dtype is fed to the dots as is), 1 int8, 2 int4 (split
halves), 3 fp8 e4m3 (codes passed as uint8), 4 int4-c64 keys (per-channel scales of a
64-slot block: folded into the queries, `_block_scores`), 7 int4w-c64 keys (code 4 in a
stored channel order, the queries loaded through it, plus fifth bits in the low nibbles'
codes, kernels/widest.py). Integer formats need group
size >= D/2 and a power-of-two head dim; the wrapper routes other shapes to `decode.py`.

HAS_MIN_DIST (constexpr, off by default) hides keys closer than `min_dist` to the query
or before `min_key` (one part of a hybrid cache); tiles every row still sees whole keep
the unmasked path.
"""

import triton
import triton.language as tl

from kvtax.attention.kernels.common import (
    dot_acc, head_pointers, pdl_enter, pdl_exit, sequence_of, tanh, visible, window_runs,
)
from kvtax.attention.kernels.dequant import half_dims
from kvtax.attention.kernels.warp_tiles import (
    block_meta, tile_meta, tile_operands, v_pair_operands,
)


@triton.jit
def _vmax(vs_lo, vs_hi, FMT: tl.constexpr):
    """Largest V scale of a tile (0 for float formats, which have none)."""
    if FMT == 0:
        x = 0.0
    else:
        x = tl.maximum(tl.max(vs_lo, 0), tl.max(vs_hi, 0))
    return x


@triton.jit
def _pv(acc, p, v, scale, inv_t, DT: tl.constexpr, FMT: tl.constexpr, IEEE: tl.constexpr):
    """acc + P @ v for float V, acc + (P * scale / T) @ codes for quantized V (the biases
    are summed separately; `inv_t` = 1 / T, see the kernel)."""
    if FMT == 0:
        acc = dot_acc(p.to(DT), v, acc, IEEE)
    else:
        acc = dot_acc((p * (scale * inv_t)[None, :]).to(DT), v, acc, IEEE)
    return acc


@triton.jit
def _block_scores(q_lo, q_hi, k_lo, k_hi, p_ks, p_kb, start, zeros_s, qk_scale,
                  HEAD_DIM: tl.constexpr, K_DT: tl.constexpr, IEEE: tl.constexpr):
    """Scaled scores `[BLOCK_M, BLOCK_N]` of int4-c64 keys (centered codes k_lo, k_hi):
    q.(s (c - 8) + b + 8 s) = (q * s).(c - 8) + q.(b + 8 s), per channel of the tile's
    block. Scaling the 16 query rows is cheaper than scaling the 32 key rows, and the
    centered codes keep the rounded q * s from meeting any large offset. int4w-c64 keys
    alike: 5-bit codes, queries and metadata in its stored channel order."""
    s_lo, b_lo, s_hi, b_hi = block_meta(p_ks, p_kb, start, HEAD_DIM)
    qs_lo = (q_lo.to(tl.float32) * s_lo).to(K_DT)
    qs_hi = (q_hi.to(tl.float32) * s_hi).to(K_DT)
    s = dot_acc(qs_hi, tl.trans(k_hi), dot_acc(qs_lo, tl.trans(k_lo), zeros_s, IEEE), IEEE)
    qb = tl.sum(q_lo.to(tl.float32) * b_lo, 1) + tl.sum(q_hi.to(tl.float32) * b_hi, 1)
    return (s + qb[:, None]) * qk_scale


@triton.jit
def _rescale(acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v, m_tile, v_top,
             V_PAIRS: tl.constexpr):
    """Move the running max to include `m_tile` and the V scale reference to include
    `v_top`, rescaling the accumulators, bias sums and denominators to match."""
    m_new = tl.maximum(m_i, m_tile)
    # a row that has seen no visible key keeps m = -inf: rescale by 1, not NaN
    alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp2(m_i - m_new))
    t_new = tl.maximum(t_v, v_top)
    f = (alpha * (t_v / t_new))[:, None]
    acc_lo = acc_lo * f
    acc_hi = acc_hi * f
    if V_PAIRS:
        acc_c = acc_c * f
        acc_d = acc_d * f
    return (acc_lo, acc_hi, acc_c, acc_d, bias_lo * alpha, bias_hi * alpha, m_new, l_i * alpha,
            t_new)


@triton.jit
def _step(acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v,
          vs_lo, vb_lo, vs_hi, vb_hi, q_lo, q_hi, qs_lo, qs_hi, q_pos, start, step, hi,
          length, kv0, p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc, s_km, s_vc, s_vm,
          sinks, ring, window, qk_scale, cap_log2, HEAD_DIM: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          K_FMT: tl.constexpr, K_NG: tl.constexpr, V_FMT: tl.constexpr, V_NG: tl.constexpr,
          K_DT: tl.constexpr, V_DT: tl.constexpr, MASKED: tl.constexpr,
          IS_RING: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
          IEEE: tl.constexpr, HAS_KV_START: tl.constexpr, ASM: tl.constexpr,
          V_PAIRS: tl.constexpr, min_dist, min_key, HAS_MIN_DIST: tl.constexpr):
    """One online-softmax step over slots `[start, start + BLOCK_N)` (see the kernel).

    State: acc_lo/acc_hi `[BLOCK_M, D/2]` f32 in units of t_v (V_PAIRS: acc_lo, acc_hi,
    acc_c, acc_d `[BLOCK_M, D/4]` for `v_pair_operands`' four dim sets), bias_lo/bias_hi
    `[BLOCK_M]` (sum of P * V bias), m_i/l_i `[BLOCK_M]` (base 2), t_v the V scale
    reference, vs_lo..vb_hi this tile's V scales and biases (`tile_meta`; the step returns
    the next tile's, `start + step`, loaded at its start). q_lo/q_hi the K operands'
    queries (int4w-c64: in its stored channel order), qs_lo/qs_hi their row sums.
    MASKED=False: every row sees every slot of the tile.

    Why the V metadata is prefetched by hand: Triton's pipeliner staged the codes and the
    K metadata through cp.async but left one V metadata load inside the iteration that
    needs it, and Nsight Compute showed 31% of the warps' stall cycles waiting on it
    (H200, int8 at 128k, docs/KERNELS.md).

    Over 80 lines: one step's loads, scores, masks, softmax and P @ V share ~20 values
    that a split would thread through helpers of as many arguments.
    """
    o_next = start + step + tl.arange(0, BLOCK_N)
    nvs_lo, nvb_lo, nvs_hi, nvb_hi = tile_meta(p_vs, p_vb, start + step, o_next < hi, s_vm,
                                           BLOCK_N, V_FMT, V_NG)
    o_n = start + tl.arange(0, BLOCK_N)  # int32: slot counts stay below 2^31
    if MASKED:
        m_n = o_n < hi
    else:
        m_n = None
    k_lo, k_hi = tile_operands(p_kc, o_n, m_n, s_kc, HEAD_DIM, K_FMT, K_DT, ASM)
    ks_lo, kb_lo, ks_hi, kb_hi = tile_meta(p_ks, p_kb, start, m_n, s_km, BLOCK_N, K_FMT, K_NG)
    zeros_s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if K_FMT == 4 or K_FMT == 7:  # tile_meta gave zeros: the scales are per channel of
        # a block
        s = _block_scores(q_lo, q_hi, k_lo, k_hi, p_ks, p_kb, start, zeros_s, qk_scale,
                          HEAD_DIM, K_DT, IEEE)
    elif K_FMT == 0:
        s = dot_acc(q_hi, tl.trans(k_hi), dot_acc(q_lo, tl.trans(k_lo), zeros_s, IEEE), IEEE)
        s = s * qk_scale
    elif K_FMT == 3 or K_NG == 1:  # one scale per row: one accumulator for both halves
        s = dot_acc(q_hi, tl.trans(k_hi), dot_acc(q_lo, tl.trans(k_lo), zeros_s, IEEE), IEEE)
        s = s * (ks_lo * qk_scale)[None, :]
        if K_FMT != 3:
            s += (qs_lo + qs_hi)[:, None] * (kb_lo * qk_scale)[None, :]
    else:
        s = dot_acc(q_lo, tl.trans(k_lo), zeros_s, IEEE) * (ks_lo * qk_scale)[None, :]
        s += dot_acc(q_hi, tl.trans(k_hi), zeros_s, IEEE) * (ks_hi * qk_scale)[None, :]
        s += qs_lo[:, None] * (kb_lo * qk_scale)[None, :]
        s += qs_hi[:, None] * (kb_hi * qk_scale)[None, :]
    if SOFTCAP:
        s = cap_log2 * tanh(s)
    if MASKED:  # padded rows (q = 0) see finite zeros and are never stored
        vis = visible(o_n, m_n, q_pos, length, kv0, sinks, ring, window, IS_RING, HAS_WINDOW,
                      HAS_KV_START, min_dist, min_key, HAS_MIN_DIST)
        s = tl.where(vis, s, float("-inf"))
    # Lazy rescaling: the running max moves (and acc, l are rescaled) only when some
    # row's max grew by more than 2^8, or this tile's V scales outgrew t_v by 2^6;
    # otherwise P may reach 2^8 and P * s / t_v 2^14, both well inside fp16. Most tiles
    # of a long decode take neither branch and skip the [rows, D] multiplies.
    m_tile = tl.max(s, 1)
    v_top = _vmax(vs_lo, vs_hi, V_FMT)
    grow = tl.max((m_tile > m_i + 8.0).to(tl.int32), 0) > 0
    if grow or v_top > t_v * 64.0:
        (acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v) = _rescale(
            acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v, m_tile, v_top,
            V_PAIRS)
    m_base = tl.where(m_i == float("-inf"), 0.0, m_i)
    p = tl.exp2(s - m_base[:, None])
    l_i += tl.sum(p, 1)
    inv_t = 1.0 / t_v
    if V_PAIRS:
        v_a, v_b, v_c, v_d = v_pair_operands(p_vc, o_n, m_n, s_vc, HEAD_DIM, V_FMT, V_DT, ASM)
        p_lo = (p * (vs_lo * inv_t)[None, :]).to(V_DT)
        p_hi = (p * (vs_hi * inv_t)[None, :]).to(V_DT)
        acc_lo = dot_acc(p_lo, v_a, acc_lo, IEEE)
        acc_hi = dot_acc(p_lo, v_b, acc_hi, IEEE)
        acc_c = dot_acc(p_hi, v_c, acc_c, IEEE)
        acc_d = dot_acc(p_hi, v_d, acc_d, IEEE)
    else:
        v_lo, v_hi = tile_operands(p_vc, o_n, m_n, s_vc, HEAD_DIM, V_FMT, V_DT, ASM)
        acc_lo = _pv(acc_lo, p, v_lo, vs_lo, inv_t, V_DT, V_FMT, IEEE)
        acc_hi = _pv(acc_hi, p, v_hi, vs_hi, inv_t, V_DT, V_FMT, IEEE)
    if V_FMT == 1 or V_FMT == 2:
        bias_lo += tl.sum(p * vb_lo[None, :], 1)
        if V_NG == 1:
            bias_hi = bias_lo
        else:
            bias_hi += tl.sum(p * vb_hi[None, :], 1)
    return (acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v,
            nvs_lo, nvb_lo, nvs_hi, nvb_hi)


@triton.jit
def _first(x, off, step):
    """The first of the tiles off, off + step, off + 2 step, ... at or past slot x."""
    return off + tl.cdiv(tl.maximum(x - off, 0), step) * step


@triton.jit(do_not_specialize=["length_host", "n_q", "num_splits", "split_base",
                             "splits_total"])
def decode_warp_kernel(
    Q, PartO, PartM, PartL, Kc, Ks, Kb, Vc, Vs, Vb, Lens, KvStart,
    length_host, n_q, num_splits, n_kv_heads, sinks, ring, window, qk_scale, cap_log2,
    s_qb, s_qh, s_ql, s_qd,
    s_kc_b, s_kc_h, s_kc_t, s_km_b, s_km_h, s_km_t,
    s_vc_b, s_vc_h, s_vc_t, s_vm_b, s_vm_h, s_vm_t,
    min_dist, min_key, split_base, splits_total,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_NG: tl.constexpr, V_FMT: tl.constexpr, V_NG: tl.constexpr,
    K_DT: tl.constexpr, V_DT: tl.constexpr,
    IS_RING: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_LENS: tl.constexpr, IEEE: tl.constexpr, HAS_KV_START: tl.constexpr,
    ASM: tl.constexpr, V_PAIRS: tl.constexpr, HAS_MIN_DIST: tl.constexpr,
    PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False,
):
    """Grid (B * H_kv, S), one warp: partials PartO / PartM / PartL as decode.py's, this
    launch's S splits in slots `[split_base, split_base + S)` of a workspace holding
    `splits_total` per row (several launches may share one reduce: a hybrid cache's parts).

    Over 80 lines: the prologue, the loop over runs of tiles (masked or not) and the epilogue
    share one register state; the per-tile work is `_step`.
    """
    pdl_enter(PDL, PDL_LATE, False)
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b, h, length, num_slots, kv0 = sequence_of(
        pid_bh, n_kv_heads, Lens, KvStart, length_host, sinks, ring, IS_RING, HAS_LENS,
        HAS_KV_START)
    # split s takes tiles s, s + S, s + 2S, ...: the programs sweep the cache together
    # (10% faster to read at 128k than one contiguous run per split, docs/KERNELS.md)
    lo = 0
    hi = num_slots
    off = split * BLOCK_N
    step = num_splits * BLOCK_N

    DH: tl.constexpr = HEAD_DIM // 2
    n_rows = G * n_q
    o_m = tl.arange(0, BLOCK_M)
    o_l = o_m // G
    m_row = o_m < n_rows
    q_pos = length - n_q + o_l
    p_kc, p_ks, p_kb, p_vc, p_vs, p_vb = head_pointers(
        Kc, Ks, Kb, Vc, Vs, Vb, b, h, s_kc_b, s_kc_h, s_km_b, s_km_h, s_vc_b, s_vc_h, s_vm_b,
        s_vm_h)
    d_lo, d_hi = half_dims(p_kc, s_kc_t, HEAD_DIM, DH, K_FMT)  # int4w-c64: its stored order
    p_q = Q + b * s_qb + (h * G + o_m % G)[:, None] * s_qh + o_l.to(tl.int64)[:, None] * s_ql
    q_lo = tl.load(p_q + d_lo[None, :] * s_qd, mask=m_row[:, None], other=0.0).to(K_DT)
    q_hi = tl.load(p_q + d_hi[None, :] * s_qd, mask=m_row[:, None], other=0.0).to(K_DT)
    # sum(q) per half, of the operand the dots see, for the folded K biases
    qs_lo = tl.sum(q_lo.to(tl.float32), 1)
    qs_hi = tl.sum(q_hi.to(tl.float32), 1)

    if V_PAIRS:  # dims 2j, 2j + 1, D/2 + 2j, D/2 + 2j + 1 (see v_pair_operands)
        acc_lo = tl.zeros([BLOCK_M, HEAD_DIM // 4], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, HEAD_DIM // 4], dtype=tl.float32)
        acc_c = tl.zeros([BLOCK_M, HEAD_DIM // 4], dtype=tl.float32)
        acc_d = tl.zeros([BLOCK_M, HEAD_DIM // 4], dtype=tl.float32)
    else:
        acc_lo = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
        acc_c = 0.0
        acc_d = 0.0
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bias_lo = tl.zeros([BLOCK_M], dtype=tl.float32)
    bias_hi = tl.zeros([BLOCK_M], dtype=tl.float32)
    # quantized V: acc holds P @ (V / t_v) so the fp16 operand P * s / t_v stays in range
    t_v = 1e-30
    # tiles every row sees whole run without any mask (plain wide loads, no compares);
    # the causal edge, the split's ragged end, rings, windows and padding run masked
    if IS_RING or HAS_WINDOW or HAS_KV_START:
        full_end = lo
    else:
        full_end = tl.maximum(lo, tl.minimum(hi, ((length - n_q + 1) // BLOCK_N) * BLOCK_N))
    full_lo = lo
    if HAS_MIN_DIST:  # one part of a hybrid cache: keys [min_key, q - min_dist]
        if not (IS_RING or HAS_WINDOW or HAS_KV_START):
            full_lo = tl.maximum(lo, tl.minimum(hi, tl.cdiv(min_key, BLOCK_N) * BLOCK_N))
            last = tl.maximum(length - n_q + 1 - min_dist, 0) // BLOCK_N * BLOCK_N
            full_end = tl.maximum(full_lo, tl.minimum(hi, last))
            hi = tl.maximum(full_end, tl.minimum(hi, length - min_dist))  # skip unseen tiles
    # a ring read through a window: only the sinks and the window's slots (<= 2 runs)
    a_hi, b_lo, b_hi = hi, hi, hi
    if IS_RING and HAS_WINDOW:
        a_hi, b_lo, b_hi = window_runs(length, n_q, num_slots, sinks, ring, window, BLOCK_N)
    # every loop walks this split's tiles off, off + step, ... from its first one past a
    # bound, so the V metadata prefetched for `start + step` is always the next tile's
    first = _first(lo, off, step)
    vs_lo, vb_lo, vs_hi, vb_hi = tile_meta(p_vs, p_vb, first,
                                       (first + tl.arange(0, BLOCK_N)) < hi, s_vm_t, BLOCK_N,
                                       V_FMT, V_NG)
    # runs of tiles, each walked by one loop: 0 the hybrid body's masked head [lo, full_lo),
    # 1 the unmasked middle [full_lo, full_end), 2 the masked tail [full_end, a_hi), 3 a
    # windowed ring's second run [b_lo, b_hi); `hi` / a_hi / b_hi bound the valid slots
    for run in tl.static_range(4):
        if (run != 0 or HAS_MIN_DIST) and (run != 3 or (IS_RING and HAS_WINDOW)):
            if run == 0:
                run_lo = lo
                run_hi = full_lo
                valid = hi
            elif run == 1:
                run_lo = full_lo
                run_hi = full_end
                valid = hi
            elif run == 2:
                run_lo = full_end
                run_hi = a_hi
                valid = a_hi
            else:  # its first tile's metadata anew: this run does not follow the last
                run_lo = b_lo
                run_hi = b_hi
                valid = b_hi
                first = _first(b_lo, off, step)
                vs_lo, vb_lo, vs_hi, vb_hi = tile_meta(
                    p_vs, p_vb, first, (first + tl.arange(0, BLOCK_N)) < b_hi, s_vm_t,
                    BLOCK_N, V_FMT, V_NG)
            for start in range(_first(run_lo, off, step), run_hi, step):
                (acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v,
                 vs_lo, vb_lo, vs_hi, vb_hi) = _step(
                    acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v,
                    vs_lo, vb_lo, vs_hi, vb_hi, q_lo, q_hi, qs_lo, qs_hi, q_pos, start,
                    step, valid, length, kv0,
                    p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc_t, s_km_t, s_vc_t, s_vm_t,
                    sinks, ring, window, qk_scale, cap_log2, HEAD_DIM, BLOCK_M, BLOCK_N,
                    K_FMT, K_NG, V_FMT, V_NG, K_DT, V_DT, run != 1, IS_RING, HAS_WINDOW,
                    SOFTCAP, IEEE, HAS_KV_START, ASM, V_PAIRS, min_dist, min_key,
                    HAS_MIN_DIST)

    # partials: PartO [B*H_kv, splits_total, R, D], PartM / PartL [B*H_kv, splits_total, R]
    row = (pid_bh.to(tl.int64) * splits_total + split_base + split) * n_rows + o_m
    tl.store(PartM + row, m_i, mask=m_row)
    tl.store(PartL + row, l_i, mask=m_row)
    p_o = PartO + row[:, None] * HEAD_DIM
    if V_PAIRS:
        o_e = 2 * tl.arange(0, HEAD_DIM // 4)[None, :]
        tl.store(p_o + o_e, acc_lo * t_v + bias_lo[:, None], mask=m_row[:, None])
        tl.store(p_o + o_e + 1, acc_hi * t_v + bias_lo[:, None], mask=m_row[:, None])
        tl.store(p_o + DH + o_e, acc_c * t_v + bias_hi[:, None], mask=m_row[:, None])
        tl.store(p_o + DH + o_e + 1, acc_d * t_v + bias_hi[:, None], mask=m_row[:, None])
    else:
        if V_FMT != 0:
            acc_lo = acc_lo * t_v + bias_lo[:, None]
            acc_hi = acc_hi * t_v + bias_hi[:, None]
        o_d = tl.arange(0, DH)
        tl.store(p_o + o_d[None, :], acc_lo, mask=m_row[:, None])
        tl.store(p_o + (o_d + DH)[None, :], acc_hi, mask=m_row[:, None])
    pdl_exit(PDL, PDL_LATE, False)
