"""GPU check of the DRAFT swapped-orientation Gluon int8 decode kernel (swap_decode.py)
against kvtax's float32 reference `attention_blockwise`. Skips without CUDA.

    cd /work/main && python -m pytest -q notes/gluon/test_swap_decode_gpu.py

Shapes: contexts 1, 37, 4096 + 13, 70000; G = 1, 2 and 4; B = 1 and 2; L = 1 (and L = 2,
the causal bottom-right edge); fp16 and bf16; lengths from a device int32 tensor over a
capacity-padded cache (slots >= length hold garbage: the tail is filled with random
codes and NaN scales/biases to prove they are never read). Partials and output are
NaN-poisoned first, so an unwritten split or row shows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))  # /work/main: tests.helpers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Gluon)")

# (atol, rel RMS) as tests/kernels_env.py's TOLERANCE
TOLERANCE = {torch.float16: (2e-2, 4e-3), torch.bfloat16: (8e-2, 2.5e-2)}


def _build(ctx, group, batch, n_q, dtype, extra=77, seed=0, spec="int8"):
    from kvtax.cache import FullCache

    gen = torch.Generator().manual_seed(seed)
    d, h_kv = 128, 2
    k = torch.randn(batch, h_kv, ctx, d, generator=gen)
    k[..., :2] *= 6.0  # outlier channels, as real keys have
    v = torch.randn(batch, h_kv, ctx, d, generator=gen)
    cache = FullCache(spec, capacity=ctx + extra)  # capacity-padded, not a power of two
    cache.append(k.to("cuda", dtype), v.to("cuda", dtype))
    view = cache.view()
    # garbage past length: random codes, NaN metadata (must be masked, never read)
    for qt in (view.k, view.v):
        qt.codes[:, :, ctx:] = torch.randint(0, 256, qt.codes[:, :, ctx:].shape,
                                             dtype=torch.uint8, device="cuda")
        qt.scales[:, :, ctx:] = float("nan")
        qt.biases[:, :, ctx:] = float("nan")
    q = torch.randn(batch, h_kv * group, n_q, d, generator=gen).to("cuda", dtype)
    lengths = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, view, lengths


def _compare(got, ref, dtype, what):
    from tests.helpers import assert_close

    atol, rel = TOLERANCE[dtype]
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    assert_close(got.float(), ref, atol=atol, rel_rms=rel, what=what)


@pytest.mark.parametrize("ctx", [1, 37, 4096 + 13, 70000])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k_width", [4, 8])
def test_matches_reference(ctx, group, batch, dtype, k_width):
    from swap_decode import swap_decode

    from kvtax.attention import attention_blockwise

    q, view, lengths = _build(ctx, group, batch, 1, dtype)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    got = swap_decode(q, view, None, lengths, out=out, poison=True, k_width=k_width)
    assert got.data_ptr() == out.data_ptr()
    ref = attention_blockwise(q.float(), view)
    _compare(got, ref, dtype, f"ctx={ctx} G={group} B={batch} {dtype} KW={k_width}")


@pytest.mark.parametrize("splits", [1, 3, 64])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_splits_and_stages(splits, stages):
    """More splits than tiles (empty splits: m = -inf, l = 0); ring depths 2-4 (phase wrap)."""
    from swap_decode import swap_decode

    from kvtax.attention import attention_blockwise

    q, view, lengths = _build(1000, 4, 2, 1, torch.float16)
    got = swap_decode(q, view, splits, lengths, stages=stages, poison=True)
    ref = attention_blockwise(q.float(), view)
    _compare(got, ref, torch.float16, f"splits={splits} stages={stages}")


@pytest.mark.parametrize("ctx", [2, 37, 4096 + 13])
def test_causal_two_rows(ctx):
    """L = 2 (G * L = 4 rows): the last key is hidden from the first query row."""
    from swap_decode import swap_decode

    from kvtax.attention import attention_blockwise

    q, view, lengths = _build(ctx, 2, 1, 2, torch.float16)
    got = swap_decode(q, view, None, lengths, poison=True)
    ref = attention_blockwise(q.float(), view)
    _compare(got, ref, torch.float16, f"L=2 ctx={ctx}")


def test_per_row_lengths():
    """B = 2 with different device lengths (the view's host length is the larger)."""
    from swap_decode import swap_decode

    from kvtax.attention import attention_blockwise

    q, view, _ = _build(3000, 4, 2, 1, torch.float16)
    lengths = torch.tensor([3000, 1234], dtype=torch.int32, device="cuda")
    got = swap_decode(q, view, None, lengths, poison=True)
    ref0 = attention_blockwise(q[:1].float(), _row_view(view, 0, 3000))
    ref1 = attention_blockwise(q[1:].float(), _row_view(view, 1, 1234))
    _compare(got[:1], ref0, torch.float16, "row 0")
    _compare(got[1:], ref1, torch.float16, "row 1")


def _row_view(view, i, length):
    import dataclasses

    from kvtax.formats import QTensor

    def row(qt):
        parts = (qt.codes, qt.scales, qt.biases)
        return QTensor(*(None if t is None else t[i:i + 1] for t in parts))

    return dataclasses.replace(view, k=row(view.k), v=row(view.v), length=length, length_t=None)


@pytest.mark.parametrize("ctx", [37, 4096 + 13, 70000])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("late,merge,stages", [(True, False, 3), (False, True, 2),
                                               (True, True, 3), (True, True, 4)])
def test_late_issue_and_merge(ctx, group, dtype, late, merge, stages):
    """cp.async issued after the step's math; the two streams merged in the kernel."""
    from swap_decode import swap_decode

    from kvtax.attention import attention_blockwise

    q, view, lengths = _build(ctx, group, 2, 1, dtype)
    got = swap_decode(q, view, None, lengths, poison=True, late=late, merge=merge,
                      stages=stages)
    ref = attention_blockwise(q.float(), view)
    _compare(got, ref, dtype, f"ctx={ctx} G={group} {dtype} late={late} merge={merge}")


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_merge_empty_splits(splits):
    """Merged partials of splits that see no tile: m = -inf, l = 0."""
    from swap_decode import swap_decode

    from kvtax.attention import attention_blockwise

    q, view, lengths = _build(1000, 4, 2, 1, torch.float16)
    got = swap_decode(q, view, splits, lengths, poison=True, merge=True, late=True)
    ref = attention_blockwise(q.float(), view)
    _compare(got, ref, torch.float16, f"merge splits={splits}")


@pytest.mark.parametrize("ctx", [1, 37, 4096 + 13, 70000])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stages,fence", [(2, True), (3, True), (2, False)])
def test_tma(ctx, group, batch, dtype, stages, fence):
    """K / V staged by TMA box copies on mbarriers (streams merged in the kernel)."""
    from swap_decode import swap_decode

    from kvtax.attention import attention_blockwise

    q, view, lengths = _build(ctx, group, batch, 1, dtype)
    got = swap_decode(q, view, None, lengths, poison=True, merge=True, use_tma=True,
                      stages=stages, fence=fence)
    ref = attention_blockwise(q.float(), view)
    _compare(got, ref, dtype, f"tma ctx={ctx} G={group} B={batch} {dtype} stages={stages}")


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_tma_splits(splits):
    from swap_decode import swap_decode

    from kvtax.attention import attention_blockwise

    q, view, lengths = _build(1000, 4, 2, 1, torch.float16)
    got = swap_decode(q, view, splits, lengths, poison=True, merge=True, use_tma=True)
    ref = attention_blockwise(q.float(), view)
    _compare(got, ref, torch.float16, f"tma splits={splits}")


@pytest.mark.parametrize("ctx", [1, 37, 4096 + 13, 70000])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("merge,stages", [(True, 2), (True, 3), (False, 2)])
def test_int4(ctx, group, batch, dtype, merge, stages):
    """int4 K and V (split-halves nibbles, g64)."""
    from swap_decode import swap_decode

    from kvtax.attention import attention_blockwise

    q, view, lengths = _build(ctx, group, batch, 1, dtype, spec="int4")
    got = swap_decode(q, view, None, lengths, poison=True, merge=merge, stages=stages)
    ref = attention_blockwise(q.float(), view)
    _compare(got, ref, dtype, f"int4 ctx={ctx} G={group} B={batch} {dtype} merge={merge}")
