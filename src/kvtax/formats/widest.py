"""int4w-c64: int4-c64 keys plus a fifth bit on the widest 3/8 of each block's channels.

A channel's 4-bit error is set by its range over the block (max - min of its 64 tokens), and
those ranges are uneven: on Gemma-3-270M's global layers the widest 3/8 of channels, given a
fifth bit, take the scores' mean squared error from 0.042 / 0.025 / 0.026 to 0.012 / 0.009 /
0.017 at 8k, where a fifth bit on every channel gives 0.010 / 0.006 / 0.006, for 0.44 bits
per key element instead of 1 (docs/results/2026-12-05-cpu-gemma-32k-outlier-channels). The
channels are chosen per block from the keys themselves: no calibration, no queries.

Layout (`[..., T, W]` uint8 codes, W = D/2 + R/8 + ceil(R/64), R = 3D/8 selected channels):
  bytes [0, D/2)             the low 4 bits of every channel's code, int4-c64's split halves;
  bytes [D/2, D/2 + R/8)     this token's fifth bits of the block's R selected channels in
                             slot order, one bit plane: byte j holds slot j + i·R/8 in bit i;
  bytes [D/2 + R/8, W)       the block's channel indices, ascending: row u of a block holds
                             slot u + 64·m in byte m (0 past slot R - 1).
Scales and biases as int4-c64 (`[..., T, D/64]`, block layout), `scale = range / 31` on a
selected channel and `range / 15` elsewhere, so `x ≈ scale * (nibble + 16 * fifth) + bias`
on every channel. Bytes per token and head at D = 256: 128 + 12 + 2 + 2·2·4 = 158 (int4-c64:
144). The tile and one-warp kernels read it (kernel format code 7,
kvtax/attention/kernels/widest.py, which takes R = 3D/8); the swap decode kernels do not.

    >>> fmt = WidestBitFormat()               # "int4w-c64"
    >>> q = fmt.quantize(k)                   # k [B, H, 128, 256] → codes [B, H, 128, 142]
    >>> fmt.read(q, 10, 100).shape            # tokens [10, 100) decoded: [B, H, 90, 256]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtax.errors import FormatError
from kvtax.formats.affine import affine_encode
from kvtax.formats.base import QTensor
from kvtax.formats.channel import ChannelBlockFormat
from kvtax.formats.packing import pack, unpack

WIDEST = 3 / 8  # of a block's channels get the fifth bit: Gemma-3's 8k bytes allow 0.46 bits


def selected(head_dim: int) -> int:
    """R, the channels per block with a fifth bit (a multiple of 8 where 64 divides D)."""
    return round(WIDEST * head_dim)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 bits `[..., R]` (R a multiple of 8) → `[..., R/8]`: bit i of byte j is slot
    j + i·R/8."""
    e = bits.shape[-1] // 8
    out = torch.zeros_like(bits[..., :e])
    for i in range(8):
        out |= bits[..., i * e:(i + 1) * e] << i
    return out


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """`[..., R/8]` → uint8 bits `[..., R]` (pack_bits' inverse)."""
    return torch.cat([(packed >> i) & 0x1 for i in range(8)], dim=-1)


@dataclass(frozen=True)
class WidestBitFormat(ChannelBlockFormat):
    """int4-c64 whose widest 3/8 channels per block store 5-bit codes (layout above)."""

    @property
    def name(self) -> str:
        return f"int4w-c{self.block}"

    def check(self, head_dim: int) -> None:
        super().check(head_dim)
        if head_dim > 256:  # a channel index is one byte
            raise FormatError(f"{self.name}: head_dim {head_dim} over 256; use q4's int4-c64 keys")

    def code_width(self, head_dim: int) -> int:
        r = selected(head_dim)
        return head_dim // 2 + r // 8 + -(-r // self.block)

    def quantize(self, x: torch.Tensor) -> QTensor:
        """x `[..., T, D]` with T a multiple of 64 → codes `[..., T, W]`, scales and biases
        `[..., T, D/64]` in x.dtype (layout above)."""
        *lead, t, d = x.shape
        self.check(d)
        if t % self.block:
            raise FormatError(f"{self.name} quantizes whole blocks of {self.block} tokens, "
                              f"got {t}")
        nb, r, n_idx = t // self.block, selected(d), -(-selected(d) // self.block)
        g = x.float().unflatten(-2, (nb, self.block))               # [..., nb, 64, D]
        lo, hi = g.amin(-2), g.amax(-2)                             # [..., nb, D]
        # widest first; equal ranges in channel order (stable), then slots in channel order
        idx = torch.sort(torch.argsort(hi - lo, dim=-1, descending=True, stable=True)[..., :r],
                         dim=-1).values                             # [..., nb, R]
        levels = torch.full_like(lo, 15.0).scatter_(-1, idx, 31.0)
        c, scale, bias = affine_encode(g, -2, levels, x.dtype)      # c [..., nb, 64, D]
        fifth = torch.gather(c >> 4, -1, idx.unsqueeze(-2).expand(*idx.shape[:-1], self.block, r))
        slots = torch.zeros(*lead, nb, n_idx * self.block, dtype=torch.uint8, device=x.device)
        slots[..., :r] = idx.to(torch.uint8)  # slot u + 64·m → row u, byte m
        rows = slots.unflatten(-1, (n_idx, self.block)).transpose(-1, -2)  # [..., nb, 64, I]
        codes = torch.cat([pack(c & 0xF, 4), pack_bits(fifth), rows], dim=-1)
        meta = (*lead, t, d // self.block)
        return QTensor(codes.flatten(-3, -2).contiguous(), scale.reshape(meta).contiguous(),
                       bias.reshape(meta).contiguous())

    def dequantize(self, q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """codes `[..., T, W]` (T a multiple of 64, block-aligned) → `[..., T, D]`."""
        scale, bias = self._per_token(q)
        d = scale.shape[-1]
        *lead, t, _ = q.codes.shape
        r, h = selected(d), d // 2
        c = unpack(q.codes[..., :h], 4, d).to(torch.int64)          # [..., T, D]
        fifth = unpack_bits(q.codes[..., h:h + r // 8]).to(torch.int64)  # [..., T, R]
        rows = q.codes[..., h + r // 8:].unflatten(-2, (t // self.block, self.block))
        idx = rows.transpose(-1, -2).flatten(-2)[..., :r].to(torch.int64)  # [..., nb, R]
        idx = idx.repeat_interleave(self.block, dim=-2)             # [..., T, R]
        c = c.scatter_add(-1, idx, fifth << 4)
        return (c.to(torch.float32) * scale.float() + bias.float()).to(dtype)

    def read(self, q: QTensor, start: int, end: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tokens `[start, end)` of block-aligned storage, decoded: `[..., end-start, D]`.
        Every block they touch is decoded whole (its rows hold its channel indices)."""
        b0 = start // self.block
        blocks = q.slice_tokens(b0 * self.block, -(-end // self.block) * self.block)
        full = self.dequantize(blocks, dtype)
        return full[..., start - b0 * self.block:end - b0 * self.block, :]
