"""int4w-c64 keys' fifth bits in the attention kernels (kernel format code 7).

int4w-c64 (kvtax.formats.widest) is int4-c64 plus a fifth bit on the R = 3D/8 widest
channels of each 64-slot block. A slot's code row holds int4-c64's split-halves nibbles
(bytes [0, D/2)), then its fifth bits in slot order as one bit plane (bytes
[D/2, D/2 + R/8): slot j in byte j % (R/8) at bit j // (R/8)), then the block's channel
indices, one byte per row (slot j in row j % 64 of the block, byte D/2 + R/8 + j // 64).

The tile kernels do not gather per channel: a block's indices make two one-hot matrices
`[D/2, D/2]` (slots padded from R to D/2, a power of two; padding selects no channel), and
tensor-core dots move values between channel order and slot order exactly, since each
output is one product by 1 plus zeros:
  keys (prefill, staging): fifth[n, d] = bits[n, :] @ onehot[:, d], then the key is
      scale * (nibble + 16 * fifth) + bias, as int4-c64's with 5-bit codes;
  scores (decode's fold): sel[m, j] = (q * scale)[m, :] @ onehot[:, j], then the fifth
      bits add 16 * sel @ bits^T to int4-c64's folded scores.
decode_warp.py, one warp a program, has no registers for those matrices and gathers the
selected channels' queries and scales from memory instead (`gathered_fifth_scores`).
A tile must lie in one block (BLOCK_N <= 64): the launch table keeps it so. R = 3D/8 is
kvtax.formats.widest's fraction; `support.channel_keys_reason` refuses any other.
"""

import triton
import triton.language as tl


@triton.jit
def block_indices(p_kc, first, s_kc, HEAD_DIM: tl.constexpr):
    """Channel of each slot of the block holding slot `first`: `[D/2]` int32, -1 past
    slot R - 1. p_kc points at the (batch, head)'s slot 0; s_kc is the code row stride."""
    DH: tl.constexpr = HEAD_DIM // 2
    R: tl.constexpr = 3 * HEAD_DIM // 8
    E: tl.constexpr = R // 8
    o_j = tl.arange(0, DH)
    base = (first // 64) * 64
    p = p_kc + (base + o_j % 64).to(tl.int64) * s_kc + (DH + E + o_j // 64)
    idx = tl.load(p, mask=o_j < R, other=0).to(tl.int32)
    return tl.where(o_j < R, idx, -1)


@triton.jit
def block_onehots(p_kc, first, s_kc, HEAD_DIM: tl.constexpr, DT: tl.constexpr):
    """One-hot channel columns of the block holding slot `first`: (sel_lo, sel_hi), each
    `[D/2, D/2]` in DT, sel_lo[d, j] = 1 where slot j holds channel d (sel_hi: channel
    d + D/2)."""
    DH: tl.constexpr = HEAD_DIM // 2
    idx = block_indices(p_kc, first, s_kc, HEAD_DIM)
    o_d = tl.arange(0, DH)
    sel_lo = (o_d[:, None] == idx[None, :]).to(DT)
    sel_hi = ((o_d + DH)[:, None] == idx[None, :]).to(DT)
    return sel_lo, sel_hi


@triton.jit
def fifth_bits(p_kc, o_t, m_t, s_kc, HEAD_DIM: tl.constexpr, DT: tl.constexpr):
    """Fifth bits of slots `o_t` `[BLOCK_N]` (int64; rows where `m_t` is False read 0,
    m_t None: every row) in slot order: `[BLOCK_N, D/2]` in DT, 0 past slot R - 1."""
    DH: tl.constexpr = HEAD_DIM // 2
    R: tl.constexpr = 3 * HEAD_DIM // 8
    E: tl.constexpr = R // 8
    o_j = tl.arange(0, DH)
    m_j = o_j < R
    if m_t is None:
        m = m_j[None, :]
    else:
        m = m_t[:, None] & m_j[None, :]
    byte = tl.load(p_kc + o_t[:, None] * s_kc + (DH + o_j % E)[None, :], mask=m, other=0)
    shift = tl.where(m_j, o_j // E, 0)
    return ((byte.to(tl.int32) >> shift[None, :]) & 1).to(DT)


@triton.jit
def fifth_key_bits(p_kc, o_t, m_t, s_kc, HEAD_DIM: tl.constexpr):
    """Fifth bits of slots `o_t` in channel order: (f_lo, f_hi) `[BLOCK_N, D/2]` float32,
    0 or 1. The slots lie in one block."""
    bits = fifth_bits(p_kc, o_t, m_t, s_kc, HEAD_DIM, tl.float16)
    sel_lo, sel_hi = block_onehots(p_kc, tl.min(o_t, 0), s_kc, HEAD_DIM, tl.float16)
    return tl.dot(bits, tl.trans(sel_lo)), tl.dot(bits, tl.trans(sel_hi))


@triton.jit
def fifth_bit_scores(qs_lo, qs_hi, p_kc, o_t, m_t, s_kc, HEAD_DIM: tl.constexpr,
                     IEEE: tl.constexpr):
    """The fifth bits' share of folded scores: 16 * sum_j (q * s)[m, idx_j] * bit[n, j],
    `[BLOCK_M, BLOCK_N]` float32. qs_lo, qs_hi `[BLOCK_M, D/2]`: the queries times the
    block's key scales, as `_fold_qk_blocks` rounded them (the dots' dtype)."""
    dt = qs_lo.dtype
    sel_lo, sel_hi = block_onehots(p_kc, tl.min(o_t, 0), s_kc, HEAD_DIM, dt)
    bits = fifth_bits(p_kc, o_t, m_t, s_kc, HEAD_DIM, dt)
    if IEEE:
        sel = tl.dot(qs_lo, sel_lo, input_precision="ieee")
        sel = tl.dot(qs_hi, sel_hi, sel, input_precision="ieee")
        s5 = tl.dot(sel.to(dt), tl.trans(bits), input_precision="ieee")
    else:
        sel = tl.dot(qs_hi, sel_hi, tl.dot(qs_lo, sel_lo))  # exact: one nonzero term each
        s5 = tl.dot(sel.to(dt), tl.trans(bits))
    return 16.0 * s5


@triton.jit
def gathered_fifth_scores(p_q, s_qd, m_row, p_ks, p_kc, start, o_n, m_n, s_kc,
                          HEAD_DIM: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr):
    """decode_warp.py's share of the fifth bits, `[BLOCK_M, BLOCK_N]` float32: as
    `fifth_bit_scores`, but the selected channels' queries and block scales are gathered
    from memory (a few hundred bytes, in L1) instead of selected by one-hot dots, which a
    one-warp program has no registers for. p_q `[BLOCK_M, 1]`: the query rows' pointers
    (dim stride s_qd), m_row their mask; p_ks the head's key scales; o_n `[BLOCK_N]` the
    tile's slots (m_n their mask or None). q * s rounds to DT as `_block_scores` rounds it."""
    DH: tl.constexpr = HEAD_DIM // 2
    R: tl.constexpr = 3 * HEAD_DIM // 8
    o_j = tl.arange(0, DH)
    m_j = o_j < R
    idx = tl.where(m_j, block_indices(p_kc, start, s_kc, HEAD_DIM), 0)
    q = tl.load(p_q + idx[None, :] * s_qd, mask=m_row[:, None] & m_j[None, :], other=0.0)
    o_b = (start // 64 + tl.arange(0, 1)).to(tl.int64)  # [1]: the block, offsets in int64
    sc = tl.load(p_ks + o_b * HEAD_DIM + idx, mask=m_j, other=0.0)
    qs = (q.to(DT).to(tl.float32) * sc.to(tl.float32)[None, :]).to(DT)
    bits = fifth_bits(p_kc, o_n.to(tl.int64), m_n, s_kc, HEAD_DIM, DT)
    if IEEE:
        s5 = tl.dot(qs, tl.trans(bits), input_precision="ieee")
    else:
        s5 = tl.dot(qs, tl.trans(bits))
    return 16.0 * s5
