"""Staged prefill (kvtax.attention.staged): the stage kernel's dequantization against each
format's torch `read`, and `attention` of long prefill chunks through fp16 chunks of the
dequantized cache (plain caches and a hybrid cache's body) against the torch reference.

Small shapes through Triton's interpreter on CPU (tests/conftest.py), compiled on a GPU:
the scratch is shrunk to a few 128-slot chunks and the row threshold to 1, and every case
checks the stage kernel ran and the chunks chained (prefill launches counted).
"""

from __future__ import annotations

import pytest
import torch

from kvtax.attention import attention_blockwise, launch, staged
from kvtax.attention.dispatch import attention
from kvtax.attention.kernels import prefill, stage
from kvtax.attention.launch import launch_attention
from kvtax.attention.stage_launch import launch_stage
from kvtax.errors import ShapeError
from tests.attention.test_hybrid_decode_interp import _hybrid, _reference
from tests.support import kernels as ke
from tests.support.fused import fused_only
from tests.support.kernels import DEVICE, TOLERANCE

pytestmark = pytest.mark.kernels


@pytest.fixture
def launches(monkeypatch):
    """Poisoned workspaces, 128-slot chunks from one row, launches counted."""
    monkeypatch.setattr(launch, "POISON_WORKSPACE", True)
    monkeypatch.setattr(staged, "STAGE_MIN_ROWS", 1)
    monkeypatch.setattr(staged, "STAGE_BYTES", 1)  # one ALIGN of slots per chunk
    return fused_only(monkeypatch, {"prefill": [prefill.prefill_attn_fwd_kernel],
                                    "stage": [stage.stage_slots_kernel]})


@pytest.mark.parametrize("spec,d", [
    ("int8", 64), ("int4", 128), ("int4-g16", 80), ("fp8", 64), ("int3-g32", 96),
    ("k4-c64v4", 64), ("k3-c64v3-g32", 128), ("int8+hk+ck", 64), ("k4w-c64v4", 128),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stage_matches_read(spec, d, dtype):
    """Slots [64, 64 + n) staged equal the format's torch dequantization in dtype, and the
    padding rows past n are finite."""
    _, view = ke.build(spec, d=d, h_kv=2, group=1, ctx=300, n_q=1, batch=2, dtype=dtype)
    n, pad = 150, 192
    for qt, fmt in ((view.k, view.spec.key), (view.v, view.spec.value)):
        out = torch.full((2, 2, pad, d), float("nan"), dtype=dtype, device=DEVICE)
        launch_stage(qt, fmt, 64, n, out)
        want = fmt.read(qt, 64, 64 + n).to(dtype)
        # the kernels dequantize in the model dtype (one rounding per fma): one ulp of
        # keys up to ~30 (the outlier channels) is 1/64 in fp16, 1/8 in bf16
        atol = 2e-2 if dtype == torch.float16 else 0.25
        ke.assert_close(out[:, :, :n].float(), want.float(), atol=atol, rel_rms=1e-2,
                        what=f"{spec} {fmt.name}")
        assert torch.isfinite(out[:, :, n:]).all()


# (spec, head_dim, group, ctx, n_q): chunks below, at and past the causal edge, GQA,
# rotated keys / values, centered keys, 3-bit, fp8, D 256
PLAIN = [
    ("int4", 64, 2, 600, 70),
    ("int8+hk+ck", 128, 4, 455, 130),
    ("int4+hkv", 64, 1, 400, 40),
    ("k4-c64v4", 64, 7, 520, 33),
    ("k4w-c64v4", 256, 2, 330, 40),
    ("k3-c64v3-g32", 128, 2, 390, 64),
    ("fp8", 256, 2, 300, 20),
    ("int4-g16", 80, 2, 333, 17),
]


@pytest.mark.parametrize("case", PLAIN, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_staged_prefill_matches_reference(case, dtype, launches):
    spec, d, g, ctx, n_q = case
    q, view = ke.build(spec, d=d, h_kv=2, group=g, ctx=ctx, n_q=n_q, batch=2, dtype=dtype,
                       seed=ctx)
    got = attention(q, view)
    size = staged.ALIGN  # the fixture's scratch: one ALIGN of slots
    last = (ctx - n_q) // size * size  # the causal edge's chunk starts here
    if ctx - last <= size:  # it fits the scratch: staged, every slot through fp16 chunks
        chunks = last // size + 1
        assert launches == {"prefill": chunks, "stage": 2 * chunks}, launches
    else:  # the slots every row sees staged, the edge on the fused kernel
        chunks = (ctx - n_q + 1) // size
        assert launches == {"prefill": chunks + 1, "stage": 2 * chunks}, launches
    assert got.dtype == dtype and got.shape == q.shape
    atol, rel = TOLERANCE[dtype]
    ke.assert_close(got.float(), attention_blockwise(q.float(), view), atol=atol, rel_rms=rel,
                    what=f"{case} {dtype}")


def test_staged_prefill_softcap_and_scale(launches):
    q, view = ke.build("int4", d=64, h_kv=2, group=2, ctx=420, n_q=30, seed=3)
    got = attention(q * 8, view, softcap=5.0, scale=0.2)
    assert launches["stage"] == 8  # 4 chunks of 128 slots (the edge's last), K and V
    ke.assert_close(got.float(), attention_blockwise((q * 8).float(), view, softcap=5.0,
                                                     scale=0.2),
                    atol=2e-2, rel_rms=4e-3, what="softcap")


@pytest.mark.parametrize("spec,g,ctx,n_q", [("q4", 2, 700, 150), ("k4-c64v4@s4r16", 7, 461, 40),
                                            ("int4-g32+hk@s4r16", 4, 400, 24),
                                            ("k4-c64v4@s4r300", 2, 356, 100),
                                            ("k4w-c64v4@s4r128", 4, 600, 100)])
def test_staged_hybrid_body(spec, g, ctx, n_q, launches):
    """A hybrid cache's body stages its chunks; the fp16 ring part merges last. With 300
    recent tokens the first 48 rows see no body key: the chunks chain empty rows."""
    q, view = _hybrid(spec, d=64, group=g, ctx=ctx, n_q=n_q, seed=ctx)
    got = attention(q, view)
    assert launches["stage"] >= 2, launches
    atol, rel = TOLERANCE[q.dtype]
    ke.assert_close(got.float(), _reference(q, view), atol=atol, rel_rms=rel, what=spec)


def test_short_chunks_and_decode_stay_fused(monkeypatch):
    """Below the row threshold, at decode, and on float caches nothing is staged."""
    counts = fused_only(monkeypatch, {"stage": [stage.stage_slots_kernel]})
    q, view = ke.build("int4", d=64, h_kv=2, group=2, ctx=300, n_q=40)
    assert staged.staged_reason(q, view) is not None  # 80 rows < STAGE_MIN_ROWS
    attention(q, view)
    attention(q[:, :, -1:], view)
    monkeypatch.setattr(staged, "STAGE_MIN_ROWS", 1)
    q16, v16 = ke.build("fp16", d=64, h_kv=2, group=2, ctx=300, n_q=40)
    assert staged.staged_reason(q16, v16) == "the cache is not quantized"
    attention(q16, v16)
    assert counts == {"stage": 0}


def test_max_key_checked():
    q, view = ke.build("fp16", d=64, h_kv=1, group=1, ctx=300, n_q=40)
    with pytest.raises(ShapeError, match="multiple"):
        launch_attention(q, view, max_key=100)
    with pytest.raises(ShapeError, match="decode"):
        launch_attention(q[:, :, -1:], view, max_key=128)
    with pytest.raises(ShapeError, match="cannot stage"):
        launch_stage(view.k, view.spec.key, 0, 100, torch.empty(1, 1, 100, 64, device=DEVICE))
