"""Fused Triton attention vs the float32 reference, small shapes (CPU: Triton interpreter).

On a machine without CUDA every test here runs the real kernels through
`TRITON_INTERPRET=1` (tests/conftest.py builds them); with CUDA they run compiled. The grid
is a covering subset that keeps the interpreter under a couple of minutes; the full grid
is tests/attention/test_kernels_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention import launch
from kvtax.attention.triton_api import LaunchConfig, triton_attention, unsupported_reason
from kvtax.errors import ShapeError
from tests.support import kernels as ke
from tests.support.kernels import DEVICE, build, check

pytestmark = pytest.mark.kernels


@pytest.fixture(autouse=True)
def _poison_workspace(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)


# (spec, head_dim, h_kv, group, ctx, n_q, dtype)
CASES = [
    ("fp16", 128, 2, 4, 130, 1, torch.float16),
    ("bf16", 128, 1, 4, 63, 1, torch.bfloat16),
    ("fp32", 64, 1, 1, 63, 5, torch.float32),
    ("int8", 128, 2, 4, 130, 1, torch.float16),
    ("int8", 128, 1, 4, 63, 5, torch.bfloat16),
    ("int4", 128, 2, 4, 130, 1, torch.float16),
    ("int4", 128, 1, 1, 130, 5, torch.float16),
    ("fp8", 128, 1, 4, 130, 1, torch.float16),
    ("fp8", 128, 1, 4, 63, 5, torch.bfloat16),
    ("k8v4", 128, 1, 4, 130, 1, torch.float16),
    ("kfp8v4-g32", 128, 1, 4, 63, 1, torch.float16),
    ("fp8-pt", 128, 2, 4, 130, 1, torch.float16),  # one scale per tensor (vLLM's fp8)
    ("fp8-pt", 64, 1, 4, 63, 5, torch.bfloat16),
    ("fp8-pt", 96, 1, 1, 63, 1, torch.float16),
    ("kfp8-ptv4", 128, 1, 4, 63, 1, torch.float16),
    ("k4vfp16", 128, 1, 4, 63, 1, torch.float16),
    ("int8-g32", 128, 1, 4, 63, 1, torch.float16),
    ("int4-g128", 128, 1, 4, 63, 1, torch.float16),
    ("int4-g32", 64, 1, 4, 17, 1, torch.float16),
    ("int8-g16", 80, 1, 4, 63, 1, torch.float16),
    ("int4-g16", 80, 1, 1, 63, 5, torch.float16),
    ("int8-g32", 96, 1, 4, 63, 1, torch.float16),
    ("k4-g32v8-g32", 96, 1, 1, 63, 5, torch.float16),
    ("int4", 256, 1, 4, 63, 1, torch.float16),
    ("int8-g128", 256, 1, 1, 17, 5, torch.bfloat16),
    # prefill chunks (L > 16), the chunk at the end of a longer cache
    ("fp16", 128, 1, 4, 130, 33, torch.float16),
    ("int8", 128, 1, 4, 130, 40, torch.float16),
    ("int4", 128, 1, 1, 130, 63, torch.bfloat16),
    ("fp8", 128, 1, 4, 63, 17, torch.float16),
    ("fp8-pt", 128, 1, 4, 130, 40, torch.float16),
    ("kint8vfp8-pt", 64, 1, 4, 63, 17, torch.bfloat16),
    ("k8v4-g32", 128, 1, 4, 130, 17, torch.float16),
    ("int4-g16", 80, 1, 4, 63, 20, torch.float16),
    ("int8-g32", 96, 1, 1, 63, 63, torch.float16),
    ("int4-g32", 64, 1, 4, 130, 130, torch.float16),
    ("int8", 256, 1, 4, 63, 17, torch.float16),
    ("fp32", 128, 1, 4, 63, 17, torch.float32),
]


def _id(c) -> str:
    spec, d, h_kv, g, ctx, n_q, dtype = c
    return f"{spec}-D{d}-H{h_kv * g}/{h_kv}-ctx{ctx}-L{n_q}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_reference(case):
    spec, d, h_kv, g, ctx, n_q, dtype = case
    q, view = build(spec, d=d, h_kv=h_kv, group=g, ctx=ctx, n_q=n_q, dtype=dtype)
    check(q, view, what=_id(case))


@pytest.mark.parametrize("n_q", [1, 5, 20])
@pytest.mark.parametrize("spec", ["int8", "k4v8"])
def test_sliding_window_sinks_wrapped_ring(spec, n_q):
    q, view = build(spec, d=64, h_kv=1, group=4, ctx=90, n_q=n_q, window=24, sinks=3)
    assert view.ring and view.length - view.sinks > view.ring, "ring should have wrapped"
    check(q, view, what=f"sliding-{spec}-L{n_q}")


@pytest.mark.parametrize("ctx", [40, 150, 171, 205, 290, 333])
@pytest.mark.parametrize("spec, sinks", [("fp16", 4), ("int8", 0), ("int4", 3)])
def test_ring_far_wider_than_its_window_reads_the_window(spec, sinks, ctx):
    """A ring holding a chunk's worth past its window (a hybrid cache's fp16 part): the
    decode and prefill kernels read only the sinks and the window's slots (one or two runs,
    wrapped or not, inside the sinks' tile or not), and the result is still the reference's."""
    from kvtax.cache import SlidingCache

    gen = torch.Generator().manual_seed(ctx)
    k, v = (torch.randn(1, 2, ctx, 64, generator=gen).to(DEVICE, torch.float16)
            for _ in range(2))
    cache = SlidingCache(spec, window=20, sinks=sinks, max_chunk=128)
    for t0 in range(0, ctx, 17):
        cache.append(k[:, :, t0:t0 + 17], v[:, :, t0:t0 + 17])
    view = cache.view()
    assert view.ring > 5 * view.window  # several 32-slot tiles, most outside the window
    for n_q in (1, 3, min(ctx, 45)):  # 45 rows: the prefill kernel, blocks of 16 positions
        q = torch.randn(1, 8, n_q, 64, generator=gen).to(DEVICE, torch.float16)
        check(q, view, what=f"wide ring {spec} ctx {ctx} L{n_q}")


def test_sliding_window_before_wrap_and_inside_sinks():
    q, view = build("int4-g32", d=64, h_kv=1, group=2, ctx=6, n_q=2, window=16, sinks=4)
    check(q, view, what="sliding-short")


@pytest.mark.parametrize("n_q", [1, 24])
def test_softcap_and_custom_scale(n_q):
    q, view = build("int8", d=128, h_kv=1, group=4, ctx=63, n_q=n_q)
    check(q * 8, view, softcap=5.0, scale=0.2, what=f"softcap-L{n_q}")


@pytest.mark.parametrize("n_q", [1, 5, 20])
def test_batch2_noncontiguous_query(n_q):
    q, view = build("k8v4", d=64, h_kv=2, group=2, ctx=63, n_q=n_q, batch=2)
    b, h, _, d = q.shape  # strides of a [B, L, H, 2D] buffer, as a fused qkv projection gives
    q_nc = torch.empty(b, n_q, h, 2 * d, dtype=q.dtype, device=q.device).transpose(1, 2)[..., :d]
    q_nc.copy_(q)
    assert not q_nc.is_contiguous()
    check(q_nc, view, what=f"batch2-noncontig-L{n_q}")


def test_context_of_one():
    q, view = build("int4", d=128, h_kv=1, group=4, ctx=1, n_q=1)
    check(q, view, what="ctx1")


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_decode_split_counts(splits):
    """More splits than tiles leaves empty splits; the reduction must weigh them 0."""
    q, view = build("int8", d=64, h_kv=1, group=4, ctx=130, n_q=2)
    cfg = LaunchConfig("decode", 16, 32, 4, 2, splits)
    check(q, view, config=cfg, what=f"splits{splits}")


@pytest.mark.parametrize("splits", [1, 3, 7, 13])
def test_warp_decode_split_orders(splits):
    """decode_warp.py's tile order (split s takes every S-th tile from tile s) over split
    counts that leave splits with one, several or no tiles (9 tiles of 16 slots, the last
    one partial)."""
    import dataclasses

    from kvtax.attention.triton_api import warp_decode_config

    q, view = build("int8", d=64, h_kv=1, group=4, ctx=130, n_q=2)
    cfg = dataclasses.replace(warp_decode_config(q, view, block_n=16), num_splits=splits)
    assert cfg.kernel == "warp"
    check(q, view, config=cfg, what=f"warp-splits{splits}")


@pytest.mark.parametrize("splits", [5, 300])
def test_split_reduce_merges_partials(splits):
    """The reduce kernel alone on random partials (some splits empty), both its one-shot
    path (<= 256 splits) and its chunked one: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s
    - M) l_s, and the log-sum-exp beside it."""
    from kvtax.attention.kernels.reduce import decode_attn_reduce_kernel
    import triton

    gen = torch.Generator().manual_seed(splits)
    bh, g, n_q, d = 2, 3, 2, 64
    rows = g * n_q
    part_o = torch.randn(bh, splits, rows, d, generator=gen).to(DEVICE)
    part_m = (4 * torch.randn(bh, splits, rows, generator=gen)).to(DEVICE)
    part_l = (torch.rand(bh, splits, rows, generator=gen) + 0.5).to(DEVICE)
    part_m[:, 1::4] = float("-inf")  # empty splits weigh nothing
    part_l[:, 1::4] = 0.0
    out = torch.full((1, bh * g, n_q, d), float("nan"), device=DEVICE)
    lse = torch.full((1, bh * g, n_q), float("nan"), device=DEVICE)
    pad = triton.next_power_of_2(splits)
    decode_attn_reduce_kernel[(bh, rows, d // 32)](
        part_o, part_m, part_l, out, n_q, splits, bh, *out.stride()[:3], Lse=lse, HAS_LSE=True,
        G=g, HEAD_DIM=d, D_BLOCK=32, SPLITS_PAD=pad, SPLIT_BLOCK=pad if pad <= 256 else 64,
        num_warps=4)
    top = part_m.amax(1, keepdim=True)
    w = torch.exp2(part_m - top)
    want = (w[..., None] * part_o).sum(1) / (w * part_l).sum(1)[..., None]  # [bh, rows, d]
    want = want.view(bh, n_q, g, d).transpose(1, 2).reshape(1, bh * g, n_q, d)
    ke.assert_close(out, want, atol=1e-5, rel_rms=1e-5, what=f"reduce-{splits}")
    want_lse = (top.squeeze(1) + torch.log2((w * part_l).sum(1))) * 0.6931471805599453
    torch.testing.assert_close(lse, want_lse.view(bh, n_q, g).transpose(1, 2).reshape(1, -1, n_q))


def test_decode_matches_prefill_of_one_row():
    q, view = build("int4", d=128, h_kv=1, group=4, ctx=130, n_q=1)
    dec = triton_attention(q, view, config=LaunchConfig("decode", 16, 64, 4, 3, 2))
    pre = triton_attention(q, view, config=LaunchConfig("prefill", 64, 32, 4, 2))
    torch.testing.assert_close(dec, pre, atol=2e-3, rtol=0)


def test_device_lengths_per_sequence():
    """`lengths` (what a CUDA graph reads) overrides view.length, per sequence."""
    q, view = build("int8", d=64, h_kv=1, group=2, ctx=100, n_q=3, batch=2)
    lens = torch.tensor([100, 41], dtype=torch.int32, device=DEVICE)
    out = triton_attention(q, view, lengths=lens)
    for b, n in enumerate(lens.tolist()):
        sub = dataclasses.replace(
            view, k=_batch(view.k, b), v=_batch(view.v, b), length=n
        )
        ref = ke.attention_blockwise(q[b : b + 1].float(), sub)
        ke.assert_close(out[b : b + 1].float(), ref, atol=2e-2, rel_rms=4e-3, what=f"b{b}")


@pytest.mark.parametrize("spec", ["fp8", "fp8-pt"])
def test_device_lengths_sliding_prefill(spec):
    q, view = build(spec, d=64, h_kv=1, group=2, ctx=70, n_q=20, window=16, sinks=2)
    lens = torch.tensor([view.length], dtype=torch.int32, device=DEVICE)
    check(q, view, lengths=lens, what=f"lengths-sliding-{spec}")


def _batch(qt, b):
    return type(qt)(*(None if t is None else t[b : b + 1] for t in qt))


@pytest.mark.parametrize(
    "spec, d, kernel",
    [("int4", 64, "decode_warp_kernel"), ("int4-g16", 80, "decode_attn_split_kernel")],
)
def test_kernels_really_run_here(spec, d, kernel):
    """On CPU the Triton interpreter runs the kernels (not the torch reference), and
    decode shapes reach the kernel the launch table names for them."""
    from kvtax.attention.kernels import decode, decode_warp
    from kvtax.attention.kernels.prefill import prefill_attn_fwd_kernel

    kind = "InterpretedFunction" if not ke.HAS_CUDA else "JITFunction"
    fn = getattr(decode_warp if kernel == "decode_warp_kernel" else decode, kernel)
    assert type(fn).__name__ == kind
    assert type(prefill_attn_fwd_kernel).__name__ == kind
    q, view = build(spec, d=d, h_kv=1, group=1, ctx=17, n_q=1)
    calls = []
    original = fn.run

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    fn.run = spy
    try:
        check(q, view, what="spy")
    finally:
        del fn.run
    assert calls, f"{kernel} was not launched"


@pytest.mark.parametrize("grow", ["scores", "values"])
@pytest.mark.parametrize("spec", ["int8", "int4", "fp8", "k8v4", "fp16"])
def test_decode_rescaling_across_tiles(spec, grow):
    """decode_warp rescales lazily: when a row's max grows by more than 2^8 (scores
    that climb along the context) or a tile's V scales outgrow the reference by 2^6
    (values growing ~1100x while every tile keeps a similar weight). Neither may
    overflow fp16 or drop the earlier tiles' share."""
    from kvtax.attention.triton_api import warp_decode_config

    q, view = ke.rescale_case(grow, spec, ctx=200, d=64)
    cfg = warp_decode_config(q, view)
    out = triton_attention(q, view, config=cfg)
    ref = ke.attention_blockwise(q.float(), view)
    # outputs may reach ~1e2-1e3, where fp16's own rounding step is 0.06-0.5
    top = ref.abs().max().item()
    ke.assert_close(out.float(), ref, atol=max(2e-2, 2e-3 * top), rel_rms=4e-3,
                    what=f"rescale-{grow}-{spec}")


def test_unsupported_calls_say_why():
    q, view = build("int8", d=64, h_kv=1, group=2, ctx=17, n_q=1)
    # callers choosing a path (dispatch, the runner) see CPU tensors as unsupported
    assert unsupported_reason(q, view) is None if ke.HAS_CUDA else "CUDA" in unsupported_reason(q, view)
    with pytest.raises(ShapeError, match="dtype"):
        triton_attention(q.to(torch.int32), view)
    with pytest.raises(ShapeError, match="head_dim"):
        triton_attention(q, dataclasses.replace(view, head_dim=300))
    with pytest.raises(ShapeError, match="lengths"):
        triton_attention(q, view, lengths=torch.tensor([17]))
    with pytest.raises(ShapeError):
        triton_attention(q[:, :1, :, :32], view)


@pytest.mark.parametrize("n_q", [1, 20])
def test_left_padding_kv_start(n_q):
    """kv_start hides each row's keys before it (left-padded batches)."""
    q, view = build("int8", d=64, h_kv=1, group=2, ctx=70, n_q=n_q, batch=2)
    kv_start = torch.tensor([0, 23], device=DEVICE)
    out = triton_attention(q, view, kv_start=kv_start)
    ref = ke.attention_blockwise(q.float(), view, kv_start=kv_start)
    ke.assert_close(out.float(), ref, atol=2e-2, rel_rms=4e-3, what=f"kv_start-L{n_q}")


def test_view_length_tensor_is_read():
    """A view carrying `length_t` (CUDA-graph decode) is served from the device length."""
    q, view = build("int4", d=64, h_kv=1, group=2, ctx=60, n_q=1)
    short = dataclasses.replace(view, length=60, length_t=torch.tensor([41], dtype=torch.int32, device=DEVICE))
    out = triton_attention(q, short)
    ref = ke.attention_blockwise(q.float(), dataclasses.replace(view, length=41))
    ke.assert_close(out.float(), ref, atol=2e-2, rel_rms=4e-3, what="length_t")
