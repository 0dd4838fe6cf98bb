"""Fused hybrid-cache prefill (`dispatch.hybrid_prefill`): the parts' prefill kernels chained,
each merging the one before in its epilogue (`launch_attention(prior=...)`), against the
torch reference (each part's `attention_lse`, merged by `merge_lse`).

Small shapes through Triton's interpreter on CPU (tests/conftest.py), compiled on a GPU.
Every fused call is checked to have taken the fused path: the per-part path raises, and
the prefill launches are counted (one per part).
"""

from __future__ import annotations

import pytest
import torch

from kvtax.attention import launch, staged
from kvtax.attention.dispatch import attention, hybrid_prefill_reason
from kvtax.attention.kernels import prefill
from kvtax.attention.launch import launch_attention
from kvtax.attention.lse import attention_lse, merge_lse
from kvtax.attention.triton_api import triton_attention_lse
from kvtax.errors import ShapeError
from tests.attention.test_hybrid_decode_interp import _hybrid, _reference
from tests.support import kernels as ke
from tests.support.fused import fused_only
from tests.support.kernels import DEVICE, TOLERANCE

pytestmark = pytest.mark.kernels


@pytest.fixture(autouse=True)
def _poison_workspace(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)  # unwritten rows show as NaN


@pytest.fixture
def launches(monkeypatch):
    """The fused path only (tests/support/fused.py): prefill launches counted, none staged
    (tests/attention/test_staged_interp.py covers the staged body)."""
    monkeypatch.setattr(staged, "STAGE_MIN_ROWS", 2**62)
    return fused_only(monkeypatch, {"prefill": [prefill.prefill_attn_fwd_kernel]})


# (spec, head_dim, group, ctx, n_q, window): chunks shorter than the recent window, longer,
# the whole context, a wrapped fp16 ring, GQA 7, rotated keys, a sliding layer's ring body
CASES = [
    ("q4", 64, 1, 40, 40, None),      # one chunk: the body sees only its first keys
    ("q4", 64, 7, 150, 20, None),
    ("q4", 128, 4, 333, 70, None),    # the fp16 ring has wrapped (filled in two chunks)
    ("k4-c64v4@s4r16", 64, 2, 197, 33, None),
    ("k4w-c64v4@s4r128", 64, 4, 333, 70, None),
    ("int4-g32+hk@s4r16", 64, 4, 90, 24, None),   # rotated keys: q H for the body
    ("int8@s2r8", 64, 2, 70, 30, 24),             # a sliding layer: the body is a ring
    ("k4-c64v4@r64i8", 64, 2, 333, 70, 200),      # q4 on a sliding layer: an int8 ring
    ("k4-c64v4-g128@r64i8", 256, 4, 333, 70, 200),  # q4 there at Gemma-3's head_dim: V g128
]


def _id(c) -> str:
    spec, d, g, ctx, n_q, window = c
    return f"{spec}-D{d}-G{g}-ctx{ctx}-L{n_q}" + (f"-w{window}" if window else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_prefill_matches_reference(case, launches):
    spec, d, g, ctx, n_q, window = case
    q, view = _hybrid(spec, d=d, group=g, ctx=ctx, n_q=n_q, window=window, seed=ctx)
    assert hybrid_prefill_reason(q, view) is None
    got = attention(q, view)
    assert launches == {"prefill": len(view.parts)}, launches
    assert got.dtype == q.dtype and got.shape == q.shape and got.is_contiguous()
    atol, rel = TOLERANCE[q.dtype]
    ke.assert_close(got.float(), _reference(q, view), atol=atol, rel_rms=rel, what=_id(case))


def test_fused_prefill_softcap_and_scale(launches):
    q, view = _hybrid("k4-c64v4@s4r16", d=64, group=2, ctx=150, n_q=40)
    got = attention(q * 8, view, softcap=5.0, scale=0.2)
    assert launches == {"prefill": 2}
    ke.assert_close(got.float(), _reference(q * 8, view, softcap=5.0, scale=0.2),
                    atol=2e-2, rel_rms=4e-3, what="softcap")


def test_rotated_values_take_the_per_part_path():
    q, view = _hybrid("int4+hkv@s2r16", d=64, group=2, ctx=77, n_q=30)
    if not ke.HAS_CUDA:
        assert hybrid_prefill_reason(q, view) is not None  # CPU: not on the kernels at all
    else:
        assert "rotated values" in hybrid_prefill_reason(q, view)
    ke.assert_close(attention(q, view).float(), _reference(q, view), atol=2e-2, rel_rms=4e-3,
                    what="hkv per part")


def test_prior_merges_like_merge_lse_in_place_too(monkeypatch):
    """launch_attention(prior=...) equals merge_lse of the two parts; with out / lse the
    prior's own tensors (a middle part of a chain) it updates them in place."""
    q, view = _hybrid("q4", d=64, group=4, ctx=260, n_q=40, seed=3)
    fp, body = view.parts
    want = merge_lse([attention_lse(q.float(), p.view, min_distance=p.min_distance,
                                    min_key=p.min_key) for p in view.parts])
    pair = triton_attention_lse(q, fp.view)
    o, lse = pair[0].clone(), pair[1].clone()
    launch_attention(q, body.view, out=o, lse=lse, prior=(o, lse), min_distance=body.min_distance,
                     min_key=body.min_key)
    ke.assert_close(o, want[0], atol=2e-2, rel_rms=4e-3, what="in-place prior")
    torch.testing.assert_close(lse, want[1], atol=2e-3, rtol=1e-3)


def test_prior_rows_no_part_saw_stay_zero():
    """A row that neither part saw (both lse -inf) stays 0, not NaN: q4's body sees no key
    of a context shorter than its recent window, and the prior here saw none either."""
    q, view = _hybrid("q4", d=64, group=1, ctx=20, n_q=20)
    fp, body = view.parts
    o = torch.zeros(q.shape, dtype=torch.float32, device=DEVICE)
    lse = torch.full(q.shape[:3], float("-inf"), device=DEVICE)
    out = launch_attention(q, body.view, out=torch.empty_like(o), prior=(o, lse),
                           min_distance=body.min_distance, min_key=body.min_key)
    assert not out.isnan().any() and (out == 0).all()


def test_prior_is_checked():
    q, view = _hybrid("q4", d=64, group=2, ctx=100, n_q=30)
    body = view.parts[1]
    o = torch.zeros(q.shape, dtype=torch.float32, device=DEVICE)
    lse = torch.zeros(q.shape[:3], device=DEVICE)
    with pytest.raises(ShapeError, match="prior tensors"):
        launch_attention(q, body.view, prior=(o.half(), lse))
    with pytest.raises(ShapeError, match="prior tensors"):
        launch_attention(q, body.view, prior=(o, lse[..., :-1]))
    with pytest.raises(ShapeError, match="decode path"):
        launch_attention(q[:, :, -1:], body.view, prior=(o[:, :, -1:].contiguous(),
                                                          lse[:, :, -1:].contiguous()))
