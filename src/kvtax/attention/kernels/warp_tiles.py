"""decode_warp.py's tile loads: K / V codes as fp16 MMA operands, and per-slot metadata.

Codes become fp16 without the int → float unit: `0x6400 | c` is the fp16 number 1024 + c,
so one subtraction centers them (int8: c - 128, int4: c - 8), exactly. On the GPU
(`ASM`) inline PTX does four codes per `prmt` + `sub.f16x2`; the interpreter takes the
same arithmetic in plain Triton. `v_pair_operands` reads int8 / int4 V as uint16 pairs of
dims (why: its docstring); `tile_meta` loads a tile's scales and centered biases,
`block_meta` those of int4-c64 keys (one vector per 64-slot block).
"""

import triton
import triton.language as tl

from kvtax.attention.kernels.widest import fifth_bits


@triton.jit
def _centered(c, OFF: tl.constexpr):
    """uint8 codes (< 1024) → fp16 `c - OFF`, exact, without the int→float unit:
    0x6400 | c is the fp16 number 1024 + c."""
    x = (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    return x - (1024.0 + OFF)


def _bytes_asm(sel_a: str, sel_b: str) -> str:
    """PTX turning a 32-bit word of uint8 codes into two fp16x2 registers of code - 128:
    `prmt` with selectors `sel_a`, `sel_b` (which bytes pair up) builds the fp16 pairs
    1024 + c, one `sub.f16x2` each removes 1024 + 128."""
    return f"""{{
        .reg .b32 t0, t1, m;
        mov.b32 m, 0x64806480;
        prmt.b32 t0, $2, 0x64646464, {sel_a};
        prmt.b32 t1, $2, 0x64646464, {sel_b};
        sub.f16x2 $0, t0, m;
        sub.f16x2 $1, t1, m;
        }}"""


# bytes (0, 1), (2, 3) pair up for 4 consecutive codes; (0, 2), (1, 3) for uint16 pairs
_INT8_ASM = tl.constexpr(_bytes_asm("0x4140", "0x4342"))
_INT8_PAIRS_ASM = tl.constexpr(_bytes_asm("0x4240", "0x4341"))


@triton.jit
def _int8_asm(c):
    """uint8 codes → fp16 `c - 128` with two prmt + two sub.f16x2 per 4 codes (GPU only;
    same result as `_centered(c, 128.0)`)."""
    return tl.inline_asm_elementwise(
        asm=_INT8_ASM, constraints="=r,=r,r", args=[c], dtype=tl.float16, is_pure=True,
        pack=4)


def _nibbles_asm(sel_a: str, sel_b: str) -> str:
    """PTX turning a 32-bit word of packed int4 bytes into four fp16x2 registers of
    nibble - 8: the lo nibbles, then the hi nibbles, each split into two fp16 pairs by
    `prmt` with selectors `sel_a`, `sel_b` (which bytes pair up), 11 instructions."""
    return f"""{{
        .reg .b32 lo, hi, t0, t1, t2, t3, m;
        mov.b32 m, 0x64086408;
        and.b32 lo, $4, 0x0F0F0F0F;
        shr.b32 hi, $4, 4;
        and.b32 hi, hi, 0x0F0F0F0F;
        prmt.b32 t0, lo, 0x64646464, {sel_a};
        prmt.b32 t1, lo, 0x64646464, {sel_b};
        prmt.b32 t2, hi, 0x64646464, {sel_a};
        prmt.b32 t3, hi, 0x64646464, {sel_b};
        sub.f16x2 $0, t0, m;
        sub.f16x2 $1, t1, m;
        sub.f16x2 $2, t2, m;
        sub.f16x2 $3, t3, m;
        }}"""


# bytes (0, 1), (2, 3) pair up for 4 consecutive codes; (0, 2), (1, 3) for uint16 pairs
_INT4_ASM = tl.constexpr(_nibbles_asm("0x4140", "0x4342"))
_INT4_PAIRS_ASM = tl.constexpr(_nibbles_asm("0x4240", "0x4341"))


@triton.jit
def _int4_asm(byte):
    """Packed int4 bytes → fp16 (lo nibble - 8, hi nibble - 8), 11 instructions per 4
    bytes (GPU only; same result as `_centered` on `byte & 15`, `byte >> 4`)."""
    return tl.inline_asm_elementwise(
        asm=_INT4_ASM, constraints="=r,=r,=r,=r,r", args=[byte],
        dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _int8_pairs_asm(w):
    """uint16 pairs of int8 codes → fp16 (first byte - 128, second byte - 128): one prmt
    and one sub.f16x2 per two codes (GPU only; see `v_pair_operands`)."""
    return tl.inline_asm_elementwise(
        asm=_INT8_PAIRS_ASM, constraints="=r,=r,r", args=[w], dtype=(tl.float16, tl.float16),
        is_pure=True, pack=2)


@triton.jit
def _int4_pairs_asm(w):
    """uint16 pairs of packed int4 bytes → fp16 (byte 0 lo, byte 1 lo, byte 0 hi, byte 1
    hi nibble, each - 8): 11 instructions per 8 codes (GPU only; see `v_pair_operands`)."""
    return tl.inline_asm_elementwise(
        asm=_INT4_PAIRS_ASM, constraints="=r,=r,=r,=r,r", args=[w],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _load(p, m):
    """tl.load with an optional mask (None: unmasked, so the load stays wide)."""
    if m is None:
        x = tl.load(p)
    else:
        x = tl.load(p, mask=m, other=0)
    return x


@triton.jit
def tile_operands(p_codes, o_n, m_n, s_ct, HEAD_DIM: tl.constexpr, FMT: tl.constexpr,
              DT: tl.constexpr, ASM: tl.constexpr):
    """Tile of slots `o_n` (int32) as MMA operands: lo, hi `[BLOCK_N, D/2]` in DT.

    Float formats: the stored rows. int8/int4 (and int4-c64): centered codes. int4w-c64:
    centered 5-bit codes (c - 8) of its stored channels (kernels/widest.py). fp8: decoded
    values.
    Slots where `m_n` is False read code 0 (their scores are masked, their P is 0);
    m_n None loads the whole tile unmasked.
    """
    DH: tl.constexpr = HEAD_DIM // 2
    o_d = tl.arange(0, DH)
    p_rows = p_codes + o_n[:, None].to(tl.int64) * s_ct  # [BLOCK_N, 1]
    p_row = p_rows + o_d[None, :]
    m = None if m_n is None else m_n[:, None]
    if FMT == 2 or FMT == 4 or FMT == 7:
        byte = _load(p_row, m)
        if ASM:
            lo, hi = _int4_asm(byte)
        else:
            lo = _centered(byte & 0xF, 8.0)
            hi = _centered(byte >> 4, 8.0)
        if FMT == 7:  # 5-bit codes: + 16 per fifth bit, exact in fp16 (after the PTX,
            # which masks the nibbles: fewer spills for sm_90 than OR-ing it in first)
            lo = lo + _centered(fifth_bits(p_rows, m, HEAD_DIM), 0.0)
    else:
        r_lo = _load(p_row, m)
        r_hi = _load(p_row + DH, m)
        if FMT == 1 and ASM:
            lo = _int8_asm(r_lo)
            hi = _int8_asm(r_hi)
        elif FMT == 1:
            lo = _centered(r_lo, 128.0)
            hi = _centered(r_hi, 128.0)
        elif FMT == 3:
            lo = r_lo.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            hi = r_hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            lo = r_lo
            hi = r_hi
    return lo.to(DT), hi.to(DT)


@triton.jit
def v_pair_operands(p_codes, o_n, m_n, s_ct, HEAD_DIM: tl.constexpr, FMT: tl.constexpr,
             DT: tl.constexpr, ASM: tl.constexpr):
    """An int8/int4 V tile of slots `o_n` as four `[BLOCK_N, D/4]` MMA operands (centered
    codes in DT) for the dims (2j, 2j + 1, D/2 + 2j, D/2 + 2j + 1), j < D/4.

    Why: in P @ V the MMA's reduction runs over slots, so each thread needs codes of
    consecutive slots for one dim, while a cache row holds consecutive dims of one slot.
    Read as bytes, Triton gathers them one LDS.U8 and one PRMT at a time (~3 instructions
    per code). Read as uint16 pairs of dims, the tile is an ordinary 16-bit operand that
    `ldmatrix.trans` transposes, and one PRMT splits a pair of slots' pairs into the even
    and the odd dim's fp16 operands. Same MMA count; the output dims come out interleaved
    and the kernel stores them back in place. Both halves of a pair share the scale group
    (group >= D/2), so the folded V scales stay per half.
    """
    DQ: tl.constexpr = HEAD_DIM // 4
    o_j = tl.arange(0, DQ)
    p16 = p_codes.to(tl.pointer_type(tl.uint16), bitcast=True)
    p_row = p16 + o_n[:, None].to(tl.int64) * (s_ct // 2) + o_j[None, :]
    m = None if m_n is None else m_n[:, None]
    if FMT == 2:  # uint16 j = bytes 2j, 2j + 1: lo nibbles dims 2j, 2j + 1; hi + D/2
        w = _load(p_row, m)
        if ASM:
            a, b, c, d = _int4_pairs_asm(w)
        else:
            a = _centered(w & 0xF, 8.0)
            b = _centered((w >> 8) & 0xF, 8.0)
            c = _centered((w >> 4) & 0xF, 8.0)
            d = _centered(w >> 12, 8.0)
    else:  # uint16 j = dims 2j, 2j + 1 (lo half); j + D/4 the same in the hi half
        w_lo = _load(p_row, m)
        w_hi = _load(p_row + DQ, m)
        if ASM:
            a, b = _int8_pairs_asm(w_lo)
            c, d = _int8_pairs_asm(w_hi)
        else:
            a = _centered(w_lo & 0xFF, 128.0)
            b = _centered(w_lo >> 8, 128.0)
            c = _centered(w_hi & 0xFF, 128.0)
            d = _centered(w_hi >> 8, 128.0)
    return a.to(DT), b.to(DT), c.to(DT), d.to(DT)


@triton.jit
def tile_meta(p_s, p_b, start, m_n, s_mt, BLOCK_N: tl.constexpr, FMT: tl.constexpr,
          NG: tl.constexpr):
    """Per-slot scales and centered biases of a tile, float32 `[BLOCK_N]` each:
    (s_lo, b_lo, s_hi, b_hi). NG = groups per row (1 or 2 here); fp8's one scale per row
    serves both halves and its biases are zeros.

    Loaded as one flat run of BLOCK_N * NG values when rows are packed (s_mt == NG), so
    the load is wide and the pipeliner can stage it like the codes.
    """
    o_t = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
    zero = tl.zeros([BLOCK_N], dtype=tl.float32)
    s_lo = zero
    b_lo = zero
    s_hi = zero
    b_hi = zero
    if FMT == 3:
        s_lo = _load(p_s + o_t * s_mt, m_n).to(tl.float32)
        s_hi = s_lo
    elif FMT == 1 or FMT == 2:
        OFF: tl.constexpr = 128.0 if FMT == 1 else 8.0
        if NG == 1:
            s_lo = _load(p_s + o_t * s_mt, m_n).to(tl.float32)
            b_lo = _load(p_b + o_t * s_mt, m_n).to(tl.float32)
            b_lo += OFF * s_lo
            s_hi = s_lo
            b_hi = b_lo
        else:
            o_f = (2 * start + tl.arange(0, 2 * BLOCK_N)).to(tl.int64)
            if m_n is None:
                m_f = None
            else:
                m_f = tl.reshape(tl.broadcast_to(m_n[:, None], (BLOCK_N, 2)), (2 * BLOCK_N,))
            s2 = _load(p_s + o_f, m_f).to(tl.float32)
            b2 = _load(p_b + o_f, m_f).to(tl.float32)
            s_lo, s_hi = tl.split(tl.reshape(s2, (BLOCK_N, 2)))
            b_lo, b_hi = tl.split(tl.reshape(b2, (BLOCK_N, 2)))
            b_lo += OFF * s_lo
            b_hi += OFF * s_hi
    return s_lo, b_lo, s_hi, b_hi


@triton.jit
def block_meta(p_s, p_b, start, HEAD_DIM: tl.constexpr):
    """int4-c64 scales and centered biases (b + 8 s) of the 64-slot block holding slot
    `start`, float32 `[1, D/2]` each: (s_lo, b_lo, s_hi, b_hi). A tile of <= 64 slots
    starting at a multiple of its size lies in one block; the block is stored whenever
    the tile has a valid slot (storage is block-aligned), so the loads are unmasked."""
    DH: tl.constexpr = HEAD_DIM // 2
    o_b = (start // 64 + tl.arange(0, 1)).to(tl.int64)  # [1]: offsets in int64
    p = o_b[:, None] * HEAD_DIM + tl.arange(0, DH)[None, :]  # [1, DH]
    s_lo = tl.load(p_s + p).to(tl.float32)
    s_hi = tl.load(p_s + p + DH).to(tl.float32)
    b_lo = tl.load(p_b + p).to(tl.float32) + 8.0 * s_lo
    b_hi = tl.load(p_b + p + DH).to(tl.float32) + 8.0 * s_hi
    return s_lo, b_lo, s_hi, b_hi
