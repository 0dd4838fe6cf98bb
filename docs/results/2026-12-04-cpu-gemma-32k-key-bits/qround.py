"""`kvtax quality` with q4's per-channel keys rounded to minimize the error of the scores
q·k rather than of k: each block's scales and biases as q4 stores them (min/max per
channel), the codes chosen channel by channel with the error fed forward (GPTQ's update)
under H = sum of q qᵀ over the queries of this KV head's group seen so far in this prompt
(this chunk's included). Same bytes, same reader; only the codes differ.

    python qround.py [--layers full|all] <kvtax quality arguments>
"""
import sys

import torch

import kvtax.models.decoder as decoder
from kvtax.cache import blocks
from kvtax.formats.affine import affine_encode
from kvtax.formats.base import QTensor
from kvtax.formats.packing import pack
from rounding import factor, round_forward

DAMP = 0.1  # of H's mean diagonal: the held-out screen's best on Gemma's global layers
LAYERS = "all"
if sys.argv[1] == "--layers":
    LAYERS = sys.argv[2]
    del sys.argv[1:3]
LAST = {}
_rope = decoder.apply_rope


def rope_capture(x, cos, sin):
    out = _rope(x, cos, sin)
    LAST["qk"] = out  # [B, T, Hq + Hkv, D]: the caller splits q off next
    return out


decoder.apply_rope = rope_capture


def rounded(fmt, x, gram):
    """x [B, H, T, D] (T a multiple of 64) → QTensor as fmt.quantize, codes GPTQ-rounded
    under gram [B, H, D, D] (float64)."""
    b, h, t, d = x.shape
    g = x.float().unflatten(-2, (t // 64, 64))
    _, scale, bias = affine_encode(g, -2, fmt.levels, x.dtype)  # [B, H, nb, D]
    s = scale.float().unsqueeze(-2).expand_as(g).reshape(b, h, t, d).double()
    lo = bias.float().unsqueeze(-2).expand_as(g).reshape(b, h, t, d).double()
    codes = round_forward(x.double(), lo, s, factor(gram, DAMP), fmt.levels).to(torch.uint8)
    rows = (b, h, t, d // 64)
    return QTensor(pack(codes, fmt.n_bits).contiguous(), scale.reshape(rows).contiguous(),
                   bias.reshape(rows).contiguous())


_extend = blocks.KeyBlocks.extend
_quant = blocks.KeyBlocks._quantize


def extend(self, k, p0):
    qk = LAST.pop("qk", None)
    if p0 == 0:
        self.gram = None
    use = getattr(self, "use_gram", None)
    if qk is not None and use is not False:
        hkv = k.shape[1]
        q = qk[:, :, : qk.shape[2] - hkv].transpose(1, 2).double()  # [B, Hq, T, D]
        q = q.unflatten(1, (hkv, -1)).flatten(2, 3)                 # [B, Hkv, g·T, D]
        add = q.transpose(-1, -2) @ q
        self.gram = add if getattr(self, "gram", None) is None else self.gram + add
    return _extend(self, k, p0)


def quantize(self, x):
    gram = getattr(self, "gram", None)
    if gram is None or getattr(self, "use_gram", None) is False:
        return _quant(self, x)
    pad = -x.shape[-2] % 64
    if pad:
        x = torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], pad, x.shape[-1])], dim=-2)
    return rounded(self.fmt, x, gram)


blocks.KeyBlocks.extend = extend
blocks.KeyBlocks._quantize = quantize

if LAYERS == "full":  # only full-attention layers' keys (Gemma-3's 5, 11, 17)
    from kvtax.cache import base
    from kvtax.cache.sliding import SlidingCache
    _wb = base.BaseCache._write_blocked

    def wb(self, k, v):
        self.blocks.use_gram = not isinstance(self, SlidingCache)
        return _wb(self, k, v)
    base.BaseCache._write_blocked = wb

from kvtax.cli import main  # noqa: E402

sys.exit(main(["quality", *sys.argv[1:]]))
