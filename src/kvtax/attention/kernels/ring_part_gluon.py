"""A hybrid cache's fp16 part (sinks + a recent window held in a ring) read by extra
programs of the Gluon swap kernel's grid (decode_swap_gluon.py's FOLD), so q4's two parts
take one launch, not two: where the body fills every SM, the part's own launch put the
body's start ~2 µs behind it at 128k (docs/KERNELS.md, "What the fp16 part still costs").

The program walks *positions*, not slots: the sinks [0, min(sinks, length)) and the window
[t0, length) of the last n_q queries (t0 = max(sinks, length - n_q - window + 1)), each
mapped to its slot (sinks + (p - sinks) % ring past the sinks), BF positions a step; step
t of the list goes to split t % S. Per step, one warp, the slots as the MMA's M (as the
body's):

    S^T [BF, 8] = K [BF, D] @ Q^T [D, 8]       O^T [D, 8] += V^T [D, BF] @ P^T [BF, 8]

column c < G * n_q is query row c (head h * G + c % G at position length - n_q + c // G);
the others are zero and never stored. Partials as the body's: unnormalized O, base-2 max,
denominator. Its Triton twin is ring_part.py (the interpreter runs that one).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def _slots(i, n_sink, t0, sinks, ring):
    """(position, slot) of list entry i: the sinks first, then t0, t0 + 1, ..."""
    pos = gl.where(i < n_sink, i, t0 + i - n_sink)
    return pos, gl.where(pos < sinks, pos, sinks + (pos - sinks) % ring)


@gluon.jit
def ring_part_split(q_ptr, part_o, part_m, part_l, fk, fv, b, h, prow0, length, n_q,
                    split, num_splits, sinks, ring, window, qk_scale,
                    s_qb, s_qh, s_ql, s_qd, s_fk_b, s_fk_h, s_fk_t, s_fv_b, s_fv_h, s_fv_t,
                    G: gl.constexpr, D: gl.constexpr):
    """One split of the fp16 part: partials of rows prow0 + c (c < G * n_q). fk, fv: the
    part's K / V `[B, H_kv, slots, D]` (fp16 or bf16, the MMA's type; strides in elements)."""
    BF: gl.constexpr = 16
    NC: gl.constexpr = 8
    LD: gl.constexpr = D // 8  # lanes across a row, 16 B each
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                                  instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    kl: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LD, LD], [1, 1], [1, 0])  # [BF, D]
    dcol_l: gl.constexpr = gl.BlockedLayout([8, 1], [LD, 32 // LD], [1, 1], [0, 1])  # [D, *]
    DT: gl.constexpr = fk.dtype.element_ty
    n_rows = G * n_q

    # Q^T [D, 8]: column c is row c
    qd = gl.arange(0, D, layout=gl.SliceLayout(1, dcol_l))
    qc = gl.arange(0, NC, layout=gl.SliceLayout(0, dcol_l))
    p_q = (q_ptr + b * s_qb + (h * G + qc % G).to(gl.int64)[None, :] * s_qh
           + (qc // G).to(gl.int64)[None, :] * s_ql + qd.to(gl.int64)[:, None] * s_qd)
    qt = gl.load(p_q, mask=(qc < n_rows)[None, :] & (qd < D)[:, None], other=0.0)
    qb = gl.convert_layout(qt.to(DT), b_l)

    n_sink = gl.minimum(sinks, length)
    t0 = gl.maximum(sinks, length - n_q - window + 1)  # the oldest position a row sees
    total = n_sink + gl.maximum(length - t0, 0)
    p_fk = fk + b * s_fk_b + h * s_fk_h
    p_fv = fv + b * s_fv_b + h * s_fv_h
    kr = gl.arange(0, BF, layout=gl.SliceLayout(1, kl))
    kd = gl.arange(0, D, layout=gl.SliceLayout(0, kl))
    vr = gl.arange(0, BF, layout=gl.SliceLayout(0, dcol_l))
    mi = gl.arange(0, BF, layout=row_l)
    mc = gl.arange(0, NC, layout=col_l)
    q_pos = length - n_q + mc // G
    acc = gl.zeros([D, NC], gl.float32, mma)
    zs = gl.zeros([BF, NC], gl.float32, mma)
    m_i = gl.full([NC], float("-inf"), gl.float32, col_l)
    l_i = gl.zeros([NC], gl.float32, col_l)
    for t in range(split, gl.cdiv(total, BF), num_splits):
        _, slot_k = _slots(t * BF + kr, n_sink, t0, sinks, ring)
        kt = gl.load(p_fk + slot_k.to(gl.int64)[:, None] * s_fk_t + kd[None, :],
                     mask=((t * BF + kr) < total)[:, None] & (kd < D)[None, :], other=0.0)
        _, slot_v = _slots(t * BF + vr, n_sink, t0, sinks, ring)
        vt = gl.load(p_fv + slot_v.to(gl.int64)[None, :] * s_fv_t + qd[:, None],
                     mask=((t * BF + vr) < total)[None, :] & (qd < D)[:, None], other=0.0)
        sc = mma_v2(gl.convert_layout(kt, a_l), qb, zs) * qk_scale
        pos, _ = _slots(t * BF + mi, n_sink, t0, sinks, ring)
        d = q_pos[None, :] - pos[:, None]
        vis = ((t * BF + mi) < total)[:, None] & (d >= 0) & ((d < window)
                                                              | (pos < sinks)[:, None])
        sc = gl.where(vis, sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, 0))
        m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_base)  # m_i = -inf: 0 (acc and l are 0 then)
        p = gl.exp2(sc - m_base[None, :])  # hidden slots: exactly 0
        l_i = l_i * alpha + gl.sum(p, 0)
        acc = mma_v2(gl.convert_layout(vt, a_l), gl.convert_layout(p.to(DT), b_l),
                     acc * alpha[None, :])
        m_i = m_new

    prow = prow0 + mc
    ok = mc < n_rows
    gl.store(part_m + prow, m_i, mask=ok)
    gl.store(part_l + prow, l_i, mask=ok)
    od = gl.arange(0, D, layout=row_l)
    gl.store(part_o + prow[None, :] * D + od[:, None], acc, mask=ok[None, :] & (od < D)[:, None])
