"""Fused kernels reading int4w-c64 keys (int4-c64 in one channel order per sequence and KV
head, plus a fifth bit on the first 3/8 of the stored channels, its widest; kernel format
code 7) vs the reference.

Every kernel reads the keys in stored order with the fifth bits OR'd into the low nibbles'
codes, and loads the queries through the order (staging writes the keys back through it;
kvtax/attention/kernels/widest.py); all must equal the format's own dequantization up to
the kernels' rounding. The views' orders are not the identity (tests/support/channel.py),
and `test_any_channel_order` gives each head a random one. Small shapes through Triton's
interpreter on CPU (tests/conftest.py), compiled on a GPU; the larger grid is
tests/attention/test_kernels_widest_gpu.py, staging and the hybrid cache's parts are in
test_staged_interp.py and test_hybrid_*_interp.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention import launch
from kvtax.attention.stage_launch import launch_stage
from kvtax.attention.support import format_code, gluon_swap_reason, warp_reason
from kvtax.attention.triton_api import LaunchConfig, launch_config, warp_decode_config
from kvtax.formats.widest import selected
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
    ("int4-g32", 64, 2, 4, 130, 1, F16),     # decode: folded 5-bit codes, 64-slot tiles
    ("int4-g32", 128, 1, 7, 63, 1, BF16),    # GQA 7, one partial block
    ("int4-g32", 256, 1, 4, 100, 1, F16),    # 32-slot decode tiles, 4 order bytes a row
    ("int4", 128, 1, 1, 1, 1, F32),          # one token; float32 queries (IEEE dots)
    ("int8", 64, 1, 4, 70, 3, F16),          # 3 decode rows
    ("int4-g32", 64, 1, 4, 200, 40, F16),    # prefill: dequantized 5-bit codes
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


def _with_codes(view, codes: torch.Tensor):
    """`view` with its key codes replaced (scales and biases kept)."""
    return dataclasses.replace(view, k=type(view.k)(codes, view.k.scales, view.k.biases))


# one config per kernel path: decode_warp, the tile decode folded (tiles inside a block)
# and dequantizing (tiles across blocks), prefill
PATHS = {
    "warp": None,
    "tile-fold": LaunchConfig("decode", 16, 64, 4, 2, 2, fold=True),
    "tile-dequant": LaunchConfig("decode", 16, 128, 4, 2, 2, fold=True),
    "prefill": LaunchConfig("prefill", 64, 64, 4, 2),
}


def _path_check(kind: str, q: torch.Tensor, view, what: str) -> torch.Tensor:
    """`check` through the kernel path `kind` (a key of PATHS)."""
    cfg = warp_decode_config(q, view) if kind == "warp" else PATHS[kind]
    return check(q, view, config=cfg, what=f"{kind} {what}")


@pytest.mark.parametrize("kind", list(PATHS))
def test_fifth_bits_are_read(kind):
    """The same view with its fifth-bit plane (bytes [D/2, D/2 + R/8) of each row) cleared
    reads other keys: the kernels must follow the reference to the changed keys, not to
    int4-c64's."""
    d = 64
    q, view = widest_view("int4", d=d, h_kv=1, group=4, ctx=128,
                          n_q=1 if kind != "prefill" else 20, seed=11)
    codes = view.k.codes.clone()
    codes[..., d // 2:d // 2 + selected(d) // 8] = 0
    a = _path_check(kind, q, view, "plane")
    b = _path_check(kind, q, _with_codes(view, codes), "cleared plane")
    assert (a.float() - b.float()).abs().max() > 1e-2


def _random_orders(view, seed: int):
    """`view` with its keys (as the reference reads them) re-quantized in a random channel
    order per (batch, KV head): any order is a valid int4w-c64 storage, the chosen channels
    being its first R, so the kernels must take each head's order from its rows."""
    fmt = view.spec.key
    keys = fmt.dequantize(view.k).to(view.k.scales.dtype)  # [B, H, slots, D]
    b, h, _, d = keys.shape
    gen = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(d, generator=gen) for _ in range(b * h)])
    return dataclasses.replace(view, k=fmt.quantize(keys, order.view(b, h, d).to(keys.device)))


def _identity_order(view):
    """`view` with its order bytes overwritten by the identity: the same nibbles and fifth
    bits read as other keys (the reference's too)."""
    d = view.head_dim
    codes = view.k.codes.clone()
    base = d // 2 + selected(d) // 8
    rows = torch.arange(codes.shape[2], device=codes.device) % 64
    for m in range(d // 64):
        codes[..., base + m] = (rows + 64 * m).to(torch.uint8)
    return _with_codes(view, codes)


@pytest.mark.parametrize("kind", list(PATHS))
@pytest.mark.parametrize("d", [64, 128])
def test_any_channel_order(kind, d):
    """Keys in a random channel order per (batch, head) read as the reference reads them,
    and the same rows with an identity order read as other keys, which the kernels follow
    too: the queries go through each head's own order, high-nibble channels included."""
    n_q = 1 if kind != "prefill" else 20
    q, view = widest_view("int4", d=d, h_kv=2, group=2, ctx=150, n_q=n_q, batch=2, seed=d)
    view = _random_orders(view, seed=d + 1)
    a = _path_check(kind, q, view, f"D{d} random orders")
    b = _path_check(kind, q, _identity_order(view), f"D{d} identity order")
    assert (a.float() - b.float()).abs().max() > 1e-1


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_stage_writes_model_order(dtype):
    """The stage kernel writes keys stored in random orders back in model channel order:
    the format's own read, from a block boundary past block 0."""
    _, view = widest_view("int4", d=128, h_kv=2, group=1, ctx=300, n_q=1, batch=2,
                          dtype=dtype, seed=4)
    view = _random_orders(view, seed=5)
    out = torch.full((2, 2, 192, 128), float("nan"), dtype=dtype, device=view.k.codes.device)
    launch_stage(view.k, view.spec.key, 64, 150, out)
    want = view.spec.key.read(view.k, 64, 214).to(dtype)
    atol = 2e-2 if dtype == F16 else 0.25  # an ulp of the wide channels (test_staged_interp)
    ke.assert_close(out[:, :, :150].float(), want.float(), atol=atol, rel_rms=1e-2,
                    what=f"stage {dtype}")


@pytest.mark.parametrize(
    "cfg",
    [LaunchConfig("decode", 16, 16, 4, 2, 3, fold=True),
     LaunchConfig("decode", 16, 32, 4, 2, 2, fold=True),
     LaunchConfig("decode", 16, 64, 4, 2, 5, fold=False),
     LaunchConfig("decode", 16, 128, 4, 2, 2, fold=True),
     LaunchConfig("prefill", 16, 16, 4, 2),
     LaunchConfig("prefill", 64, 64, 4, 2),
     LaunchConfig("prefill", 64, 128, 4, 3)],
    ids=["tile16-fold", "tile32-fold", "tile64-dequant", "tile128-across-blocks",
         "prefill16", "prefill64", "prefill128-across-blocks"],
)
def test_tile_sizes(cfg):
    """Tiles inside a 64-slot block and across blocks (no per-block state: a 128-slot
    tile dequantizes, as int4-c64's do)."""
    n_q = 1 if cfg.path == "decode" else 20
    q, view = widest_view(d=64, h_kv=1, group=4, ctx=300, n_q=n_q, seed=3)
    check(q, view, config=cfg, what=f"{cfg.path}-n{cfg.block_n}-fold{cfg.fold}")


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
    tile kernel, folded, tiles inside one block; the Gluon swap kernel where it serves the
    call (compiled, not under the interpreter). Prefill: the prefill kernel."""
    q, view = widest_view(value, d=d, h_kv=1, group=4, ctx=70, n_q=1)
    assert format_code(view.spec.key) == (7, 64)
    assert (warp_reason(view) is None) == (kernel == "warp")
    if gluon_swap_reason(q, view) is None:
        kernel = "swap"
    cfg = launch_config(q, view)
    assert (cfg.path, cfg.kernel) == ("decode", kernel), cfg
    assert cfg.block_n <= 64 and (cfg.fold or kernel != "tile")
    q, view = widest_view(value, d=d, h_kv=1, group=4, ctx=70, n_q=40, dtype=BF16)
    assert launch_config(q, view).path == "prefill"


@pytest.mark.parametrize("value, n_q, block_n, dtype", [
    ("int4", 1, 16, F16), ("int4", 3, 32, BF16), ("int4", 1, 64, F16), ("int8", 2, 32, F16),
    ("fp16", 1, 32, F16), ("int4", 1, 32, F32),
])
def test_warp_kernel(value, n_q, block_n, dtype):
    """decode_warp.py with int4w-c64 keys: queries loaded through the order, 5-bit codes
    in the low nibbles' operands (masked and unmasked tiles: ctx 200 ends mid-tile)."""
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
