"""int4w-c64 keys' fifth bits in the attention kernels (kernel format code 7).

int4w-c64 (kvtax.formats.widest) is int4-c64 plus a fifth bit on the R = 3D/8 widest
channels of each 64-slot block. A slot's code row holds int4-c64's split-halves nibbles
(bytes [0, D/2)), then its fifth bits in slot order as one bit plane (bytes
[D/2, D/2 + R/8): slot j in byte j % (R/8) at bit j // (R/8)), then the block's channel
indices, one byte per row (slot j in row j % 64 of the block, byte D/2 + R/8 + j // 64).

The kernels never gather per channel. A block's indices make two one-hot matrices
`[D/2, D/2]` (slots padded from R to D/2, a power of two; padding selects no channel), and
tensor-core dots move values between channel order and slot order exactly, since each
output is one product by 1 plus zeros:
  keys (prefill, staging): fifth[n, d] = bits[n, :] @ onehot[:, d], then the key is
      scale * (nibble + 16 * fifth) + bias, as int4-c64's with 5-bit codes;
  scores (decode's fold): sel[m, j] = (q * scale)[m, :] @ onehot[:, j], then the fifth
      bits add 16 * sel @ bits^T to int4-c64's folded scores.
A tile must lie in one block (BLOCK_N <= 64): the launch table keeps it so.
"""

import triton
import triton.language as tl


@triton.jit
def block_onehots(p_kc, first, s_kc, HEAD_DIM: tl.constexpr, DT: tl.constexpr):
    """One-hot channel columns of the block holding slot `first`: (sel_lo, sel_hi), each
    `[D/2, D/2]` in DT, sel_lo[d, j] = 1 where slot j holds channel d (sel_hi: channel
    d + D/2). p_kc points at the (batch, head)'s slot 0; s_kc is the code row stride."""
    DH: tl.constexpr = HEAD_DIM // 2
    R: tl.constexpr = 3 * HEAD_DIM // 8
    E: tl.constexpr = R // 8
    o_j = tl.arange(0, DH)
    base = (first // 64) * 64
    p = p_kc + (base + o_j % 64).to(tl.int64) * s_kc + (DH + E + o_j // 64)
    idx = tl.load(p, mask=o_j < R, other=0).to(tl.int32)
    idx = tl.where(o_j < R, idx, -1)  # [D/2] channel of each slot; padding: none
    o_d = tl.arange(0, DH)
    sel_lo = (o_d[:, None] == idx[None, :]).to(DT)
    sel_hi = ((o_d + DH)[:, None] == idx[None, :]).to(DT)
    return sel_lo, sel_hi


@triton.jit
def fifth_bits(p_kc, o_t, m_t, s_kc, HEAD_DIM: tl.constexpr, DT: tl.constexpr):
    """Fifth bits of slots `o_t` `[BLOCK_N]` (int64; masked rows `m_t` False read 0) in
    slot order: `[BLOCK_N, D/2]` in DT, 0 past slot R - 1."""
    DH: tl.constexpr = HEAD_DIM // 2
    R: tl.constexpr = 3 * HEAD_DIM // 8
    E: tl.constexpr = R // 8
    o_j = tl.arange(0, DH)
    m_j = o_j < R
    byte = tl.load(p_kc + o_t[:, None] * s_kc + (DH + o_j % E)[None, :],
                   mask=m_t[:, None] & m_j[None, :], other=0)
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
