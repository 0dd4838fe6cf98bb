"""int4w-c64 keys' channel order and fifth bits in the attention kernels (format code 7).

int4w-c64 (kvtax.formats.widest) is int4-c64 with its channels stored in one order per
sequence and KV head (`order`: stored channel j is model channel order[j]) and a fifth bit
on stored channels [0, R), R = 3D/8. A slot's code row of W = D/2 + D/16 bytes holds:
  bytes [0, D/2)             int4-c64's split-halves nibbles of the stored channels: byte
                             j holds stored channel j (low nibble) and j + D/2 (high);
  bytes [D/2, D/2 + R/8)     the fifth bits of stored channels [0, R): bit b of byte i is
                             stored channel 8i + b;
  bytes [D/2 + R/8, W)       `order`, block layout: row u of every 64-slot block holds
                             order[u + 64 m] in byte m.
Scales and biases are int4-c64's, in stored order: key = s_j * (nibble_j + 16 fifth_j) + b_j.

So a kernel reads the keys as int4-c64 keys in stored order and needs two things only:
  `stored_channels`: the model channel of each stored one, to load the queries through
      once per program (q_perm[j] = q[order[j]], so scores are q_perm . k_stored) or to
      write dequantized keys back in model order (staging);
  `fifth_bits`: 16 * fifth_j, OR'd into the low nibbles of a tile's code bytes: R < D/2,
      so every channel with a fifth bit is a low nibble, and its 5-bit code 0..31 goes
      through the int4 paths (fp16 / bf16 conversions, centering, folds) unchanged.
No per-block state: tiles may span blocks like int4-c64's. R = 3D/8 is kvtax.formats.
widest's fraction; `support.channel_keys_reason` refuses any other.
"""

import triton
import triton.language as tl


@triton.jit
def stored_channels(p_kc, s_kc, HEAD_DIM: tl.constexpr):
    """The model channels of stored channels [0, D/2) and [D/2, D): (lo, hi) `[D/2]`
    int32, read from the 64 rows at p_kc, the start of a block (every block carries the
    whole order: callers pass their (batch, head)'s slot 0). s_kc is the code row stride."""
    DH: tl.constexpr = HEAD_DIM // 2
    E: tl.constexpr = 3 * HEAD_DIM // 64  # fifth-bit bytes, R / 8
    o_j = tl.arange(0, DH)
    o_k = o_j + DH
    lo = tl.load(p_kc + (o_j % 64) * s_kc + (DH + E + o_j // 64))
    hi = tl.load(p_kc + (o_k % 64) * s_kc + (DH + E + o_k // 64))
    # % D keeps a load through the order in bounds even for rows never written (storage
    # of a sequence with no keys yet, whose scores are all masked)
    return lo.to(tl.int32) % HEAD_DIM, hi.to(tl.int32) % HEAD_DIM


@triton.jit
def fifth_bits(p_rows, m_rows, HEAD_DIM: tl.constexpr):
    """16 * the fifth bit of stored channels [0, D/2) of the code rows p_rows `[BLOCK_N, 1]`:
    `[BLOCK_N, D/2]` int32, 16 or 0 (0 from channel R on, which have none, and in rows
    where m_rows `[BLOCK_N, 1]` is False; m_rows None: every row). OR it into the low
    nibbles.

    Why the plane is loaded as bytes and expanded by a reshape: a `[BLOCK_N, D/2]` gather
    of its bytes (8 lanes per byte) or per-row words picked apart by selects spilled more
    for sm_90 (Triton 3.9, benchmarks/compile_check.py: D 128 decode_warp 488 / 192 bytes
    of stack against 136; D 256 prefill 168 / 4,880 against 104)."""
    DH: tl.constexpr = HEAD_DIM // 2
    E: tl.constexpr = 3 * HEAD_DIM // 64  # the plane's bytes, R / 8
    EP: tl.constexpr = HEAD_DIM // 16  # padded to a power of two: 8 EP = D/2
    BLOCK_N: tl.constexpr = p_rows.shape[0]
    o_e = tl.arange(0, EP)[None, :]
    m = o_e < E if m_rows is None else m_rows & (o_e < E)  # bytes past E hold the order
    plane = tl.load(p_rows + (DH + o_e), mask=m, other=0).to(tl.int32)  # [BLOCK_N, EP]
    bits = (plane[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1   # [BLOCK_N, EP, 8]
    return tl.reshape(bits, (BLOCK_N, DH)) << 4  # stored channel 8 e + b at column 8 e + b
