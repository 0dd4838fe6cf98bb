"""Dequantize a run of cached slots into a float buffer: the first half of a staged prefill.

Grid `(cdiv(n_pad, BLOCK_N), B * H_kv)`: program (t, bh) dequantizes slots
`[start + t * BLOCK_N, ...)` of one (batch, KV head) into rows `[t * BLOCK_N, ...)` of
`Out` `[B, H_kv, n_pad, D]`, with `dequant.load_kv_tile`, the loads and arithmetic the
attention kernels run in registers, in float32 and rounded once to Out's dtype (the
fused kernels' fp16 / bf16 arithmetic rounds per fma: the two differ by at most an ulp,
and Triton's interpreter computes bf16 bit-cast arithmetic wrongly). Slots at or past
`start + n` are written as what a masked load gives (zeros, or a block's bias): finite,
so the attention that reads them masked never multiplies an Inf or NaN by zero.
int4w-c64 keys, stored in their own channel order, are written back in the model's
(`dequant.half_dims`), so the fp16 attention over `Out` takes the queries as they are.
"""

import triton
import triton.language as tl

from kvtax.attention.kernels.dequant import half_dims, load_block_meta, load_kv_tile, load_meta


@triton.jit(do_not_specialize=["start", "n"])
def stage_slots_kernel(
    Codes, Scales, Biases, Out, start, n, n_kv_heads,
    s_c_b, s_c_h, s_c_t, s_m_b, s_m_h, s_m_t, s_o_b, s_o_h, s_o_t,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, GS: tl.constexpr,
):
    """Grid (cdiv(n_pad, BLOCK_N), B * H_kv): one tile of slots of one (batch, KV head).

    Codes / Scales / Biases: one QTensor's parts `[B, H_kv, slots, width]` (kernel format
    code FMT, group GS; int4-c64 / int3-c64 / int4w-c64 keys' metadata block-aligned and
    packed, as `support.channel_keys_reason` requires, and `start` a multiple of 64 for
    them).
    """
    b = tl.program_id(1) // n_kv_heads
    h = tl.program_id(1) % n_kv_heads
    p_c = Codes + b * s_c_b + h * s_c_h
    p_s = Scales + b * s_m_b + h * s_m_h
    p_b = Biases + b * s_m_b + h * s_m_h
    first = start + tl.program_id(0) * BLOCK_N
    o_n = first + tl.arange(0, BLOCK_N)
    m_n = o_n < start + n
    o_t = o_n.to(tl.int64)
    if FMT == 4 or FMT == 5 or FMT == 7:
        s_lo, b_lo, s_hi, b_hi = load_block_meta(p_s, p_b, first, start + n, HEAD_DIM, BLOCK_N)
    else:
        s_lo, b_lo, s_hi, b_hi = load_meta(p_s, p_b, o_t, m_n, s_m_t, HEAD_DIM, HALF, BLOCK_N,
                                           FMT, GS)
    lo, hi = load_kv_tile(p_c, p_s, p_b, o_t, m_n, s_c_t, s_m_t, s_lo, b_lo, s_hi, b_hi,
                          HEAD_DIM, HALF, BLOCK_N, FMT, GS, tl.float32)
    lo = lo.to(Out.dtype.element_ty)
    hi = hi.to(Out.dtype.element_ty)
    o_r = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    p_o = Out + b * s_o_b + h * s_o_h + o_r[:, None] * s_o_t
    d_lo, d_hi = half_dims(p_c, s_c_t, HEAD_DIM, HALF, FMT)
    m_d = (tl.arange(0, HALF) < HEAD_DIM // 2)[None, :]
    tl.store(p_o + d_lo[None, :], lo, mask=m_d)
    tl.store(p_o + d_hi[None, :], hi, mask=m_d)
