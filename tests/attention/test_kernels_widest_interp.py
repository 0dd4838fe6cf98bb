"""Fused kernels reading int4w-c64 keys (int4-c64 plus a fifth bit on each block's widest
3/8 channels, kernel format code 7) vs the reference.

Decode folds the fifth bits into the scores, prefill and staging dequantize them
(kvtax/attention/kernels/widest.py); both must equal the format's own dequantization up to
the kernels' rounding. Small shapes through Triton's interpreter on CPU (tests/conftest.py),
compiled on a GPU; the larger grid is tests/attention/test_kernels_widest_gpu.py, staging
and the hybrid cache's parts are in test_staged_interp.py and test_hybrid_*_interp.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention import launch
from kvtax.attention.support import format_code, swap_reason, warp_reason
from kvtax.attention.triton_api import (
    LaunchConfig, launch_config, triton_attention, warp_decode_config,
)
from kvtax.errors import ShapeError
from tests.attention.test_kernels_lse_interp import check_lse
from tests.support import kernels as ke
from tests.support.channel import channel_view
from tests.support.kernels import check

pytestmark = pytest.mark.kernels
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
KEY = "int4w-c64"


@pytest.fixture(autouse=True)
def _poison_workspace(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)


def widest_view(value: str = "int4-g32", **kw):
    return channel_view(value, key=KEY, **kw)


# (value format, head_dim, h_kv, group, ctx, n_q, dtype)
CASES = [
    ("int4-g32", 64, 2, 4, 130, 1, F16),     # decode: folded fifth bits, 64-slot tiles
    ("int4-g32", 128, 1, 7, 63, 1, BF16),    # GQA 7, one partial block
    ("int4-g32", 256, 1, 4, 100, 1, F16),    # 32-slot decode tiles, 2 index bytes a row
    ("int4", 128, 1, 1, 1, 1, F32),          # one token; float32 queries (IEEE dots)
    ("int8", 64, 1, 4, 70, 3, F16),          # 3 decode rows
    ("int4-g32", 64, 1, 4, 200, 40, F16),    # prefill: dequantized fifth bits
    ("int4-g32", 128, 1, 2, 130, 33, BF16),
    ("int4-g32", 256, 1, 1, 90, 20, F16),
    ("int4", 64, 1, 4, 70, 17, F32),
]


def _id(c) -> str:
    value, d, h_kv, g, ctx, n_q, dtype = c
    return f"w64-v{value}-D{d}-H{h_kv * g}/{h_kv}-ctx{ctx}-L{n_q}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_reference(case):
    value, d, h_kv, g, ctx, n_q, dtype = case
    q, view = widest_view(value, d=d, h_kv=h_kv, group=g, ctx=ctx, n_q=n_q, dtype=dtype,
                          seed=ctx + d)
    check(q, view, what=_id(case))


def test_fifth_bits_are_read():
    """The same view with its fifth-bit plane cleared reads other keys: the kernels must
    follow the reference to the changed keys, not to int4-c64's."""
    q, view = widest_view(d=64, h_kv=1, group=4, ctx=128, n_q=1, seed=11)
    codes = view.k.codes.clone()
    codes[..., 32:35] = 0
    cleared = dataclasses.replace(view, k=type(view.k)(codes, view.k.scales, view.k.biases))
    a = check(q, view, what="plane")
    b = check(q, cleared, what="cleared plane")
    assert (a.float() - b.float()).abs().max() > 1e-2


@pytest.mark.parametrize(
    "cfg",
    [LaunchConfig("decode", 16, 16, 4, 2, 3, fold=True),
     LaunchConfig("decode", 16, 32, 4, 2, 2, fold=True),
     LaunchConfig("decode", 16, 64, 4, 2, 5, fold=False),
     LaunchConfig("prefill", 16, 16, 4, 2),
     LaunchConfig("prefill", 64, 64, 4, 2)],
    ids=["tile16-fold", "tile32-fold", "tile64-dequant", "prefill16", "prefill64"],
)
def test_tile_sizes(cfg):
    n_q = 1 if cfg.path == "decode" else 20
    q, view = widest_view(d=64, h_kv=1, group=4, ctx=300, n_q=n_q, seed=3)
    check(q, view, config=cfg, what=f"{cfg.path}-n{cfg.block_n}-fold{cfg.fold}")


def test_tiles_across_blocks_are_refused():
    q, view = widest_view(d=64, h_kv=1, group=4, ctx=200, n_q=1)
    with pytest.raises(ShapeError, match="at most 64 slots"):
        triton_attention(q, view, config=LaunchConfig("decode", 16, 128, 4, 2, 2, fold=True))


@pytest.mark.parametrize("n_q", [1, 20])
def test_window_and_sinks(n_q):
    q, view = widest_view(d=64, h_kv=1, group=2, ctx=200, n_q=n_q, window=50, seed=5)
    check(q, dataclasses.replace(view, sinks=3), what=f"window-L{n_q}")


@pytest.mark.parametrize("d, g, ctx, n_q, dtype, md, mk", [
    (128, 4, 300, 1, F16, 128, 4),   # the body part of k4w-c64v4@s4r128 at decode
    (64, 2, 150, 40, BF16, 17, 4),   # its prefill rows
    (256, 1, 130, 20, F16, 64, 4),
])
def test_lse_and_hybrid_masks(d, g, ctx, n_q, dtype, md, mk):
    q, view = widest_view(d=d, h_kv=1, group=g, ctx=ctx, n_q=n_q, dtype=dtype, seed=ctx)
    check_lse(q, view, min_distance=md, min_key=mk, what=f"D{d}-L{n_q}")


@pytest.mark.parametrize("d, value, kernel", [
    (64, "int4", "warp"), (128, "int4", "warp"), (256, "int4", "tile"),
    (128, "int4-g32", "tile"), (64, "int8", "warp"),
])
def test_launch_table_routes_widest_keys(d, value, kernel):
    """Decode: decode_warp where the values fit it (one scale group per half row), else the
    tile kernel, folded, tiles inside one block; never the swap kernels, which do not read
    fifth bits. Prefill: 64-slot tiles."""
    q, view = widest_view(value, d=d, h_kv=1, group=4, ctx=70, n_q=1)
    assert format_code(view.spec.key) == (7, 64)
    cfg = launch_config(q, view)
    assert (cfg.path, cfg.kernel) == ("decode", kernel), cfg
    assert cfg.block_n <= 64 and (cfg.fold or kernel == "warp")
    assert (warp_reason(view) is None) == (kernel == "warp")
    assert "fifth bits" in swap_reason(q, view)
    q, view = widest_view(value, d=d, h_kv=1, group=4, ctx=70, n_q=40, dtype=BF16)
    cfg = launch_config(q, view)
    assert cfg.path == "prefill" and cfg.block_n <= 64, cfg


@pytest.mark.parametrize("value, n_q, block_n, dtype", [
    ("int4", 1, 16, F16), ("int4", 3, 32, BF16), ("int4", 1, 64, F16), ("int8", 2, 32, F16),
    ("fp16", 1, 32, F16), ("int4", 1, 32, F32),
])
def test_warp_kernel(value, n_q, block_n, dtype):
    """decode_warp.py with int4w-c64 keys: the selected channels' q * s gathered, the
    fifth bits folded into the scores (masked and unmasked tiles: ctx 200 ends mid-tile)."""
    q, view = widest_view(value, d=64, h_kv=2, group=4, ctx=200, n_q=n_q, dtype=dtype,
                          seed=block_n + n_q)
    cfg = warp_decode_config(q, view, block_n=block_n)
    assert cfg.kernel == "warp"
    check(q, view, config=cfg, what=f"warp-{value}-n{block_n}-L{n_q}")


def test_warp_kernel_hybrid_masks():
    q, view = widest_view("int4", d=128, h_kv=1, group=4, ctx=300, n_q=1, seed=9)
    check_lse(q, view, min_distance=128, min_key=4, kind="warp16", what="warp body part")


def test_other_fractions_are_refused(monkeypatch):
    """The kernels read R = 3D/8 selected channels; a format selecting another count must
    fall back to the reference, not be misread."""
    from kvtax.attention.support import unsupported_reason
    from kvtax.formats import widest

    q, view = widest_view(d=64, h_kv=1, group=2, ctx=70, n_q=1)
    assert unsupported_reason(q, view, allow_cpu=True) is None
    monkeypatch.setattr(widest, "WIDEST", 1 / 4)
    assert "kernels/widest.py reads 3D/8" in unsupported_reason(q, view, allow_cpu=True)
