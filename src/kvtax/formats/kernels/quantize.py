"""Quantize new K/V rows and write them into their cache slots, K and V in one launch.

The torch path (`fmt.quantize`, then one index_copy per storage part) launches ~15 small
kernels per layer per decode step; this kernel does a layer's whole append in one.
Grid: (row blocks, 2), program_id(1) picks K (0) or V (1). K and V share one launch
because they share rows, positions and the slot map, and at batch 1 a decode step's
writes cost launch latency, not bytes: a launch each would double that latency.

A row is one token of one (batch, KV head): row r = (b * H + h) * T + t, read from
`x[b, h, t, :]` and written to the slot of position pos0 + t (pos0 a host int or, for
CUDA-graph decode, read from a device tensor) under the cache's ring map: slot = pos
for pos < sinks, else sinks + (pos - sinks) % ring (ring = 0: slot = pos).

Bit-exact with the torch reference (`kvtax.formats.*.quantize`), which computes in
float32: each value here is computed in float32 in the reference's order, and
- divisions use `div_rn` (Triton's `/` is an approximate division on GPUs);
- `range / levels` (and fp8's `amax / 448`) is, in torch on CUDA, a multiplication by
  float32(1 / levels): ATen multiplies by the reciprocal when the divisor is a Python
  scalar. On CPU it divides. RECIP picks one, so the kernel matches torch on its device;
- rounding to bf16 and to e4m3 uses integer ops, as c10 does (Triton's interpreter
  truncates float32 → bf16); round-half-to-even uses the 2^23 trick (no libdevice).

Format codes (constexpr), as in the attention kernels: 0 float (a cast), 1 int8 affine,
2 int4 affine (split halves: byte j = code[j] | code[j + D/2] << 4), 3 fp8 e4m3 with one
scale per row (codes written as their uint8 bit patterns), 4 fp8-pt (e4m3, scale 1.0
per tensor: no scale array).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def round_to(x, DT: tl.constexpr):
    """float32 `x` rounded to nearest-even in DT: (value as DT, same value as float32)."""
    if DT == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)  # NaN stays a quiet NaN, as in c10
        v = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        f = (r << 16).to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        v = x.to(tl.float16)
        f = v.to(tl.float32)
    else:
        v = x
        f = x
    return v, f


@triton.jit
def _e4m3_bits(v):
    """float32 `v` (|v| <= 448) → float8_e4m3fn bits (uint8), nearest-even; the integer
    steps of c10's fp8e4m3fn_from_fp32_value."""
    u = v.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    # below 2^-6 (e4m3 subnormals, steps of 2^-9): adding 2^14 rounds |v| to that step
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
    # normal: round the 23-bit mantissa to 3 bits, rebias the exponent from 127 to 7
    nrm = (a + 0x7FFFF + ((a >> 20) & 1) - (120 << 23)) >> 20
    mag = tl.where(a < (121 << 23), sub, nrm)
    return (mag | ((u >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _affine_codes(x, scale, bias, LEVELS: tl.constexpr):
    """round((x - bias) / scale) clamped to [0, LEVELS], as uint8; all float32."""
    y = tl.math.div_rn(x - bias, scale)
    y = tl.minimum(tl.maximum(y, 0.0), LEVELS)  # clamping before rounding rounds the same
    y = (y + 8388608.0) - 8388608.0  # 0 <= y < 2^23: adding 2^23 rounds half to even
    return y.to(tl.uint8)


@triton.jit
def _per_dim(p, gid, NG_P: tl.constexpr, BLOCK_R: tl.constexpr, HALF_P: tl.constexpr):
    """Per-group values `p` `[BLOCK_R, NG_P]` at the dims of a half: `[BLOCK_R, HALF_P]`
    (`[BLOCK_R, 1]`, broadcasting, when there is one group); gid `[HALF_P]` group ids."""
    if NG_P == 1:
        out = p
    else:
        # one-hot select and sum (exact: one term is nonzero). Not tl.gather: Triton
        # 3.6's thread-locality pass fails on this gather (seen on the H200).
        o_g = tl.arange(0, NG_P)
        hit = gid[None, None, :] == o_g[None, :, None]  # [1, NG_P, HALF_P]
        out = tl.sum(tl.where(hit, p[:, :, None], 0.0), 1)
    return out


@triton.jit
def _store_affine(p_x, p_c, p_s, p_b, m_r, inv, HEAD_DIM: tl.constexpr, GS: tl.constexpr,
                  NG_P: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr,
                  BITS: tl.constexpr, DT: tl.constexpr, RECIP: tl.constexpr):
    """int8/int4 rows: group min/max → scale, bias (stored in DT) → codes.

    p_x, p_c, p_s, p_b: `[BLOCK_R]` row pointers (input, codes, scales, biases).
    Statistics come from a `[BLOCK_R, NG_P, GS]` tile; codes from the two half rows
    (dims `[0, D/2)` and `[D/2, D)`), which is int4's packing and also serves int8.
    """
    NG: tl.constexpr = HEAD_DIM // GS
    DH: tl.constexpr = HEAD_DIM // 2
    LEVELS: tl.constexpr = (1 << BITS) - 1
    o_g = tl.arange(0, NG_P)
    o_i = tl.arange(0, GS)
    m_g = m_r[:, None] & (o_g < NG)[None, :]  # [BLOCK_R, NG_P]
    # masked lanes read 0: they only ever fill whole padding groups or padding rows
    p_grp = p_x[:, None, None] + (o_g[:, None] * GS + o_i[None, :])[None, :, :]
    x = tl.load(p_grp, mask=m_g[:, :, None], other=0.0).to(tl.float32)  # [BLOCK_R, NG_P, GS]
    lo = tl.min(x, 2)
    hi = tl.max(x, 2)
    if RECIP:
        s = (hi - lo) * inv
    else:
        s = tl.math.div_rn(hi - lo, LEVELS * 1.0)
    _, s = round_to(s, DT)
    # a zero scale (constant group, or one that underflowed in DT) becomes 1, in DT
    s_v, s = round_to(tl.where(s == 0.0, 1.0, s), DT)
    b_v, b = round_to(lo, DT)
    o_m = o_g[None, :]
    tl.store(p_s[:, None] + o_m, s_v, mask=m_g)
    tl.store(p_b[:, None] + o_m, b_v, mask=m_g)

    o_h = tl.arange(0, HALF_P)
    m_h = m_r[:, None] & (o_h < DH)[None, :]  # [BLOCK_R, HALF_P]
    g_lo = tl.minimum(o_h // GS, NG - 1)  # clamped: padding dims must index in range
    g_hi = tl.minimum((o_h + DH) // GS, NG - 1)
    x_lo = tl.load(p_x[:, None] + o_h[None, :], mask=m_h, other=0.0).to(tl.float32)
    x_hi = tl.load(p_x[:, None] + (o_h + DH)[None, :], mask=m_h, other=0.0).to(tl.float32)
    c_lo = _affine_codes(x_lo, _per_dim(s, g_lo, NG_P, BLOCK_R, HALF_P),
                         _per_dim(b, g_lo, NG_P, BLOCK_R, HALF_P), LEVELS)
    c_hi = _affine_codes(x_hi, _per_dim(s, g_hi, NG_P, BLOCK_R, HALF_P),
                         _per_dim(b, g_hi, NG_P, BLOCK_R, HALF_P), LEVELS)
    if BITS == 4:
        tl.store(p_c[:, None] + o_h[None, :], c_lo | (c_hi << 4), mask=m_h)
    else:
        tl.store(p_c[:, None] + o_h[None, :], c_lo, mask=m_h)
        tl.store(p_c[:, None] + (o_h + DH)[None, :], c_hi, mask=m_h)


@triton.jit
def _store_fp8(p_x, p_c, p_s, m_r, inv, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
               DT: tl.constexpr, RECIP: tl.constexpr):
    """fp8 rows: scale = amax / 448 (stored in DT), codes = e4m3(x / scale) as uint8."""
    o_d = tl.arange(0, D_P)
    m = m_r[:, None] & (o_d < HEAD_DIM)[None, :]
    x = tl.load(p_x[:, None] + o_d[None, :], mask=m, other=0.0).to(tl.float32)  # [BLOCK_R, D_P]
    amax = tl.max(tl.abs(x), 1)
    if RECIP:
        s = amax * inv
    else:
        s = tl.math.div_rn(amax, 448.0)
    _, s = round_to(s, DT)
    s_v, s = round_to(tl.where(s == 0.0, 1.0, s), DT)
    tl.store(p_s, s_v, mask=m_r)
    v = tl.math.div_rn(x, s[:, None])
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(p_c[:, None] + o_d[None, :], _e4m3_bits(v), mask=m)


@triton.jit
def _store_fp8_unit(p_x, p_c, m_r, HEAD_DIM: tl.constexpr, D_P: tl.constexpr):
    """fp8-pt rows (one scale per tensor, 1.0): codes = e4m3(clamp(x, ±448)) as uint8."""
    o_d = tl.arange(0, D_P)
    m = m_r[:, None] & (o_d < HEAD_DIM)[None, :]
    x = tl.load(p_x[:, None] + o_d[None, :], mask=m, other=0.0).to(tl.float32)  # [BLOCK_R, D_P]
    v = tl.minimum(tl.maximum(x, -448.0), 448.0)
    tl.store(p_c[:, None] + o_d[None, :], _e4m3_bits(v), mask=m)


@triton.jit
def _store_float(p_x, p_c, m_r, HEAD_DIM: tl.constexpr, D_P: tl.constexpr, DT: tl.constexpr,
                 OUT: tl.constexpr):
    """Float rows: a cast from the model dtype DT to the storage dtype OUT."""
    o_d = tl.arange(0, D_P)
    m = m_r[:, None] & (o_d < HEAD_DIM)[None, :]
    x = tl.load(p_x[:, None] + o_d[None, :], mask=m, other=0.0)  # [BLOCK_R, D_P]
    if OUT == DT:
        y = x
    else:
        y, _ = round_to(x.to(tl.float32), OUT)
    tl.store(p_c[:, None] + o_d[None, :], y, mask=m)


@triton.jit
def ring_slot(pos, sinks, ring, IS_RING: tl.constexpr):
    """The storage slot of position pos: pos itself below `sinks` or in a full cache
    (IS_RING False), else sinks + (pos - sinks) % ring."""
    if IS_RING:
        return tl.where(pos < sinks, pos, sinks + (pos - sinks) % ring)
    return pos


@triton.jit
def store_part(p_x, p_c, p_s, p_b, m_r, inv, FMT: tl.constexpr, GS: tl.constexpr,
               OUT: tl.constexpr, NG_P: tl.constexpr, HEAD_DIM: tl.constexpr,
               D_P: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr,
               DT: tl.constexpr, RECIP: tl.constexpr):
    """Quantize and store `[BLOCK_R]` rows of K or V in format FMT."""
    if FMT == 0:
        _store_float(p_x, p_c, m_r, HEAD_DIM, D_P, DT, OUT)
    elif FMT == 3:
        _store_fp8(p_x, p_c, p_s, m_r, inv, HEAD_DIM, D_P, DT, RECIP)
    elif FMT == 4:
        _store_fp8_unit(p_x, p_c, m_r, HEAD_DIM, D_P)
    else:
        _store_affine(p_x, p_c, p_s, p_b, m_r, inv, HEAD_DIM, GS, NG_P, HALF_P, BLOCK_R,
                      8 if FMT == 1 else 4, DT, RECIP)


@triton.jit(do_not_specialize=["pos0", "n_rows", "seq_len"])
def quantize_store_kernel(
    p_pos, pos0, sinks, ring, n_rows, seq_len, n_heads,
    p_kx, s_kx_b, s_kx_h, s_kx_t, p_kc, p_ks, p_kb,
    s_kc_b, s_kc_h, s_kc_t, s_km_b, s_km_h, s_km_t, k_inv,
    p_vx, s_vx_b, s_vx_h, s_vx_t, p_vc, p_vs, p_vb,
    s_vc_b, s_vc_h, s_vc_t, s_vm_b, s_vm_h, s_vm_t, v_inv,
    HEAD_DIM: tl.constexpr, DT: tl.constexpr,
    K_FMT: tl.constexpr, K_GS: tl.constexpr, K_OUT: tl.constexpr, K_NG_P: tl.constexpr,
    V_FMT: tl.constexpr, V_GS: tl.constexpr, V_OUT: tl.constexpr, V_NG_P: tl.constexpr,
    POS_FROM_PTR: tl.constexpr, IS_RING: tl.constexpr, RECIP: tl.constexpr,
    BLOCK_R: tl.constexpr, D_P: tl.constexpr, HALF_P: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Rows `[pid * BLOCK_R, +BLOCK_R)` of K (program_id(1) == 0) or V (== 1).

    x strides s_?x_* (elements; the last dim is contiguous), codes strides s_?c_*,
    scales/biases strides s_?m_* (batch, head, slot). k_inv / v_inv: float32(1 / levels)
    (1 / 448 for fp8) when RECIP. p_pos: int `[1]` device position when POS_FROM_PTR.
    PDL (kvtax.pdl): let the next kernel launch, then wait for
    the kernels before this one (they wrote k, v and the position) before any access.
    """
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < n_rows
    o_r = o_r.to(tl.int64)
    t = o_r % seq_len
    bh = o_r // seq_len
    h = bh % n_heads
    b = bh // n_heads
    if POS_FROM_PTR:
        pos = tl.load(p_pos).to(tl.int64) + t
    else:
        pos = pos0 + t
    slot = ring_slot(pos, sinks, ring, IS_RING)
    if tl.program_id(1) == 0:
        store_part(p_kx + b * s_kx_b + h * s_kx_h + t * s_kx_t,
                   p_kc + b * s_kc_b + h * s_kc_h + slot * s_kc_t,
                   p_ks + b * s_km_b + h * s_km_h + slot * s_km_t,
                   p_kb + b * s_km_b + h * s_km_h + slot * s_km_t,
                   m_r, k_inv, K_FMT, K_GS, K_OUT, K_NG_P, HEAD_DIM, D_P, HALF_P, BLOCK_R,
                   DT, RECIP)
    else:
        store_part(p_vx + b * s_vx_b + h * s_vx_h + t * s_vx_t,
                   p_vc + b * s_vc_b + h * s_vc_h + slot * s_vc_t,
                   p_vs + b * s_vm_b + h * s_vm_h + slot * s_vm_t,
                   p_vb + b * s_vm_b + h * s_vm_h + slot * s_vm_t,
                   m_r, v_inv, V_FMT, V_GS, V_OUT, V_NG_P, HEAD_DIM, D_P, HALF_P, BLOCK_R,
                   DT, RECIP)
