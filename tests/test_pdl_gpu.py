"""Programmatic dependent launch (kvtax.pdl) over a decode step's attention stretch: the
qkv-like producer, the fused cache store, the decode kernel (Gluon for int8 / int4, the
warp kernel for bf16) and the split-KV reduce, each reading what the one before wrote.
Launched with PDL, each kernel waits before its first access; a kernel that read early
would see the previous step's q, K/V slot or length here, because every step changes
all three. Needs CUDA sm_90+ (PDL); tests/models/test_gemv.py checks the GEMV chain."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax import pdl
from kvtax.attention import attention
from tests.support import kernels as ke

pytestmark = [pytest.mark.gpu, pytest.mark.kernels]  # programmatic dependent launch: sm_90+


def _step(cache, x, w, pos_t, len_t):
    """One decode step's attention stretch for `x` `[1, 512]`: q, k, v = x @ w (a
    torch matmul), store k / v at pos_t, attend over the length in len_t."""
    qkv = (x @ w).view(1, 1, 6, 128).transpose(1, 2)  # [1, 6 heads, 1, 128]
    q, k, v = qkv[:, :4], qkv[:, 4:5], qkv[:, 5:6]
    cache.write_at(k.contiguous(), v.contiguous(), pos_t)
    view = dataclasses.replace(cache.view(), length=cache.length + 1, length_t=len_t)
    return attention(q.contiguous(), view, impl="triton")  # [1, 4, 1, 128]


@pytest.mark.parametrize("spec", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_attention_stretch_with_pdl_matches_plain_launches(spec, graph, monkeypatch):
    """A decode stretch (cache store, attention, split-KV reduce) gives the same results
    launched with PDL as without, eagerly and in a CUDA graph."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+")
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randn(1, 1, 3000, 128, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(512, 768, generator=gen) / 16).to("cuda", torch.bfloat16)
    xs = [torch.randn(1, 512, generator=gen).to("cuda", torch.bfloat16) for _ in range(4)]
    results = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "USE_PDL", on)
        cache = ke.FullCache(spec, capacity=3100)
        cache.append(prompt, prompt)
        x = xs[0].clone()
        pos_t = torch.tensor([cache.length], dtype=torch.int64, device="cuda")
        len_t = torch.tensor([cache.length + 1], dtype=torch.int32, device="cuda")
        outs = []
        if graph:
            _step(cache, x, w, pos_t, len_t)  # compile and warm up outside the capture
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                out = _step(cache, x, w, pos_t, len_t)
        for i, xi in enumerate(xs):
            x.copy_(xi)
            if graph:
                cg.replay()
                res = out
            else:
                res = _step(cache, x, w, pos_t, len_t)
            outs.append(res.clone())
            cache.advance(1)
            pos_t += 1
            len_t += 1
        torch.cuda.synchronize()
        results[on] = outs
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)
    assert not torch.equal(results[True][0], results[True][1])
