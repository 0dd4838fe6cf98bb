"""`kvtax quality` where int4w-c64 keys take the fifth bit on the same channels in every
block of a sequence: the widest 3/8 (max - min over the block's tokens) of the sequence's
first 64-token block, per batch row and KV head, instead of each block's own widest.

The question: can a kernel treat the selected channels as a fixed set per sequence and head
(permuted once to one contiguous range, so the fifth bits OR into the nibbles' fp16
mantissa where the swap kernels unpack codes), or do the keys need a per-block choice?

Block 0's choice is a function of its tokens only (it is re-quantized, as any open block,
until it fills), so every block's codes stay independent of how the prompt was chunked.
The storage is int4w-c64's own (every block's index rows hold block 0's channels), so the
cache bytes are the format's.

    python fixed.py <kvtax quality arguments>
"""
import sys
import threading

import torch

from kvtax.cache.blocks import KeyBlocks
from kvtax.errors import FormatError
from kvtax.formats.affine import affine_encode
from kvtax.formats.base import QTensor
from kvtax.formats.packing import pack
from kvtax.formats.widest import WidestBitFormat, pack_bits, selected

_sel = threading.local()  # the selection the quantize call in flight must use


def widest(x: torch.Tensor, r: int) -> torch.Tensor:
    """x `[..., 64, D]` → its widest r channels `[..., r]`, ascending (ties as the format)."""
    g = x.float()
    rng = g.amax(-2) - g.amin(-2)
    return torch.sort(torch.argsort(rng, dim=-1, descending=True, stable=True)[..., :r],
                      dim=-1).values


def quantize(self, x: torch.Tensor) -> QTensor:
    """WidestBitFormat.quantize with every block's channels `_sel.idx` `[..., R]`."""
    idx0 = getattr(_sel, "idx", None)
    if idx0 is None:
        raise RuntimeError("fixed.py: an int4w-c64 quantize outside KeyBlocks._quantize")
    *lead, t, d = x.shape
    self.check(d)
    if t % self.block:
        raise FormatError(f"{self.name} quantizes whole blocks of {self.block} tokens, got {t}")
    nb, r, n_idx = t // self.block, selected(d), -(-selected(d) // self.block)
    g = x.float().unflatten(-2, (nb, self.block))                    # [..., nb, 64, D]
    idx = idx0.unsqueeze(-2).expand(*lead, nb, r)                    # [..., nb, R]
    levels = torch.full(g.shape[:-2] + (d,), 15.0, device=x.device).scatter_(-1, idx, 31.0)
    c, scale, bias = affine_encode(g, -2, levels, x.dtype)
    fifth = torch.gather(c >> 4, -1, idx.unsqueeze(-2).expand(*idx.shape[:-1], self.block, r))
    slots = torch.zeros(*lead, nb, n_idx * self.block, dtype=torch.uint8, device=x.device)
    slots[..., :r] = idx.to(torch.uint8)
    rows = slots.unflatten(-1, (n_idx, self.block)).transpose(-1, -2)
    codes = torch.cat([pack(c & 0xF, 4), pack_bits(fifth), rows], dim=-1)
    meta = (*lead, t, d // self.block)
    return QTensor(codes.flatten(-3, -2).contiguous(), scale.reshape(meta).contiguous(),
                   bias.reshape(meta).contiguous())


_extend, _trim, _quantize = KeyBlocks.extend, KeyBlocks.trim, KeyBlocks._quantize


def extend(self, k, p0):
    self.first_ = p0 // self.block * self.block
    return _extend(self, k, p0)


def trim(self, length):
    self.first_ = length // self.block * self.block
    return _trim(self, length)


def quantize_blocks(self, x):
    if not isinstance(self.fmt, WidestBitFormat):
        return _quantize(self, x)
    if self.first_ == 0:  # block 0 is in x (open or full): its widest channels, padded as stored
        n = min(x.shape[-2], self.block)
        b0 = x[..., :n, :]
        self.sel_ = widest(b0, selected(x.shape[-1]))
    _sel.idx = self.sel_
    try:
        return _quantize(self, x)
    finally:
        _sel.idx = None


def write_at(self, k, pos_t):
    raise RuntimeError("fixed.py: write_at is not patched")


WidestBitFormat.quantize = quantize
KeyBlocks.extend, KeyBlocks.trim, KeyBlocks._quantize = extend, trim, quantize_blocks
KeyBlocks.write_at = write_at

from kvtax.cli import main  # noqa: E402

sys.exit(main(["quality", *sys.argv[1:]]))
