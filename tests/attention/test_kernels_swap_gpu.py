"""decode_swap_gluon.py (the CUDA path of kernel "swap") against the float32 reference
(needs CUDA: Gluon does not run in Triton's interpreter; tests/attention/test_kernels_swap.py runs
its Triton twin there). Contexts 1 to 70k over capacity-padded caches whose slots past
the length hold random codes and NaN scales (they must never be read), G 1 / 2 / 4,
batch 1 / 2, fp16 / bf16, int8 / int4, the causal edge with L = 2, split counts that
leave splits empty, per-row device lengths; and the calls the Gluon kernel hands to the
twin (soft-capping) or refuses back to the table (left padding)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention import launch
from kvtax.attention import triton_api as ta
from tests.support import kernels as ke

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]  # Gluon: compiled only


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)  # unwritten partials show as NaN


def _build(spec, ctx, group, batch, n_q, dtype, extra=77, seed=0):
    """q [batch, 2 * group, n_q, 128] and a FullCache view of capacity ctx + extra whose
    slots past ctx hold random codes and NaN scales / biases."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, 2, ctx, 128, generator=gen)
    k[..., :2] *= 6.0  # outlier channels, as real keys have
    v = torch.randn(batch, 2, ctx, 128, generator=gen)
    cache = ke.FullCache(spec, capacity=ctx + extra)
    cache.append(k.to("cuda", dtype), v.to("cuda", dtype))
    view = cache.view()
    for qt in (view.k, view.v):
        qt.codes[:, :, ctx:] = torch.randint(0, 256, qt.codes[:, :, ctx:].shape,
                                             dtype=torch.uint8, device="cuda")
        qt.scales[:, :, ctx:] = float("nan")
        qt.biases[:, :, ctx:] = float("nan")
    q = torch.randn(batch, 2 * group, n_q, 128, generator=gen).to("cuda", dtype)
    return q, view


def _check(q, view, what, **kwargs):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    got = ta.triton_attention(q, view, out=out, **kwargs)
    ref = ke.attention_blockwise(q.float(), view, softcap=kwargs.get("softcap"))
    atol, rel = ke.TOLERANCE[q.dtype]
    ke.assert_close(got.float(), ref, atol=atol, rel_rms=rel, what=what)


@pytest.mark.parametrize("spec", ["int8", "int4"])
@pytest.mark.parametrize("ctx", [1, 37, 4096 + 13, 70000])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gluon_swap_matches_reference(spec, ctx, group, batch, dtype):
    q, view = _build(spec, ctx, group, batch, 1, dtype)
    cfg = ta.launch_config(q, view)
    assert cfg.kernel == "swap" and ta.gluon_swap_reason(q, view) is None
    _check(q, view, f"{spec} ctx={ctx} G={group} B={batch} {dtype}")


@pytest.mark.parametrize("spec", ["int8", "int4"])
@pytest.mark.parametrize("ctx", [2, 37, 4096 + 13])
def test_gluon_swap_causal_two_rows(spec, ctx):
    """L = 2 (G * L = 4): the newest key is hidden from the first query row."""
    q, view = _build(spec, ctx, 2, 1, 2, torch.float16)
    assert ta.launch_config(q, view).kernel == "swap"
    _check(q, view, f"{spec} L=2 ctx={ctx}")


@pytest.mark.parametrize("spec", ["int8", "int4"])
@pytest.mark.parametrize("splits", [1, 3, 64])
@pytest.mark.parametrize("stages", [2, 3])
def test_gluon_swap_splits_and_stages(spec, splits, stages):
    """More splits than steps (empty splits write m = -inf, l = 0); ring depths 2, 3."""
    q, view = _build(spec, 1000, 4, 2, 1, torch.float16)
    cfg = dataclasses.replace(ta.swap_decode_config(q, view), num_splits=splits,
                              num_stages=stages)
    _check(q, view, f"{spec} splits={splits} stages={stages}", config=cfg)


def test_gluon_swap_per_row_lengths():
    """B = 2 with different device lengths, as a CUDA-graph decode step reads them."""
    q, view = _build("int4", 3000, 4, 2, 1, torch.float16)
    lens = torch.tensor([3000, 1234], dtype=torch.int32, device="cuda")
    out = ta.triton_attention(q, view, lengths=lens)
    for b, n in enumerate(lens.tolist()):
        sub = dataclasses.replace(view, length=n, k=type(view.k)(*(t[b:b + 1] for t in view.k)),
                                  v=type(view.v)(*(t[b:b + 1] for t in view.v)))
        ref = ke.attention_blockwise(q[b:b + 1].float(), sub)
        ke.assert_close(out[b:b + 1].float(), ref, atol=2e-2, rel_rms=4e-3, what=f"row {b}")


def test_softcap_and_left_padding_leave_the_gluon_kernel():
    """Soft-capping runs decode_swap.py (the twin) under kernel "swap"; left padding goes
    back to the table's decode_warp."""
    q, view = _build("int8", 300, 4, 2, 1, torch.float16)
    assert ta.launch_config(q, view, softcap=True).kernel == "warp"
    _check(q, view, "softcap", softcap=30.0)
    _check(q, view, "softcap via twin", softcap=30.0, config=ta.swap_decode_config(q, view))
    kv_start = torch.tensor([0, 17], device="cuda")
    assert ta.launch_config(q, view, masked=True).kernel == "warp"
    out = ta.triton_attention(q, view, kv_start=kv_start)
    ref = ke.attention_blockwise(q.float(), view, kv_start=kv_start)
    ke.assert_close(out.float(), ref, atol=2e-2, rel_rms=4e-3, what="kv_start")

