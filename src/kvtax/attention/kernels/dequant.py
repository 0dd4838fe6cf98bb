"""Load a tile of cached K or V rows and dequantize it in registers.

Every format is returned as two half-width tiles `[BLOCK_N, HALF]` holding dims
`[0, D/2)` and `[D/2, D)` (HALF = D/2 rounded up to a power of two, padding masked to
0). That is int4's split-halves packing natively: one byte tile gives both halves with
one mask and one shift; the other formats load the two half rows. Attention then does
two half-width `tl.dot`s per tile instead of one full-width one.

Scales and biases are tiny (2-byte) loads that Triton cannot stage through cp.async, so
the kernels fetch them one tile ahead with `load_meta` and carry them in registers:
their latency hides behind the current tile instead of stalling every iteration.

Format codes (constexpr): 0 float (fp16/bf16/fp32 rows), 1 int8 affine, 2 int4 affine
(split halves), 3 fp8 e4m3 with one scale per row (codes passed as uint8), 4 int4-c64
keys (int4's split-halves codes; one scale and bias per channel per 64-slot block,
kvtax.formats.channel, read by `load_block_meta`), 5 int3-c64 keys (code 4's block
metadata, 3-bit codes), 6 int3 affine (code 2's per-token groups, 3-bit codes), 7
int4w-c64 keys (code 4's layout in a stored channel order, plus a fifth bit on the low
nibbles of stored channels [0, 3D/8), kernels/widest.py: its tiles hold the stored
channels, `half_dims` says which model dims). 3-bit codes are kvtax.formats.packing's two
bit planes, unpacked by `_int3_codes`.
"""

import triton
import triton.language as tl

from kvtax.attention.kernels.widest import fifth_bits, stored_channels


@triton.jit
def _codes_to_f32(c):
    """Exact uint8 codes → float32 without the slow int→float unit: 2^23 + c has c
    as its mantissa, so OR-ing the exponent in and subtracting 2^23 is exact."""
    return (c.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _meta_half(p_meta, o_t, m_t, s_mt, OFF: tl.constexpr, HEAD_DIM: tl.constexpr,
               GS: tl.constexpr):
    """Groups of the half starting at dim OFF: `[BLOCK_N]` when one group covers it,
    else `[BLOCK_N, D/2 / GS]` (D a power of two, so groups never straddle halves)."""
    DH: tl.constexpr = HEAD_DIM // 2
    if GS >= DH:
        x = tl.load(p_meta + o_t * s_mt + OFF // GS, mask=m_t, other=0.0)
    else:
        o_g = tl.arange(0, DH // GS) + OFF // GS
        x = tl.load(p_meta + o_t[:, None] * s_mt + o_g[None, :], mask=m_t[:, None], other=0.0)
    return x


@triton.jit
def load_meta(p_scales, p_biases, o_t, m_t, s_mt, HEAD_DIM: tl.constexpr,
              HALF: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr,
              GS: tl.constexpr):
    """Compact scales/biases of slots `o_t` `[BLOCK_N]`: (s_lo, b_lo, s_hi, b_hi).

    Each is `[BLOCK_N]` (one group per half, fp8's row scale) or `[BLOCK_N, NGH]`.
    Unused entries are zeros (float formats; fp8 uses s_lo only; head dims that are not
    a power of two gather theirs inside `load_kv_tile` instead).
    """
    none = tl.zeros([BLOCK_N], dtype=tl.float16)
    s_lo = none
    b_lo = none
    s_hi = none
    b_hi = none
    if FMT == 3:
        s_lo = tl.load(p_scales + o_t * s_mt, mask=m_t, other=0.0)
    elif (FMT == 1 or FMT == 2 or FMT == 6) and HALF == HEAD_DIM // 2:
        s_lo = _meta_half(p_scales, o_t, m_t, s_mt, 0, HEAD_DIM, GS)
        b_lo = _meta_half(p_biases, o_t, m_t, s_mt, 0, HEAD_DIM, GS)
        s_hi = _meta_half(p_scales, o_t, m_t, s_mt, HEAD_DIM // 2, HEAD_DIM, GS)
        b_hi = _meta_half(p_biases, o_t, m_t, s_mt, HEAD_DIM // 2, HEAD_DIM, GS)
    return s_lo, b_lo, s_hi, b_hi


@triton.jit
def load_block_meta(p_scales, p_biases, start, num_slots, HEAD_DIM: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """int4-c64 / int3-c64 scales/biases of the tile at slot `start`: (s_lo, b_lo, s_hi, b_hi), each
    `[NB, D/2]` in the stored dtype, NB = max(BLOCK_N / 64, 1) blocks.

    Per (batch, head) the metadata is `[slots / 64, D]` row-major, so block j's vector is
    the D values at j * D. Tiles start at multiples of BLOCK_N (a power of two), so a tile
    of <= 64 slots lies in one block: one vector serves all its rows. Blocks past
    `num_slots` read 0 (the prefetch past the last tile)."""
    DH: tl.constexpr = HEAD_DIM // 2
    NB: tl.constexpr = BLOCK_N // 64 if BLOCK_N > 64 else 1
    o_b = (start // 64 + tl.arange(0, NB)).to(tl.int64)
    m_b = (o_b * 64 < num_slots)[:, None]
    o_d = tl.arange(0, DH)[None, :]
    p_lo = o_b[:, None] * HEAD_DIM + o_d  # [NB, DH]
    s_lo = tl.load(p_scales + p_lo, mask=m_b, other=0.0)
    b_lo = tl.load(p_biases + p_lo, mask=m_b, other=0.0)
    s_hi = tl.load(p_scales + p_lo + DH, mask=m_b, other=0.0)
    b_hi = tl.load(p_biases + p_lo + DH, mask=m_b, other=0.0)
    return s_lo, b_lo, s_hi, b_hi


@triton.jit
def expand_blocks(x, BLOCK_N: tl.constexpr, DH: tl.constexpr, MATH: tl.constexpr):
    """`load_block_meta`'s `[NB, D/2]` → one row per slot: `[1, D/2]` (broadcasts over the
    tile) when the tile lies in one block, else each block's row repeated 64 times."""
    x = x.to(MATH)
    if BLOCK_N > 64:
        NB: tl.constexpr = BLOCK_N // 64
        x = tl.reshape(tl.broadcast_to(x[:, None, :], (NB, 64, DH)), (BLOCK_N, DH))
    return x


@triton.jit
def _expand(x, HALF: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr,
            MATH: tl.constexpr):
    """`[BLOCK_N]` → `[BLOCK_N, 1]` (broadcasts); `[BLOCK_N, NGH]` repeats each group GS
    times to `[BLOCK_N, HALF]`."""
    x = x.to(MATH)
    if GS >= HALF:
        x = x[:, None]
    else:
        x = tl.reshape(tl.broadcast_to(x[:, :, None], (BLOCK_N, HALF // GS, GS)), (BLOCK_N, HALF))
    return x


@triton.jit
def _gather_half(p_meta, o_t, m_t, s_mt, OFF: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HALF: tl.constexpr, GS: tl.constexpr):
    """Per-dim group parameter for D = 80, 96, whose groups straddle the halves."""
    o_d = tl.arange(0, HALF)
    m = m_t[:, None] & (o_d < HEAD_DIM // 2)[None, :]
    p = p_meta + o_t[:, None] * s_mt + ((o_d + OFF) // GS)[None, :]
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@triton.jit
def load_kv_tile(p_codes, p_scales, p_biases, o_t, m_t, s_ct, s_mt,
                 s_lo, b_lo, s_hi, b_hi,
                 HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                 FMT: tl.constexpr, GS: tl.constexpr, DTYPE: tl.constexpr):
    """Dequantized rows of slots `o_t` `[BLOCK_N]` (int64) of one (batch, KV head).

    p_codes/p_scales/p_biases point at the head's slot 0; s_ct / s_mt are the slot
    strides of codes and of scales/biases (elements); s_lo..b_hi come from `load_meta`.
    With DTYPE fp16 the codes convert and scale in fp16; bf16 int4 / int3 codes in bf16 (exact,
    one rounding per FMA: prefill 244 -> 296 TFLOP/s on an H200); else in float32.
    Masked slots (`m_t` False) read 0. Returns lo, hi `[BLOCK_N, HALF]` in DTYPE (int4w-c64:
    the stored channels, `half_dims`).
    """
    DH: tl.constexpr = HEAD_DIM // 2
    # fp16 models dequantize in fp16 (an fma rounds once, as f32-then-round does); bf16
    # models int4 / int3 codes in bf16 too (0..31 are exact, the fma rounds once); else
    # float32
    MATH: tl.constexpr = (tl.float16 if DTYPE == tl.float16 else
                          tl.bfloat16 if DTYPE == tl.bfloat16 and (
                              FMT == 2 or FMT == 4 or FMT == 5 or FMT == 6 or FMT == 7)
                          else tl.float32)
    o_d = tl.arange(0, HALF)
    m = m_t[:, None] & (o_d < DH)[None, :]
    p_row = p_codes + o_t[:, None] * s_ct  # [BLOCK_N, 1]
    if FMT == 2 or FMT == 4 or FMT == 7:
        c_lo, c_hi = _nibbles(p_row, o_d, m_t, m, HEAD_DIM, FMT)  # [BLOCK_N, HALF]
        c_lo = _codes_to(c_lo, MATH)
        c_hi = _codes_to(c_hi, MATH)
    elif FMT == 5 or FMT == 6:
        i_lo, i_hi = _int3_codes(p_row, o_d, m_t, m, HEAD_DIM, HALF)
        c_lo = _codes_to(i_lo, MATH)
        c_hi = _codes_to(i_hi, MATH)
    else:
        r_lo = tl.load(p_row + o_d[None, :], mask=m, other=0)
        r_hi = tl.load(p_row + (o_d + DH)[None, :], mask=m, other=0)
        if FMT == 1:
            c_lo = _codes_to(r_lo, MATH)
            c_hi = _codes_to(r_hi, MATH)
        elif FMT == 3:
            # fp8 codes arrive as uint8 (the interpreter can't fill fp8 masks)
            c_lo = r_lo.to(tl.float8e4nv, bitcast=True).to(MATH)
            c_hi = r_hi.to(tl.float8e4nv, bitcast=True).to(MATH)
        else:
            c_lo = r_lo
            c_hi = r_hi
    if FMT == 0:
        lo = r_lo
        hi = r_hi
    elif FMT == 3:
        lo = c_lo * s_lo.to(MATH)[:, None]
        hi = c_hi * s_lo.to(MATH)[:, None]
    elif FMT == 4 or FMT == 5 or FMT == 7:  # s_lo..b_hi: load_block_meta's block vectors
        lo = c_lo * expand_blocks(s_lo, BLOCK_N, DH, MATH) + expand_blocks(b_lo, BLOCK_N, DH, MATH)
        hi = c_hi * expand_blocks(s_hi, BLOCK_N, DH, MATH) + expand_blocks(b_hi, BLOCK_N, DH, MATH)
    elif HALF == DH:
        lo = c_lo * _expand(s_lo, HALF, GS, BLOCK_N, MATH) + _expand(b_lo, HALF, GS, BLOCK_N, MATH)
        hi = c_hi * _expand(s_hi, HALF, GS, BLOCK_N, MATH) + _expand(b_hi, HALF, GS, BLOCK_N, MATH)
    else:
        lo = c_lo.to(tl.float32) * _gather_half(p_scales, o_t, m_t, s_mt, 0, HEAD_DIM, HALF, GS) \
            + _gather_half(p_biases, o_t, m_t, s_mt, 0, HEAD_DIM, HALF, GS)
        hi = c_hi.to(tl.float32) * _gather_half(p_scales, o_t, m_t, s_mt, DH, HEAD_DIM, HALF, GS) \
            + _gather_half(p_biases, o_t, m_t, s_mt, DH, HEAD_DIM, HALF, GS)
    return lo.to(DTYPE), hi.to(DTYPE)


@triton.jit
def _nibbles(p_row, o_d, m_t, m, HEAD_DIM: tl.constexpr, FMT: tl.constexpr):
    """Split-halves codes of a tile: lo, hi `[BLOCK_N, HALF]` (p_row `[BLOCK_N, 1]` the
    rows, o_d `[HALF]` the byte columns, m_t `[BLOCK_N]` the valid slots, m the valid
    (slot, column) pairs; masked slots read 0). int4w-c64 (FMT 7): the low nibbles carry
    their fifth bits, codes 0..31 (`widest.fifth_bits`)."""
    byte = tl.load(p_row + o_d[None, :], mask=m, other=0)  # uint8
    lo = byte & 0xF
    if FMT == 7:
        lo = lo.to(tl.int32) | fifth_bits(p_row, m_t[:, None], HEAD_DIM)
    return lo, byte >> 4


@triton.jit
def half_dims(p_codes, s_ct, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, FMT: tl.constexpr):
    """The model dims of a tile's lo / hi columns, `[HALF]` int32 each: [0, D/2) and
    [D/2, D) (columns past D/2 are padding, masked by the callers), or for int4w-c64
    (FMT 7) the model channels of stored channels [0, D/2) and [D/2, D)
    (`widest.stored_channels`, from the rows at p_codes, code row stride s_ct): load
    queries through them once, or store dequantized keys through them."""
    if FMT == 7:
        d_lo, d_hi = stored_channels(p_codes, s_ct, HEAD_DIM)
    else:
        d_lo = tl.arange(0, HALF)
        d_hi = d_lo + HEAD_DIM // 2
    return d_lo, d_hi


@triton.jit
def _codes_to(c, DT: tl.constexpr):
    """Exact integer codes (0..255; bf16: 0..127) as DT without the slow int→float unit."""
    if DT == tl.float16:
        # 0x6400 is 1024.0: OR-ing a code into its mantissa gives 1024 + c exactly
        x = (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    elif DT == tl.bfloat16:  # int4 / int3 codes: 0x4300 is 128.0, 128 + c exact for c < 128
        x = (c.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0
    else:
        x = _codes_to_f32(c).to(DT)
    return x


@triton.jit
def code_offset(FMT: tl.constexpr, DTYPE: tl.constexpr):
    """The constant `load_codes` adds to every code (1024 on the fp16 fast path)."""
    if (FMT == 1 or FMT == 2 or FMT == 4 or FMT == 5 or FMT == 6 or FMT == 7) and \
            DTYPE == tl.float16:
        off = 1024.0
    else:
        off = 0.0
    return off


@triton.jit
def load_codes(p_codes, o_t, m_t, s_ct, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
               FMT: tl.constexpr, DTYPE: tl.constexpr):
    """Raw codes of a tile as DTYPE, for kernels that apply scales after the dot.

    Returns lo, hi `[BLOCK_N, HALF]`: value = code + `code_offset(FMT, DTYPE)` for int
    formats (fp16 skips the subtraction: the key fold takes it off through the bias term,
    the value fold before its dot, `common._fold_pv`), the
    decoded e4m3 value for fp8. Masked slots read code 0. int4w-c64 (FMT 7): 5-bit codes
    of the stored channels (`_nibbles`).
    """
    DH: tl.constexpr = HEAD_DIM // 2
    o_d = tl.arange(0, HALF)
    m = m_t[:, None] & (o_d < DH)[None, :]
    p_row = p_codes + o_t[:, None] * s_ct
    if FMT == 2 or FMT == 4 or FMT == 7:
        c_lo, c_hi = _nibbles(p_row, o_d, m_t, m, HEAD_DIM, FMT)
    elif FMT == 5 or FMT == 6:
        c_lo, c_hi = _int3_codes(p_row, o_d, m_t, m, HEAD_DIM, HALF)
    else:
        c_lo = tl.load(p_row + o_d[None, :], mask=m, other=0)
        c_hi = tl.load(p_row + (o_d + DH)[None, :], mask=m, other=0)
    if FMT == 3:
        lo = c_lo.to(tl.float8e4nv, bitcast=True).to(DTYPE)
        hi = c_hi.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    elif DTYPE == tl.float16:
        lo = (c_lo.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        hi = (c_hi.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    else:
        lo = _codes_to_f32(c_lo).to(DTYPE)
        hi = _codes_to_f32(c_hi).to(DTYPE)
    return lo, hi


@triton.jit
def _int3_codes(p_row, o_d, m_t, m, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """3-bit codes of a tile's two half rows: lo, hi `[BLOCK_N, HALF]` int32 in [0, 8)
    (0 for masked slots). p_row `[BLOCK_N, 1]` points at each slot's packed row, o_d
    `[HALF]` are the half row's dims, m_t `[BLOCK_N]` the valid slots, m
    `[BLOCK_N, HALF]` the valid (slot, dim) pairs.

    kvtax.formats.packing's planes: dim d's low 2 bits sit in byte d % (D/4) at bit
    2 * (d // (D/4)), its high bit in byte D/4 + d % (D/8) at bit d // (D/8). Dims j and
    j + D/2 share both bytes (D/2 is 2 * D/4 and 4 * D/8), so one read of each plane
    serves both halves: hi takes the same bytes 4 bits higher.
    """
    if HALF == HEAD_DIM // 2:
        lo, hi = _int3_runs(p_row, m_t, HEAD_DIM)
    else:
        lo, hi = _int3_gather(p_row, o_d, m, HEAD_DIM)
    return lo, hi


@triton.jit
def _int3_runs(p_row, m_t, HEAD_DIM: tl.constexpr):
    """`_int3_codes` for D a power of two. Dim k * D/8 + e of the lo half (k < 4, e < D/8)
    has its low bits in byte (k % 2) * D/8 + e at bit 2 * (k // 2) and its high bit in byte
    D/4 + e at bit k, so the half row read as `[BLOCK_N, 4, D/8]` is contiguous D/8-byte
    runs (cp.async-able; each low-plane byte is read twice) and one reshape per half puts
    every dim in place. Per-dim gathers of both planes (`_int3_gather`) compiled to more
    spills for sm_90 (Triton 3.9, benchmarks/compile_check.py: 1520 against 216 bytes of
    stack in a D 128 prefill at 64 x 128 tiles, 24 against 0 in its decode)."""
    BLOCK_N: tl.constexpr = m_t.shape[0]
    Q: tl.constexpr = HEAD_DIM // 4
    E: tl.constexpr = HEAD_DIM // 8
    k = tl.arange(0, 4)[None, :, None]  # [1, 4, 1]
    e = tl.arange(0, E)[None, None, :]  # [1, 1, E]
    p3 = p_row[:, :, None]  # [BLOCK_N, 1, 1]
    m3 = m_t[:, None, None]
    low = tl.load(p3 + (k % 2) * E + e, mask=m3, other=0).to(tl.int32)  # [BLOCK_N, 4, E]
    high = tl.load(p3 + Q + e, mask=m3, other=0).to(tl.int32)           # [BLOCK_N, 1, E]
    s_low = 2 * (k // 2)  # bits 0, 0, 2, 2; the hi half's 4, 4, 6, 6
    lo = ((low >> s_low) & 3) | (((high >> k) & 1) << 2)
    hi = ((low >> (s_low + 4)) & 3) | (((high >> (k + 4)) & 1) << 2)
    return tl.reshape(lo, (BLOCK_N, 2 * Q)), tl.reshape(hi, (BLOCK_N, 2 * Q))


@triton.jit
def _int3_gather(p_row, o_d, m, HEAD_DIM: tl.constexpr):
    """`_int3_codes` for D = 80, 96 (half rows padded to HALF lanes): each plane gathered
    per dim (every byte read by 2 or 4 lanes; L1 absorbs the repeats)."""
    DH: tl.constexpr = HEAD_DIM // 2
    Q: tl.constexpr = HEAD_DIM // 4
    E: tl.constexpr = HEAD_DIM // 8
    od = tl.where(o_d < DH, o_d, 0)  # padding dims (masked): shifts in range
    low = tl.load(p_row + (od % Q)[None, :], mask=m, other=0).to(tl.int32)
    high = tl.load(p_row + (Q + od % E)[None, :], mask=m, other=0).to(tl.int32)
    s_low = (2 * (od // Q))[None, :]  # 0 or 2; the hi half's 4 or 6
    s_high = (od // E)[None, :]       # 0..3; the hi half's 4..7
    lo = ((low >> s_low) & 3) | (((high >> s_high) & 1) << 2)
    hi = ((low >> (s_low + 4)) & 3) | (((high >> (s_high + 4)) & 1) << 2)
    return lo, hi
