"""Bit packing of integer codes along head_dim, laid out so a kernel unpacks with shifts.

Each packing keeps every byte's codes `D/k` dims apart ("split" layouts), so unpacking a row
is a few masks and shifts that yield contiguous sub-rows, never a shuffle:

  8 bits: one code per byte.
  4 bits: byte j holds dims j (low nibble) and j + D/2 (high nibble): "split halves".
  3 bits: two planes. Bytes [0, D/4): the low 2 bits, byte j holding dims j, j + D/4,
          j + D/2, j + 3D/4 (bits 0-1, 2-3, 4-5, 6-7); bytes [D/4, 3D/8): the high bit,
          byte j holding dims j + i·D/8 in bit i. 3 bits per code, D a multiple of 8.

    >>> packed = pack(codes, 3)       # codes uint8 [..., D] in [0, 8) → [..., 3D/8]
    >>> unpack(packed, 3, D)          # back to [..., D]
"""

from __future__ import annotations

import torch


def packed_width(head_dim: int, bits: int) -> int:
    """Bytes per row of `head_dim` codes of `bits` bits."""
    return head_dim * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes `[..., D]` (values < 2**bits) → packed bytes `[..., D * bits / 8]`."""
    d = codes.shape[-1]
    if bits == 8:
        return codes.contiguous()
    if bits == 4:
        return (codes[..., : d // 2] | (codes[..., d // 2:] << 4)).contiguous()
    if bits == 3:
        lo = codes & 0x3
        q = d // 4
        low = lo[..., :q] | (lo[..., q:2 * q] << 2) | (lo[..., 2 * q:3 * q] << 4) | (lo[..., 3 * q:] << 6)
        hi = (codes >> 2) & 0x1
        e = d // 8
        high = torch.zeros_like(hi[..., :e])
        for i in range(8):
            high |= hi[..., i * e:(i + 1) * e] << i
        return torch.cat([low, high], dim=-1).contiguous()
    raise ValueError(f"no packing for {bits}-bit codes")


def unpack(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Packed bytes `[..., D * bits / 8]` → uint8 codes `[..., D]`."""
    if bits == 8:
        return packed
    if bits == 4:
        return torch.cat([packed & 0xF, packed >> 4], dim=-1)
    if bits == 3:
        q, e = head_dim // 4, head_dim // 8
        low, high = packed[..., :q], packed[..., q:q + e]
        lo = torch.cat([(low >> (2 * i)) & 0x3 for i in range(4)], dim=-1)
        hi = torch.cat([(high >> i) & 0x1 for i in range(8)], dim=-1)
        return lo | (hi << 2)
    raise ValueError(f"no packing for {bits}-bit codes")
