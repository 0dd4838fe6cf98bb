"""Affine group-wise integer formats (int8, int4, int3) with MLX's semantics.

Each group of `group_size` consecutive head_dim elements of one token stores
`x ≈ scale * q + bias`, `q ∈ [0, 2^bits)`, `scale = (max - min) / (2^bits - 1)`,
`bias = min`, with scale and bias in the model dtype — as `mx.quantize` does, so
errors compare with the seeds' mlx-lm measurements.

int4 packs two codes per byte in *split halves*: byte `j` holds dim `j` in its low
nibble and dim `j + head_dim/2` in its high nibble. A kernel then unpacks a tile with
one mask and one shift into two contiguous half-rows, with no interleave shuffle. int3
packs a 2-bit and a 1-bit plane the same way (kvtax.formats.packing); attention's tile
kernels unpack both planes (kernel format code 6), the cache store kernel does not (3-bit
writes quantize in torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtax.errors import FormatError
from kvtax.formats.base import KVFormat, QTensor
from kvtax.formats.packing import pack, packed_width, unpack

GROUP_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class AffineFormat(KVFormat):
    """int8 / int4 / int3 affine quantization, group-wise along head_dim, per token.

    Example: `AffineFormat(4, 64).quantize(k)` with `k` `[B, H, T, 128]` gives codes
    `[B, H, T, 64]` uint8 and scales/biases `[B, H, T, 2]` in `k.dtype`.
    """

    n_bits: int = 8
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.n_bits not in (3, 4, 8):
            raise FormatError(f"affine formats have 3, 4 or 8 bits, got {self.n_bits}")
        if self.group_size not in GROUP_SIZES:
            raise FormatError(
                f"group size must be one of {GROUP_SIZES}, got {self.group_size}"
            )

    @property
    def name(self) -> str:
        base = f"int{self.n_bits}"
        return base if self.group_size == 64 else f"{base}-g{self.group_size}"

    @property
    def bits(self) -> int:
        return self.n_bits

    @property
    def levels(self) -> int:
        return (1 << self.n_bits) - 1

    def check(self, head_dim: int) -> None:
        super().check(head_dim)
        if self.n_bits == 3 and head_dim % 8:
            raise FormatError(f"{self.name}: head_dim {head_dim} is not a multiple of 8 (3-bit "
                              "codes pack eight dims per bit plane byte)")
        if head_dim % self.group_size:
            raise FormatError(
                f"{self.name}: head_dim {head_dim} is not divisible by group size "
                f"{self.group_size}; pick a group size from {GROUP_SIZES} that divides it "
                f"(e.g. '{self.name.split('-')[0]}-g{_largest_divisor(head_dim)}')"
            )

    def code_width(self, head_dim: int) -> int:
        return packed_width(head_dim, self.n_bits)

    def scale_width(self, head_dim: int) -> int:
        return head_dim // self.group_size

    def bias_width(self, head_dim: int) -> int:
        return head_dim // self.group_size

    def code_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def quantize(self, x: torch.Tensor) -> QTensor:
        d = x.shape[-1]
        self.check(d)
        g = x.float().unflatten(-1, (d // self.group_size, self.group_size))
        q, scale, bias = affine_encode(g, -1, self.levels, x.dtype)
        return QTensor(pack(q.flatten(-2), self.n_bits), scale.contiguous(), bias.contiguous())

    def dequantize(self, q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        assert q.scales is not None and q.biases is not None
        d = q.scales.shape[-1] * self.group_size
        codes = unpack(q.codes, self.n_bits, d)
        g = codes.to(torch.float32).unflatten(-1, (d // self.group_size, self.group_size))
        x = g * q.scales.float().unsqueeze(-1) + q.biases.float().unsqueeze(-1)
        return x.flatten(-2).to(dtype)


def affine_encode(g: torch.Tensor, dim: int, levels: int | torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLX's affine code of float32 `g` over its axis `dim` (a group): uint8 codes shaped
    like g, and scale, bias (g without `dim`) in `dtype`: scale = (max - min) / levels
    (1 where a group is constant), bias = min. Scale and bias are rounded to `dtype` first
    and the codes chosen against the rounded values, so dequantize reproduces exactly what
    the codes were chosen for. `levels` may be a float tensor shaped like the groups' scale
    (a level count per group: int4w-c64's 31 or 15 per channel)."""
    lo, hi = g.amin(dim), g.amax(dim)
    scale = ((hi - lo) / levels).to(dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    bias = lo.to(dtype)
    q = ((g - bias.float().unsqueeze(dim)) / scale.float().unsqueeze(dim)).round_()
    top = levels.unsqueeze(dim) if isinstance(levels, torch.Tensor) else levels
    return q.clamp_(min=0).clamp_(max=top).to(torch.uint8), scale, bias


def _largest_divisor(head_dim: int) -> int:
    fits = [g for g in GROUP_SIZES if head_dim % g == 0]
    return max(fits) if fits else GROUP_SIZES[0]
