"""Kernel "swap" over int4-c64 keys and int4w-c64 keys (q4's body): decode_swap.py, the
Triton twin of the Gluon kernel, against the float32 reference through the interpreter on CPU (block vectors
folded into the queries, steps inside one 64-slot block, lengths off the blocks, device
lengths, splits left empty, soft-capping), the calls it refuses, and the launch table's
routing of `k4-c64v4` decode to the Gluon kernel (decided on shapes, so checked here with
the interpreter's veto lifted). The Gluon kernel itself runs in
tests/attention/test_kernels_channel_swap_gpu.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention import launch, launch_table, support
from kvtax.attention.triton_api import (
    gluon_swap_reason, launch_config, swap_decode_config, swap_reason, triton_attention,
)
from kvtax.errors import ShapeError
from kvtax.formats import QTensor
from tests.support import kernels as ke
from tests.support.channel import channel_view
from tests.support.kernels import check

pytestmark = pytest.mark.kernels
F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _poison_workspace(monkeypatch):
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)


# (value format, head_dim, group, ctx, n_q, dtype, softcap)
CASES = [
    ("int4", 128, 4, 130, 1, F16, None),       # q4's body (k4-c64v4): the Gluon kernel's case
    ("int4", 128, 1, 63, 1, BF16, None),       # one partial block
    ("int4", 128, 2, 1, 1, F16, None),         # one token in a 64-slot block
    ("int4", 128, 2, 200, 2, F16, None),       # causal edge, G * L = 4
    ("int8", 64, 2, 99, 2, F16, None),         # int8 values, D 64: one group per row
    ("int4-g128", 256, 4, 70, 1, BF16, None),  # D 256, V one group per row
    ("int4", 128, 4, 97, 1, F16, 30.0),        # soft-capping (the twin's alone)
]


def _id(c) -> str:
    value, d, g, ctx, n_q, dtype, cap = c
    return f"c64-v{value}-D{d}-G{g}-ctx{ctx}-L{n_q}-{str(dtype)[6:]}" + ("-cap" if cap else "")


@pytest.mark.parametrize("key", ["int4-c64", "int4w-c64"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_swap_twin_matches_reference(case, key):
    value, d, g, ctx, n_q, dtype, cap = case
    q, view = channel_view(value, key=key, d=d, h_kv=2, group=g, ctx=ctx, n_q=n_q,
                           dtype=dtype, seed=ctx + d)
    cfg = swap_decode_config(q, view)
    assert cfg.kernel == "swap" and swap_reason(q, view) is None
    check(q, view, what=_id(case), softcap=cap, config=cfg)


@pytest.mark.parametrize("key", ["int4-c64", "int4w-c64"])
@pytest.mark.parametrize("splits", [1, 3, 9])
def test_swap_twin_splits_and_device_lengths(splits, key):
    """Strided steps of each split land in different blocks (their vectors must follow),
    splits without a step merge away, and a device length ending mid-block hides the
    rest of the block it shares with stored tokens (int4w-c64: each sequence its own
    channel order)."""
    q, view = channel_view("int4", key=key, d=128, h_kv=2, group=4, ctx=300, n_q=1,
                           batch=2, seed=4)
    cfg = dataclasses.replace(swap_decode_config(q, view), num_splits=splits)
    lens = torch.tensor([300, 77], dtype=torch.int32, device=q.device)
    out = triton_attention(q, view, lengths=lens, config=cfg)
    for b, n in enumerate(lens.tolist()):
        sub = dataclasses.replace(view, k=_row(view.k, b), v=_row(view.v, b), length=n)
        ref = ke.attention_blockwise(q[b : b + 1].float(), sub)
        ke.assert_close(out[b : b + 1].float(), ref, atol=2e-2, rel_rms=4e-3,
                        what=f"splits={splits} b={b}")


def _row(qt, b):
    return type(qt)(*(None if t is None else t[b : b + 1] for t in qt))


def test_swap_twin_keys_far_from_zero():
    """Keys with large per-channel offsets and narrow ranges (large biases, small scales):
    q.b dominates each score, and the 1024 offset of the codes must cancel against the
    same rounded q s, or the small part of the score is lost."""
    q, view = channel_view("int4", d=128, h_kv=1, group=4, ctx=150, n_q=1, seed=6)
    gen = torch.Generator().manual_seed(6)
    k = 20.0 + 0.05 * torch.randn(1, 1, 192, 128, generator=gen)  # 192 slots: 3 blocks
    view = dataclasses.replace(view, k=view.spec.key.quantize(k.to(q.device, q.dtype)))
    check(q, view, what="far keys", config=swap_decode_config(q, view))


@pytest.mark.parametrize("key, code", [("int4-c64", 4), ("int4w-c64", 7)])
def test_swap_twin_really_runs_with_block_keys(key, code):
    """decode_swap.py launched with format code 4 / 7 (head_dim 64: the twin's alone, also
    on a GPU, where D 128 goes to the Gluon kernel)."""
    from kvtax.attention.kernels import decode_swap

    q, view = channel_view("int4", key=key, d=64, h_kv=1, group=4, ctx=70, n_q=1)
    fn, calls = decode_swap.decode_swap_kernel, []
    original = fn.run
    fn.run = lambda *a, **k: calls.append(k.get("K_FMT")) or original(*a, **k)
    try:
        check(q, view, what="spy", config=swap_decode_config(q, view))
    finally:
        del fn.run
    assert calls == [code], f"decode_swap.py was not launched with {key} keys"


@pytest.mark.parametrize("value, d, group, n_q, why", [
    ("int4-g32", 128, 4, 1, "group size 32 < head_dim / 2"),   # q4's own values (g32)
    ("int4", 128, 7, 1, "G * L = 7 > 4"),
    ("fp16", 128, 4, 1, "value format fp16 is not int8 / int4"),
    ("int4", 128, 2, 3, "G * L = 6 > 4"),
])
def test_swap_refuses_with_reason(value, d, group, n_q, why):
    q, view = channel_view(value, d=d, h_kv=1, group=group, ctx=70, n_q=n_q)
    assert why in (swap_reason(q, view) or "")
    cfg = dataclasses.replace(swap_decode_config(q, view), num_splits=1)
    with pytest.raises(ShapeError, match="decode_swap kernel cannot run"):
        triton_attention(q, view, config=cfg)


@pytest.fixture
def compiled(monkeypatch):
    """The table's view of a CUDA machine: Gluon loadable, Triton compiling (the routing
    depends on shapes and formats only; nothing is launched)."""
    monkeypatch.setattr(support, "interpreting", lambda: False)
    monkeypatch.setattr(support, "gluon_swap_kernel", lambda: object())
    monkeypatch.setattr(launch_table, "sm_count", lambda device: 132)  # an H200's, anywhere


@pytest.mark.parametrize("dtype, per_sm", [(F16, 12), (BF16, 8)])
def test_launch_table_routes_k4c64v4_decode_to_the_gluon_kernel(compiled, dtype, per_sm):
    """`k4-c64v4` decode at head_dim 128, G 4 (Llama's GQA): kernel "swap" (the Gluon
    kernel), 12 programs per SM in fp16 (168 registers on sm_90, as plain int4's) and 8
    in bf16 (206 and more)."""
    q, view = channel_view("int4", d=128, h_kv=8, group=4, ctx=4096, n_q=1, dtype=dtype)
    assert gluon_swap_reason(q, view) is None
    cfg = launch_config(q, view)
    assert (cfg.path, cfg.kernel, cfg.block_n) == ("decode", "swap", 32), cfg
    assert cfg == swap_decode_config(q, view, per_sm=per_sm)
    # early only at 12 per SM on a full grid: 4,096 slots make 32 splits of >= 4 tiles, not
    # the 198 that fill 132 SMs over 8 heads; 32,768 slots fill it
    assert not cfg.pdl_launch and cfg.num_splits == 32, cfg
    long = launch_config(q, dataclasses.replace(view, length=32768))
    assert long.num_splits == per_sm * 132 // 8, long
    assert long.pdl_launch == (per_sm == 12), long
    # soft-capping and left padding stay with decode_warp (the hybrid masks do not)
    assert launch_config(q, view, softcap=True).kernel == "warp"
    assert launch_config(q, view, masked=True).kernel == "warp"


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_launch_table_routes_k4wc64v4_decode_to_the_gluon_kernel(compiled, dtype):
    """`k4w-c64v4` decode at head_dim 128, G 4: kernel "swap" (the Gluon kernel), 8
    programs per SM (202-242 registers: the queries' gather through the channel order)."""
    q, view = channel_view("int4", key="int4w-c64", d=128, h_kv=8, group=4, ctx=4096,
                           n_q=1, dtype=dtype)
    assert gluon_swap_reason(q, view) is None
    cfg = launch_config(q, view)
    assert (cfg.path, cfg.kernel) == ("decode", "swap"), cfg
    assert cfg == swap_decode_config(q, view, per_sm=8)
    assert cfg.max_registers is None, cfg


def test_register_cap_goes_with_twelve_programs_per_sm(compiled):
    """The cap is set exactly where three one-warp programs share a scheduler."""
    q, view = channel_view("int4", d=128, h_kv=8, group=4, ctx=4096, n_q=1, dtype=BF16)
    assert launch_config(q, view).max_registers is None  # 8 per SM: no cap
    assert swap_decode_config(q, view, per_sm=12).max_registers == 168
    assert swap_decode_config(q, view, per_sm=8).max_registers is None


@pytest.mark.parametrize("value, d, group, kernel", [
    ("int4-g32", 128, 4, "tile"),   # q4's values: two groups per half row
    ("int8", 128, 4, "warp"),       # the Gluon kernel takes int4 values beside c64 keys
    ("int4", 64, 4, "warp"),        # head_dim 64: the twin's shape, not the Gluon kernel's
    ("int4", 128, 8, "warp"),       # G * L = 8 > 4
])
def test_launch_table_keeps_other_c64_calls_off_the_gluon_kernel(compiled, value, d, group,
                                                                 kernel):
    q, view = channel_view(value, d=d, h_kv=1, group=group, ctx=300, n_q=1)
    assert gluon_swap_reason(q, view) is not None
    assert launch_config(q, view).kernel == kernel


def test_gluon_refuses_unaligned_block_metadata(compiled):
    """The Gluon kernel copies the block vectors with 8-byte cp.async: metadata starting
    off a 16-byte boundary goes to decode_warp (the twin and decode_warp take it)."""
    q, view = channel_view("int4", d=128, h_kv=1, group=4, ctx=300, n_q=1)
    k = view.k

    def shifted(t):  # the same values one element into a fresh buffer
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        return out

    odd = dataclasses.replace(view, k=QTensor(k.codes, shifted(k.scales), shifted(k.biases)))
    assert "16-byte aligned" in gluon_swap_reason(q, odd)
    assert launch_config(q, odd).kernel == "warp"
    check(q, odd, what="unaligned metadata through the twin", config=swap_decode_config(q, odd))
