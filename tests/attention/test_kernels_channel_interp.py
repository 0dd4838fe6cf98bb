"""Fused kernels reading int4-c64 keys (per channel over 64-token blocks) vs the reference.

Storage is block-aligned (slots rounded up to 64, the tail rows past `length`), values
per token. Small shapes through Triton's interpreter on CPU (tests/conftest.py), compiled
on a GPU; the full grid is tests/attention/test_kernels_channel_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention import launch
from kvtax.attention.triton_api import (
    LaunchConfig, launch_config, triton_attention, unsupported_reason, warp_decode_config,
)
from kvtax.errors import ShapeError
from tests.attention.test_kernels_lse_interp import check_lse
from tests.support import kernels as ke
from tests.support.channel import channel_view
from tests.support.kernels import check

pytestmark = pytest.mark.kernels
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def _poison_workspace(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)


# (value format, head_dim, h_kv, group, ctx, n_q, dtype)
CASES = [
    ("int4-g32", 128, 2, 4, 130, 1, F16),   # q4's body: decode
    ("int4-g32", 128, 1, 7, 63, 1, F16),    # GQA 7, one partial block
    ("int4-g32", 128, 1, 1, 1, 1, F16),     # one token in a 64-slot block
    ("int4-g32", 64, 1, 4, 65, 1, BF16),    # g32 = D/2: decode_warp
    ("int4", 128, 1, 4, 130, 2, F32),       # decode_warp, float32 dots
    ("int4-g32", 256, 1, 4, 100, 1, F16),   # 32-slot decode tiles
    ("int4-g32", 128, 1, 4, 64, 3, F16),    # decode of 3 rows, exactly one block
    ("int4-g32", 128, 1, 7, 90, 3, BF16),   # 21 rows: still the tile kernel
    ("int4", 128, 1, 4, 130, 1, F16),       # V one group per half
    ("int8", 64, 1, 4, 70, 1, F16),
    ("fp16", 128, 1, 4, 70, 1, F16),
    ("fp8", 64, 1, 1, 70, 2, F16),
    ("int4-g32", 128, 1, 4, 130, 1, F32),   # float32 queries: IEEE dots
    # prefill chunks (L > 16), 128-slot tiles spanning two blocks at D <= 128
    ("int4-g32", 128, 1, 4, 200, 40, F16),
    ("int4-g32", 128, 1, 1, 130, 130, BF16),
    ("int4-g32", 64, 1, 7, 100, 17, F16),
    ("int4-g32", 256, 1, 4, 90, 20, BF16),  # 64-slot prefill tiles
    ("int8", 128, 1, 4, 150, 33, F16),
    ("int4-g32", 64, 1, 4, 63, 17, F32),
]


def _id(c) -> str:
    value, d, h_kv, g, ctx, n_q, dtype = c
    return f"c64-v{value}-D{d}-H{h_kv * g}/{h_kv}-ctx{ctx}-L{n_q}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_reference(case):
    value, d, h_kv, g, ctx, n_q, dtype = case
    q, view = channel_view(value, d=d, h_kv=h_kv, group=g, ctx=ctx, n_q=n_q, dtype=dtype,
                           seed=ctx + d)
    check(q, view, what=_id(case))


@pytest.mark.parametrize(
    "cfg",
    [LaunchConfig("decode", 16, 16, 4, 2, 3, fold=True),
     LaunchConfig("decode", 16, 32, 4, 2, 2, fold=True),
     LaunchConfig("decode", 16, 64, 4, 2, 5, fold=False),
     LaunchConfig("decode", 16, 128, 4, 2, 2, fold=True),  # 2 blocks a tile: no fold
     LaunchConfig("prefill", 16, 16, 4, 2),
     LaunchConfig("prefill", 64, 64, 4, 2),
     LaunchConfig("prefill", 32, 256, 4, 2)],
    ids=["tile16-fold", "tile32-fold", "tile64", "tile128", "prefill16", "prefill64",
         "prefill256"],
)
def test_tile_sizes(cfg):
    """Tiles inside one block (one scale vector a tile, folded into q at decode) and
    tiles spanning 2 or 4 blocks (each block's vector repeated over its rows)."""
    n_q = 1 if cfg.path == "decode" else 20
    q, view = channel_view(d=64, h_kv=1, group=4, ctx=300, n_q=n_q, seed=3)
    check(q, view, config=cfg, what=f"{cfg.path}-n{cfg.block_n}")


@pytest.mark.parametrize("n_q", [1, 20])
def test_window_and_sinks(n_q):
    q, view = channel_view(d=64, h_kv=1, group=2, ctx=200, n_q=n_q, window=50, seed=5)
    check(q, dataclasses.replace(view, sinks=3), what=f"window-L{n_q}")


@pytest.mark.parametrize("n_q", [1, 5])
def test_batch2_device_lengths(n_q):
    """Per-sequence device lengths inside block-aligned storage (the shorter row ends
    mid-block; its tail rows hold other tokens and must stay unseen)."""
    q, view = channel_view(d=128, h_kv=2, group=2, ctx=150, n_q=n_q, batch=2, seed=8)
    lens = torch.tensor([150, 77], dtype=torch.int32, device=q.device)
    out = triton_attention(q, view, lengths=lens)
    for b, n in enumerate(lens.tolist()):
        sub = dataclasses.replace(view, k=_row(view.k, b), v=_row(view.v, b), length=n)
        ref = ke.attention_blockwise(q[b : b + 1].float(), sub)
        ke.assert_close(out[b : b + 1].float(), ref, atol=2e-2, rel_rms=4e-3, what=f"b{b}")


def _row(qt, b):
    return type(qt)(*(None if t is None else t[b : b + 1] for t in qt))


# (head_dim, group, ctx, n_q, dtype, min_distance, min_key, launch)
LSE_CASES = [
    (128, 4, 300, 1, F16, 128, 4, "auto"),     # q4's body part at decode
    (64, 4, 150, 1, F16, 17, 4, "tile16"),
    (64, 4, 150, 2, F16, 17, 4, "warp16"),
    (128, 7, 200, 1, BF16, 30, 70, "auto"),   # min_key mid-block
    (64, 2, 150, 40, F16, 17, 4, "auto"),     # prefill rows
    (64, 2, 150, 40, F16, 17, 4, "prefill16"),
    (256, 1, 130, 20, F16, 64, 4, "auto"),
    (64, 1, 40, 4, F32, 38, 0, "auto"),       # rows that see no key
]


@pytest.mark.parametrize("case", LSE_CASES, ids=lambda c: f"D{c[0]}-G{c[1]}-ctx{c[2]}-L{c[3]}-"
                         f"{str(c[4])[6:]}-dist{c[5]}-key{c[6]}-{c[7]}")
def test_lse_and_hybrid_masks(case):
    """triton_attention_lse on a hybrid cache's int4-c64 body part (min_distance /
    min_key hide the fp16 sinks and recent tokens) vs attention_lse."""
    d, g, ctx, n_q, dtype, md, mk, kind = case
    q, view = channel_view(d=d, h_kv=1, group=g, ctx=ctx, n_q=n_q, dtype=dtype, seed=ctx)
    check_lse(q, view, min_distance=md, min_key=mk, kind=kind, what=str(case))


def test_decode_matches_prefill_of_one_row():
    q, view = channel_view(d=128, h_kv=1, group=4, ctx=130, n_q=1, seed=2)
    dec = triton_attention(q, view, config=LaunchConfig("decode", 16, 64, 4, 3, 2, fold=True))
    pre = triton_attention(q, view, config=LaunchConfig("prefill", 64, 128, 4, 2))
    torch.testing.assert_close(dec, pre, atol=2e-3, rtol=0)


@pytest.mark.parametrize("d, value, kernel, swap", [
    (128, "int4-g32", "tile", False), (256, "int4-g32", "tile", False),
    (64, "int4-g32", "warp", True), (128, "int4", "warp", True), (64, "int8", "warp", True),
    (256, "fp16", "warp", False), (128, "fp8", "warp", False),
])
def test_launch_table_routes_c64_keys(d, value, kernel, swap):
    """Decode of int4-c64 keys: decode_warp where the values fit it (one scale group per
    half row), else decode.py (folded, tiles inside one block). The swap twin takes them
    beside int8 / int4 values of one group per half row or row (explicit configs); the
    Gluon kernel never runs interpreted, and compiled the table sends k4-c64v4 at D 128
    there (tests/attention/test_kernels_channel_swap.py)."""
    from kvtax.attention.support import gluon_swap_reason, swap_reason, warp_reason

    q, view = channel_view(value, d=d, h_kv=1, group=4, ctx=70, n_q=1)
    cfg = launch_config(q, view)
    gluon = gluon_swap_reason(q, view) is None
    assert not gluon or (ke.HAS_CUDA and d == 128 and value == "int4")
    assert (cfg.path, cfg.kernel) == ("decode", "swap" if gluon else kernel), cfg
    assert cfg.block_n <= 64 and (cfg.fold or kernel == "warp")
    assert (warp_reason(view) is None) == (kernel == "warp")
    assert (swap_reason(q, view) is None) == swap
    q, view = channel_view(value, d=d, h_kv=1, group=4, ctx=70, n_q=40)
    assert launch_config(q, view).path == "prefill"


@pytest.mark.parametrize("value, n_q, block_n", [
    ("int4", 1, 16), ("int4", 3, 64), ("int8", 1, 32), ("int8", 3, 16), ("fp16", 1, 32),
    ("fp16", 2, 64), ("fp8", 1, 16), ("fp8", 3, 32),
])
def test_warp_kernel(value, n_q, block_n):
    """decode_warp.py with int4-c64 keys (scales folded into the queries per block)."""
    q, view = channel_view(value, d=64, h_kv=2, group=4, ctx=200, n_q=n_q, seed=block_n)
    cfg = warp_decode_config(q, view, block_n=block_n)
    assert cfg.kernel == "warp"
    check(q, view, config=cfg, what=f"warp-{value}-n{block_n}-L{n_q}")


def test_warp_kernel_refuses_tiles_across_blocks():
    q, view = channel_view("int4", d=64, h_kv=1, group=4, ctx=200, n_q=1)
    with pytest.raises(ShapeError, match="one 64-slot block"):
        triton_attention(q, view, config=warp_decode_config(q, view, block_n=128))


def test_decode_really_runs_the_tile_kernel():
    from kvtax.attention.kernels import decode

    q, view = channel_view(d=128, h_kv=1, group=4, ctx=70, n_q=1)
    fn, calls = decode.decode_attn_split_kernel, []
    original = fn.run
    fn.run = lambda *a, **k: calls.append(k.get("FOLD_K")) or original(*a, **k)
    try:
        check(q, view, what="spy")
    finally:
        del fn.run
    assert calls == [True], "decode.py was not launched with folded int4-c64 scales"


def test_unsupported_layouts_say_why():
    """head_dim other than 64 / 128 / 256, c64 values, storage not block-aligned and
    unpacked scale rows are refused with their reason (dispatch then uses the reference)."""
    from kvtax.formats import ChannelBlockFormat, KVSpec, QTensor

    q, view = channel_view(d=192, h_kv=1, group=2, ctx=70, n_q=1)
    assert "head_dim 192" in unsupported_reason(q, view, allow_cpu=True)
    with pytest.raises(ShapeError, match="int4-c64 keys at head_dim 192"):
        triton_attention(q, view)
    q, view = channel_view(d=64, h_kv=1, group=2, ctx=70, n_q=1)
    assert unsupported_reason(q, view, allow_cpu=True) is None
    both = dataclasses.replace(view, v=ChannelBlockFormat().quantize(torch.randn(1, 1, 128, 64)),
                               spec=KVSpec(view.spec.key, ChannelBlockFormat()))
    assert "value format int4-c64" in unsupported_reason(q, both, allow_cpu=True)
    k = view.k
    short = dataclasses.replace(view, k=QTensor(k.codes[:, :, :100], k.scales[:, :, :100],
                                                k.biases[:, :, :100]))
    assert "not block-aligned" in unsupported_reason(q, short, allow_cpu=True)
    wide = [torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., : t.shape[-1]]
            for t in (k.scales, k.biases)]  # row pitch 2 D / 64
    unpacked = dataclasses.replace(view, k=QTensor(k.codes, *wide))
    assert "not packed" in unsupported_reason(q, unpacked, allow_cpu=True)
