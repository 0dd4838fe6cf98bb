"""Merge split-KV decode partials into the output.

Grid `(B * H_kv, R, cdiv(D, D_BLOCK))` with R = G * L rows per KV head: a single decode
row has few (b, head, row) triples, so the head dims are split too, to spread the
partials' read (splits x D floats per row) over enough SMs. Each split s holds an unnormalized
acc_s, a base-2 max m_s and a denominator l_s; with M = max_s m_s and w_s = 2^(m_s - M):
out = sum_s w_s acc_s / sum_s w_s l_s. Empty splits have m_s = -inf and weigh 0.
HAS_LSE (constexpr, off by default) also stores each row's log-sum-exp of scores,
ln 2 * (M + log2 sum_s w_s l_s), to `Lse` `[B, H_q, L]` float32 (-inf for a row that saw
no key), so partial attentions can be merged (kvtax.attention.lse). PDL: common.pdl_enter / pdl_exit.
"""

import triton
import triton.language as tl

from kvtax.attention.kernels.common import pdl_enter, pdl_exit


@triton.jit(do_not_specialize=["n_q", "num_splits"])
def decode_attn_reduce_kernel(
    PartO, PartM, PartL, Out, n_q, num_splits, n_kv_heads,
    s_ob, s_oh, s_ol, Lse,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, D_BLOCK: tl.constexpr,
    SPLITS_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr, HAS_LSE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL, False, False)  # the next kernel launches first thing (a reduce is short)
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)
    d0 = tl.program_id(2) * D_BLOCK
    n_rows = G * n_q
    base = pid_bh.to(tl.int64) * num_splits * n_rows + r  # row r of split 0
    o_s = tl.arange(0, SPLITS_PAD)
    m_s = tl.load(PartM + base + o_s * n_rows, mask=o_s < num_splits, other=float("-inf"))
    m_max = tl.max(m_s, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_s = tl.load(PartL + base + o_s * n_rows, mask=o_s < num_splits, other=0.0)
    denom = tl.sum(tl.exp2(m_s - m_max) * l_s, 0)

    o_d = d0 + tl.arange(0, D_BLOCK)
    m_d = o_d < HEAD_DIM
    if SPLIT_BLOCK == SPLITS_PAD:
        # One shot: m, l and every partial row are loaded together (one memory round trip
        # instead of one per chunk plus a reload of m); this kernel is latency, not bytes.
        p_o = PartO + (base + o_s * n_rows)[:, None] * HEAD_DIM + o_d[None, :]
        o = tl.load(p_o, mask=(o_s < num_splits)[:, None] & m_d[None, :], other=0.0)
        acc = tl.sum(tl.exp2(m_s - m_max)[:, None] * o, 0)
    else:
        acc = tl.zeros([D_BLOCK], dtype=tl.float32)
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            o_c = s0 + tl.arange(0, SPLIT_BLOCK)
            m_c = o_c < num_splits
            w = tl.exp2(tl.load(PartM + base + o_c * n_rows, mask=m_c, other=float("-inf"))
                        - m_max)
            p_o = PartO + (base + o_c * n_rows)[:, None] * HEAD_DIM + o_d[None, :]
            o = tl.load(p_o, mask=m_c[:, None] & m_d[None, :], other=0.0)  # [SPLIT_BLOCK, D_BLOCK]
            acc += tl.sum(w[:, None] * o, 0)
    out = acc / tl.where(denom == 0.0, 1.0, denom)  # a row that saw nothing → zeros

    b = pid_bh // n_kv_heads
    h = pid_bh % n_kv_heads
    g = r % G
    l = r // G
    p_out = Out + b.to(tl.int64) * s_ob + (h * G + g).to(tl.int64) * s_oh + l.to(tl.int64) * s_ol
    tl.store(p_out + o_d, out.to(Out.dtype.element_ty), mask=m_d)
    if HAS_LSE:  # natural-log sum of exp(scores) of the row, Lse [B, H_q, L]; -inf: no key
        if tl.program_id(2) == 0:
            d_safe = tl.where(denom == 0.0, 1.0, denom)
            lse = tl.where(denom == 0.0, float("-inf"),
                           (m_max + tl.log2(d_safe)) * 0.6931471805599453)
            tl.store(Lse + (pid_bh.to(tl.int64) * G + g) * n_q + l, lse)
    pdl_exit(PDL, False, False)
