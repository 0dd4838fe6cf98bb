"""int4 / int3 keys quantized per channel over blocks of 64 tokens (KIVI's key layout).

A key's quantization error is set by its group's range. Within one token a few outlier
channels stretch every group they fall in; along tokens one channel keeps a similar range.
So each block of `BLOCK` consecutive tokens stores, per channel d, `x ≈ scale_d * c + bias_d`
(MLX's affine semantics: `scale = (max - min) / (2^bits - 1)`, `bias = min`, both in the
model dtype). On Qwen2.5-Coder-0.5B this alone took 4-bit keys from KL 2.9e-2 to
2.2e-3 at 2k (the scheme screen in docs/QUALITY.md).

Layout (a kernel reads it without any reordering):
  codes  `[..., T, D/2]` uint8, split halves like int4: byte j holds dim j (low nibble) and
         dim j + D/2 (high nibble) of the same token (int3: `[..., T, 3D/8]`, the bit planes
         of kvtax.formats.packing);
  scales `[..., T, D/BLOCK]`, biases the same, in the model dtype. Per sequence and head the
         rows are contiguous, so that memory read as `[T/BLOCK, D]` is block j's per-channel
         vector: the scale of (token t, channel d) sits at flat offset (t // BLOCK) * D + d.
A block's metadata thus spans its 64 token rows, so T is a multiple of BLOCK and writes go a
whole block at a time (a cache re-quantizes its partial last block as tokens arrive).
Bytes per token and head at D = 128: 64 codes + 2 x 2 x 2 = 72, 0.5625 per element.

    >>> fmt = ChannelBlockFormat()            # "int4-c64"
    >>> q = fmt.quantize(k)                   # k [B, H, 128, 128] → codes [B, H, 128, 64]
    >>> fmt.read(q, 10, 100).shape            # tokens [10, 100) decoded: [B, H, 90, 128]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtax.errors import FormatError
from kvtax.formats.affine import affine_encode
from kvtax.formats.base import KVFormat, QTensor
from kvtax.formats.packing import pack, packed_width, unpack

BLOCK = 64  # tokens per block: the recent fp16 window (128) covers a block until it fills


@dataclass(frozen=True)
class ChannelBlockFormat(KVFormat):
    """4- or 3-bit affine codes with one scale and bias per channel per 64-token block."""

    n_bits: int = 4
    block: int = BLOCK

    def __post_init__(self) -> None:
        if self.n_bits not in (3, 4) or self.block != BLOCK:
            raise FormatError(f"channel-block formats are int4-c{BLOCK} and int3-c{BLOCK}; "
                              f"got int{self.n_bits}-c{self.block}")

    @property
    def name(self) -> str:
        return f"int{self.n_bits}-c{self.block}"

    @property
    def bits(self) -> int:
        return self.n_bits

    @property
    def levels(self) -> int:
        return (1 << self.n_bits) - 1

    def check(self, head_dim: int) -> None:
        super().check(head_dim)
        if head_dim % self.block:
            # Name a spec that runs at this head_dim: per-token keys, rotated and centered,
            # whose group size fit_head_dim takes from head_dim (g32 at 96, g16 at 80).
            short, alt = (("q4", "int4+hk+ck@s4r128") if self.n_bits == 4
                          else ("q3", "int3+hk+ck@s4r96"))
            raise FormatError(
                f"{self.name}: head_dim {head_dim} is not a multiple of {self.block} (each "
                f"token row holds 1/{self.block} of its block's per-channel scales), so "
                f"{short} cannot store this model's keys; use per-token keys, e.g. '{alt}' "
                "(less accurate than per-channel keys where keys have outlier channels, "
                "docs/QUALITY.md), or q8")

    def code_width(self, head_dim: int) -> int:
        return packed_width(head_dim, self.n_bits)

    def scale_width(self, head_dim: int) -> int:
        return head_dim // self.block

    def bias_width(self, head_dim: int) -> int:
        return head_dim // self.block

    def code_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

    def quantize(self, x: torch.Tensor) -> QTensor:
        """x `[..., T, D]` with T a multiple of 64 → codes `[..., T, D/2]`, scales and
        biases `[..., T, D/64]` in x.dtype (layout above)."""
        *lead, t, d = x.shape
        self.check(d)
        if t % self.block:
            raise FormatError(f"{self.name} quantizes whole blocks of {self.block} tokens, "
                              f"got {t}")
        g = x.float().unflatten(-2, (t // self.block, self.block))  # [..., nb, BLOCK, D]
        c, scale, bias = affine_encode(g, -2, self.levels, x.dtype)  # scale [..., nb, D]
        codes = pack(c.flatten(-3, -2), self.n_bits)                 # from [..., T, D]
        rows = (*lead, t, d // self.block)
        return QTensor(codes.contiguous(), scale.reshape(rows).contiguous(),
                       bias.reshape(rows).contiguous())

    def dequantize(self, q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """codes `[..., T, D/2]` (T a multiple of 64, block-aligned) → `[..., T, D]`."""
        return self._decode(q.codes, *self._per_token(q), dtype)

    def read(self, q: QTensor, start: int, end: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tokens `[start, end)` of block-aligned storage, decoded: `[..., end-start, D]`.
        The metadata of every block they touch is read whole (it spans the block's rows)."""
        b0, b1 = start // self.block, -(-end // self.block)
        blocks = q.slice_tokens(b0 * self.block, b1 * self.block)
        scale, bias = self._per_token(blocks)
        lo, hi = start - b0 * self.block, end - b0 * self.block
        return self._decode(q.codes[..., start:end, :], scale[..., lo:hi, :],
                            bias[..., lo:hi, :], dtype)

    def read_index(self, q: QTensor, index: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tokens at `index` (1-D, any order) of block-aligned storage: `[..., len, D]`."""
        n = int(index.max()) + 1 if index.numel() else 0
        full = self.read(q, 0, n, dtype) if n else q.codes.new_zeros(0)
        return full.index_select(-2, index) if n else full

    def _per_token(self, q: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """scales, biases `[..., T, D/64]` (block layout) → per token `[..., T, D]`."""
        assert q.scales is not None and q.biases is not None
        *lead, t, w = q.scales.shape
        if t % self.block:
            raise FormatError(f"{self.name} storage is read in whole blocks of "
                              f"{self.block} tokens, got {t}")
        d = w * self.block

        def expand(m: torch.Tensor) -> torch.Tensor:
            return m.reshape(*lead, t // self.block, 1, d).expand(
                *lead, t // self.block, self.block, d).reshape(*lead, t, d)

        return expand(q.scales), expand(q.biases)

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        c = unpack(codes, self.n_bits, scale.shape[-1]).to(torch.float32)
        return (c * scale.float() + bias.float()).to(dtype)
