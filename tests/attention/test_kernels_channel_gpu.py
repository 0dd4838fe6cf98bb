"""Fused kernels reading int4-c64 keys vs the float32 reference over the full grid (CUDA).

Contexts 1..8193 (block-aligned storage, lengths off the 64-token blocks), head dims
64/128/256, GQA 1/4/7, decode and prefill chunks, fp16/bf16, the value formats q4 and
its neighbours use, windows, hybrid-part masks and a CUDA-graph decode step. Skipped on
CPU, where tests/attention/test_kernels_channel_interp.py runs the kernels interpreted.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention.triton_api import launch_config, triton_attention
from tests.attention.test_kernels_lse_interp import check_lse
from tests.support import kernels as ke
from tests.support.channel import channel_view
from tests.support.kernels import check

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]

CONTEXTS = [1, 63, 64, 65, 255, 257, 1000, 8193]


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("n_q", [1, 300], ids=["decode", "prefill"])
def test_grid(n_q, d, group, ctx):
    n_q = min(n_q, ctx)
    q, view = channel_view(d=d, h_kv=2, group=group, ctx=ctx, n_q=n_q, seed=ctx + d)
    check(q, view, what=f"c64-D{d}-G{group}-ctx{ctx}-L{n_q}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n_q", [1, 4, 16, 17, 2048])
@pytest.mark.parametrize("value", ["int4-g32", "int4", "int8", "fp16", "fp8"])
def test_values_and_dtypes(value, n_q, dtype):
    q, view = channel_view(value, d=128, h_kv=8, group=4, ctx=4097, n_q=n_q, dtype=dtype)
    check(q, view, what=f"c64-v{value}-L{n_q}-{dtype}")


@pytest.mark.parametrize("n_q", [1, 64])
def test_window(n_q):
    q, view = channel_view(d=128, h_kv=2, group=4, ctx=3000, n_q=n_q, window=1024)
    check(q, view, what=f"c64-window-L{n_q}")


@pytest.mark.parametrize("n_q", [1, 300])
@pytest.mark.parametrize("ctx", [200, 5000])
def test_hybrid_body_part(ctx, n_q):
    """The body part of q4 (`@s4r128`): keys >= 4 and at least 128 behind the query."""
    n_q = min(n_q, ctx)
    q, view = channel_view(d=128, h_kv=2, group=4, ctx=ctx, n_q=n_q, seed=ctx)
    check_lse(q, view, min_distance=128, min_key=4, what=f"c64-body-ctx{ctx}-L{n_q}")


def test_cuda_graph_decode_with_device_length():
    """One captured decode step replayed at two lengths read from a device tensor (the
    shorter ends mid-block: the rest of its block is stored but must stay unseen)."""
    q, view = channel_view(d=128, h_kv=8, group=4, ctx=4096, n_q=1)
    lens = torch.tensor([4000], dtype=torch.int32, device=q.device)
    assert launch_config(q, view, lens).kernel == "tile"
    out = torch.empty_like(q)
    triton_attention(q, view, lengths=lens, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_attention(q, view, lengths=lens, out=out)
    for n in (4000, 2049):
        lens.fill_(n)
        out.fill_(float("nan"))
        graph.replay()
        ref = ke.attention_blockwise(q.float(), dataclasses.replace(view, length=n))
        ke.assert_close(out.float(), ref, atol=2e-2, rel_rms=4e-3, what=f"graph-{n}")
