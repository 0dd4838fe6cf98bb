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
halves), 3 fp8 e4m3 (codes passed as uint8). Integer formats need group size >= D/2 and
a power-of-two head dim; the wrapper routes other shapes to `decode.py`.

HAS_MIN_DIST (constexpr, off by default) hides keys closer than `min_dist` to the query
or before `min_key` (one part of a hybrid cache); tiles every row still sees whole keep
the unmasked path.
"""

import triton
import triton.language as tl

from kvtax.attention.kernels.common import (
    dot_acc, tanh, head_pointers, pdl_enter, pdl_exit, sequence_of, visible,
)


@triton.jit
def _centered(c, OFF: tl.constexpr):
    """uint8 codes (< 1024) → fp16 `c - OFF`, exact, without the int→float unit:
    0x6400 | c is the fp16 number 1024 + c."""
    x = (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    return x - (1024.0 + OFF)


def _bytes_asm(sel_a: str, sel_b: str) -> str:
    """PTX turning a 32-bit word of uint8 codes into two fp16x2 registers of code - 128:
    `prmt` with selectors `sel_a`, `sel_b` (which bytes pair up) builds the fp16 pairs
    1024 + c, one `sub.f16x2` each removes 1024 + 128."""
    return f"""{{
        .reg .b32 t0, t1, m;
        mov.b32 m, 0x64806480;
        prmt.b32 t0, $2, 0x64646464, {sel_a};
        prmt.b32 t1, $2, 0x64646464, {sel_b};
        sub.f16x2 $0, t0, m;
        sub.f16x2 $1, t1, m;
        }}"""


# bytes (0, 1), (2, 3) pair up for 4 consecutive codes; (0, 2), (1, 3) for uint16 pairs
_INT8_ASM = tl.constexpr(_bytes_asm("0x4140", "0x4342"))
_INT8_PAIRS_ASM = tl.constexpr(_bytes_asm("0x4240", "0x4341"))


@triton.jit
def _int8_asm(c):
    """uint8 codes → fp16 `c - 128` with two prmt + two sub.f16x2 per 4 codes (GPU only;
    same result as `_centered(c, 128.0)`)."""
    return tl.inline_asm_elementwise(
        asm=_INT8_ASM, constraints="=r,=r,r", args=[c], dtype=tl.float16, is_pure=True,
        pack=4)


def _nibbles_asm(sel_a: str, sel_b: str) -> str:
    """PTX turning a 32-bit word of packed int4 bytes into four fp16x2 registers of
    nibble - 8: the lo nibbles, then the hi nibbles, each split into two fp16 pairs by
    `prmt` with selectors `sel_a`, `sel_b` (which bytes pair up), 11 instructions."""
    return f"""{{
        .reg .b32 lo, hi, t0, t1, t2, t3, m;
        mov.b32 m, 0x64086408;
        and.b32 lo, $4, 0x0F0F0F0F;
        shr.b32 hi, $4, 4;
        and.b32 hi, hi, 0x0F0F0F0F;
        prmt.b32 t0, lo, 0x64646464, {sel_a};
        prmt.b32 t1, lo, 0x64646464, {sel_b};
        prmt.b32 t2, hi, 0x64646464, {sel_a};
        prmt.b32 t3, hi, 0x64646464, {sel_b};
        sub.f16x2 $0, t0, m;
        sub.f16x2 $1, t1, m;
        sub.f16x2 $2, t2, m;
        sub.f16x2 $3, t3, m;
        }}"""


# bytes (0, 1), (2, 3) pair up for 4 consecutive codes; (0, 2), (1, 3) for uint16 pairs
_INT4_ASM = tl.constexpr(_nibbles_asm("0x4140", "0x4342"))
_INT4_PAIRS_ASM = tl.constexpr(_nibbles_asm("0x4240", "0x4341"))


@triton.jit
def _int4_asm(byte):
    """Packed int4 bytes → fp16 (lo nibble - 8, hi nibble - 8), 11 instructions per 4
    bytes (GPU only; same result as `_centered` on `byte & 15`, `byte >> 4`)."""
    return tl.inline_asm_elementwise(
        asm=_INT4_ASM, constraints="=r,=r,=r,=r,r", args=[byte],
        dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _int8_pairs_asm(w):
    """uint16 pairs of int8 codes → fp16 (first byte - 128, second byte - 128): one prmt
    and one sub.f16x2 per two codes (GPU only; see `_v_pairs`)."""
    return tl.inline_asm_elementwise(
        asm=_INT8_PAIRS_ASM, constraints="=r,=r,r", args=[w], dtype=(tl.float16, tl.float16),
        is_pure=True, pack=2)


@triton.jit
def _int4_pairs_asm(w):
    """uint16 pairs of packed int4 bytes → fp16 (byte 0 lo, byte 1 lo, byte 0 hi, byte 1
    hi nibble, each - 8): 11 instructions per 8 codes (GPU only; see `_v_pairs`)."""
    return tl.inline_asm_elementwise(
        asm=_INT4_PAIRS_ASM, constraints="=r,=r,=r,=r,r", args=[w],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _load(p, m):
    """tl.load with an optional mask (None: unmasked, so the load stays wide)."""
    if m is None:
        x = tl.load(p)
    else:
        x = tl.load(p, mask=m, other=0)
    return x


@triton.jit
def _operands(p_codes, o_n, m_n, s_ct, HEAD_DIM: tl.constexpr, FMT: tl.constexpr,
              DT: tl.constexpr, ASM: tl.constexpr):
    """Tile of slots `o_n` (int32) as MMA operands: lo, hi `[BLOCK_N, D/2]` in DT.

    Float formats: the stored rows. int8/int4: centered codes. fp8: decoded values.
    Slots where `m_n` is False read code 0 (their scores are masked, their P is 0);
    m_n None loads the whole tile unmasked.
    """
    DH: tl.constexpr = HEAD_DIM // 2
    o_d = tl.arange(0, DH)
    p_row = p_codes + o_n[:, None].to(tl.int64) * s_ct + o_d[None, :]
    m = None if m_n is None else m_n[:, None]
    if FMT == 2:
        byte = _load(p_row, m)
        if ASM:
            lo, hi = _int4_asm(byte)
        else:
            lo = _centered(byte & 0xF, 8.0)
            hi = _centered(byte >> 4, 8.0)
    else:
        r_lo = _load(p_row, m)
        r_hi = _load(p_row + DH, m)
        if FMT == 1 and ASM:
            lo = _int8_asm(r_lo)
            hi = _int8_asm(r_hi)
        elif FMT == 1:
            lo = _centered(r_lo, 128.0)
            hi = _centered(r_hi, 128.0)
        elif FMT == 3:
            lo = r_lo.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            hi = r_hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            lo = r_lo
            hi = r_hi
    return lo.to(DT), hi.to(DT)


@triton.jit
def _v_pairs(p_codes, o_n, m_n, s_ct, HEAD_DIM: tl.constexpr, FMT: tl.constexpr,
             DT: tl.constexpr, ASM: tl.constexpr):
    """An int8/int4 V tile of slots `o_n` as four `[BLOCK_N, D/4]` MMA operands (centered
    codes in DT) for the dims (2j, 2j + 1, D/2 + 2j, D/2 + 2j + 1), j < D/4.

    Why: in P @ V the MMA's reduction runs over slots, so each thread needs codes of
    consecutive slots for one dim, while a cache row holds consecutive dims of one slot.
    Read as bytes, Triton gathers them one LDS.U8 and one PRMT at a time (~3 instructions
    per code). Read as uint16 pairs of dims, the tile is an ordinary 16-bit operand that
    `ldmatrix.trans` transposes, and one PRMT splits a pair of slots' pairs into the even
    and the odd dim's fp16 operands. Same MMA count; the output dims come out interleaved
    and the kernel stores them back in place. Both halves of a pair share the scale group
    (group >= D/2), so the folded V scales stay per half.
    """
    DQ: tl.constexpr = HEAD_DIM // 4
    o_j = tl.arange(0, DQ)
    p16 = p_codes.to(tl.pointer_type(tl.uint16), bitcast=True)
    p_row = p16 + o_n[:, None].to(tl.int64) * (s_ct // 2) + o_j[None, :]
    m = None if m_n is None else m_n[:, None]
    if FMT == 2:  # uint16 j = bytes 2j, 2j + 1: lo nibbles dims 2j, 2j + 1; hi + D/2
        w = _load(p_row, m)
        if ASM:
            a, b, c, d = _int4_pairs_asm(w)
        else:
            a = _centered(w & 0xF, 8.0)
            b = _centered((w >> 8) & 0xF, 8.0)
            c = _centered((w >> 4) & 0xF, 8.0)
            d = _centered(w >> 12, 8.0)
    else:  # uint16 j = dims 2j, 2j + 1 (lo half); j + D/4 the same in the hi half
        w_lo = _load(p_row, m)
        w_hi = _load(p_row + DQ, m)
        if ASM:
            a, b = _int8_pairs_asm(w_lo)
            c, d = _int8_pairs_asm(w_hi)
        else:
            a = _centered(w_lo & 0xFF, 128.0)
            b = _centered(w_lo >> 8, 128.0)
            c = _centered(w_hi & 0xFF, 128.0)
            d = _centered(w_hi >> 8, 128.0)
    return a.to(DT), b.to(DT), c.to(DT), d.to(DT)


@triton.jit
def _meta(p_s, p_b, start, m_n, s_mt, BLOCK_N: tl.constexpr, FMT: tl.constexpr,
          NG: tl.constexpr):
    """Per-slot scales and centered biases of a tile, float32 `[BLOCK_N]` each:
    (s_lo, b_lo, s_hi, b_hi). NG = groups per row (1 or 2 here); fp8's one scale per row
    serves both halves and its biases are zeros.

    Loaded as one flat run of BLOCK_N * NG values when rows are packed (s_mt == NG), so
    the load is wide and the pipeliner can stage it like the codes.
    """
    o_t = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
    zero = tl.zeros([BLOCK_N], dtype=tl.float32)
    s_lo = zero
    b_lo = zero
    s_hi = zero
    b_hi = zero
    if FMT == 3:
        s_lo = _load(p_s + o_t * s_mt, m_n).to(tl.float32)
        s_hi = s_lo
    elif FMT == 1 or FMT == 2:
        OFF: tl.constexpr = 128.0 if FMT == 1 else 8.0
        if NG == 1:
            s_lo = _load(p_s + o_t * s_mt, m_n).to(tl.float32)
            b_lo = _load(p_b + o_t * s_mt, m_n).to(tl.float32)
            b_lo += OFF * s_lo
            s_hi = s_lo
            b_hi = b_lo
        else:
            o_f = (2 * start + tl.arange(0, 2 * BLOCK_N)).to(tl.int64)
            if m_n is None:
                m_f = None
            else:
                m_f = tl.reshape(tl.broadcast_to(m_n[:, None], (BLOCK_N, 2)), (2 * BLOCK_N,))
            s2 = _load(p_s + o_f, m_f).to(tl.float32)
            b2 = _load(p_b + o_f, m_f).to(tl.float32)
            s_lo, s_hi = tl.split(tl.reshape(s2, (BLOCK_N, 2)))
            b_lo, b_hi = tl.split(tl.reshape(b2, (BLOCK_N, 2)))
            b_lo += OFF * s_lo
            b_hi += OFF * s_hi
    return s_lo, b_lo, s_hi, b_hi


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
    acc_c, acc_d `[BLOCK_M, D/4]` for `_v_pairs`' four dim sets), bias_lo/bias_hi
    `[BLOCK_M]` (sum of P * V bias), m_i/l_i `[BLOCK_M]` (base 2), t_v the V scale
    reference, vs_lo..vb_hi this tile's V scales and biases (`_meta`; the step returns
    the next tile's, `start + step`, loaded at its start). q_lo/q_hi the K operands'
    queries, qs_lo/qs_hi their row sums. MASKED=False: every row sees every slot of the tile.

    Why the V metadata is prefetched by hand: Triton's pipeliner staged the codes and the
    K metadata through cp.async but left one V metadata load inside the iteration that
    needs it, and Nsight Compute showed 31% of the warps' stall cycles waiting on it
    (H200, int8 at 128k, docs/KERNELS.md).
    """
    o_next = start + step + tl.arange(0, BLOCK_N)
    nvs_lo, nvb_lo, nvs_hi, nvb_hi = _meta(p_vs, p_vb, start + step, o_next < hi, s_vm,
                                           BLOCK_N, V_FMT, V_NG)
    o_n = start + tl.arange(0, BLOCK_N)  # int32: slot counts stay below 2^31
    if MASKED:
        m_n = o_n < hi
    else:
        m_n = None
    k_lo, k_hi = _operands(p_kc, o_n, m_n, s_kc, HEAD_DIM, K_FMT, K_DT, ASM)
    ks_lo, kb_lo, ks_hi, kb_hi = _meta(p_ks, p_kb, start, m_n, s_km, BLOCK_N, K_FMT, K_NG)
    zeros_s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if K_FMT == 0:
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
        v_a, v_b, v_c, v_d = _v_pairs(p_vc, o_n, m_n, s_vc, HEAD_DIM, V_FMT, V_DT, ASM)
        p_lo = (p * (vs_lo * inv_t)[None, :]).to(V_DT)
        p_hi = (p * (vs_hi * inv_t)[None, :]).to(V_DT)
        acc_lo = dot_acc(p_lo, v_a, acc_lo, IEEE)
        acc_hi = dot_acc(p_lo, v_b, acc_hi, IEEE)
        acc_c = dot_acc(p_hi, v_c, acc_c, IEEE)
        acc_d = dot_acc(p_hi, v_d, acc_d, IEEE)
    else:
        v_lo, v_hi = _operands(p_vc, o_n, m_n, s_vc, HEAD_DIM, V_FMT, V_DT, ASM)
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


@triton.jit(do_not_specialize=["length_host", "n_q", "num_splits"])
def decode_warp_kernel(
    Q, PartO, PartM, PartL, Kc, Ks, Kb, Vc, Vs, Vb, Lens, KvStart,
    length_host, n_q, num_splits, n_kv_heads, sinks, ring, window, qk_scale, cap_log2,
    s_qb, s_qh, s_ql, s_qd,
    s_kc_b, s_kc_h, s_kc_t, s_km_b, s_km_h, s_km_t,
    s_vc_b, s_vc_h, s_vc_t, s_vm_b, s_vm_h, s_vm_t,
    min_dist, min_key,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr, K_NG: tl.constexpr, V_FMT: tl.constexpr, V_NG: tl.constexpr,
    K_DT: tl.constexpr, V_DT: tl.constexpr,
    IS_RING: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_LENS: tl.constexpr, IEEE: tl.constexpr, HAS_KV_START: tl.constexpr,
    ASM: tl.constexpr, V_PAIRS: tl.constexpr, HAS_MIN_DIST: tl.constexpr,
    PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False,
):
    pdl_enter(PDL, PDL_LATE)
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
    o_d = tl.arange(0, DH)
    p_q = Q + b * s_qb + (h * G + o_m % G)[:, None] * s_qh + o_l.to(tl.int64)[:, None] * s_ql
    q_lo = tl.load(p_q + o_d[None, :] * s_qd, mask=m_row[:, None], other=0.0).to(K_DT)
    q_hi = tl.load(p_q + (o_d + DH)[None, :] * s_qd, mask=m_row[:, None], other=0.0).to(K_DT)
    # sum(q) per half, of the operand the dots see, for the folded K biases
    qs_lo = tl.sum(q_lo.to(tl.float32), 1)
    qs_hi = tl.sum(q_hi.to(tl.float32), 1)

    p_kc, p_ks, p_kb, p_vc, p_vs, p_vb = head_pointers(
        Kc, Ks, Kb, Vc, Vs, Vb, b, h, s_kc_b, s_kc_h, s_km_b, s_km_h, s_vc_b, s_vc_h, s_vm_b,
        s_vm_h)

    if V_PAIRS:  # dims 2j, 2j + 1, D/2 + 2j, D/2 + 2j + 1 (see _v_pairs)
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
    # every loop walks this split's tiles off, off + step, ... from its first one past a
    # bound, so the V metadata prefetched for `start + step` is always the next tile's
    first = _first(lo, off, step)
    vs_lo, vb_lo, vs_hi, vb_hi = _meta(p_vs, p_vb, first,
                                       (first + tl.arange(0, BLOCK_N)) < hi, s_vm_t, BLOCK_N,
                                       V_FMT, V_NG)
    if HAS_MIN_DIST:
        for start in range(first, full_lo, step):
            (acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v,
         vs_lo, vb_lo, vs_hi, vb_hi) = _step(
                acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v,
                vs_lo, vb_lo, vs_hi, vb_hi, q_lo, q_hi, qs_lo, qs_hi, q_pos, start, step,
                hi, length, kv0,
                p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc_t, s_km_t, s_vc_t, s_vm_t,
                sinks, ring, window, qk_scale, cap_log2, HEAD_DIM, BLOCK_M, BLOCK_N,
                K_FMT, K_NG, V_FMT, V_NG, K_DT, V_DT, True, IS_RING, HAS_WINDOW, SOFTCAP,
                IEEE, HAS_KV_START, ASM, V_PAIRS, min_dist, min_key, HAS_MIN_DIST)
    for start in range(_first(full_lo, off, step), full_end, step):
        (acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v,
         vs_lo, vb_lo, vs_hi, vb_hi) = _step(
            acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v,
            vs_lo, vb_lo, vs_hi, vb_hi, q_lo, q_hi, qs_lo, qs_hi, q_pos, start, step, hi,
            length, kv0,
            p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc_t, s_km_t, s_vc_t, s_vm_t,
            sinks, ring, window, qk_scale, cap_log2, HEAD_DIM, BLOCK_M, BLOCK_N,
            K_FMT, K_NG, V_FMT, V_NG, K_DT, V_DT, False, IS_RING, HAS_WINDOW, SOFTCAP, IEEE,
            HAS_KV_START, ASM, V_PAIRS, min_dist, min_key, HAS_MIN_DIST)
    for start in range(_first(full_end, off, step), hi, step):
        (acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v,
         vs_lo, vb_lo, vs_hi, vb_hi) = _step(
            acc_lo, acc_hi, acc_c, acc_d, bias_lo, bias_hi, m_i, l_i, t_v,
            vs_lo, vb_lo, vs_hi, vb_hi, q_lo, q_hi, qs_lo, qs_hi, q_pos, start, step, hi,
            length, kv0,
            p_kc, p_ks, p_kb, p_vc, p_vs, p_vb, s_kc_t, s_km_t, s_vc_t, s_vm_t,
            sinks, ring, window, qk_scale, cap_log2, HEAD_DIM, BLOCK_M, BLOCK_N,
            K_FMT, K_NG, V_FMT, V_NG, K_DT, V_DT, True, IS_RING, HAS_WINDOW, SOFTCAP, IEEE,
            HAS_KV_START, ASM, V_PAIRS, min_dist, min_key, HAS_MIN_DIST)

    # partials: PartO [B*H_kv, splits, R, D], PartM / PartL [B*H_kv, splits, R]
    row = (pid_bh.to(tl.int64) * num_splits + split) * n_rows + o_m
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
        tl.store(p_o + o_d[None, :], acc_lo, mask=m_row[:, None])
        tl.store(p_o + (o_d + DH)[None, :], acc_hi, mask=m_row[:, None])
    pdl_exit(PDL, PDL_LATE)
