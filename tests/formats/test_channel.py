"""int4-c64: per-channel scales over 64-token blocks, read back by any token range."""

import pytest
import torch

from kvtax.errors import FormatError
from kvtax.formats import ChannelBlockFormat, KVSpec, WidestBitFormat, parse_format
from kvtax.formats.hybrid import parse_kv


def _oracle(x: torch.Tensor) -> torch.Tensor:
    """Per (block of 64 tokens, channel) min/max affine 4-bit, written the obvious way."""
    out = torch.empty_like(x, dtype=torch.float32)
    for b0 in range(0, x.shape[-2], 64):
        blk = x[..., b0:b0 + 64, :].float()
        lo, hi = blk.amin(-2, keepdim=True), blk.amax(-2, keepdim=True)
        scale = ((hi - lo) / 15).to(x.dtype).float()
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        lo = lo.to(x.dtype).float()
        out[..., b0:b0 + 64, :] = ((blk - lo) / scale).round().clamp(0, 15) * scale + lo
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_matches_oracle_and_layout(dtype, d):
    torch.manual_seed(d)
    x = (torch.randn(2, 3, 192, d) * torch.linspace(0.1, 5, d)).to(dtype)
    fmt = ChannelBlockFormat()
    q = fmt.quantize(x)
    assert q.codes.shape == (2, 3, 192, d // 2) and q.scales.shape == (2, 3, 192, d // 64)
    torch.testing.assert_close(fmt.dequantize(q), _oracle(x), rtol=0, atol=0)
    # the layout kernels rely on: flat offset (t // 64) * D + d of a head's scales
    lo = x[1, 2, 64:128, 7].float().min().to(dtype)
    assert q.biases[1, 2].flatten()[1 * d + 7] == lo
    # split-halves codes: byte j holds dim j low, dim j + D/2 high
    assert fmt.bytes_per_token(d, dtype) == d // 2 + 2 * (d // 64) * x.element_size()


@pytest.mark.parametrize("fmt", [ChannelBlockFormat(), WidestBitFormat()], ids=lambda f: f.name)
def test_read_any_range_and_index(fmt):
    x = torch.randn(1, 2, 256, 128)
    q = fmt.quantize(x)
    full = fmt.dequantize(q)
    for a, b in [(0, 1), (10, 100), (63, 65), (64, 128), (200, 256)]:
        torch.testing.assert_close(fmt.read(q, a, b), full[..., a:b, :], rtol=0, atol=0)
    idx = torch.tensor([255, 3, 64, 130])
    torch.testing.assert_close(fmt.read_index(q, idx), full[..., idx, :], rtol=0, atol=0)


def test_names_and_errors():
    spec = KVSpec.parse("k4-c64v4-g32")
    assert spec.key == ChannelBlockFormat() and spec.value == parse_format("int4-g32")
    assert KVSpec.parse(spec.name) == spec
    assert spec.bytes_per_token(128) == 72 + 80  # keys 0.5625, values 0.625 B/element
    assert parse_kv("q4").name == "k4w-c64v4@s4r128"
    assert parse_kv("q8") == KVSpec.parse("int8+hk+ck")
    assert parse_kv("q8@s4r8").name == "int8+hk+ck@s4r8"
    with pytest.raises(FormatError, match=r"q4 already keeps .* write k4w-c64v4@s4r8"):
        parse_kv("q4@s4r8")  # its own suffix is part of the name: say which spelling works
    with pytest.raises(FormatError, match="int4-c64, int3-c64 and int4w-c64, got 'int8-c64'"):
        parse_format("int8-c64")
    with pytest.raises(FormatError, match="got 'int4-c32'"):  # the K part as a format name
        parse_kv("k4-c32v4@s4r128")
    with pytest.raises(FormatError, match="not a multiple of 64"):
        ChannelBlockFormat().check(96)
    with pytest.raises(FormatError, match="whole blocks"):
        ChannelBlockFormat().quantize(torch.randn(1, 1, 10, 64))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_three_bit_planes_round_trip_and_bytes(d):
    from kvtax.formats.packing import pack, unpack

    codes = torch.randint(0, 8, (2, 5, d), dtype=torch.uint8)
    packed = pack(codes, 3)
    assert packed.shape[-1] == 3 * d // 8
    assert torch.equal(unpack(packed, 3, d), codes)
    # plane layout: byte j of the low plane holds dim j + D/4 in bits 2-3
    j = 3
    assert (packed[0, 0, j] >> 2) & 3 == codes[0, 0, j + d // 4] & 3
    assert (packed[0, 0, d // 4 + j] >> 5) & 1 == codes[0, 0, j + 5 * d // 8] >> 2


def test_three_bit_formats_match_oracles():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 128, 64)
    c3 = parse_format("int3-c64")
    q = c3.quantize(x)
    blk = x[..., :64, :]
    lo, hi = blk.amin(-2, keepdim=True), blk.amax(-2, keepdim=True)
    want = ((blk - lo) / ((hi - lo) / 7)).round().clamp(0, 7) * ((hi - lo) / 7) + lo
    torch.testing.assert_close(c3.dequantize(q)[..., :64, :], want, rtol=1e-6, atol=1e-6)
    g3 = parse_format("int3-g32")
    lo, hi = x.unflatten(-1, (2, 32)).amin(-1), x.unflatten(-1, (2, 32)).amax(-1)
    assert g3.bytes_per_token(64) == 24 + 2 * 2 * 2  # codes 3/8 B per dim, fp16 metadata
    err3 = (g3.dequantize(g3.quantize(x)) - x).abs().mean()
    err4 = (parse_format("int4-g32").dequantize(parse_format("int4-g32").quantize(x)) - x).abs().mean()
    assert err4 < err3 < 2.5 * err4
    assert parse_kv("q3").name == "k3-c64v3-g32@s4r96"
    for head_dim in (64, 128):  # Qwen2.5-0.5B's and Llama's; 8k is where the window weighs most
        for tokens in (8192, 16384, 32768):
            fp16 = tokens * 4 * head_dim  # K and V, 2 bytes each
            assert parse_kv("q3").bytes_for(tokens, head_dim, torch.bfloat16) / fp16 <= 0.25
    assert parse_kv("q3").bytes_for(8192, 64, torch.bfloat16) / (8192 * 4 * 64) == \
        pytest.approx(0.2466, abs=1e-4)


def test_attention_kernels_read_three_bit_the_store_kernel_does_not():
    """Attention's tile kernels read 3-bit codes (format codes 5 int3-c64, 6 int3; the
    kernel tests are tests/attention/test_kernels_int3_interp.py); the store kernel packs
    8- and 4-bit codes only, so 3-bit writes take the torch path."""
    from kvtax.attention.support import format_code
    from kvtax.formats.store_triton import format_code as store_code

    assert format_code(parse_format("int3-c64")) == (5, 64)
    for name, group in (("int3", 64), ("int3-g32", 32)):
        assert format_code(parse_format(name)) == (6, group)
        assert store_code(parse_format(name)) is None  # block formats never reach it
