"""Unit checks of the screen's fake quantizers (benchmarks/kv_quant_sim.py) against
hand-computed values, kvtax's own int4 and the bytes a real cache holds."""

from __future__ import annotations

import sys

import pytest
import torch

from kvtax.formats import KVSpec
from tests.support.scripts import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import kv_quant_sim as kq  # noqa: E402


def test_affine_by_hand() -> None:
    # One group [0, 1, 2, 7] at 2 bits: scale = 7/3, zero = 0; codes round(x / scale) =
    # [0, 0, 1, 3] → [0, 0, 7/3, 7] (7/3 rounded to fp16 first).
    x = torch.tensor([[0.0, 1.0, 2.0, 7.0]])
    s = torch.tensor(7 / 3).half().float()
    want = torch.tensor([[0.0, 0.0, 1.0, 3.0]]) * s
    assert torch.equal(kq.affine(x, 2, 1, 4), want)
    # Two groups of 2 at 1 bit: each keeps its own min and max exactly.
    y = torch.tensor([[1.0, 3.0, -2.0, 5.0]])
    assert torch.equal(kq.affine(y, 1, 1, 2), y)
    # A constant group (scale 0) comes back exactly.
    assert torch.equal(kq.affine(torch.full((1, 4), 0.5), 4, 1, 4), torch.full((1, 4), 0.5))


def test_per_token_int4_matches_kvtax_int4() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 2, 16, 64).half().float()
    fmt = KVSpec.parse("int4").key
    ref = fmt.dequantize(fmt.quantize(x.half()))  # fp16 scales/biases, group 64
    got = kq.fake_quant(x, kq.parse_scheme("int4").k, sinks=0, keep_recent=0)
    assert torch.allclose(got, ref.float(), atol=2e-3)


def test_per_channel_blocks_sinks_window_and_partial_block() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 1, 50, 8)
    q = kq.parse_scheme("k2c16/v4g8").k
    got = kq.fake_quant(x, q, sinks=4, keep_recent=10)
    x16 = x.half().float()
    # body [4, 40) holds two whole 16-token blocks [4, 36); [36, 40) waits in fp16.
    assert torch.equal(got[:, :, :4], x16[:, :, :4])
    assert torch.equal(got[:, :, 36:], x16[:, :, 36:])
    block = x16[0, 0, 4:20]  # [16 tokens, 8 channels]: each channel over its block
    lo, hi = block.amin(0), block.amax(0)
    scale = ((hi - lo) / 3).half().float()
    want = ((block - lo.half().float()) / scale).round().clamp(0, 3) * scale + lo.half().float()
    assert torch.allclose(got[0, 0, 4:20], want, atol=1e-6)
    assert not torch.equal(got[:, :, 4:36], x16[:, :, 4:36])


def test_one_huge_constant_channel_hurts_per_token_not_per_channel() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 2, 128, 64)
    x[..., 5] = 300.0  # Qwen-like: a key bias makes one channel a large constant
    err = {}
    for name in ("k4g64/v4g64", "k4c32/v4g64"):
        got = kq.fake_quant(x, kq.parse_scheme(name).k, sinks=0, keep_recent=0)
        err[name] = float((got - x).norm() / x[..., [i for i in range(64) if i != 5]].norm())
    assert err["k4c32/v4g64"] < 0.1 < err["k4g64/v4g64"]


def test_centering_and_rotation_are_undone() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 2, 40, 64) + 20.0 * torch.randn(64)  # one offset vector per key
    for name in ("k8g32+ck/v8g32", "k8g32+h/v8g32", "k8g32+h+ck/v8g32"):
        got = kq.fake_quant(x, kq.parse_scheme(name).k, sinks=0, keep_recent=0)
        assert float((got - x).norm() / x.norm()) < 1e-2, name  # not undone: ~1
    plain = kq.fake_quant(x, kq.parse_scheme("k4g64/v4g64").k, sinks=0, keep_recent=0)
    ck = kq.fake_quant(x, kq.parse_scheme("k4g64+ck/v4g64").k, sinks=0, keep_recent=0)
    assert (ck - x).norm() < 0.5 * (plain - x).norm()  # the offset no longer sets the range


def test_bytes_ratio_by_hand() -> None:
    d = 64
    assert kq.bytes_ratio(kq.parse_scheme("fp16"), 1000, d) == 1.0
    # int4 g64: (0.5 + 4/64) bytes per element over 2 → 0.28125 for K and V alike.
    assert kq.bytes_ratio(kq.parse_scheme("int4"), 2048, d) == pytest.approx(0.28125)
    # k4c64 / v4g32 @s4r128 at 2048: K fp16 = 4 + 128 + (1916 % 64 = 60) = 192 tokens,
    # V fp16 = 132 tokens; +ck not used.
    k = (192 * 2 + (2048 - 192) * (0.5 + 4 / 64)) / (2 * 2048)
    v = (132 * 2 + (2048 - 132) * (0.5 + 4 / 32)) / (2 * 2048)
    got = kq.bytes_ratio(kq.parse_scheme("k4c64/v4g32@s4r128"), 2048, d)
    assert got == pytest.approx((k + v) / 2)


@pytest.mark.parametrize("bad", ["k4x32/v4g32", "k4c32", "k4c32/v4c32", "k4g32/v4g32@r5",
                                 "k9g32/v4g32", "k4g32/v4g32+pre"])
def test_bad_names_raise(bad: str) -> None:
    with pytest.raises(kq.SchemeError):
        kq.parse_scheme(bad)
