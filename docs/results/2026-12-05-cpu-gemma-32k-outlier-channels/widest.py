"""`kvtax quality` where the int5-c64 key format (`int5-keys.patch` of the key-bits folder,
applied to the kvtax this imports) stores 5-bit codes only on the widest FRACTION of each
64-token block's channels (largest max - min over the block's tokens, by torch.topk) and
4-bit codes on the rest: scale = range / 31 there, range / 15 elsewhere, so the
int5 reader decodes both. The decoded keys are those of kvtax's int4w-c64 at FRACTION 0.375 (where no two ranges tie), which
stores the fifth bits and the channel indices compactly (kvtax.formats.widest).

    python widest.py FRACTION <kvtax quality arguments>
"""
import sys

import torch

from kvtax.errors import FormatError
from kvtax.formats.base import QTensor
from kvtax.formats.channel import ChannelBlockFormat
from kvtax.formats.packing import pack

FRACTION = float(sys.argv.pop(1))
_quantize = ChannelBlockFormat.quantize


def quantize(self, x: torch.Tensor) -> QTensor:
    """x `[..., T, D]` (T a multiple of 64) → int5-c64 storage whose unselected channels use
    only the codes 0..15 on a 4-bit grid."""
    if self.n_bits != 5:
        return _quantize(self, x)
    *lead, t, d = x.shape
    if t % self.block:
        raise FormatError(f"{self.name} quantizes whole blocks of {self.block} tokens, got {t}")
    g = x.float().unflatten(-2, (t // self.block, self.block))  # [..., nb, 64, D]
    lo, hi = g.amin(-2), g.amax(-2)                              # [..., nb, D]
    levels = torch.full_like(lo, 15.0)
    levels.scatter_(-1, (hi - lo).topk(round(FRACTION * d), dim=-1).indices, 31.0)
    scale = ((hi - lo) / levels).to(x.dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    bias = lo.to(x.dtype)
    c = ((g - bias.float().unsqueeze(-2)) / scale.float().unsqueeze(-2)).round_()
    c = c.clamp_(min=0).minimum(levels.unsqueeze(-2)).to(torch.uint8)
    rows = (*lead, t, d // self.block)
    return QTensor(pack(c.flatten(-3, -2), 5).contiguous(), scale.reshape(rows).contiguous(),
                   bias.reshape(rows).contiguous())


ChannelBlockFormat.quantize = quantize

from kvtax.cli import main  # noqa: E402

sys.exit(main(["quality", *sys.argv[1:]]))
