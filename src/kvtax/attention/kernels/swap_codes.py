"""Code tiles of the swapped decode (decode_swap.py) and their fp16 MMA operands.

`tiles` loads one 16-slot stream's K bytes and V pairs, `k_halves` / `v_quarters` turn
them into fp16 operands (the PTX of swap_asm.py on a GPU, the same arithmetic in plain
Triton under the interpreter). int4w-c64 keys (format code 7) come with their fifth bits
as a second byte tile (`_fifth_bytes`), OR'd into the low nibbles before the conversion.
"""

import triton
import triton.language as tl

from kvtax.attention.kernels import swap_asm

# PTX in swap_asm.py (shared with decode_swap_gluon.py)
_X8_ASM = tl.constexpr(swap_asm.X8)
_X4_ASM = tl.constexpr(swap_asm.X4)
_X8_PAIRS_ASM = tl.constexpr(swap_asm.X8_PAIRS)
_X4_PAIRS_ASM = tl.constexpr(swap_asm.X4_PAIRS)
_X4W_ASM = tl.constexpr(swap_asm.X4W)


@triton.jit
def _x(c):
    """Codes (< 1024, any integer dtype) -> fp16 1024 + c, exact: 0x6400 | c."""
    return (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)



@triton.jit
def k_halves(byte_lo, byte_hi, FMT: tl.constexpr, ASM: tl.constexpr):
    """K code tiles -> (lo-half, hi-half) fp16 operands of 1024 + c. int8: byte_lo /
    byte_hi are the two halves' bytes; int4 (and int4-c64): byte_lo holds both (byte_hi
    unused); int4w-c64: byte_hi holds each low nibble's fifth bit at bit 4 (0x10 or 0)."""
    if FMT == 7:
        if ASM:
            lo, hi = tl.inline_asm_elementwise(
                asm=_X4W_ASM, constraints="=r,=r,=r,=r,r,r", args=[byte_lo, byte_hi],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            lo = _x((byte_lo & 0xF) | byte_hi)
            hi = _x(byte_lo >> 4)
    elif FMT == 2 or FMT == 4:
        if ASM:
            lo, hi = tl.inline_asm_elementwise(
                asm=_X4_ASM, constraints="=r,=r,=r,=r,r", args=[byte_lo],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            lo = _x(byte_lo & 0xF)
            hi = _x(byte_lo >> 4)
    else:
        if ASM:
            lo = tl.inline_asm_elementwise(asm=_X8_ASM, constraints="=r,=r,r", args=[byte_lo],
                                           dtype=tl.float16, is_pure=True, pack=4)
            hi = tl.inline_asm_elementwise(asm=_X8_ASM, constraints="=r,=r,r", args=[byte_hi],
                                           dtype=tl.float16, is_pure=True, pack=4)
        else:
            lo = _x(byte_lo)
            hi = _x(byte_hi)
    return lo, hi



@triton.jit
def v_quarters(w_lo, w_hi, FMT: tl.constexpr, ASM: tl.constexpr):
    """Transposed V pair tiles [D/4, slots] uint16 -> four fp16 operands of centered
    codes (c - 128, int4 c - 8) for the dims (2j, 2j + 1, D/2 + 2j, D/2 + 2j + 1).
    int8: w_lo / w_hi hold the pairs of the lo / hi half; int4: w_lo holds bytes (2j,
    2j + 1), whose low nibbles are dims 2j, 2j + 1 and high nibbles dims D/2 + 2j,
    D/2 + 2j + 1 (w_hi unused)."""
    if FMT == 2:
        if ASM:
            a, b, c, d = tl.inline_asm_elementwise(
                asm=_X4_PAIRS_ASM, constraints="=r,=r,=r,=r,r", args=[w_lo],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
        else:
            a = _x(w_lo & 0xF) - 1032.0
            b = _x((w_lo >> 8) & 0xF) - 1032.0
            c = _x((w_lo >> 4) & 0xF) - 1032.0
            d = _x(w_lo >> 12) - 1032.0
    else:
        if ASM:
            a, b = tl.inline_asm_elementwise(
                asm=_X8_PAIRS_ASM, constraints="=r,=r,r", args=[w_lo],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
            c, d = tl.inline_asm_elementwise(
                asm=_X8_PAIRS_ASM, constraints="=r,=r,r", args=[w_hi],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
        else:
            a = _x(w_lo & 0xFF) - 1152.0
            b = _x(w_lo >> 8) - 1152.0
            c = _x(w_hi & 0xFF) - 1152.0
            d = _x(w_hi >> 8) - 1152.0
    return a, b, c, d



@triton.jit
def _fifth_bytes(p_k, m, HEAD_DIM: tl.constexpr):
    """int4w-c64: the fifth bits of a [16, D/2] tile of code bytes `p_k` (pointers to
    bytes [0, D/2) of each row; m its row mask or None) as uint8 0x10 / 0, each at its
    low nibble's byte: stored channel j < R = 3D/8 has bit j % 8 of byte D/2 + j // 8."""
    DH: tl.constexpr = HEAD_DIM // 2
    R: tl.constexpr = 3 * HEAD_DIM // 8
    o_d = tl.arange(0, DH)
    p = p_k - o_d[None, :] + (DH + o_d // 8)[None, :]  # each row's byte of channel j's bit
    sel = (o_d < R)[None, :]
    if m is None:
        byte = tl.load(p, mask=sel, other=0)
    else:
        byte = tl.load(p, mask=m & sel, other=0)
    return (((byte >> (o_d % 8).to(tl.uint8)[None, :]) & 1) << 4).to(tl.uint8)


@triton.jit
def tiles(p_kc, p_vc, slot0, length, s_kc_t, s_vc_t, HEAD_DIM: tl.constexpr,
           K_FMT: tl.constexpr, V_FMT: tl.constexpr, MASKED: tl.constexpr):
    """One stream's 16 slots from slot0: K bytes (lo, hi; int4: both halves in lo;
    int4w-c64: hi its fifth bits, `_fifth_bytes`) as [16, D/2] uint8 and V pairs (lo, hi;
    int4: all in lo) as [D/4, 16] uint16, the V tile addressed transposed so that it
    feeds the dot as loaded (an explicit tl.trans kept Triton's pipeliner from staging it
    through cp.async: plain loads every step)."""
    DH: tl.constexpr = HEAD_DIM // 2
    DQ: tl.constexpr = HEAD_DIM // 4
    o_s = slot0 + tl.arange(0, 16)
    o_d = tl.arange(0, DH)
    o_j = tl.arange(0, DQ)
    p_k = p_kc + o_s.to(tl.int64)[:, None] * s_kc_t + o_d[None, :]
    p16 = p_vc.to(tl.pointer_type(tl.uint16), bitcast=True)
    p_v = p16 + o_s.to(tl.int64)[None, :] * (s_vc_t // 2) + o_j[:, None]
    if MASKED:
        m = (o_s < length)[:, None]
        k_lo = tl.load(p_k, mask=m, other=0)
        v_lo = tl.load(p_v, mask=m.T, other=0)
        if K_FMT == 1:
            k_hi = tl.load(p_k + DH, mask=m, other=0)
        elif K_FMT == 7:
            k_hi = _fifth_bytes(p_k, m, HEAD_DIM)
        else:
            k_hi = k_lo
        if V_FMT == 1:
            v_hi = tl.load(p_v + DQ, mask=m.T, other=0)
        else:
            v_hi = v_lo
    else:
        k_lo = tl.load(p_k)
        v_lo = tl.load(p_v)
        if K_FMT == 1:
            k_hi = tl.load(p_k + DH)
        elif K_FMT == 7:
            k_hi = _fifth_bytes(p_k, None, HEAD_DIM)
        else:
            k_hi = k_lo
        if V_FMT == 1:
            v_hi = tl.load(p_v + DQ)
        else:
            v_hi = v_lo
    return k_lo, k_hi, v_lo, v_hi
