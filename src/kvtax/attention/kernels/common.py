"""Pieces shared by the prefill and decode kernels: slot positions and one attention step.

Softmax runs in base 2: scores are scaled by `qk_scale = scale * log2(e)` (or by
`scale / softcap` followed by `softcap * log2(e) * tanh(.)` when soft-capping), so the
exponentials are `exp2`.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvtax.attention.kernels.dequant import (
    code_offset, half_dims, load_block_meta, load_codes, load_kv_tile, load_meta,
)


@triton.jit
def pdl_enter(PDL: tl.constexpr, LATE: tl.constexpr, BESIDE: tl.constexpr):
    """With PDL (kvtax.pdl): let the next kernel launch (unless LATE: see pdl_exit), then
    wait for the kernels before this one to finish, before any memory access (they wrote
    q, the new K/V slot, the length; and read the partials this kernel overwrites).

    BESIDE (a hybrid cache's later part, `launch.launch_parts_decode`): the kernel before
    this one was launched normally and let it launch first thing, so everything this
    kernel reads was complete before it could start, and the two write disjoint splits.
    It runs beside that kernel instead of after it; its wait moves to pdl_exit."""
    if PDL:
        if not LATE:
            gdc_launch_dependents()
        if not BESIDE:
            gdc_wait()


@triton.jit
def pdl_exit(PDL: tl.constexpr, LATE: tl.constexpr, BESIDE: tl.constexpr):
    """With PDL and LATE: let the next kernel launch once this program's work is done (its
    programs then wait beside this kernel's last ones only, not beside all of them).
    BESIDE: wait for the kernel before this one here, so this kernel completes only after
    it (the reduce after both waits for this one alone)."""
    if PDL:
        if BESIDE:
            gdc_wait()
        if LATE:
            gdc_launch_dependents()


@triton.jit
def num_slots_of(length, sinks, ring, IS_RING: tl.constexpr):
    """Slots holding valid tokens for a sequence of `length` (see CacheView.num_slots)."""
    if IS_RING:
        n = tl.minimum(length, sinks) + tl.minimum(tl.maximum(length - sinks, 0), ring)
    else:
        n = length
    return n


@triton.jit
def window_runs(length, n_q, num_slots, sinks, ring, window, BLOCK_N: tl.constexpr):
    """(a_hi, b_lo, b_hi): tile-aligned slot runs [0, a_hi) and [b_lo, b_hi), disjoint,
    that hold every slot a ring read through `window` shows to the last n_q queries: the
    sinks, the window's slots that wrapped to the ring's start, and its slots before the
    ring's end. Why: a ring holds a prefill chunk's worth past its window (a hybrid cache's
    fp16 part: 2,180 slots for a 128-token window), and a decode reads ~5 tiles of them.
    A held position p sits in slot sinks + (p - sinks) % ring whatever the cache's length,
    so a prefill program passes its last query + 1 and its query positions' count."""
    t0 = tl.maximum(sinks, length - n_q - window + 1)  # the oldest visible ring position
    count = tl.maximum(length - t0, 0)
    s0 = sinks + (t0 - sinks) % ring
    end = s0 + count  # past sinks + ring where the window wraps
    wrapped = tl.maximum(end - (sinks + ring), 0)
    a_hi = tl.minimum(tl.cdiv(sinks + wrapped, BLOCK_N) * BLOCK_N, num_slots)
    b_hi = tl.minimum(tl.cdiv(tl.minimum(end, sinks + ring), BLOCK_N) * BLOCK_N, num_slots)
    b_lo = tl.minimum(tl.maximum(a_hi, s0 // BLOCK_N * BLOCK_N), b_hi)
    return a_hi, b_lo, b_hi


@triton.jit
def sequence_of(pid_bh, n_kv_heads, Lens, KvStart, length_host, sinks, ring,
                IS_RING: tl.constexpr, HAS_LENS: tl.constexpr, HAS_KV_START: tl.constexpr):
    """(b, h, length, num_slots, kv0) of the program row `pid_bh` = b * H_kv + h: its
    length (from the device tensor `Lens` when given, so one CUDA graph serves every
    step), the slots to scan, and its first valid key position (left padding)."""
    b = (pid_bh // n_kv_heads).to(tl.int64)
    h = (pid_bh % n_kv_heads).to(tl.int64)
    if HAS_LENS:
        length = tl.load(Lens + b)
    else:
        length = length_host
    num_slots = num_slots_of(length, sinks, ring, IS_RING)
    if HAS_KV_START:  # left padding: this row's keys start here
        kv0 = tl.load(KvStart + b)
    else:
        kv0 = 0
    return b, h, length, num_slots, kv0


@triton.jit
def split_range(num_slots, split, num_splits, BLOCK_N: tl.constexpr):
    """Slots `[lo, hi)` of a split-KV program: equal shares of whole tiles; trailing
    splits may be empty (they write m = -inf, l = 0)."""
    chunk = tl.cdiv(tl.cdiv(num_slots, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    return lo, tl.minimum(lo + chunk, num_slots)


@triton.jit
def visible(o_n, m_n, q_pos, length, kv0, sinks, ring, window, IS_RING: tl.constexpr,
            HAS_WINDOW: tl.constexpr, HAS_KV_START: tl.constexpr,
            min_dist, min_key, HAS_MIN_DIST: tl.constexpr):
    """`[rows, slots]` mask of the keys in slots `o_n` (valid where `m_n`) that queries at
    `q_pos` see: causal, the window (plus sinks), and not before `kv0`. HAS_MIN_DIST
    (one part of a hybrid cache, kvtax.attention.lse): also only keys at least
    `min_dist` behind the query and at positions >= `min_key`."""
    k_pos = slot_positions(o_n, length, sinks, ring, IS_RING)
    vis = m_n[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        vis = vis & (((q_pos[:, None] - k_pos[None, :]) < window) | (k_pos[None, :] < sinks))
    if HAS_KV_START:
        vis = vis & (k_pos[None, :] >= kv0)
    if HAS_MIN_DIST:
        vis = vis & ((q_pos[:, None] - k_pos[None, :]) >= min_dist) & (k_pos[None, :] >= min_key)
    return vis


@triton.jit
def slot_positions(o_n, length, sinks, ring, IS_RING: tl.constexpr):
    """Logical position of each slot in `o_n` (CacheView's slot map; valid slots only)."""
    if IS_RING:
        n_ring = length - sinks
        # for valid ring slots (n_ring - 1) - (o_n - sinks) >= 0, so % needs no sign care
        t = (n_ring - 1) - ((n_ring - 1 - (o_n - sinks)) % ring)
        pos = tl.where(o_n < sinks, o_n, sinks + t)
    else:
        pos = o_n
    return pos


@triton.jit
def tanh(x):
    """tanh from exp2, saturating cleanly to ±1 for large |x| (no libdevice needed)."""
    e = tl.exp2(x * 2.8853900817779268)  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def tile_meta(p_ks, p_kb, p_vs, p_vb, start, num_slots, s_km, s_vm,
              HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
              K_FMT: tl.constexpr, K_GS: tl.constexpr, V_FMT: tl.constexpr,
              V_GS: tl.constexpr):
    """K and V scales/biases of the tile at `start` (8 tensors, see `load_meta`; int4-c64,
    int3-c64 and int4w-c64 keys: `load_block_meta`'s per-block vectors)."""
    o_n = start + tl.arange(0, BLOCK_N)
    m_n = o_n < num_slots
    o_t = o_n.to(tl.int64)
    if K_FMT == 4 or K_FMT == 5 or K_FMT == 7:
        ks_lo, kb_lo, ks_hi, kb_hi = load_block_meta(p_ks, p_kb, start, num_slots, HEAD_DIM,
                                                     BLOCK_N)
    else:
        ks_lo, kb_lo, ks_hi, kb_hi = load_meta(p_ks, p_kb, o_t, m_n, s_km, HEAD_DIM, HALF,
                                               BLOCK_N, K_FMT, K_GS)
    vs_lo, vb_lo, vs_hi, vb_hi = load_meta(p_vs, p_vb, o_t, m_n, s_vm, HEAD_DIM, HALF,
                                           BLOCK_N, V_FMT, V_GS)
    return ks_lo, kb_lo, ks_hi, kb_hi, vs_lo, vb_lo, vs_hi, vb_hi


@triton.jit
def attn_step(acc_lo, acc_hi, m_i, l_i, q_lo, q_hi, q_pos, start, num_slots, length, kv0,
              p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc, s_km, s_vc, s_vm,
              ks_lo, kb_lo, ks_hi, kb_hi, vs_lo, vb_lo, vs_hi, vb_hi,
              sinks, ring, window, qk_scale, cap_log2,
              HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
              K_FMT: tl.constexpr, K_GS: tl.constexpr, V_FMT: tl.constexpr,
              V_GS: tl.constexpr, MASKED: tl.constexpr, IS_RING: tl.constexpr,
              HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
              FOLD_K: tl.constexpr, FOLD_V: tl.constexpr,
              HAS_KV_START: tl.constexpr, min_dist, min_key, HAS_MIN_DIST: tl.constexpr):
    """One online-softmax step over slots `[start, start + BLOCK_N)`.

    acc_lo/acc_hi `[BLOCK_M, HALF]` f32, m_i/l_i `[BLOCK_M]` f32 (base-2 running max and
    denominator), q_lo/q_hi `[BLOCK_M, HALF]`, q_pos `[BLOCK_M]` query positions;
    ks_lo..vb_hi: this tile's scales/biases (`tile_meta`). Returns the updated state and
    the next tile's scales/biases, fetched first so their latency overlaps this tile.
    MASKED=False is for tiles every row sees whole (no causal, window, ring or padding
    masking); with HAS_KV_START keys at positions < kv0 (left padding) are hidden, with
    HAS_MIN_DIST keys closer than `min_dist` to the query or before `min_key`.
    FOLD_K / FOLD_V (decode, one scale group per half): feed raw codes to the dots and
    apply scales and biases to the few score / output rows instead of every K/V element.

    Over 80 lines: one step's loads, scores, masks, softmax and P @ V share ~20 values
    that a split would thread through helpers of as many arguments.
    """
    nk_s_lo, nk_b_lo, nk_s_hi, nk_b_hi, nv_s_lo, nv_b_lo, nv_s_hi, nv_b_hi = tile_meta(
        p_ks, p_kb, p_vs, p_vb, start + BLOCK_N, num_slots, s_km, s_vm,
        HEAD_DIM, HALF, BLOCK_N, K_FMT, K_GS, V_FMT, V_GS)
    dtype = q_lo.dtype
    o_n = start + tl.arange(0, BLOCK_N)
    m_n = o_n < num_slots
    o_t = o_n.to(tl.int64)
    if FOLD_K and (K_FMT == 4 or K_FMT == 5 or K_FMT == 7):
        s = _fold_qk_blocks(q_lo, q_hi, p_kc, o_t, m_n, s_kc, ks_lo, kb_lo, ks_hi, kb_hi,
                            HEAD_DIM, HALF, K_FMT, IEEE)
    elif FOLD_K:
        # q.(s*c + b) per half = s * (q.c) + b * sum(q); codes may carry an offset
        c_lo, c_hi = load_codes(p_kc, o_t, m_n, s_kc, HEAD_DIM, HALF, K_FMT, dtype)
        s = _dot(q_lo, tl.trans(c_lo), IEEE) * _row(ks_lo)[None, :]
        if K_FMT == 3:
            s += _dot(q_hi, tl.trans(c_hi), IEEE) * _row(ks_lo)[None, :]
        else:
            off = code_offset(K_FMT, dtype)
            s += _dot(q_hi, tl.trans(c_hi), IEEE) * _row(ks_hi)[None, :]
            qs_lo = tl.sum(q_lo.to(tl.float32), 1)
            qs_hi = tl.sum(q_hi.to(tl.float32), 1)
            s += qs_lo[:, None] * (_row(kb_lo) - off * _row(ks_lo))[None, :]
            s += qs_hi[:, None] * (_row(kb_hi) - off * _row(ks_hi))[None, :]
    else:
        k_lo, k_hi = load_kv_tile(p_kc, p_ks, p_kb, o_t, m_n, s_kc, s_km,
                                  ks_lo, kb_lo, ks_hi, kb_hi,
                                  HEAD_DIM, HALF, BLOCK_N, K_FMT, K_GS, dtype)
        s = _dot(q_lo, tl.trans(k_lo), IEEE)
        s = dot_acc(q_hi, tl.trans(k_hi), s, IEEE)  # [BLOCK_M, BLOCK_N]
    s = s * qk_scale
    if SOFTCAP:
        s = cap_log2 * tanh(s)
    if MASKED:
        vis = visible(o_n, m_n, q_pos, length, kv0, sinks, ring, window, IS_RING, HAS_WINDOW,
                      HAS_KV_START, min_dist, min_key, HAS_MIN_DIST)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen no visible key yet keeps m = -inf; subtract 0 instead of -inf
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FOLD_V:
        # P.(s*c + b) = (P*s).c + P.b; P*s is taken relative to the tile's largest scale
        # so the fp16 operand stays in range, and the offset comes off via sum(P*s)
        c_lo, c_hi = load_codes(p_vc, o_t, m_n, s_vc, HEAD_DIM, HALF, V_FMT, dtype)
        acc_lo = _fold_pv(acc_lo, alpha, p, c_lo, _row(vs_lo), _row(vb_lo), V_FMT, dtype, IEEE)
        if V_FMT == 3:  # one scale per row: s_lo serves both halves
            acc_hi = _fold_pv(acc_hi, alpha, p, c_hi, _row(vs_lo), _row(vb_lo), V_FMT, dtype,
                              IEEE)
        else:
            acc_hi = _fold_pv(acc_hi, alpha, p, c_hi, _row(vs_hi), _row(vb_hi), V_FMT, dtype,
                              IEEE)
    else:
        v_lo, v_hi = load_kv_tile(p_vc, p_vs, p_vb, o_t, m_n, s_vc, s_vm,
                                  vs_lo, vb_lo, vs_hi, vb_hi,
                                  HEAD_DIM, HALF, BLOCK_N, V_FMT, V_GS, dtype)
        p16 = p.to(dtype)
        acc_lo = dot_acc(p16, v_lo, acc_lo * alpha[:, None], IEEE)
        acc_hi = dot_acc(p16, v_hi, acc_hi * alpha[:, None], IEEE)
    return (acc_lo, acc_hi, m_new, l_i,
            nk_s_lo, nk_b_lo, nk_s_hi, nk_b_hi, nv_s_lo, nv_b_lo, nv_s_hi, nv_b_hi)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def load_queries(Q, b, h, o_m, o_l, m_row, s_qb, s_qh, s_ql, s_qd, p_kc, s_kc,
                 G: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                 K_FMT: tl.constexpr, IEEE: tl.constexpr):
    """Packed query rows `o_m` (row m = query l = m // G of head h * G + m % G) as the two
    half-width tiles q_lo, q_hi `[BLOCK_M, HALF]` (zero where `m_row` is False or past
    D/2), in the key tiles' channel order (`dequant.half_dims`: int4w-c64 keys are stored
    permuted, p_kc / s_kc their codes); float32 for IEEE dots."""
    DH: tl.constexpr = HEAD_DIM // 2
    d_lo, d_hi = half_dims(p_kc, s_kc, HEAD_DIM, HALF, K_FMT)
    p_q = Q + b * s_qb + (h * G + o_m % G)[:, None] * s_qh + o_l.to(tl.int64)[:, None] * s_ql
    m_q = m_row[:, None] & (tl.arange(0, HALF) < DH)[None, :]
    q_lo = tl.load(p_q + d_lo[None, :] * s_qd, mask=m_q, other=0.0)
    q_hi = tl.load(p_q + d_hi[None, :] * s_qd, mask=m_q, other=0.0)
    if IEEE:  # float32 dots throughout (fp32 models; bf16 under the interpreter)
        q_lo = q_lo.to(tl.float32)
        q_hi = q_hi.to(tl.float32)
    return q_lo, q_hi


@triton.jit
def head_pointers(Kc, Ks, Kb, Vc, Vs, Vb, b, h, s_kc_b, s_kc_h, s_km_b, s_km_h,
                  s_vc_b, s_vc_h, s_vm_b, s_vm_h):
    """The six cache parts' base pointers for sequence b, KV head h."""
    return (Kc + b * s_kc_b + h * s_kc_h, Ks + b * s_km_b + h * s_km_h,
            Kb + b * s_km_b + h * s_km_h, Vc + b * s_vc_b + h * s_vc_h,
            Vs + b * s_vm_b + h * s_vm_h, Vb + b * s_vm_b + h * s_vm_h)


@triton.jit
def dot_acc(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _row(x):
    """Per-slot metadata `[BLOCK_N]` as float32."""
    return x.to(tl.float32)


@triton.jit
def _fold_pv(acc, alpha, p, codes, scale, bias, FMT: tl.constexpr, DTYPE: tl.constexpr,
             IEEE: tl.constexpr):
    """acc * alpha + P @ (scale * codes + bias), with the scales applied to P.

    codes `[BLOCK_N, HALF]` from `load_codes`; scale, bias `[BLOCK_N]` float32.
    """
    top = tl.maximum(tl.max(scale, 0), 1e-30)
    pv = (p * (scale / top)[None, :]).to(DTYPE)  # [BLOCK_M, BLOCK_N]
    if (FMT == 1 or FMT == 2 or FMT == 6) and DTYPE == tl.float16:
        # the codes carry +1024 (load_codes): take it off before the dot, exactly, not after
        # it: P.(1024 + c) is ~300x P.c, and its accumulation error, amplified again where
        # P.(s*c) and P.b nearly cancel, was the tile kernel's head_dim-64 error on an H200
        codes = codes - 1024.0
    o = _dot(pv, codes, IEEE)
    acc = acc * alpha[:, None] + top * o
    if FMT != 3:
        acc += tl.sum(p * bias[None, :], 1)[:, None]
    return acc


@triton.jit
def _fold_qk_blocks(q_lo, q_hi, p_kc, o_t, m_n, s_kc, s_lo, b_lo, s_hi, b_hi,
                    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, FMT: tl.constexpr,
                    IEEE: tl.constexpr):
    """Scores `[BLOCK_M, BLOCK_N]` of int4-c64 / int3-c64 / int4w-c64 keys (FMT 4 / 5 / 7)
    in a tile inside one 64-slot block:
    q.(s * c + b) = (q * s).c + q.b, with s, b `[1, HALF]` per channel (`load_block_meta`);
    int4w-c64's codes carry their fifth bits (`load_codes`), its queries come permuted.

    Why: a decode tile has BLOCK_M (16) query rows but BLOCK_N (32-64) key rows, so
    scaling the queries costs a quarter of dequantizing the keys, and q.b is one number
    per row. The scaled queries are rounded to the dots' dtype once and the offset the
    codes carry (`code_offset`) comes off with the sum of those same rounded values.
    """
    dtype = q_lo.dtype
    c_lo, c_hi = load_codes(p_kc, o_t, m_n, s_kc, HEAD_DIM, HALF, FMT, dtype)
    qs_lo = (q_lo.to(tl.float32) * s_lo.to(tl.float32)).to(dtype)  # [BLOCK_M, HALF]
    qs_hi = (q_hi.to(tl.float32) * s_hi.to(tl.float32)).to(dtype)
    s = dot_acc(qs_hi, tl.trans(c_hi), _dot(qs_lo, tl.trans(c_lo), IEEE), IEEE)
    off = code_offset(FMT, dtype)
    qb = tl.sum(q_lo.to(tl.float32) * b_lo.to(tl.float32), 1)
    qb += tl.sum(q_hi.to(tl.float32) * b_hi.to(tl.float32), 1)
    qb -= off * (tl.sum(qs_lo.to(tl.float32), 1) + tl.sum(qs_hi.to(tl.float32), 1))
    return s + qb[:, None]
