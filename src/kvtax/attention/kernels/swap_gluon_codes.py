"""Gluon helpers of decode_swap_gluon.py: integer codes to fp16 MMA operands (the PTX of
swap_asm.py through `inline_asm_elementwise`), model-dtype metadata words to fp32, and
int4w-c64 keys' fifth bits spread to one byte per low nibble in shared memory."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kvtax.attention.kernels import swap_asm

# PTX in swap_asm.py (shared with decode_swap.py)
_X8_ASM = gl.constexpr(swap_asm.X8)
_X4_ASM = gl.constexpr(swap_asm.X4)
_X8_PAIRS_ASM = gl.constexpr(swap_asm.X8_PAIRS)
_X4_PAIRS_ASM = gl.constexpr(swap_asm.X4_PAIRS)
_X4W_ASM = gl.constexpr(swap_asm.X4W)
# shared-memory views of another dtype: `_reinterpret` on 3.6, `reinterpret` on 3.9
_NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def x8(c):
    """uint8 codes (4 per 32-bit word) -> fp16 1024 + c: two prmt per 4 codes."""
    return gl.inline_asm_elementwise(
        asm=_X8_ASM, constraints="=r,=r,r", args=[c], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def x8_pairs(w):
    """uint16 pairs (dim 2p, dim 2p + 1) of int8 codes, two slots per word -> fp16
    (even-dim code - 128, odd-dim code - 128): one prmt and one sub.f16x2 per two codes.
    V codes are centered (unlike K's): P @ (1024 + c) accumulated over a long context
    carries fp32 rounding of the 1024 offset (int4 at 70k tokens: over the fp16 bound)."""
    return gl.inline_asm_elementwise(
        asm=_X8_PAIRS_ASM, constraints="=r,=r,r", args=[w], dtype=(gl.float16, gl.float16),
        is_pure=True, pack=2)


@gluon.jit
def x4(c):
    """Packed int4 bytes (4 per 32-bit word; low nibble = a lo-half dim, high nibble the
    dim D/2 further) -> (fp16 1024 + lo nibble, fp16 1024 + hi nibble)."""
    return gl.inline_asm_elementwise(
        asm=_X4_ASM, constraints="=r,=r,=r,=r,r", args=[c], dtype=(gl.float16, gl.float16),
        is_pure=True, pack=4)


@gluon.jit
def x4w(c, f):
    """int4w-c64: packed int4 bytes c and their low nibbles' fifth bits f (0x10 or 0 per
    byte, same layout) -> (fp16 1024 + (lo | f), fp16 1024 + hi nibble)."""
    return gl.inline_asm_elementwise(
        asm=_X4W_ASM, constraints="=r,=r,=r,=r,r,r", args=[c, f],
        dtype=(gl.float16, gl.float16), is_pure=True, pack=4)


@gluon.jit
def _as(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """The same shared memory viewed as `shape` of `dtype` (the version bridge)."""
    if _NEW_REINTERPRET:
        return smem.reinterpret(dtype, shape, layout)
    else:
        return smem._reinterpret(dtype, shape, layout)


@gluon.jit
def fifth_bytes(f_smem, w0, w1, jj, R: gl.constexpr, BN: gl.constexpr, DH: gl.constexpr,
                 sp_l: gl.constexpr, swz32: gl.constexpr):
    """int4w-c64: each row's fifth bits (w0, w1 [BN]: bits [0, 32) and [32, 64) of its
    bytes [D/2, D/2 + 8), stored channel j at bit j, j < R) spread to one byte per low
    nibble, 0x10 or 0, into f_smem ([BN, D/2] uint8, the K codes' swizzle) so that a
    slice loads in the K operand's layout beside its codes. Four bits a word: the 4-bit
    group n lands at bit 4 of bytes 0..3 by `(n * 0x02040810) & 0x10101010` (the four
    shifted copies cannot carry into each other). The caller syncs before reading.
    swz32 is the codes' swizzle over 4-byte words (the same 16-byte vectors per row)."""
    word = gl.where(jj[None, :] < 8, w0[:, None], w1[:, None])       # [BN, D/8]
    nib = (word >> (4 * (jj % 8))[None, :]) & 0xF
    spread = gl.where(jj[None, :] < R // 4, (nib * 0x02040810) & 0x10101010, 0)
    _as(f_smem, gl.int32, [BN, DH // 4], swz32).store(spread)


@gluon.jit
def x4_pairs(w):
    """uint16 = packed int4 bytes (2j, 2j + 1), two slots per word -> fp16 nibble - 8
    for dims 2j, 2j + 1 (low nibbles), D/2 + 2j, D/2 + 2j + 1 (high nibbles)."""
    return gl.inline_asm_elementwise(
        asm=_X4_PAIRS_ASM, constraints="=r,=r,=r,=r,r", args=[w],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=2)


@gluon.jit
def halves(w, MDT: gl.constexpr):
    """uint32 words (lo-half value, hi-half value) in the model dtype -> two fp32."""
    lo = w.to(gl.int16).to(MDT, bitcast=True).to(gl.float32)
    hi = (w >> 16).to(gl.int16).to(MDT, bitcast=True).to(gl.float32)
    return lo, hi
