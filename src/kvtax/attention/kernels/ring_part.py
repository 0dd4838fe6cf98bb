"""Triton twin of ring_part_gluon.py (every formula the same; Gluon does not run in
Triton's interpreter, so CI checks the fold here): a hybrid cache's fp16 part (sinks + a
recent window held in a ring) read by extra programs of decode_swap.py's grid (FOLD).

The program walks positions, not slots: the sinks [0, min(sinks, length)) and the window
[t0, length) of the last n_q queries (t0 = max(sinks, length - n_q - window + 1)), each
mapped to its slot (sinks + (p - sinks) % ring past the sinks), 16 positions a step;
step t of the list goes to split t % S. Per step, the slots as the dots' M:

    S^T [16, 8] = K [16, D] @ Q^T [D, 8]       O^T [D, 8] += V^T [D, 16] @ P^T [16, 8]

column c < G * n_q is query row c (head h * G + c % G at position length - n_q + c // G);
the others are zero and never stored. Partials as decode_swap.py's: unnormalized O,
base-2 max, denominator.
"""

import triton
import triton.language as tl


@triton.jit
def _slots(i, n_sink, t0, sinks, ring):
    """(position, slot) of list entry i: the sinks first, then t0, t0 + 1, ..."""
    pos = tl.where(i < n_sink, i, t0 + i - n_sink)
    return pos, tl.where(pos < sinks, pos, sinks + (pos - sinks) % ring)


@triton.jit
def ring_part_split(Q, PartO, PartM, PartL, fk, fv, b, h, prow0, length, n_q,
                    split, num_splits, sinks, ring, window, qk_scale,
                    s_qb, s_qh, s_ql, s_qd, s_fk_b, s_fk_h, s_fk_t, s_fv_b, s_fv_h, s_fv_t,
                    G: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One split of the fp16 part: partials of rows prow0 + c (c < G * n_q). fk, fv: the
    part's K / V `[B, H_kv, slots, D]` (fp16 or bf16, the dots' type; strides in elements)."""
    BF: tl.constexpr = 16
    DT = fk.dtype.element_ty
    n_rows = G * n_q
    o_d = tl.arange(0, HEAD_DIM)
    col = tl.arange(0, 8)
    p_q = (Q + b * s_qb + (h * G + col % G).to(tl.int64)[None, :] * s_qh
           + (col // G).to(tl.int64)[None, :] * s_ql + o_d.to(tl.int64)[:, None] * s_qd)
    qt = tl.load(p_q, mask=(col < n_rows)[None, :], other=0.0).to(DT)  # Q^T [D, 8]

    n_sink = tl.minimum(sinks, length)
    t0 = tl.maximum(sinks, length - n_q - window + 1)  # the oldest position a row sees
    total = n_sink + tl.maximum(length - t0, 0)
    p_fk = fk + b * s_fk_b + h * s_fk_h
    p_fv = fv + b * s_fv_b + h * s_fv_h
    q_pos = length - n_q + col // G
    acc = tl.zeros([HEAD_DIM, 8], dtype=tl.float32)
    m_i = tl.full([8], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([8], dtype=tl.float32)
    for t in range(split, tl.cdiv(total, BF), num_splits):
        i = t * BF + tl.arange(0, BF)
        pos, slot = _slots(i, n_sink, t0, sinks, ring)
        ok = i < total
        kt = tl.load(p_fk + slot.to(tl.int64)[:, None] * s_fk_t + o_d[None, :],
                     mask=ok[:, None], other=0.0)
        vt = tl.load(p_fv + slot.to(tl.int64)[None, :] * s_fv_t + o_d[:, None],
                     mask=ok[None, :], other=0.0)
        sc = tl.dot(kt, qt) * qk_scale  # [16, 8]
        d = q_pos[None, :] - pos[:, None]
        vis = ok[:, None] & (d >= 0) & ((d < window) | (pos < sinks)[:, None])
        sc = tl.where(vis, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 0))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)  # m_i = -inf: 0 (acc and l are 0 then)
        p = tl.exp2(sc - m_base[None, :])  # hidden slots: exactly 0
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = tl.dot(vt, p.to(DT), acc * alpha[None, :])
        m_i = m_new

    prow = prow0 + col
    m_row = col < n_rows
    tl.store(PartM + prow, m_i, mask=m_row)
    tl.store(PartL + prow, l_i, mask=m_row)
    tl.store(PartO + prow[None, :] * HEAD_DIM + o_d[:, None], acc, mask=m_row[None, :])
