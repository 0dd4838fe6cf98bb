"""int4w-c64: int4-c64 keys plus a fifth bit on each block's widest 3/8 channels."""

import pytest
import torch

from kvtax.errors import FormatError
from kvtax.formats import ChannelBlockFormat, KVSpec, WidestBitFormat, parse_format
from kvtax.formats.hybrid import parse_kv
from kvtax.formats.packing import unpack


def _oracle(x: torch.Tensor) -> torch.Tensor:
    """The 3D/8 channels of largest max - min over the first 64 tokens (ties to the lower
    channel) on a 5-bit min/max grid in every 64-token block, the rest on int4-c64's 4-bit
    one."""
    out = torch.empty_like(x, dtype=torch.float32)
    d = x.shape[-1]
    first = x[..., :64, :].float()
    wide = first.amax(-2, keepdim=True) - first.amin(-2, keepdim=True)
    levels = torch.full_like(wide, 15.0)
    for i in range(wide.shape[0]):
        for j in range(wide.shape[1]):
            rng = wide[i, j, 0].tolist()
            levels[i, j, 0, sorted(range(d), key=lambda c: (-rng[c], c))[:3 * d // 8]] = 31.0
    for b0 in range(0, x.shape[-2], 64):
        blk = x[..., b0:b0 + 64, :].float()
        lo, hi = blk.amin(-2, keepdim=True), blk.amax(-2, keepdim=True)
        scale = ((hi - lo) / levels).to(x.dtype).float()
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        lo = lo.to(x.dtype).float()
        code = ((blk - lo) / scale).round().clamp(min=0).minimum(levels)
        out[..., b0:b0 + 64, :] = code * scale + lo
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_matches_oracle_and_layout(dtype, d):
    torch.manual_seed(d)
    x = (torch.randn(2, 3, 192, d) * torch.linspace(0.1, 5, d)[torch.randperm(d)]).to(dtype)
    x[0, 0, :64, :8] = 1.0  # a constant channel block: scale 1, never selected
    fmt = WidestBitFormat()
    q = fmt.quantize(x)
    r = 3 * d // 8
    assert q.codes.shape == (2, 3, 192, d // 2 + d // 16)
    assert q.scales.shape == (2, 3, 192, d // 64)
    torch.testing.assert_close(fmt.dequantize(q), _oracle(x), rtol=0, atol=0)
    # the order of (1, 2), in every block's rows: row u holds order[u + 64 m] in byte m;
    # the widest of block 0 ascending, then the rest ascending
    rng = x[1, 2, :64].float().amax(0) - x[1, 2, :64].float().amin(0)
    top = torch.sort(torch.argsort(rng, descending=True, stable=True)[:r]).values
    rest = torch.tensor([c for c in range(d) if c not in set(top.tolist())])
    order = torch.cat([top, rest])
    for b0 in (0, 64, 128):
        rows = q.codes[1, 2, b0:b0 + 64, d // 2 + r // 8:]
        assert torch.equal(rows.T.flatten().long(), order)
    assert torch.equal(fmt.order_of(q)[1, 2], order)
    # block 1 in stored order: chosen channels' scales range / 31, the others' int4-c64's
    c4 = ChannelBlockFormat().quantize(x)
    s = q.scales[1, 2].flatten()[d:2 * d]
    s4 = c4.scales[1, 2].flatten()[d:2 * d][order]
    assert torch.equal(s[r:], s4[r:])
    nib = torch.cat([q.codes[1, 2, 64:128, :d // 2] & 0xF, q.codes[1, 2, 64:128, :d // 2] >> 4], -1)
    assert torch.equal(nib[:, r:], unpack(c4.codes[1, 2, 64:128], 4, d)[:, order][:, r:])
    rng1 = x[1, 2, 64:128].float().amax(0) - x[1, 2, 64:128].float().amin(0)
    torch.testing.assert_close(s[:r].float(), (rng1[top] / 31).to(dtype).float(), rtol=0, atol=0)
    assert fmt.bytes_per_token(d, dtype) == d // 2 + d // 16 + 2 * (d // 64) * x.element_size()
    # a later block quantized alone in the sequence's order is the same bytes
    q2 = fmt.quantize(x[..., 128:, :], fmt.order_of(q))
    assert torch.equal(q2.codes, q.codes[..., 128:, :])
    assert torch.equal(q2.scales, q.scales[..., 128:, :])


def test_fifth_bit_plane_and_less_error_than_int4_c64():
    torch.manual_seed(1)
    x = torch.randn(1, 2, 128, 64) * torch.linspace(0.1, 5, 64)[torch.randperm(64)]
    fmt = WidestBitFormat()
    q = fmt.quantize(x)
    # one hand-decoded code: stored channel j < 24 of token t is channel order[j], its
    # code the low nibble of byte j plus 16 * bit j % 8 of byte 32 + j // 8
    t, j = 70, 13
    order = fmt.order_of(q)[0, 1]
    nib = q.codes[0, 1, t, j] & 0xF
    bit = (q.codes[0, 1, t, 32 + j // 8] >> (j % 8)) & 1
    scale, bias = q.scales[0, 1].flatten()[64 + j], q.biases[0, 1].flatten()[64 + j]
    want = (int(nib) + 16 * int(bit)) * scale + bias
    assert fmt.dequantize(q)[0, 1, t, int(order[j])] == want
    c4 = ChannelBlockFormat()
    err = (fmt.dequantize(q) - x).pow(2).mean()
    err4 = (c4.dequantize(c4.quantize(x)) - x).pow(2).mean()
    assert err < 0.6 * err4


def test_names_and_errors():
    spec = KVSpec.parse("k4w-c64v4")
    assert spec.key == WidestBitFormat() and spec.name == "k4w-c64v4"
    assert parse_format("int4w-c64") == WidestBitFormat() != ChannelBlockFormat()
    assert parse_kv("k4w-c64v4@s4r128").name == "k4w-c64v4@s4r128"
    assert spec.bytes_per_token(256) == 160 + 144  # Gemma-3's head_dim: keys 0.62 B/element
    with pytest.raises(FormatError, match="got 'int4w-c32'"):
        parse_format("int4w-c32")
    with pytest.raises(FormatError, match="unknown KV format"):
        parse_format("int4w")
    with pytest.raises(FormatError, match="not a multiple of 64"):
        WidestBitFormat().check(96)
    with pytest.raises(FormatError, match="over 256"):
        WidestBitFormat().check(320)
    with pytest.raises(FormatError, match="whole blocks"):
        WidestBitFormat().quantize(torch.randn(1, 1, 10, 64))
    with pytest.raises(FormatError, match=r"int4w-c64 is a key format .* e\.g\. k4w-c64v4"):
        KVSpec.parse("int4w-c64")  # values per channel: refused when the spec is named


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_channel_order_is_a_stable_descending_sort_of_the_ranges(d):
    """`channel_order` ranks by comparisons; a stable sort (NaN ranges widest) says the
    same, ties included: many channels share a range here."""
    from kvtax.formats.widest import channel_order, selected
    torch.manual_seed(d)
    x = torch.randint(0, 5, (3, 2, 64, d)).float() * torch.randint(1, 4, (d,)).float()
    x[0, 0, 5, 7] = float("nan")
    x[1, 1, :, :] = 0.25  # every range equal: the first R channels
    rng = torch.nan_to_num(x.amax(-2) - x.amin(-2), nan=float("inf"))
    top = torch.argsort(rng, dim=-1, descending=True, stable=True)[..., :selected(d)]
    chosen = torch.zeros_like(rng, dtype=torch.bool).scatter_(-1, top, True)
    want = torch.argsort((~chosen).to(torch.uint8), dim=-1, stable=True)
    got = channel_order(x)
    assert torch.equal(got, want)
    assert torch.equal(got[1, 1], torch.arange(d))
    assert 7 in got[0, 0, :selected(d)].tolist()  # the NaN channel counts as widest
