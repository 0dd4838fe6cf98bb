"""A hybrid body's decode-step write for keys quantized over 64-token blocks, in one launch.

int4-c64 and int4w-c64 keys (kvtax.formats.channel, kvtax.formats.widest) store one scale
and bias per channel per block, so the torch path (kvtax.cache.blocks.KeyBlocks.write_at)
re-quantizes the whole open block every step: ~40 small kernels per layer, 0.38 of q4's
6.30 ms per token at 32k on an H100 (docs/results/2026-12-05-h100-q4-record). A hybrid
cache with >= 63 recent fp16 tokens never reads its body's open block (kvtax.cache.hybrid),
so this kernel writes a key block once, at the step that fills it, and otherwise only
stages the key: one launch per layer that also stores the value.

Grid (B * H, 2): program (bh, 0) writes the key of (batch, head) bh into the staging ring
at pos % ROWS; where pos ends its block (pos % 64 == 63) it then quantizes the block's 64
staged rows (int4w-c64 at block 0: choosing the sequence's channel order first, as
kvtax.formats.kernels.widest_order does) into the 64 storage slots from slot(first).
Program (bh, 1) stores the value row at slot(pos) as kvtax.formats.kernels.quantize does.
The slot map is the store kernel's: slot = p below `sinks`, else sinks + (p - sinks) % ring
(ring 0: slot = p); a block never wraps (sinks and ring are multiples of 64).

A block written here is bit-exact with the torch path's at the same step, as the store
kernel is (its helpers, its rules): float32 arithmetic in the reference's order, `div_rn`
for tensor divisions, int4-c64's `range / 15` as a multiplication by float32(1/15) where
ATen does that (RECIP: on CUDA), int4w-c64's `range / levels` (a tensor of 31s and 15s) a
true division on every device. The open block's slots keep what the last prefill wrote.
An earlier version re-quantized the open block every step (8 programs over 64 x D each):
59 us per layer on an H100, slower than the compiled torch path (283715a).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kvtax.formats.kernels.quantize import ring_slot, round_to, store_part
from kvtax.formats.kernels.widest_order import stored_spots


@triton.jit
def _channels_at(spot, o_d, o_j):
    """The channel stored at each index o_j `[N]` (spot's inverse there), int32."""
    return tl.sum(tl.where(spot[:, None] == o_j[None, :], o_d[:, None], 0), 0)


@triton.jit
def _block_codes(p_x, src, ch, m_ch, lev, inv, DT: tl.constexpr, KW: tl.constexpr,
                 RECIP: tl.constexpr):
    """One half of a block's stored channels: the 64 staged rows at ring offsets src `[64]`
    read through model channels ch `[N]` → (codes `[64, N]` int32 0..lev, scale, bias `[N]`
    as stored in DT)."""
    x = tl.load(p_x + src[:, None] + ch[None, :], mask=m_ch[None, :], other=0.0)
    x = x.to(tl.float32)
    lo = tl.min(x, 0)
    hi = tl.max(x, 0)
    if KW:  # levels per channel: torch divides tensor by tensor
        s = tl.math.div_rn(hi - lo, lev)
    elif RECIP:
        s = (hi - lo) * inv
    else:
        s = tl.math.div_rn(hi - lo, lev)
    _, s = round_to(s, DT)
    s_v, s = round_to(tl.where(s == 0.0, 1.0, s), DT)
    b_v, b = round_to(lo, DT)
    y = tl.math.div_rn(x - b[None, :], s[None, :])
    y = tl.minimum(tl.maximum(y, 0.0), lev[None, :])  # clamping first rounds the same
    y = (y + 8388608.0) - 8388608.0  # 0 <= y < 2^23: adding 2^23 rounds half to even
    return y.to(tl.int32), s_v, b_v


@triton.jit(do_not_specialize=["sinks", "ring", "rows"])
def block_store_kernel(
    p_pos, sinks, ring, rows, n_heads,
    p_k, s_k_b, s_k_h, p_buf, s_buf_b, s_buf_h, s_buf_t, p_ord, s_ord_b, s_ord_h,
    p_kc, p_ks, p_kb, s_kc_b, s_kc_h, s_kc_t, s_km_b, s_km_h, k_inv,
    p_v, s_v_b, s_v_h, p_vc, p_vs, p_vb, s_vc_b, s_vc_h, s_vc_t, s_vm_b, s_vm_h, s_vm_t,
    v_inv,
    HEAD_DIM: tl.constexpr, DT: tl.constexpr, KW: tl.constexpr, IS_RING: tl.constexpr,
    RECIP: tl.constexpr, V_FMT: tl.constexpr, V_GS: tl.constexpr, V_OUT: tl.constexpr,
    V_NG_P: tl.constexpr, D_P: tl.constexpr, HALF_P: tl.constexpr, CH: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Key (its block where pos ends one) or value of one (batch, head) bh =
    program_id(0) (module docstring).

    p_k, p_v: the new token `[B, H, 1, D]` (strides s_?_b, s_?_h; D contiguous); p_buf the
    staging ring `[B, H, rows, D]`; p_ord int64 `[B, H, D]` (int4w-c64's order: stored
    channel j is channel p_ord[j]); key codes `[B, H, slots, W]`, scales and biases
    `[B, H, slots, D/64]` (block rows contiguous: a block's D values back to back);
    value storage as the store kernel's. k_inv: float32(1/15) for RECIP. CH: channels per
    step of the order's rank comparisons.
    """
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    bh = tl.program_id(0)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    pos = tl.load(p_pos).to(tl.int64)
    if tl.program_id(1) == 1:
        slot = ring_slot(pos, sinks, ring, IS_RING)
        o_r = tl.arange(0, 1)
        store_part(p_v + b * s_v_b + h * s_v_h + o_r,
                   p_vc + b * s_vc_b + h * s_vc_h + slot * s_vc_t + o_r,
                   p_vs + b * s_vm_b + h * s_vm_h + slot * s_vm_t + o_r,
                   p_vb + b * s_vm_b + h * s_vm_h + slot * s_vm_t + o_r,
                   o_r < 1, v_inv, V_FMT, V_GS, V_OUT, V_NG_P, HEAD_DIM, D_P, HALF_P, 1,
                   DT, RECIP)
        return
    DH: tl.constexpr = HEAD_DIM // 2
    E: tl.constexpr = 3 * HEAD_DIM // 64  # int4w-c64: fifth-bit bytes, R / 8
    R: tl.constexpr = 3 * HEAD_DIM // 8
    p_k = p_k + b * s_k_b + h * s_k_h
    p_x = p_buf + b * s_buf_b + h * s_buf_h
    p_o = p_ord + b * s_ord_b + h * s_ord_h
    o_d = tl.arange(0, D_P)
    m_d = o_d < HEAD_DIM
    tl.store(p_x + (pos % rows) * s_buf_t + o_d, tl.load(p_k + o_d, mask=m_d), mask=m_d)
    if pos % 64 != 63:
        return  # the open block: attention does not read it, its last step writes it
    tl.debug_barrier()  # the row just staged is read back below by other threads

    first = pos - 63
    o_u = tl.arange(0, 64)
    src = ((first + o_u) % rows) * s_buf_t
    o_h = tl.arange(0, HALF_P)
    m_h = o_h < DH
    if KW:
        if first == 0:  # block 0 chooses the sequence's order
            spot = stored_spots(p_x, src, o_u < 64, HEAD_DIM, D_P, CH)
            ch_lo = _channels_at(spot, o_d, o_h)
            ch_hi = _channels_at(spot, o_d, o_h + DH)
            tl.store(p_o + o_h, ch_lo.to(tl.int64), mask=m_h)
            tl.store(p_o + DH + o_h, ch_hi.to(tl.int64), mask=m_h)
        else:
            ch_lo = tl.load(p_o + o_h, mask=m_h, other=0).to(tl.int32)
            ch_hi = tl.load(p_o + DH + o_h, mask=m_h, other=0).to(tl.int32)
        # % D keeps a read through an order never written in bounds (as the kernels' reads)
        ch_lo = ch_lo % HEAD_DIM
        ch_hi = ch_hi % HEAD_DIM
        lev_lo = tl.where(o_h < R, 31.0, 15.0)
    else:
        ch_lo = o_h
        ch_hi = o_h + DH
        lev_lo = tl.full([HALF_P], 15.0, tl.float32)
    lev_hi = tl.full([HALF_P], 15.0, tl.float32)
    c_lo, s_lo, b_lo = _block_codes(p_x, src, ch_lo, m_h, lev_lo, k_inv, DT, KW, RECIP)
    c_hi, s_hi, b_hi = _block_codes(p_x, src, ch_hi, m_h, lev_hi, k_inv, DT, KW, RECIP)

    slot0 = ring_slot(first, sinks, ring, IS_RING)
    p_c = p_kc + b * s_kc_b + h * s_kc_h + slot0 * s_kc_t  # the block's first code row
    p_m = b * s_km_b + h * s_km_h + slot0 * (HEAD_DIM // 64)  # its D metadata, contiguous
    tl.store(p_ks + p_m + o_h, s_lo, mask=m_h)
    tl.store(p_ks + p_m + DH + o_h, s_hi, mask=m_h)
    tl.store(p_kb + p_m + o_h, b_lo, mask=m_h)
    tl.store(p_kb + p_m + DH + o_h, b_hi, mask=m_h)
    m2 = (o_u < 64)[:, None] & m_h[None, :]
    rows_c = p_c + o_u[:, None] * s_kc_t
    tl.store(rows_c + o_h[None, :], ((c_lo & 15) | ((c_hi & 15) << 4)).to(tl.uint8), mask=m2)
    if KW:
        # fifth bits of stored channels [0, R) (all low nibbles): bit b of byte e is
        # stored channel 8e + b
        bits = tl.reshape((c_lo >> 4) & 1, (64, HALF_P // 8, 8))
        plane = tl.sum(bits << tl.arange(0, 8)[None, None, :], 2).to(tl.uint8)
        o_e = tl.arange(0, HALF_P // 8)
        m_e = (o_u < 64)[:, None] & (o_e < E)[None, :]
        tl.store(rows_c + DH + o_e[None, :], plane, mask=m_e)
        # the order, block layout: row u holds order[u + 64 m] in byte DH + E + m
        tl.store(p_c + (o_h % 64) * s_kc_t + DH + E + o_h // 64, ch_lo.to(tl.uint8), mask=m_h)
        o_k = o_h + DH
        tl.store(p_c + (o_k % 64) * s_kc_t + DH + E + o_k // 64, ch_hi.to(tl.uint8), mask=m_h)
