"""int4w-c64: int4-c64 keys plus a fifth bit on the widest 3/8 of each sequence's channels.

A channel's 4-bit error is set by its range over the block (max - min of its 64 tokens), and
those ranges are uneven: on Gemma-3-270M's global layers the widest 3/8 of channels, given a
fifth bit, take the scores' mean squared error from 0.042 / 0.025 / 0.026 to 0.012 / 0.009 /
0.017 at 8k, where a fifth bit on every channel gives 0.010 / 0.006 / 0.006, for 0.44 bits
per key element instead of 1 (docs/results/2026-12-05-cpu-gemma-32k-outlier-channels). No
calibration, no queries: the channels are the widest over the sequence's block 0 (its first
64 tokens), one choice per sequence and KV head for every later block. Choosing afresh in
each block measured the same on CPU (Gemma-3 32k, Qwen 8k / 16k: within a standard error,
docs/results/2026-12-05-cpu-fixed-channels), and one choice lets a kernel read the keys
in a fixed channel order: the chosen channels first, so their fifth bits sit on the low
nibbles of bytes [0, R) of every row, and a query is permuted once at its load.

Layout (`[..., T, W]` uint8 codes, W = D/2 + D/16; R = 3D/8 chosen channels; `order` the
sequence's channel order: stored channel j is channel order[j], the R chosen ones ascending,
then the others ascending):
  bytes [0, D/2)             int4-c64's split-halves nibbles of the *stored* channels: byte j
                             holds stored channel j (low nibble) and j + D/2 (high);
  bytes [D/2, D/2 + R/8)     the fifth bits of stored channels [0, R): bit b of byte i is
                             stored channel 8i + b;
  bytes [D/2 + R/8, W)       `order`, one byte per row in block layout: row u of every block
                             holds order[u + 64 m] in byte m (each block carries it whole).
Scales and biases as int4-c64 (`[..., T, D/64]`, block layout), in stored channel order,
`scale = range / 31` on stored channels [0, R) and `range / 15` on the others, so that
`x[order[j]] ≈ scale_j * (nibble_j + 16 * fifth_j) + bias_j`. Bytes per token and head:
D = 128: 72 + 2·2·2 = 80 (int4-c64: 72); D = 256: 144 + 16 = 160 (int4-c64: 144).
Kernel format code 7 (kvtax/attention/kernels/widest.py).

    >>> fmt = WidestBitFormat()               # "int4w-c64"
    >>> q = fmt.quantize(k)                   # k [B, H, 128, 256] → codes [B, H, 128, 144]
    >>> fmt.read(q, 10, 100).shape            # tokens [10, 100) decoded: [B, H, 90, 256]
    >>> q2 = fmt.quantize(k2, fmt.order_of(q))  # later blocks keep block 0's channels
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtax.errors import FormatError
from kvtax.formats.affine import affine_encode
from kvtax.formats.base import QTensor
from kvtax.formats.channel import ChannelBlockFormat
from kvtax.formats.packing import pack, unpack

WIDEST = 3 / 8  # of the channels get the fifth bit: Gemma-3's 8k bytes allow 0.46 bits


def selected(head_dim: int) -> int:
    """R, the channels with a fifth bit (a multiple of 8 where 64 divides D)."""
    return round(WIDEST * head_dim)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 bits `[..., R]` (R a multiple of 8) → `[..., R/8]`: bit b of byte i is bit
    8i + b."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    return (bits.unflatten(-1, (-1, 8)) << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """`[..., R/8]` → uint8 bits `[..., R]` (pack_bits' inverse)."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def channel_order(block0: torch.Tensor) -> torch.Tensor:
    """Keys of a sequence's block 0 `[..., 64, D]` → its channel order `[..., D]` int64:
    the R widest channels (max - min over the block; equal ranges to the lower channel, a
    NaN range as the widest), ascending, then the others ascending.

    By comparisons, not sorts: a decode step off CUDA computes it for every open block
    (a graph cannot skip it past block 0; on CUDA kvtax.formats.order_triton does, with
    the same ranks), and two argsorts per layer took 0.59 of q4's 7.04 ms per token at
    32k on an H100 (Llama-3.1-8B shapes, benchmarks/decode.py --profile)."""
    d = block0.shape[-1]
    r = selected(d)
    rng = block0.float().amax(-2) - block0.float().amin(-2)            # [..., D]
    rng = torch.nan_to_num(rng, nan=float("inf"))
    idx = torch.arange(d, device=rng.device)
    wider = rng.unsqueeze(-2) > rng.unsqueeze(-1)                      # [..., i, j]: j beats i
    tie = (rng.unsqueeze(-2) == rng.unsqueeze(-1)) & (idx < idx.unsqueeze(-1))
    chosen = (wider | tie).sum(-1) < r                                 # rank < R
    before = chosen.cumsum(-1) - chosen.long()                         # chosen below i
    spot = torch.where(chosen, before, r + idx - before)               # channel i's place
    return torch.empty_like(spot).scatter_(-1, spot, idx.expand_as(spot))


@dataclass(frozen=True)
class WidestBitFormat(ChannelBlockFormat):
    """int4-c64 whose widest 3/8 channels (per sequence) store 5-bit codes (layout above)."""

    @property
    def name(self) -> str:
        return f"int4w-c{self.block}"

    def check(self, head_dim: int) -> None:
        super().check(head_dim)
        if head_dim > 256:  # a channel index is one byte
            raise FormatError(f"{self.name}: head_dim {head_dim} over 256; use q4's int4-c64 keys")

    def code_width(self, head_dim: int) -> int:
        return head_dim // 2 + head_dim // 16

    def quantize(self, x: torch.Tensor, order: torch.Tensor | None = None) -> QTensor:
        """x `[..., T, D]` with T a multiple of 64 → codes `[..., T, W]`, scales and biases
        `[..., T, D/64]` in x.dtype (layout above). `order` `[..., D]`: the sequence's
        channel order (`order_of` its stored blocks); None takes `channel_order` of x's
        first block, for x starting at the sequence's block 0."""
        *lead, t, d = x.shape
        self.check(d)
        if t % self.block or (not t and order is None):  # no block 0 to take an order from
            raise FormatError(f"{self.name} quantizes whole blocks of {self.block} tokens, "
                              f"got {t}")
        r = selected(d)
        if order is None:
            order = channel_order(x[..., :self.block, :])
        order = order.to(device=x.device, dtype=torch.int64)
        xs = torch.gather(x, -1, order.unsqueeze(-2).expand(*lead, t, d))  # stored order
        g = xs.float().unflatten(-2, (t // self.block, self.block))       # [..., nb, 64, D]
        levels = torch.full((d,), 15.0, device=x.device)
        levels[:r] = 31.0
        c, scale, bias = affine_encode(g, -2, levels, x.dtype)            # c [..., nb, 64, D]
        c = c.flatten(-3, -2)                                             # [..., T, D]
        rows = order.to(torch.uint8).unflatten(-1, (d // self.block, self.block)).transpose(-1, -2)
        rows = rows.unsqueeze(-3).expand(*lead, t // self.block, self.block, d // self.block)
        codes = torch.cat([pack(c & 0xF, 4), pack_bits(c[..., :r] >> 4),
                           rows.flatten(-3, -2)], dim=-1)
        meta = (*lead, t, d // self.block)
        return QTensor(codes.contiguous(), scale.reshape(meta).contiguous(),
                       bias.reshape(meta).contiguous())

    def order_of(self, q: QTensor) -> torch.Tensor:
        """The channel order `[..., D]` int64 held by block-aligned storage (its first
        block's rows)."""
        d = q.scales.shape[-1] * self.block
        rows = q.codes[..., :self.block, d // 2 + selected(d) // 8:]      # [..., 64, D/64]
        return rows.transpose(-1, -2).flatten(-2).to(torch.int64)

    def dequantize(self, q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """codes `[..., T, W]` (T a multiple of 64, block-aligned) → `[..., T, D]`."""
        scale, bias = self._per_token(q)
        d = scale.shape[-1]
        r, h = selected(d), d // 2
        c = unpack(q.codes[..., :h], 4, d).to(torch.int32)                # [..., T, D]
        c[..., :r] += unpack_bits(q.codes[..., h:h + r // 8]).to(torch.int32) << 4
        xs = c.to(torch.float32) * scale.float() + bias.float()           # stored order
        order = self.order_of(q).unsqueeze(-2).expand_as(xs)
        return torch.empty_like(xs).scatter_(-1, order, xs).to(dtype)

    def read(self, q: QTensor, start: int, end: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tokens `[start, end)` of block-aligned storage, decoded: `[..., end-start, D]`.
        Every block they touch is decoded whole (its rows hold the channel order)."""
        b0 = start // self.block
        blocks = q.slice_tokens(b0 * self.block, -(-end // self.block) * self.block)
        full = self.dequantize(blocks, dtype)
        return full[..., start - b0 * self.block:end - b0 * self.block, :]
