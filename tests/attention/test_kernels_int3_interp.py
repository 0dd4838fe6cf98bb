"""Fused kernels reading 3-bit codes (int3-c64 keys, int3 affine values or keys) vs the
reference, and the q3 hybrid cache through `attention`.

3-bit codes sit in two bit planes (kvtax.formats.packing); the tile kernels (decode.py,
prefill.py) unpack them (kernel format codes 5 int3-c64, 6 int3), the one-warp and swap
decode kernels refuse them. Small shapes through Triton's interpreter on CPU
(tests/conftest.py), compiled on a GPU; the full grid is
tests/attention/test_kernels_int3_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention import dispatch as dispatch_mod
from kvtax.attention import launch, triton_api
from kvtax.attention.dispatch import attention, hybrid_decode_reason
from kvtax.attention.kernels import decode, reduce
from kvtax.attention.support import format_code, is_three_bit, swap_reason, warp_reason
from kvtax.attention.triton_api import (
    LaunchConfig, launch_config, swap_decode_config, triton_attention, triton_attention_lse,
    unsupported_reason, warp_decode_config,
)
from kvtax.errors import ShapeError
from kvtax.formats import ChannelBlockFormat, KVSpec, parse_format
from tests.attention.test_hybrid_decode_interp import SPLIT_KERNELS, _hybrid, _reference
from tests.attention.test_kernels_lse_interp import check_lse
from tests.support import kernels as ke
from tests.support.channel import channel_view
from tests.support.fused import fused_only
from tests.support.kernels import build, check

pytestmark = pytest.mark.kernels
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def _poison_workspace(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)


def view_of(spec: str, **kw):
    """q and a view of `spec`: channel-block keys in block-aligned storage
    (`channel_view`), else a FullCache (`build`)."""
    kv = KVSpec.parse(spec)
    if isinstance(kv.key, ChannelBlockFormat):
        return channel_view(kv.value.name, key=kv.key.name, **kw)
    return build(spec, **kw)


# (spec, head_dim, h_kv, group, ctx, n_q, dtype); k3-c64v3-g32 is q3's body
CASES = [
    ("k3-c64v3-g32", 128, 2, 4, 130, 1, F16),   # q3's body: decode
    ("k3-c64v3-g32", 128, 1, 7, 63, 1, F16),    # GQA 7, one partial block
    ("k3-c64v3-g32", 128, 1, 1, 1, 1, F16),     # one token in a 64-slot block
    ("k3-c64v3-g32", 64, 1, 4, 65, 1, BF16),    # g32 = D/2: values folded too
    ("k3-c64v3-g32", 64, 1, 4, 130, 2, F32),    # float32 dots
    ("k3-c64v3-g32", 256, 1, 4, 100, 1, F16),   # 32-slot decode tiles
    ("k3-c64v3-g32", 128, 1, 7, 90, 3, BF16),   # 21 rows
    ("k3-c64v8", 128, 1, 4, 130, 1, F16),
    ("k3-c64v4", 64, 1, 4, 65, 2, F16),         # int4 g64: would be decode_warp's
    ("k3-c64v4-g32", 128, 1, 1, 63, 1, BF16),
    ("k16v3-g32", 128, 1, 4, 70, 1, F16),       # int3 values beside float keys
    ("k4v3-g32", 64, 1, 7, 65, 2, BF16),        # ... beside int4 keys
    ("int3", 128, 1, 4, 130, 1, F16),           # int3 keys per token, one group a half
    ("int3-g16", 80, 1, 3, 70, 1, F16),         # D 80: half rows padded to 64
    ("k8-g32v3-g32", 96, 1, 2, 50, 2, F32),
    # prefill chunks (L > 16), 128-slot tiles spanning two blocks at D <= 128
    ("k3-c64v3-g32", 128, 1, 4, 200, 40, F16),
    ("k3-c64v3-g32", 128, 1, 1, 130, 130, BF16),
    ("k3-c64v3-g32", 64, 1, 7, 100, 17, F16),
    ("k3-c64v3-g32", 256, 1, 4, 90, 20, BF16),  # 64-slot prefill tiles
    ("k3-c64v8", 128, 1, 4, 150, 33, F16),
    ("k3-c64v3-g32", 64, 1, 4, 63, 17, F32),
    ("k16v3-g32", 64, 2, 2, 100, 24, F16),
    ("k4v3-g32", 128, 1, 4, 65, 20, BF16),
    ("int3-g16", 80, 1, 3, 70, 21, F16),
]


def _id(c) -> str:
    spec, d, h_kv, g, ctx, n_q, dtype = c
    return f"{spec}-D{d}-H{h_kv * g}/{h_kv}-ctx{ctx}-L{n_q}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_reference(case):
    spec, d, h_kv, g, ctx, n_q, dtype = case
    q, view = view_of(spec, d=d, h_kv=h_kv, group=g, ctx=ctx, n_q=n_q, dtype=dtype,
                      seed=ctx + d)
    check(q, view, what=_id(case))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("spec", ["k3-c64v3-g32", "int3-g16"])
def test_one_token_reads_exact_codes(spec, path, d):
    """One visible key: the output is its value row and the log-sum-exp its score, so
    every dim's unpacked code shows, at float32 precision (a wrong bit moves a value by a
    whole scale step)."""
    q, view = view_of(spec, d=d, h_kv=1, group=2, ctx=1, n_q=1, dtype=F32, seed=d)
    cfg = (LaunchConfig("decode", 16, 16, 4, 2, 1, fold=True) if path == "decode" else
           LaunchConfig("prefill", 16, 16, 4, 2))
    out, lse = triton_attention_lse(q, view, config=cfg)
    k = view.spec.key.dequantize(view.k)[:, :, :1]  # [1, 1, 1, D] (c64: the first block)
    v = view.spec.value.dequantize(view.v)[:, :, :1]
    torch.testing.assert_close(out, v.expand_as(out), atol=1e-5, rtol=1e-5)
    score = (q * k).sum(-1) / d**0.5  # [1, 2, 1]
    torch.testing.assert_close(lse, score, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "cfg",
    [LaunchConfig("decode", 16, 16, 4, 2, 3, fold=True),
     LaunchConfig("decode", 16, 32, 4, 2, 2, fold=True),
     LaunchConfig("decode", 16, 64, 4, 2, 5, fold=False),
     LaunchConfig("decode", 16, 128, 4, 2, 2, fold=True),  # 2 blocks a tile: keys unfolded
     LaunchConfig("prefill", 16, 16, 4, 2),
     LaunchConfig("prefill", 64, 64, 4, 2),
     LaunchConfig("prefill", 32, 256, 4, 2)],
    ids=["tile16-fold", "tile32-fold", "tile64", "tile128", "prefill16", "prefill64",
         "prefill256"],
)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_tile_sizes(cfg, dtype):
    """int3-c64 keys and int3-g32 values at D 64 (one group per half row, so both fold at
    decode) in tiles inside one block and spanning 2 or 4 blocks, folded or not."""
    n_q = 1 if cfg.path == "decode" else 20
    q, view = view_of("k3-c64v3-g32", d=64, h_kv=1, group=4, ctx=300, n_q=n_q, dtype=dtype,
                      seed=3)
    check(q, view, config=cfg, what=f"{cfg.path}-n{cfg.block_n}-{dtype}")


@pytest.mark.parametrize("n_q", [1, 20])
def test_window_and_sinks(n_q):
    """A window and sinks over block-aligned int3-c64 keys (a full cache's view), and
    int3 values in a SlidingCache's ring."""
    q, view = view_of("k3-c64v3-g32", d=64, h_kv=1, group=2, ctx=200, n_q=n_q, window=50,
                      seed=5)
    check(q, dataclasses.replace(view, sinks=3), what=f"c64-window-L{n_q}")
    q, view = build("k8-g32v3-g32", d=64, h_kv=1, group=2, ctx=200, n_q=n_q, window=50,
                    sinks=3, seed=5)
    assert view.ring and view.length > view.ring, "ring should have wrapped"
    check(q, view, what=f"ring-window-L{n_q}")


def test_batch2_device_lengths():
    """Per-sequence device lengths inside block-aligned storage (the shorter row ends
    mid-block; its tail rows hold other tokens and must stay unseen)."""
    q, view = view_of("k3-c64v3-g32", d=128, h_kv=2, group=2, ctx=150, n_q=1, batch=2,
                      seed=8)
    lens = torch.tensor([150, 77], dtype=torch.int32, device=q.device)
    out = triton_attention(q, view, lengths=lens)
    for b, n in enumerate(lens.tolist()):
        sub = dataclasses.replace(view, k=_row(view.k, b), v=_row(view.v, b), length=n)
        ref = ke.attention_blockwise(q[b : b + 1].float(), sub)
        ke.assert_close(out[b : b + 1].float(), ref, atol=2e-2, rel_rms=4e-3, what=f"b{b}")


def _row(qt, b):
    return type(qt)(*(None if t is None else t[b : b + 1] for t in qt))


# (spec, head_dim, group, ctx, n_q, dtype, min_distance, min_key, launch): q3's body part
# reads keys >= 4 and >= 96 behind the query
LSE_CASES = [
    ("k3-c64v3-g32", 128, 4, 300, 1, F16, 96, 4, "auto"),
    ("k3-c64v3-g32", 64, 4, 150, 1, F16, 17, 4, "tile16"),
    ("k3-c64v3-g32", 64, 4, 150, 2, BF16, 17, 4, "auto"),
    ("k3-c64v3-g32", 128, 7, 200, 1, BF16, 30, 70, "auto"),   # min_key mid-block
    ("k3-c64v3-g32", 64, 2, 150, 40, F16, 17, 4, "auto"),     # prefill rows
    ("k3-c64v3-g32", 64, 2, 150, 40, F16, 17, 4, "prefill16"),
    ("k3-c64v3-g32", 256, 1, 130, 20, F16, 64, 4, "auto"),
    ("k3-c64v3-g32", 64, 1, 40, 4, F32, 38, 0, "auto"),       # rows that see no key
    ("k16v3-g32", 128, 4, 150, 1, F16, 20, 3, "auto"),
    ("int3-g16", 80, 3, 70, 21, F16, 5, 3, "auto"),
]


@pytest.mark.parametrize("case", LSE_CASES, ids=lambda c: f"{c[0]}-D{c[1]}-G{c[2]}-ctx{c[3]}-"
                         f"L{c[4]}-{str(c[5])[6:]}-dist{c[6]}-key{c[7]}-{c[8]}")
def test_lse_and_hybrid_masks(case):
    """triton_attention_lse on a hybrid cache's 3-bit body part (min_distance / min_key
    hide the fp16 sinks and recent tokens) vs attention_lse."""
    spec, d, g, ctx, n_q, dtype, md, mk, kind = case
    q, view = view_of(spec, d=d, h_kv=1, group=g, ctx=ctx, n_q=n_q, dtype=dtype, seed=ctx)
    check_lse(q, view, min_distance=md, min_key=mk, kind=kind, what=str(case))


def test_decode_matches_prefill_of_one_row():
    q, view = view_of("k3-c64v3-g32", d=128, h_kv=1, group=4, ctx=130, n_q=1, seed=2)
    dec = triton_attention(q, view, config=LaunchConfig("decode", 16, 64, 4, 3, 2, fold=True))
    pre = triton_attention(q, view, config=LaunchConfig("prefill", 64, 128, 4, 2))
    torch.testing.assert_close(dec, pre, atol=2e-3, rtol=0)


def test_formats_have_kernel_codes():
    """The 3-bit formats now map to kernel codes (5: int3-c64 keys, its group the 64-token
    block; 6: int3 affine, its group along head_dim)."""
    assert format_code(parse_format("int3-c64")) == (5, 64)
    assert format_code(parse_format("int3-g32")) == (6, 32)
    assert format_code(parse_format("int3")) == (6, 64)
    assert format_code(parse_format("int4-c64")) == (4, 64)
    assert all(is_three_bit(parse_format(n)) for n in ("int3", "int3-g16", "int3-c64"))
    assert not any(is_three_bit(parse_format(n)) for n in ("int4", "int4-c64", "int8", "fp8"))
    for spec in ("k3-c64v3-g32", "k3-c64v8", "k16v3-g32", "int3", "int3-g16"):
        d = 80 if spec == "int3-g16" else 64
        q, view = view_of(spec, d=d, h_kv=1, group=2, ctx=70, n_q=1)
        assert unsupported_reason(q, view, allow_cpu=True) is None, spec


@pytest.mark.parametrize("spec, d", [("k3-c64v3-g32", 128), ("k3-c64v3-g32", 64),
                                     ("k3-c64v4", 128), ("int3", 128), ("k8v3", 64),
                                     ("k4v3-g32", 256)])
def test_launch_table_sends_three_bit_to_the_tile_kernel(spec, d):
    """Decode of 3-bit codes: decode.py (folded where a half row is one group or a tile
    lies in one block), never decode_warp or the swap kernels, which say why; explicit
    warp / swap configs are refused; longer chunks take prefill.py."""
    q, view = view_of(spec, d=d, h_kv=1, group=4, ctx=70, n_q=1)
    cfg = launch_config(q, view)
    assert (cfg.path, cfg.kernel, cfg.fold) == ("decode", "tile", True), cfg
    assert cfg.block_n <= 64
    assert "3-bit codes" in warp_reason(view)
    assert "3-bit codes" in swap_reason(q, view)
    with pytest.raises(ShapeError, match="decode_warp kernel cannot run"):
        triton_attention(q, view, config=warp_decode_config(q, view))
    with pytest.raises(ShapeError, match="decode_swap kernel cannot run.*3-bit"):
        triton_attention(q, view, config=swap_decode_config(q, view))
    q, view = view_of(spec, d=d, h_kv=1, group=4, ctx=70, n_q=40)
    cfg = launch_config(q, view)
    assert (cfg.path, cfg.block_m, cfg.block_n) == (
        ("prefill", 128, 64) if d <= 128 else ("prefill", 64, 32)), cfg  # spill-free tiles


@pytest.mark.parametrize("spec, fold_k, fold_v", [
    ("k3-c64v3-g32", True, True),    # D 64: g32 is half a row
    ("k3-c64v8", True, False),       # int8 measured faster unfolded
    ("k16v3-g32", False, True),
    ("int3", True, True),            # g64: one group per half row
])
def test_decode_runs_the_tile_kernel_folded(spec, fold_k, fold_v):
    q, view = view_of(spec, d=64, h_kv=1, group=4, ctx=70, n_q=1)
    fn, calls = decode.decode_attn_split_kernel, []
    original = fn.run
    fn.run = lambda *a, **k: calls.append((k.get("FOLD_K"), k.get("FOLD_V"))) or original(*a, **k)
    try:
        check(q, view, what=f"spy-{spec}")
    finally:
        del fn.run
    assert calls == [(fold_k, fold_v)], calls


def test_unsupported_layouts_say_why():
    """int3-c64 keys at a head_dim other than 64 / 128 / 256, int3-c64 values and storage
    that is not block-aligned are refused with their reason."""
    from kvtax.formats import QTensor

    q, view = view_of("k3-c64v3-g32", d=192, h_kv=1, group=2, ctx=70, n_q=1)
    assert "int3-c64 keys at head_dim 192" in unsupported_reason(q, view, allow_cpu=True)
    q, view = view_of("k3-c64v3-g32", d=64, h_kv=1, group=2, ctx=70, n_q=1)
    c3 = ChannelBlockFormat(n_bits=3)
    both = dataclasses.replace(view, v=c3.quantize(torch.randn(1, 1, 128, 64)),
                               spec=KVSpec(view.spec.key, c3))
    assert "value format int3-c64" in unsupported_reason(q, both, allow_cpu=True)
    k = view.k
    short = dataclasses.replace(view, k=QTensor(k.codes[:, :, :100], k.scales[:, :, :100],
                                                k.biases[:, :, :100]))
    assert "int3-c64 key storage of 100 slots" in unsupported_reason(q, short, allow_cpu=True)


# q3 = k3-c64v3-g32@s4r96: (spec, head_dim, group, ctx, n_q)
HYBRID_CASES = [
    ("q3", 64, 1, 3, 1),          # shorter than the sinks: the body sees nothing
    ("q3", 64, 7, 90, 3),         # shorter than sinks + recent
    ("q3", 128, 4, 230, 1),
    ("q3", 64, 2, 333, 2),
    ("k3-c64v3-g32@s4r64", 128, 1, 197, 1),
]


def _count_launches(monkeypatch) -> dict:
    """The fused path only (tests/support/fused.py): split-kernel and reduce launches."""
    return fused_only(monkeypatch, {"split": SPLIT_KERNELS,
                                    "reduce": [reduce.decode_attn_reduce_kernel]})


@pytest.mark.parametrize("case", HYBRID_CASES, ids=lambda c: "-".join(map(str, c)))
def test_q3_hybrid_decode_is_fused(case, monkeypatch):
    """Decode rows over a q3 HybridCache: one split kernel per part (the body on decode.py)
    and one reduce, equal to `attention(..., impl="reference")`."""
    spec, d, g, ctx, n_q = case
    q, view = _hybrid(spec, d=d, group=g, ctx=ctx, n_q=n_q, seed=ctx)
    want = attention(q, view, impl="reference")
    launches = _count_launches(monkeypatch)
    assert hybrid_decode_reason(q, view) is None
    got = attention(q, view)
    assert launches == {"split": len(view.parts), "reduce": 1}, launches
    atol, rel = ke.TOLERANCE[q.dtype]
    ke.assert_close(got.float(), want.float(), atol=atol, rel_rms=rel, what=str(case))
    ke.assert_close(got.float(), _reference(q, view), atol=atol, rel_rms=rel, what=str(case))


@pytest.mark.parametrize("d, n_q", [(64, 20), (128, 40)])
def test_q3_hybrid_prefill_chunk_on_kernels(d, n_q, monkeypatch):
    """A prefill chunk over a q3 HybridCache: the parts' prefill kernels chained (the
    kernels forced on CPU, one launch per part, no per-part path), equal to
    `attention(..., impl="reference")`."""
    from kvtax.attention.kernels import prefill

    q, view = _hybrid("q3", d=d, group=2, ctx=250, n_q=n_q, seed=d)
    want = attention(q, view, impl="reference")
    calls = []
    real = prefill.prefill_attn_fwd_kernel.run
    monkeypatch.setattr(prefill.prefill_attn_fwd_kernel, "run",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(dispatch_mod, "kernel_unavailable", lambda *a: None)
    monkeypatch.setattr(dispatch_mod, "merge_lse", None)  # the per-part path would fail
    got = attention(q, view)
    assert len(calls) == len(view.parts), "every part should use the kernels"
    atol, rel = ke.TOLERANCE[q.dtype]
    ke.assert_close(got.float(), want.float(), atol=atol, rel_rms=rel, what=f"q3-D{d}")
