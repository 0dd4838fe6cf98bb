"""decode_swap.py (slots as the MMA's M, two 4-row streams per step) against the float32
reference, through the interpreter on CPU: int8 / int4 / mixed K and V, one or two scale
groups per row, head dims 64 / 128 / 256, G * L from 1 to 4, causal L > 1, soft-capping,
bf16 queries, device lengths per sequence, split counts that leave splits empty, lazy
rescaling; and the calls it refuses, with the reason. On a GPU the same tests
run compiled, and launch kernel "swap" runs decode_swap_gluon.py where that applies
(int8 / int4 group 64 at head dim 128, no soft-capping)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention.triton_api import swap_decode_config, swap_reason
from kvtax.errors import ShapeError
from tests.support import kernels as ke
from tests.support.kernels import DEVICE, build, check

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize(
    "spec, d, group, n_q, ctx, softcap, dtype",
    [("int8", 128, 4, 1, 130, None, torch.float16),     # two groups per row (g64)
     ("int4", 128, 4, 1, 75, None, torch.bfloat16),
     ("k8v4", 64, 2, 2, 99, None, torch.float16),       # causal edge, one group per row
     ("k4v8", 128, 1, 1, 33, 30.0, torch.float16),      # soft-capping
     ("int8-g128", 256, 2, 1, 70, None, torch.bfloat16),
     ("int4", 64, 1, 3, 31, None, torch.float16),       # 3 rows of 4, one partial step
     ("int8", 128, 4, 1, 1, None, torch.float16)],      # a single token
)
def test_swap_matches_reference(spec, d, group, n_q, ctx, softcap, dtype):
    q, view = build(spec, d=d, h_kv=2, group=group, ctx=ctx, n_q=n_q, dtype=dtype)
    cfg = swap_decode_config(q, view)
    assert cfg.kernel == "swap" and swap_reason(q, view) is None
    check(q, view, what=f"swap-{spec}-{d}-G{group}-L{n_q}", softcap=softcap, config=cfg)


@pytest.mark.parametrize("splits", [1, 3, 9])
def test_swap_splits_and_device_lengths(splits):
    """Split counts that leave some splits without a step (5 steps at 130 tokens; their
    m = -inf partials must merge away), and per-sequence device lengths."""
    q, view = build("int8", d=64, h_kv=2, group=4, ctx=130, n_q=1, batch=2)
    cfg = dataclasses.replace(swap_decode_config(q, view), num_splits=splits)
    lens = torch.tensor([130, 45], dtype=torch.int32, device=DEVICE)
    out = ke.triton_attention(q, view, lengths=lens, config=cfg)
    for b, n in enumerate(lens.tolist()):
        sub = dataclasses.replace(
            view, length=n,
            k=type(view.k)(*(t[b:b + 1] for t in view.k)),
            v=type(view.v)(*(t[b:b + 1] for t in view.v)))
        ref = ke.attention_blockwise(q[b:b + 1].float(), sub)
        ke.assert_close(out[b:b + 1].float(), ref, atol=2e-2, rel_rms=4e-3,
                        what=f"splits={splits} b={b}")


def test_swap_large_values_keep_precision():
    """V far from zero with a narrow range (large biases, small scales): the fp16 P
    operand's rounding must not be multiplied by the codes' 1024 offset."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(1, 2, 37, 128, generator=gen)
    v = 40.0 + 0.05 * torch.randn(1, 2, 37, 128, generator=gen)
    cache = ke.FullCache("int8")
    cache.append(k.to(DEVICE, torch.float16), v.to(DEVICE, torch.float16))
    q = torch.randn(1, 4, 1, 128, generator=gen).to(DEVICE, torch.float16)
    view = cache.view()
    check(q, view, what="offset V", config=swap_decode_config(q, view))


@pytest.mark.parametrize(
    "spec, d, group, n_q, window, why",
    [("int8", 128, 8, 1, None, "G * L = 8 > 4"),
     ("int8", 128, 2, 3, None, "G * L = 6 > 4"),
     ("fp8", 128, 4, 1, None, "not int8 / int4"),
     ("int4-g32", 128, 4, 1, None, "group size 32 < head_dim / 2"),
     ("int8", 128, 4, 1, 16, "ring / window / sinks"),
     ("int8-g16", 32, 4, 1, None, "head_dim 32 not in")],
)
def test_swap_refuses_with_reason(spec, d, group, n_q, window, why):
    q, view = build(spec, d=d, h_kv=1, group=group, ctx=40, n_q=n_q, window=window)
    assert why in (swap_reason(q, view) or "")
    cfg = dataclasses.replace(swap_decode_config(q, view), num_splits=1)
    with pytest.raises(ShapeError, match="decode_swap kernel cannot run"):
        ke.triton_attention(q, view, config=cfg)


@pytest.mark.skipif(ke.HAS_CUDA, reason="the interpreter's side of the dispatch")
def test_gluon_kernel_never_chosen_under_the_interpreter():
    """Gluon cannot run interpreted: the table keeps decode_warp and kernel "swap" runs the
    Triton twin (this file's other tests), whatever the shape."""
    from kvtax.attention.triton_api import gluon_swap_reason, launch_config

    q, view = build("int8", d=128, h_kv=2, group=4, ctx=40, n_q=1)
    assert swap_reason(q, view) is None
    assert "interpreter" in gluon_swap_reason(q, view)
    assert launch_config(q, view).kernel == "warp"


@pytest.mark.parametrize("grow", ["scores", "values", "values-flat"])
@pytest.mark.parametrize("spec", ["int8", "int4", "k8v4"])
def test_swap_rescaling_across_steps(spec, grow):
    """Scores climbing along the context (a column's max grows by far more than 2^8); V
    growing 1000x after slot 64 with the early keys weighted to match; V growing 1e5x
    under flat scores (P * s / t_v would pass fp16's 65504 unless t_v follows). The lazy
    rescale (only when a score passes the reference max by 2^8 or a V scale the
    reference by 2^6) must keep fp16's range and the early steps' share. Head dim 128: the int8 / int4 default groups give two per row."""
    q, view = ke.rescale_case(grow, spec, ctx=300, d=128)
    cfg = dataclasses.replace(swap_decode_config(q, view), num_splits=2)
    out = ke.triton_attention(q, view, config=cfg)
    ref = ke.attention_blockwise(q.float(), view)
    top = ref.abs().max().item()  # outputs may reach ~1e2-1e3 (fp16 steps of 0.06-0.5)
    ke.assert_close(out.float(), ref, atol=max(2e-2, 2e-3 * top), rel_rms=4e-3,
                    what=f"swap rescale-{grow}-{spec}")
