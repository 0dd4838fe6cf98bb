"""Fused Triton attention vs the float32 reference over the full grid (needs CUDA).

Contexts 1..8193, head dims 64/80/96/128/256, GQA 1/4/8, decode and prefill chunks,
every format and mixed K/V pairs, sliding windows, soft-capping, and a decode step
replayed from a CUDA graph with device-side lengths. Skipped on CPU, where
tests/attention/test_kernels_interp.py runs the same kernels through the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import kernels as ke
from tests.support.kernels import build, check

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]

CONTEXTS = [1, 63, 255, 256, 257, 1000, 8193]
HEAD_DIMS = [64, 80, 96, 128, 256]
GROUPS = [1, 4, 8]
# formats per head dim: group sizes must divide D (80 → 16, 96 → 32)
FORMATS = {
    64: ["int4", "int8-g32", "fp8"],
    80: ["int4-g16", "int8-g16", "fp16"],
    96: ["int8-g32", "fp8", "int4-g32"],
    128: ["int4", "int8", "k8v4"],
    256: ["int8", "int4-g128", "kfp8v4"],
}
ALL_SPECS_128 = [
    "fp16", "bf16", "int8", "int4", "fp8", "k8v4", "k4v8", "kfp8v4", "k8vfp16",
    "int8-g32", "int8-g128", "int4-g32", "int4-g128", "fp8-pt", "kfp8-ptv4",
]


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("n_q", [1, 300], ids=["decode", "prefill"])
def test_grid(n_q, d, group, ctx):
    spec = FORMATS[d][GROUPS.index(group)]  # every format of D across the GQA ratios
    n_q = min(n_q, ctx)
    q, view = build(spec, d=d, h_kv=2, group=group, ctx=ctx, n_q=n_q, seed=ctx + d)
    check(q, view, what=f"{spec}-D{d}-G{group}-ctx{ctx}-L{n_q}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("n_q", [1, 5, 16, 17, 2048])
@pytest.mark.parametrize("spec", ALL_SPECS_128)
def test_formats(spec, n_q, dtype):
    if dtype == torch.bfloat16 and spec not in ("bf16", "int8", "int4", "fp8"):
        pytest.skip("bf16 runs the four base formats")
    q, view = build(spec, d=128, h_kv=8, group=4, ctx=4097, n_q=n_q, dtype=dtype)
    check(q, view, what=f"{spec}-L{n_q}-{dtype}")


@pytest.mark.parametrize("n_q", [1, 4, 64])
@pytest.mark.parametrize("spec", ["fp16", "int8", "int4", "k8v4"])
def test_sliding(spec, n_q):
    q, view = build(spec, d=128, h_kv=2, group=4, ctx=3000, n_q=n_q, window=1024, sinks=4)
    check(q, view, what=f"sliding-{spec}-L{n_q}")


@pytest.mark.parametrize("n_q", [1, 512])
def test_softcap_batch_fp32(n_q):
    q, view = build("int8", d=128, h_kv=2, group=4, ctx=2000, n_q=n_q, batch=3)
    check(q * 4, view, softcap=30.0, what="softcap")
    q32, view32 = build("int4", d=64, h_kv=2, group=2, ctx=700, n_q=n_q, dtype=torch.float32)
    check(q32, view32, what="fp32")


@pytest.mark.parametrize("n_q", [1, 700])
def test_left_padding(n_q):
    from kvtax.attention.triton_api import triton_attention

    q, view = build("k8v4", d=128, h_kv=2, group=4, ctx=3000, n_q=n_q, batch=3)
    kv_start = torch.tensor([0, 5, 1500], device="cuda")
    out = triton_attention(q, view, kv_start=kv_start)
    ref = ke.attention_blockwise(q.float(), view, kv_start=kv_start)
    ke.assert_close(out.float(), ref, atol=2e-2, rel_rms=4e-3, what=f"kv_start-L{n_q}")


@pytest.mark.parametrize("spec", ["fp16", "int4"])
def test_cuda_graph_decode_with_device_lengths(spec):
    """One captured decode step serves later lengths: the kernels read `lengths`."""
    from kvtax.attention.triton_api import triton_attention
    from kvtax.cache import FullCache

    d, h_kv, g, ctx = 128, 8, 4, 5000
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(1, h_kv, ctx + 8, d, generator=gen).to("cuda", torch.float16)
    cache = FullCache(spec, capacity=ctx + 8)
    cache.append(kv[:, :, :ctx], kv[:, :, :ctx])
    q = torch.randn(1, h_kv * g, 1, d, device="cuda", dtype=torch.float16)
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    view = cache.view()
    triton_attention(q, view, lengths=lens, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_attention(q, view, lengths=lens, out=out)
    for step in range(3):
        cache.append(kv[:, :, ctx + step : ctx + step + 1], kv[:, :, ctx + step : ctx + step + 1])
        lens.fill_(cache.length)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        ref = ke.attention_blockwise(q.float(), cache.view())
        ke.assert_close(out.float(), ref, atol=2e-2, rel_rms=4e-3, what=f"graph step {step}")
