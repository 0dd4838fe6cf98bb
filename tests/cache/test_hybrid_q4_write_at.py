"""Hybrid caches (q4 and kin, int4w-c64 keys among them) written one token at a device
position (`write_at` + `advance`, the CUDA-graph decode step): every part's storage and the
attention output equal eager appends', bit for bit; with the fused kernels (Triton's
interpreter on CPU) reading the device lengths from a view whose host length is frozen, as
a captured graph's is, the output matches too."""

from __future__ import annotations

import pytest
import torch

from kvtax.attention import attention
from kvtax.attention import dispatch as dispatch_mod
from kvtax.attention.lse import attention_lse, merge_lse
from kvtax.cache.hybrid import HybridCache
from kvtax.errors import CapacityError
from tests.support.device import DEVICE, HAS_CUDA
from tests.support.kernels import TOLERANCE
from tests.support.tensors import assert_close, rand_kv

SPECS = ["q4", "k4-c64v4+hk+ck@s4r128", "k3-c64v4@s4r128", "k4w-c64v4@s4r128"]


def _data(n: int, d: int = 64, dtype=torch.float32, seed: int = 0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    k = rand_kv((1, 2, n, d), outliers=3, gen=gen)
    k[..., 5] += 3.0  # an offset channel: +ck has work to do
    v = rand_kv((1, 2, n, d), gen=gen)
    q = rand_kv((1, 4, n, d), gen=gen)
    return (t.to(device, dtype) for t in (q, k, v))


def _make(spec: str, window: int | None, capacity: int = 512) -> HybridCache:
    return HybridCache(spec, window=window, capacity=capacity, max_chunk=150)


def _same_parts(a: HybridCache, b: HybridCache, what: str) -> None:
    for pa, pb in zip(a.parts, b.parts):
        held = pa.view().num_slots
        kb = -(-held // 64) * 64 if pa.blocks is not None else held
        for x, y in zip(pa.store.k.parts(), pb.store.k.parts()):
            assert torch.equal(x[:, :, :kb], y[:, :, :kb]), what
        for x, y in zip(pa.store.v.parts(), pb.store.v.parts()):
            assert torch.equal(x[:, :, :held], y[:, :, :held]), what


@pytest.mark.parametrize("window", [None, 150], ids=["full", "sliding150"])
@pytest.mark.parametrize("spec", SPECS)
def test_write_at_steps_equal_appends(spec, window) -> None:
    """Prefill 100 in chunks of 64 and 36, then 300 write_at steps (blocks end and start,
    the body starts being read past 128 recent tokens, the rings wrap): each step stores
    what a one-token append stores, and attention over the view at the step's length
    gives the eager output exactly."""
    n, prefill = 400, 100
    q, k, v = _data(n, seed=len(spec))
    graph, eager = _make(spec, window), _make(spec, window)
    for c in (graph, eager):
        c.append(k[:, :, :64], v[:, :, :64])
        c.append(k[:, :, 64:prefill], v[:, :, 64:prefill])
    for t in range(prefill, n):
        pos = torch.tensor([t])
        graph.write_at(k[:, :, t:t + 1], v[:, :, t:t + 1], pos)
        view = graph.view().at_length(t + 1, torch.full((1,), t + 1, dtype=torch.int32))
        graph.advance(1)
        eager.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert len(graph) == len(eager) == t + 1
        _same_parts(graph, eager, f"{spec} after token {t}")
        if t % 50 == 0 or t == n - 1:
            got = attention(q[:, :, t:t + 1], view)
            assert torch.equal(got, attention(q[:, :, t:t + 1], eager.view())), f"token {t}"


@pytest.mark.parametrize("spec", SPECS)
def test_trim_and_reset_after_write_at_steps(spec) -> None:
    """As `kvtax recall` runs a cache: prompt, graph steps, trim the answer, graph steps again, then a
    reset and a new prompt: the storage and attention of eager appends of the same tokens;
    the key shift (+ck) and the staging ring stay where a captured graph reads them."""
    q, k, v = _data(400, seed=3)
    graph, eager = _make(spec, None), _make(spec, None)
    for c in (graph, eager):
        c.append(k[:, :, :150], v[:, :, :150])
    for t in range(150, 260):
        graph.write_at(k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([t]))
        graph.advance(1)
        eager.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert graph.trim(90) == eager.trim(90) == 90
    _same_parts(graph, eager, f"{spec} after the trim")
    for i, t in enumerate(range(260, 330)):  # written at positions 170 ..
        graph.write_at(k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([170 + i]))
        graph.advance(1)
        eager.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    _same_parts(graph, eager, f"{spec} decoding on after the trim")
    last = q[:, :, -1:]
    assert torch.equal(attention(last, graph.view()), attention(last, eager.view()))
    ptrs = [p.blocks.buf.data_ptr() for p in graph.parts if p.blocks is not None]
    shift = None if graph.key_shift is None else graph.key_shift.data_ptr()
    for c in (graph, eager):
        c.reset()
        c.append(k[:, :, 330:], v[:, :, 330:])  # a new prompt: a new key mean
    _same_parts(graph, eager, f"{spec} after a reset")
    assert ptrs == [p.blocks.buf.data_ptr() for p in graph.parts if p.blocks is not None]
    assert shift == (None if graph.key_shift is None else graph.key_shift.data_ptr())


def test_advance_past_the_body_capacity_moves_no_part() -> None:
    _, k, v = _data(70)
    cache = _make("q4", None, capacity=65)
    cache.append(k[:, :, :64], v[:, :, :64])
    cache.write_at(k[:, :, 64:65], v[:, :, 64:65], torch.tensor([64]))
    cache.advance(1)
    with pytest.raises(CapacityError, match="capacity"):
        cache.advance(1)
    assert [p.length for p in cache.parts] == [65, 65]
    assert cache.device_write_blocker() is None


@pytest.mark.kernels
@pytest.mark.parametrize("spec", ["q4", "k4-c64v4+hk+ck@s4r128"])
def test_fused_decode_reads_the_device_length(spec, monkeypatch) -> None:
    """The captured step's writes and attention: the fused writes (q4's body stages a key
    and writes its block only when it fills) and the fused hybrid decode over a view whose
    host length is frozen at the first step (the graph's capture), the lengths read from a
    device tensor, match the reference over the eager cache as the cache grows."""
    if not HAS_CUDA:  # the interpreter serves CPU tensors
        monkeypatch.setattr(dispatch_mod, "kernel_unavailable", lambda *a: None)
    monkeypatch.setattr(dispatch_mod, "part_attention", _boom)
    q, k, v = _data(260, dtype=torch.float16, seed=1, device=DEVICE)
    graph, eager = _make(spec, None, capacity=260), _make(spec, None, capacity=260)
    for part in graph.parts:  # the fused writes too (on CPU, interpreted): q4's body
        part.fused_store = True  # then writes a key block once, when it fills
    assert not graph.body.open_block_read
    for c in (graph, eager):
        c.append(k[:, :, :150], v[:, :, :150])
    lens = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    frozen = None
    for t in range(150, 260):
        graph.write_at(k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([t], device=DEVICE))
        lens.fill_(t + 1)
        if frozen is None:  # the graph's view, taken once: storage never moves
            frozen = graph.view().at_length(t + 1, lens)
        graph.advance(1)
        eager.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        filled = (t + 1) // 64 * 64  # the body's whole blocks: the eager bytes
        for x, y in zip(graph.body.store.k.parts(), eager.body.store.k.parts()):
            assert torch.equal(x[:, :, :filled], y[:, :, :filled]), f"token {t}"
        if t in (150, 191, 192, 259):
            got = attention(q[:, :, t:t + 1], frozen)
            want = _reference(q[:, :, t:t + 1], eager.view())
            atol, rel = TOLERANCE[torch.float16]
            assert_close(got.float(), want.float(), atol=atol, rel_rms=rel, what=f"token {t}")


def _reference(q: torch.Tensor, view) -> torch.Tensor:
    """The torch reference over a HybridView: each part's LSE attention, merged."""
    parts = [attention_lse(q, p.view, min_distance=p.min_distance, min_key=p.min_key)
             for p in view.parts]
    return merge_lse(parts)[0]


def _boom(*a, **kw):
    raise AssertionError("the per-part path ran: the fused hybrid decode was expected")
