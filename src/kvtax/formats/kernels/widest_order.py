"""int4w-c64's channel order, chosen on the device while block 0 is the open block.

A decode step re-quantizes its open key block (kvtax.cache.blocks.KeyBlocks.write_at);
at block 0 that also re-chooses the sequence's channel order (kvtax.formats.widest.
channel_order), later blocks keep it. A CUDA graph cannot skip the choice on the host,
and in torch it costs every step a [D, D] comparison, a cumsum and a scatter: 3 launches,
~11 us per layer on an H100. This kernel returns at once past block 0 and otherwise
writes what `channel_order` gives, bit for bit: channel i's rank is the number of
channels with a wider range (max - min of block 0's staged keys, NaN as the widest) or an
equal one at a lower index; the R = 3D/8 lowest ranks go first in channel order, then the
rest.
"""

import triton
import triton.language as tl


@triton.jit
def _ranges(p_x, src, m_rows, o_c, m_c):
    """max - min over the block's 64 staged rows (ring offsets src `[64]`, valid where
    m_rows) of channels o_c `[N]`: `[N]` float32, NaN as +inf."""
    x = tl.load(p_x + src[:, None] + o_c[None, :], mask=m_rows[:, None] & m_c[None, :],
                other=0.0).to(tl.float32)
    lo = tl.min(tl.where(m_rows[:, None], x, float("inf")), 0)
    hi = tl.max(tl.where(m_rows[:, None], x, float("-inf")), 0)
    nan = tl.max((x != x).to(tl.int32), 0) > 0  # tl.min / tl.max may drop a NaN: say it
    r = hi - lo
    return tl.where(nan | (r != r), float("inf"), r)


@triton.jit(do_not_specialize=["rows"])
def block0_order_kernel(p_pos, rows, n_heads, p_buf, s_buf_b, s_buf_h, s_buf_t,
                        p_ord, s_ord_b, s_ord_h,
                        HEAD_DIM: tl.constexpr, D_P: tl.constexpr, CH: tl.constexpr):
    """Program (batch, head) = program_id(0): if the position in p_pos `[1]` lies in block 0,
    write its channel order into p_ord `[B, H, D]` int64 from the staged keys p_buf
    `[B, H, rows, D]` (rows 0 .. pos hold positions 0 .. pos; the block's padding repeats
    pos, which leaves every range unchanged, so only those rows are read)."""
    pos = tl.load(p_pos).to(tl.int64)
    if pos >= 64:
        return
    bh = tl.program_id(0)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    p_x = p_buf + b * s_buf_b + h * s_buf_h
    o_u = tl.arange(0, 64)
    src = (o_u % rows) * s_buf_t
    o_d = tl.arange(0, D_P)
    spot = stored_spots(p_x, src, o_u <= pos, HEAD_DIM, D_P, CH)
    tl.store(p_ord + b * s_ord_b + h * s_ord_h + spot, o_d.to(tl.int64), mask=o_d < HEAD_DIM)


@triton.jit
def stored_spots(p_x, src, m_rows, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
                 CH: tl.constexpr):
    """Each channel's stored index `[D_P]` int32 in the order `channel_order` chooses from
    the staged rows at ring offsets src `[64]` (valid where m_rows): the R = 3D/8 widest
    channels first, in channel order, then the others; padding channels map to
    themselves. Also kvtax.formats.kernels.block_store's choice at block 0's end."""
    R: tl.constexpr = 3 * HEAD_DIM // 8
    o_d = tl.arange(0, D_P)
    m_d = o_d < HEAD_DIM
    rng = _ranges(p_x, src, m_rows, o_d, m_d)                      # [D_P], channel i
    rank = tl.zeros([D_P], tl.int32)
    for j0 in tl.static_range(0, D_P, CH):                         # channels j in chunks
        o_j = j0 + tl.arange(0, CH)
        rj = _ranges(p_x, src, m_rows, o_j, o_j < HEAD_DIM)        # [CH]
        beats = (rj[None, :] > rng[:, None]) | \
            ((rj[None, :] == rng[:, None]) & (o_j[None, :] < o_d[:, None]))
        rank += tl.sum((beats & (o_j < HEAD_DIM)[None, :]).to(tl.int32), 1)
    chosen = ((rank < R) & m_d).to(tl.int32)
    before = tl.cumsum(chosen, 0) - chosen                         # chosen channels below i
    spot = tl.where(chosen == 1, before, R + o_d - before)         # channel i's stored index
    return tl.where(m_d, spot, o_d)
