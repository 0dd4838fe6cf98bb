"""decode_swap_gluon.py over int4-c64 keys beside int4 g64 values (`k4-c64v4`, q4's
body at Llama's shapes), and over int4w-c64 keys (`k4w-c64v4`: the sequence's channel
order, fifth bits, 72-byte rows) against the float32 reference (needs CUDA: Gluon does not run in
Triton's interpreter; tests/attention/test_kernels_channel_swap.py runs the Triton twin
there). Contexts 1 to 70k, lengths off the 64-token blocks, over block-aligned storage with
spare capacity whose blocks wholly past the length carry NaN metadata and whose V
metadata past the length is NaN (never to be read), G 1 / 2 / 4, batch 1 / 2, fp16 / bf16,
the causal edge with L = 2, split counts that leave splits empty and strided steps in
other blocks, both ring depths, per-row device lengths, a CUDA-graph step, keys far from
zero; and the calls the Gluon kernel hands on (soft-capping, the hybrid cache's masks).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention import launch
from kvtax.attention import triton_api as ta
from tests.support import kernels as ke
from tests.support.channel import channel_view

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]  # Gluon: compiled only
KEYS = ["int4-c64", "int4w-c64"]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)  # unwritten partials show as NaN


def _build(ctx, group, batch, n_q, dtype, extra=77, seed=0, key="int4-c64"):
    """q [batch, 2 * group, n_q, 128] and a k4-c64v4 (or `key`) view of `ctx` tokens in
    storage of ctx + extra slots rounded up to 64: codes past ctx random (int4w-c64: the
    nibbles and fifth bits, not the channel order every block's rows carry), K block
    metadata of blocks wholly past ctx and V metadata past ctx NaN."""
    cap = -(-(ctx + extra) // 64) * 64
    q, view = channel_view("int4", d=128, h_kv=2, group=group, ctx=cap, n_q=n_q, batch=batch,
                           dtype=dtype, seed=seed, key=key)
    view = dataclasses.replace(view, length=ctx)
    used = -(-ctx // 64) * 64  # the partial last block's metadata is real
    for qt, first in ((view.k, used), (view.v, ctx)):
        w = 64 + 6 if qt is view.k and key == "int4w-c64" else qt.codes.shape[-1]
        qt.codes[:, :, ctx:, :w] = torch.randint(0, 256, qt.codes[:, :, ctx:, :w].shape,
                                                 dtype=torch.uint8, device="cuda")
        qt.scales[:, :, first:] = float("nan")
        qt.biases[:, :, first:] = float("nan")
    return q, view


def _check(q, view, what, **kwargs):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    got = ta.triton_attention(q, view, out=out, **kwargs)
    ref = ke.attention_blockwise(q.float(), view, softcap=kwargs.get("softcap"))
    atol, rel = ke.TOLERANCE[q.dtype]
    ke.assert_close(got.float(), ref, atol=atol, rel_rms=rel, what=what)


@pytest.mark.parametrize("ctx", [1, 37, 63, 64, 65, 1000, 4096 + 13, 70000])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("key", KEYS)
def test_gluon_c64_matches_reference(ctx, group, batch, dtype, key):
    q, view = _build(ctx, group, batch, 1, dtype, seed=ctx + group, key=key)
    cfg = ta.launch_config(q, view)
    assert cfg.kernel == "swap" and ta.gluon_swap_reason(q, view) is None, cfg
    _check(q, view, f"{key} ctx={ctx} G={group} B={batch} {dtype}")


@pytest.mark.parametrize("ctx", [2, 64, 65, 4096 + 13])
@pytest.mark.parametrize("key", KEYS)
def test_gluon_c64_causal_two_rows(ctx, key):
    """L = 2 (G * L = 4): the newest key, first of a block at ctx 65, is hidden from the
    first query row."""
    q, view = _build(ctx, 2, 1, 2, torch.float16, seed=ctx, key=key)
    assert ta.launch_config(q, view).kernel == "swap"
    _check(q, view, f"c64 L=2 ctx={ctx}")


@pytest.mark.parametrize("splits", [1, 3, 64])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("key", KEYS)
def test_gluon_c64_splits_and_stages(splits, stages, key):
    """Odd split counts put a split's strided steps in both halves of different blocks;
    more splits than steps leave some empty (m = -inf, l = 0); ring depths 2, 3 carry
    the block vectors beside the codes."""
    q, view = _build(1000, 4, 2, 1, torch.float16, seed=splits, key=key)
    cfg = dataclasses.replace(ta.swap_decode_config(q, view), num_splits=splits,
                              num_stages=stages)
    assert ta.gluon_swap_reason(q, view) is None
    _check(q, view, f"c64 splits={splits} stages={stages}", config=cfg)


@pytest.mark.parametrize("ctx", [65, 4096 + 13])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("key", KEYS)
def test_gluon_c64_twelve_per_sm_under_the_register_cap(ctx, dtype, key):
    """12 programs per SM: ptxas compiles the kernel under a 168-register cap."""
    q, view = _build(ctx, 4, 2, 1, dtype, key=key)
    cfg = ta.swap_decode_config(q, view, per_sm=12)
    assert cfg.max_registers == 168 and ta.gluon_swap_reason(q, view) is None
    _check(q, view, f"c64 capped ctx={ctx}", config=cfg)


@pytest.mark.parametrize("key", KEYS)
def test_gluon_c64_per_row_lengths(key):
    """B = 2 with device lengths, one ending mid-block (the rest of its block is stored,
    its metadata shared with the visible tokens, and must stay unseen)."""
    q, view = _build(3000, 4, 2, 1, torch.float16, key=key)
    lens = torch.tensor([3000, 1234], dtype=torch.int32, device="cuda")
    out = ta.triton_attention(q, view, lengths=lens)
    for b, n in enumerate(lens.tolist()):
        sub = dataclasses.replace(view, length=n, k=type(view.k)(*(t[b:b + 1] for t in view.k)),
                                  v=type(view.v)(*(t[b:b + 1] for t in view.v)))
        ref = ke.attention_blockwise(q[b:b + 1].float(), sub)
        ke.assert_close(out[b:b + 1].float(), ref, atol=2e-2, rel_rms=4e-3, what=f"row {b}")


def test_gluon_c64_cuda_graph_with_device_length():
    """One captured decode step replayed at two lengths read from a device tensor (splits
    sized by the capacity); the shorter ends mid-block."""
    q, view = _build(4096, 4, 1, 1, torch.float16, extra=200)
    lens = torch.tensor([4096], dtype=torch.int32, device="cuda")
    assert ta.launch_config(q, view, lens).kernel == "swap"
    out = torch.empty_like(q)
    ta.triton_attention(q, view, lengths=lens, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.triton_attention(q, view, lengths=lens, out=out)
    for n in (4096, 2049):
        lens.fill_(n)
        out.fill_(float("nan"))
        graph.replay()
        ref = ke.attention_blockwise(q.float(), dataclasses.replace(view, length=n))
        ke.assert_close(out.float(), ref, atol=2e-2, rel_rms=4e-3, what=f"graph-{n}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("key", KEYS)
def test_gluon_c64_keys_far_from_zero(dtype, key):
    """Keys with large per-channel offsets and narrow ranges: q.b dominates each score and
    the codes' 1024 offset must cancel against the same rounded q s (block vectors of
    different offsets per block, so a stale vector shows)."""
    q, view = _build(5000, 4, 1, 1, dtype, key=key)
    gen = torch.Generator().manual_seed(9)
    slots = view.k.codes.shape[2]
    shift = 20.0 * torch.randn(1, 2, slots // 64, 1, 128, generator=gen)
    k = (shift + 0.05 * torch.randn(1, 2, slots // 64, 64, 128, generator=gen)).flatten(2, 3)
    view = dataclasses.replace(view, k=view.spec.key.quantize(k.to("cuda", dtype)))
    assert ta.gluon_swap_reason(q, view) is None
    _check(q, view, f"far keys {dtype}")


def test_lse_softcap_and_hybrid_masks():
    """triton_attention_lse without masks stays on the Gluon kernel (the reduce writes the
    log-sum-exp); soft-capping runs decode_swap.py (the twin) under kernel "swap"; left
    padding goes back to decode_warp; the hybrid cache's masks (q4's body part at
    min_distance 128, min_key 4) stay on the Gluon kernel, which applies them."""
    from tests.attention.test_kernels_lse_interp import check_lse

    q, view = _build(300, 4, 2, 1, torch.float16)
    assert ta.launch_config(q, view).kernel == "swap"
    check_lse(q, view, what="c64 lse (swap, no masks)")
    assert ta.launch_config(q, view, softcap=True).kernel == "warp"
    _check(q, view, "softcap", softcap=30.0)
    _check(q, view, "softcap via twin", softcap=30.0, config=ta.swap_decode_config(q, view))
    assert ta.launch_config(q, view, masked=True).kernel == "warp"
    check_lse(q, view, min_distance=128, min_key=4, what="c64 body part (Gluon)")
    check_lse(q, view, min_distance=17, min_key=40, what="c64 masks past one step")
