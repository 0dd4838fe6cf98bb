"""Fused kernels reading int4w-c64 keys vs the float32 reference over a larger grid (CUDA).

Contexts off and on the 64-token blocks, head dims 64/128/256, GQA 1/4/7, decode (scales
folded into the queries, loaded through the keys' channel order) and prefill chunks
(dequantized 5-bit codes), fp16/bf16, the body part of `k4w-c64v4@s4r128` and the stage
kernel (staged prefill chunks). The keys' channel orders are not the identity
(tests/support/channel.py). Skipped on CPU, where
tests/attention/test_kernels_widest_interp.py runs the kernels interpreted.
"""

from __future__ import annotations

import pytest
import torch

from kvtax.attention import attention_blockwise
from kvtax.attention.dispatch import staged_attention
from tests.attention.test_kernels_lse_interp import check_lse
from tests.support.channel import channel_view
from tests.support.kernels import TOLERANCE, check
from tests.support.tensors import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]
KEY = "int4w-c64"


@pytest.mark.parametrize("ctx", [1, 63, 65, 257, 1000, 8193])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("n_q", [1, 300], ids=["decode", "prefill"])
def test_grid(n_q, d, group, ctx):
    n_q = min(n_q, ctx)
    q, view = channel_view(d=d, h_kv=2, group=group, ctx=ctx, n_q=n_q, seed=ctx + d, key=KEY)
    check(q, view, what=f"w64-D{d}-G{group}-ctx{ctx}-L{n_q}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n_q", [1, 4, 17, 2048])
@pytest.mark.parametrize("value", ["int4", "int4-g32", "int8"])
def test_values_and_dtypes(value, n_q, dtype):
    q, view = channel_view(value, d=128, h_kv=8, group=4, ctx=4097, n_q=n_q, dtype=dtype,
                           key=KEY)
    check(q, view, what=f"w64-v{value}-L{n_q}-{dtype}")


@pytest.mark.parametrize("n_q", [1, 300])
@pytest.mark.parametrize("ctx", [200, 5000])
def test_hybrid_body_part(ctx, n_q):
    """The body part of `k4w-c64v4@s4r128`: keys >= 4 and at least 128 behind the query."""
    n_q = min(n_q, ctx)
    q, view = channel_view("int4", d=128, h_kv=2, group=4, ctx=ctx, n_q=n_q, seed=ctx, key=KEY)
    check_lse(q, view, min_distance=128, min_key=4, what=f"w64-body-ctx{ctx}-L{n_q}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_staged_prefill(dtype):
    """A long prefill chunk staged: the stage kernel writes the keys back in model channel
    order and fp16 chunks attend over them."""
    q, view = channel_view("int4", d=128, h_kv=8, group=4, ctx=4097, n_q=2048, dtype=dtype,
                           key=KEY)
    atol, rel = TOLERANCE[dtype]
    assert_close(staged_attention(q, view).float(), attention_blockwise(q.float(), view),
                 atol=atol, rel_rms=rel, what=f"w64-staged-{dtype}")
