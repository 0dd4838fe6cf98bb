"""torch.compile sees the fused kernels as two opaque custom ops, with no graph breaks.

transformers' compiled decode traces the cache write and the attention of every
layer; Inductor must not re-specialize the Triton kernels (it failed to build them with
Triton 3.6 on the H200), and a graph break per layer would split the decode step into 64
pieces. The ops `kvtax::quantize_store`, `kvtax::block_store` and `kvtax::attention` are traced here with
`fullgraph=True` through aot_eager (which functionalizes the storage mutation) and must give
what the eager calls give. On CPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtax.attention.triton_api import triton_attention
from kvtax.cache import FullCache, SlidingCache
from tests.support import kernels as ke
from tests.support.kernels import DEVICE

pytestmark = pytest.mark.kernels


def _caches(spec: str, sliding: bool):
    def make():
        c = SlidingCache(spec, window=48, sinks=2, max_chunk=1) if sliding else FullCache(spec, capacity=80)
        c.fused_store = True
        gen = torch.Generator().manual_seed(3)
        k = torch.randn(1, 2, 60, 64, generator=gen).to(DEVICE, torch.float16)
        for s in range(0, 60, 1 if sliding else 60):
            c.append(k[:, :, s : s + (1 if sliding else 60)], k[:, :, s : s + (1 if sliding else 60)].flip(-1))
        return c
    return make(), make()


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
@pytest.mark.parametrize("spec", ["int8", "int4", "fp8", "fp16"])
def test_compiled_decode_step_has_no_graph_break(spec, sliding):
    eager, traced = _caches(spec, sliding)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(1, 2, 1, 64, generator=gen).to(DEVICE, torch.float16)
    v = torch.randn(1, 2, 1, 64, generator=gen).to(DEVICE, torch.float16)
    q = torch.randn(1, 8, 1, 64, generator=gen).to(DEVICE, torch.float16)
    pos = torch.tensor([60], dtype=torch.int32, device=DEVICE)
    length = torch.tensor([61], dtype=torch.int32, device=DEVICE)

    def step(cache, q, k, v, pos, length):
        cache.write_at(k, v, pos)
        view = dataclasses.replace(cache.view(), length=cache.capacity if not sliding else 61,
                                   length_t=length)
        return triton_attention(q, view)

    want = step(eager, q, k, v, pos, length)
    torch._dynamo.reset()  # each case compiles afresh (no dynamic-shape recompiles)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
    got = compiled(traced, q, k, v, pos, length)
    assert torch.equal(got, want)
    n = 61 if not sliding else eager.view().num_slots  # slots past them are uninitialized
    for a, b in zip((*eager.store.k, *eager.store.v), (*traced.store.k, *traced.store.v)):
        if a is not None:  # the write landed in the real storage
            assert torch.equal(a[:, :, :n], b[:, :, :n])
    ref = ke.attention_blockwise(q.float(), dataclasses.replace(eager.view(), length=61))
    ke.assert_close(got.float(), ref, atol=2e-2, rel_rms=4e-3, what=f"compiled-{spec}")


def test_op_bodies_cache_their_launch_setup(monkeypatch):
    """The ops run once per layer per compiled decode step: the attention op derives its
    launch configuration once per layout, the store op its checked launch plan, and a
    cached call gives what a fresh one gives."""
    from kvtax.attention import op
    from kvtax.formats import store_triton

    cache, _ = _caches("int8", sliding=False)
    s, view = cache.store, cache.view()
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 8, 1, 64, generator=gen).to(DEVICE, torch.float16)
    k = torch.randn(1, 2, 1, 64, generator=gen).to(DEVICE, torch.float16)
    length = torch.tensor([61], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([60], dtype=torch.int64, device=DEVICE)
    op.forget_launch_configs()
    store_triton._OP_PLANS.clear()
    configs, plans = [], []
    monkeypatch.setattr(op, "launch_config",
                        lambda *a, _f=op.launch_config: configs.append(1) or _f(*a))
    monkeypatch.setattr(store_triton, "_plan",
                        lambda *a, _f=store_triton._plan: plans.append(1) or _f(*a))
    outs = []
    for _ in range(3):
        torch.ops.kvtax.quantize_store.default(k, k.flip(-1), *s.k, *s.v, "int8", pos, 0, 0, 0,
                                               False)
        outs.append(torch.ops.kvtax.attention.default(
            q, *s.k, *s.v, length, None, "int8", 64, cache.capacity, 0, 0, -1, torch.float16,
            -1.0, 0.0))
    assert len(configs) == 1 and op.cached_configs() == 1
    assert len(plans) == 1 and len(store_triton._OP_PLANS) == 1
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    cache.check_finite = False
    cache.length = 61  # the op wrote token 60; the reference reads it through the view
    ref = ke.attention_blockwise(q.float(), dataclasses.replace(cache.view(), length=61))
    ke.assert_close(outs[0].float(), ref, atol=2e-2, rel_rms=4e-3, what="cached ops")
    del view


def test_compiled_hybrid_body_write_has_no_graph_break():
    """q4's decode write (the fp16 ring's store and the body's `kvtax::block_store`, here
    at the step that fills block 0: codes, metadata and the channel order) traced with
    `fullgraph=True` lands in the real storage as the eager write does."""
    from kvtax.cache.hybrid import HybridCache

    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(1, 2, 64, 64, generator=gen).to(DEVICE, torch.float16) for _ in "kv")
    caches = [HybridCache("q4", capacity=128), HybridCache("q4", capacity=128)]
    for c in caches:
        for part in c.parts:
            part.fused_store = True
        c.append(k[:, :, :63], v[:, :, :63])
    pos = torch.tensor([63], device=DEVICE)

    def step(cache, k, v, pos):
        cache.write_at(k, v, pos)

    step(caches[0], k[:, :, 63:], v[:, :, 63:], pos)
    torch._dynamo.reset()
    torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)(
        caches[1], k[:, :, 63:], v[:, :, 63:], pos)
    eager, traced = (c.body for c in caches)
    for a, b in zip((*eager.store.k, *eager.store.v, eager.blocks.buf, eager.blocks.order),
                    (*traced.store.k, *traced.store.v, traced.blocks.buf, traced.blocks.order)):
        if a is not None:
            assert torch.equal(a[:, :, :64], b[:, :, :64])
