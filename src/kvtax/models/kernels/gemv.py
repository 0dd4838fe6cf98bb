"""Batch-1 decode GEMV kernels: y[m, n] = sum_k xn[m, k] · W[n, k], W read once, streaming.

Bytes and FLOPs: one call reads N·K weight elements once (Llama-3.1-8B bf16: 15.0 GB per
token over all layers) and does 2·M·N·K FLOPs, M <= 4: pure bandwidth. Each program
owns BLOCK_N rows of W and one K slice (split-K); it accumulates `w · x` into a
`[BLOCK_N, BLOCK_K]` fp32 tile per input row and reduces over K once, after the loop,
so the loop body is wide 16-byte loads and FMAs only.

ROPE (the qkv projection of a decode step): the rows of each head come in rotary pairs
(d, d + D/2); a program owns BLOCK_N/2 rows of each half of one head, so the epilogue
rotates q and k in registers (out[d] = y[d]·cos[d] + y[d ± D/2]·sin[d], signed sin as
kvtax.models.rope builds it) for the rows below `rope_rows` (q and k; v passes through).
ROPE_FREQS: the tables are not read but computed per row from the positions and inverse
frequencies, as rope_cos_sin computes them (fp32 angles, rounded to the output dtype), so
the decode step needs no kernels to build them.

PDL (programmatic dependent launch; CUDA, sm_90+, launched with launch_pdl): a decode step
is ~240 short kernels and each boundary costs ~2.5 µs of idle memory system (the H200,
benchmarks/kernel_floor.py: a chain of the layers' 128 weight-sized streaming reads
takes 2.49 µs per boundary over one kernel reading the same bytes; 1.66 µs when each
read lets the next launch first thing and waits first thing, 0.68 µs when it waits
after loading its first block). A program lets the next kernel launch at once and waits
(`griddepcontrol.wait`) for the kernels before it to finish before its first load
(PDL_FIRST=False) or after issuing its first W tile (PDL_FIRST: weights depend on
nothing the step writes). The tile is held in W's own dtype and widened after the wait
(as fp32 it cost qkv's RoPE launch 107 registers instead of 93, gate/up 143 instead of
80; in W's dtype 92 and 120, Triton 3.6, sm_90). kvtax.models.gemv picks PDL_FIRST for
qkv, o and down (docs/BENCHMARKS.md); gate/up, at 4 programs per SM instead of 6,
slows the o GEMV beside it.

Fusions: NORM (RMSNorm prologue) is applied as a per-row scale after the loop:
sum_k x·g·W · rsqrt(mean(x²) + eps), with mean(x²) accumulated from the same x loads,
so no program reads x twice. BIAS, RESIDUAL and SILU_MUL (GELU: a GELU-tanh gate) are
epilogues. With split-K the main
kernel writes fp32 partial sums (and partial sums of x² for NORM) to a workspace, and
`gemv_reduce_kernel` adds them in a fixed order and applies the epilogues.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _load_x(p_x, o_k, m_k, b_g, ss, NORM: tl.constexpr, EVEN_K: tl.constexpr):
    """One input row's K chunk in fp32 times the norm weight; adds its squares to `ss`."""
    if EVEN_K:
        b_x = tl.load(p_x + o_k, eviction_policy="evict_last").to(tl.float32)  # [BLOCK_K]
    else:
        b_x = tl.load(p_x + o_k, mask=m_k, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if NORM:
        ss += b_x * b_x
        b_x = b_x * b_g
    return b_x, ss


@triton.jit
def _round_to(v, DTYPE: tl.constexpr):
    """fp32 `v` (finite) rounded to nearest-even in DTYPE, returned as fp32. bf16 by bit
    arithmetic: Triton's interpreter truncates a float32 -> bfloat16 cast (the GPU rounds),
    and the tests check this kernel against torch's rounding in the interpreter."""
    if DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.to(tl.float32, bitcast=True)
    else:
        out = v.to(DTYPE).to(tl.float32)
    return out


@triton.jit
def _fold(t, FOLD: tl.constexpr):
    """`[R, C]` → `[R, C / FOLD]`: sums of FOLD neighbouring columns (FOLD 1: t)."""
    if FOLD == 1:
        out = t
    else:
        out = tl.sum(tl.reshape(t, [t.shape[0], t.shape[1] // FOLD, FOLD]), 2)
    return out


@triton.jit
def _finish_row(
    acc, acc_u, ss, row, pid_n, pid_s, o_n, m_n, B, R, Y, WS, SS,
    N, K, stride_rm, stride_ym, eps, rope,
    ROWS: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr, GELU: tl.constexpr, SPLIT: tl.constexpr, ROPE: tl.constexpr,
    ROPE_FREQS: tl.constexpr = False,
):
    """Reduce one row's tiles over K, then store a partial (SPLIT) or the finished output."""
    y = tl.sum(acc, 1)  # [BLOCK_N]
    if SPLIT:
        ws_row = (pid_s * ROWS + row).to(tl.int64) * N
        tl.store(WS + ws_row + o_n, y, mask=m_n)
        if NORM:  # every N block computes the same x² sum; block 0 writes it
            tl.store(SS + pid_s * ROWS + row, tl.sum(ss, 0), mask=pid_n == 0)
    else:
        u = tl.sum(acc_u, 1) if SILU_MUL else y
        _epilogue(y, u, tl.sum(ss, 0), row, o_n, m_n, B, R, Y, K, stride_rm, stride_ym, eps,
                  NORM, BIAS, RESIDUAL, SILU_MUL, GELU, rope, ROPE, ROPE_FREQS)


@triton.jit
def _rope_factors(rope, o_n, row, DTYPE: tl.constexpr, ROPE_FREQS: tl.constexpr):
    """(cos, signed sin) `[BLOCK_N]` fp32 of output rows `o_n` at input row `row`'s position
    (`rope`: see _epilogue): read from the tables, or (ROPE_FREQS) computed as
    kvtax.models.rope.rope_cos_sin does, fp32 angles rounded to DTYPE."""
    cs_t, sn_t, stride_cs, n_pos, rope_rows, head_dim = rope
    d = o_n % head_dim
    t = row % n_pos
    if ROPE_FREQS:
        d_half = head_dim // 2
        angle = tl.load(cs_t + t).to(tl.float32) * tl.load(sn_t + d % d_half)
        cs = _round_to(tl.cos(angle), DTYPE)
        sn = tl.sin(angle)
        sn = _round_to(tl.where(d < d_half, -sn, sn), DTYPE)
    else:
        cs = tl.load(cs_t + t * stride_cs + d).to(tl.float32)
        sn = tl.load(sn_t + t * stride_cs + d).to(tl.float32)
    return cs, sn


@triton.jit
def _epilogue(y, u, ss, row, o_n, m_n, B, R, Y, K, stride_rm, stride_ym, eps,
              NORM: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
              SILU_MUL: tl.constexpr, GELU: tl.constexpr, rope=None, ROPE: tl.constexpr = False,
              ROPE_FREQS: tl.constexpr = False):
    """Finish one row's `[BLOCK_N]` sums and store them: y (and u, the up rows' sums, under
    SILU_MUL) times rsqrt(ss / K + eps) (NORM; ss the row's sum of x²), plus the bias
    (BIAS, not with SILU_MUL), rotated (ROPE: y's halves hold the two rotary halves of
    one head; `rope` = (cos, signed sin tables [n_pos, D], their row stride, n_pos, the
    rotated row count; ROPE_FREQS: positions `[n_pos]` and inverse frequencies `[D / 2]`
    fp32 in place of the tables); input row `row` is position row % n_pos), act(y) · u with
    act SiLU or (GELU) GELU-tanh, plus the residual row."""
    if NORM:
        rstd = tl.rsqrt(ss / K + eps)
        y = y * rstd
        u = u * rstd
    if BIAS:
        y += tl.load(B + o_n, mask=m_n, other=0.0).to(tl.float32)
    if ROPE:
        rope_rows = rope[4]
        cs, sn = _rope_factors(rope, o_n, row, Y.dtype.element_ty, ROPE_FREQS)
        half: tl.constexpr = y.shape[0] // 2
        partner = tl.reshape(tl.flip(tl.reshape(y, (2, half)), 0), (y.shape[0],))  # d ± D/2
        y = tl.where(o_n < rope_rows, y * cs + partner * sn, y)
    if SILU_MUL:
        if GELU:  # 0.5 y (1 + tanh(z)) = y sigmoid(2 z), z = sqrt(2 / pi) (y + 0.044715 y^3)
            y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y)) * u
        else:
            y = y * tl.sigmoid(y) * u
    if RESIDUAL:
        y += tl.load(R + row * stride_rm + o_n, mask=m_n, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_ym + o_n, y.to(Y.dtype.element_ty), mask=m_n)


@triton.jit
def gemv_kernel(
    X, W, G, B, R, Y, WS, SS,
    N, K, K_PER, stride_xm, stride_wn, stride_rm, stride_ym, eps,
    CS, SN, stride_cs, n_pos, rope_rows,
    ROWS: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr, BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr, GELU: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROPE: tl.constexpr = False, HEAD_DIM: tl.constexpr = 0, PDL: tl.constexpr = False,
    PDL_FIRST: tl.constexpr = False, FOLD: tl.constexpr = 1,
    ROPE_FREQS: tl.constexpr = False,
):
    """Grid (cdiv(N, BLOCK_N), splits). X `[ROWS, K]`, W `[N (or 2N: SILU_MUL), K]` rows,
    G `[K]` norm weight, B `[N]` bias, R/Y `[ROWS, N]`; WS `[splits, ROWS, N]` fp32,
    SS `[splits, ROWS]`.

    N counts output columns (SILU_MUL: gate rows [0, N), up rows [N, 2N) of W). Each split
    covers K_PER columns of K (a multiple of BLOCK_K). Rows of W past N are clamped to
    row N - 1 (read, never stored) so the W loads need no row mask. ROPE (unsplit, N a
    multiple of HEAD_DIM, BLOCK_N even and dividing HEAD_DIM): see the module docstring;
    CS / SN `[n_pos, HEAD_DIM]` (ROPE_FREQS: positions `[n_pos]`, inverse frequencies
    `[HEAD_DIM / 2]` fp32), rows below rope_rows rotated. PDL: see the module
    docstring (the wait sits between the first step's W loads and its x loads). FOLD:
    each step's products are summed in groups of FOLD neighbouring columns (within a
    lane's own vector: no shuffles) before they join the accumulators, which are then
    `[BLOCK_N, BLOCK_K / FOLD]`, so a tile with long runs per W row (2 x 2048) fits the
    registers (kvtax.models.gemv.default_config).

    Over 80 lines: the loop body and epilogues are unrolled by hand for up to four input
    rows, each row's accumulators a separate named tile.
    """
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    if ROPE:  # BLOCK_N / 2 rows of each rotary half of one head
        HB: tl.constexpr = BLOCK_N // 2
        PER_HEAD: tl.constexpr = HEAD_DIM // BLOCK_N  # programs per head
        j = tl.arange(0, BLOCK_N)
        o_n = ((pid_n // PER_HEAD) * HEAD_DIM + (pid_n % PER_HEAD) * HB + j % HB
               + (j // HB) * (HEAD_DIM // 2))
    else:
        o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < N
    o_w = tl.minimum(o_n, N - 1).to(tl.int64)
    p_w = W + o_w[:, None] * stride_wn  # [BLOCK_N, 1]
    p_u = W + (o_w + N)[:, None] * stride_wn  # up rows (SILU_MUL only)
    if PDL:  # (the pointer arithmetic above touches no memory: it overlaps the wait)
        gdc_launch_dependents()
        if not PDL_FIRST:  # wait before any load (no W tile held across the wait)
            gdc_wait()
    acc0 = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    up0 = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    up1 = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    up2 = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    up3 = tl.zeros([BLOCK_N, BLOCK_K // FOLD], dtype=tl.float32)
    ss0 = tl.zeros([BLOCK_K], dtype=tl.float32)
    ss1 = tl.zeros([BLOCK_K], dtype=tl.float32)
    ss2 = tl.zeros([BLOCK_K], dtype=tl.float32)
    ss3 = tl.zeros([BLOCK_K], dtype=tl.float32)
    b_g = tl.zeros([BLOCK_K], dtype=tl.float32)
    b_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = pid_s * K_PER
    for k0 in range(k_start, k_start + K_PER, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        m_k = o_k < K
        # loaded in W's own dtype and widened after the PDL wait: a first tile held across
        # the wait costs half the registers it would as fp32
        if EVEN_K:
            raw_w = tl.load(p_w + o_k[None, :], eviction_policy="evict_first")
            if SILU_MUL:
                raw_u = tl.load(p_u + o_k[None, :], eviction_policy="evict_first")
            if NORM:
                raw_g = tl.load(G + o_k)
        else:
            raw_w = tl.load(p_w + o_k[None, :], mask=m_k[None, :], other=0.0,
                            eviction_policy="evict_first")  # [BLOCK_N, BLOCK_K]
            if SILU_MUL:
                raw_u = tl.load(p_u + o_k[None, :], mask=m_k[None, :], other=0.0,
                                eviction_policy="evict_first")
            if NORM:
                raw_g = tl.load(G + o_k, mask=m_k, other=0.0)
        if PDL and PDL_FIRST:
            if k0 == k_start:  # W (and g) are in flight; x comes from the kernel before
                gdc_wait()
        b_w = raw_w.to(tl.float32)
        if SILU_MUL:
            b_u = raw_u.to(tl.float32)
        if NORM:
            b_g = raw_g.to(tl.float32)
        if OFFSET:
            b_g = b_g + 1.0
        b_x, ss0 = _load_x(X, o_k, m_k, b_g, ss0, NORM, EVEN_K)
        acc0 += _fold(b_w * b_x[None, :], FOLD)
        if SILU_MUL:
            up0 += _fold(b_u * b_x[None, :], FOLD)
        if ROWS > 1:
            b_x, ss1 = _load_x(X + stride_xm, o_k, m_k, b_g, ss1, NORM, EVEN_K)
            acc1 += _fold(b_w * b_x[None, :], FOLD)
            if SILU_MUL:
                up1 += _fold(b_u * b_x[None, :], FOLD)
        if ROWS > 2:
            b_x, ss2 = _load_x(X + 2 * stride_xm, o_k, m_k, b_g, ss2, NORM, EVEN_K)
            acc2 += _fold(b_w * b_x[None, :], FOLD)
            if SILU_MUL:
                up2 += _fold(b_u * b_x[None, :], FOLD)
        if ROWS > 3:
            b_x, ss3 = _load_x(X + 3 * stride_xm, o_k, m_k, b_g, ss3, NORM, EVEN_K)
            acc3 += _fold(b_w * b_x[None, :], FOLD)
            if SILU_MUL:
                up3 += _fold(b_u * b_x[None, :], FOLD)
    rope = (CS, SN, stride_cs, n_pos, rope_rows, HEAD_DIM)
    _finish_row(acc0, up0, ss0, 0, pid_n, pid_s, o_n, m_n, B, R, Y, WS, SS, N, K, stride_rm,
                stride_ym, eps, rope, ROWS, NORM, BIAS, RESIDUAL, SILU_MUL, GELU, SPLIT, ROPE,
                ROPE_FREQS)
    if ROWS > 1:
        _finish_row(acc1, up1, ss1, 1, pid_n, pid_s, o_n, m_n, B, R, Y, WS, SS, N, K, stride_rm,
                    stride_ym, eps, rope, ROWS, NORM, BIAS, RESIDUAL, SILU_MUL, GELU, SPLIT, ROPE,
                    ROPE_FREQS)
    if ROWS > 2:
        _finish_row(acc2, up2, ss2, 2, pid_n, pid_s, o_n, m_n, B, R, Y, WS, SS, N, K, stride_rm,
                    stride_ym, eps, rope, ROWS, NORM, BIAS, RESIDUAL, SILU_MUL, GELU, SPLIT, ROPE,
                    ROPE_FREQS)
    if ROWS > 3:
        _finish_row(acc3, up3, ss3, 3, pid_n, pid_s, o_n, m_n, B, R, Y, WS, SS, N, K, stride_rm,
                    stride_ym, eps, rope, ROWS, NORM, BIAS, RESIDUAL, SILU_MUL, GELU, SPLIT, ROPE,
                    ROPE_FREQS)


@triton.jit
def gemv_reduce_kernel(
    WS, SS, B, R, Y,
    N, N_WS, K, SPLITS, stride_rm, stride_ym, eps,
    ROWS: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr, GELU: tl.constexpr,
    SPLITS_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N), ROWS): y[row] = epilogue(sum over splits of WS[s, row]).

    WS `[SPLITS, ROWS, N_WS]` fp32 partials (N_WS = 2N under SILU_MUL: gate then up
    columns), SS `[SPLITS, ROWS]` partial sums of x² (NORM). Splits are added in order,
    so the result does not depend on which program finished first.
    """
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < N
    o_s = tl.arange(0, SPLITS_P)  # [SPLITS_P]
    m_s = o_s < SPLITS
    p_ws = WS + (o_s[:, None] * ROWS + row).to(tl.int64) * N_WS + o_n[None, :]
    # p_ws: [SPLITS_P, BLOCK_N]
    m_ws = m_s[:, None] & m_n[None, :]
    y = tl.sum(tl.load(p_ws, mask=m_ws, other=0.0), 0)  # [BLOCK_N]
    ss = 0.0
    if NORM:
        ss = tl.sum(tl.load(SS + o_s * ROWS + row, mask=m_s, other=0.0), 0)
    u = tl.sum(tl.load(p_ws + N, mask=m_ws, other=0.0), 0) if SILU_MUL else y
    _epilogue(y, u, ss, row, o_n, m_n, B, R, Y, K, stride_rm, stride_ym, eps, NORM, BIAS,
              RESIDUAL, SILU_MUL, GELU)
