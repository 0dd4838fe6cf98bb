"""`write_at` for int4-c64 / int3-c64 / int4w-c64 keys (a token at a device-held position, as a CUDA
graph writes it): the storage equals eager appends of the same tokens, bit for bit, at
every step, whatever the position in its block, and later appends, trims and resets work
as if every token had been appended."""

from __future__ import annotations

import pytest
import torch

from kvtax.cache import FullCache, SlidingCache
from kvtax.cache.blocks import HISTORY
from kvtax.errors import CapacityError
from tests.cache.test_block_keys import _assert_same_storage, _fill
from tests.support.tensors import rand_kv

KEYS = ["k4-c64v4-g32", "k3-c64v4-g32", "k4-c64v4-g32+hk", "k3-c64v8+hk+ck", "k4w-c64v4-g32"]


def _data(n: int, d: int = 64, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = rand_kv((2, 2, n, d), outliers=3, gen=gen, dtype=dtype)
    k[..., 5] += 3.0  # a channel with an offset: +ck and the biases have work to do
    return k, rand_kv((2, 2, n, d), gen=gen, dtype=dtype)


def _step(cache, k, v, t: int) -> None:
    """Token t by write_at at a device position, then advance (the runner's graph step)."""
    cache.write_at(k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([t]))
    cache.advance(1)


def _make(spec: str, sliding: bool, capacity: int = 512):
    if sliding:
        return SlidingCache(spec, window=100, max_chunk=64)
    return FullCache(spec, capacity=capacity)


@pytest.mark.parametrize("spec", KEYS)
@pytest.mark.parametrize("prefill", [1, 63, 64, 100])
def test_write_at_equals_append_at_every_step(spec, prefill) -> None:
    """After a prefill of `prefill` tokens, 70 write_at steps: the last token of a block
    (63, 127), the first of the next (64, 128) and every position between; each step's
    storage equals the eager cache fed the same prefill then one-token appends."""
    n = prefill + 70
    k, v = _data(n, seed=prefill)
    graph, eager = FullCache(spec, capacity=256), FullCache(spec, capacity=256)
    graph.append(k[:, :, :prefill], v[:, :, :prefill])
    eager.append(k[:, :, :prefill], v[:, :, :prefill])
    for t in range(prefill, n):
        _step(graph, k, v, t)
        eager.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert len(graph) == len(eager) == t + 1
        _assert_same_storage(graph, eager, f"{spec} after token {t}")
    if "+hk" not in spec:  # no rotation: one append of everything stores the same bytes
        _assert_same_storage(graph, _fill(FullCache(spec, capacity=256), k, v, [n]), "one append")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keys(dtype) -> None:
    k, v = _data(200, d=128, dtype=dtype, seed=7)
    graph, eager = FullCache("k4-c64v4", capacity=200), FullCache("k4-c64v4", capacity=200)
    for c in (graph, eager):
        c.append(k[:, :, :70], v[:, :, :70])
    for t in range(70, 200):
        _step(graph, k, v, t)
        eager.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    _assert_same_storage(graph, eager, f"{dtype}")


@pytest.mark.parametrize("spec", ["k4-c64v4-g32", "k4-c64v4-g32+hk"])
def test_sliding_ring_of_blocks_takes_device_writes(spec) -> None:
    """A c64 sliding ring (a hybrid cache's body on a sliding layer) written by write_at
    past its wrap stores what one-token appends store."""
    k, v = _data(400, seed=2)
    graph, eager = _make(spec, True), _make(spec, True)
    for c in (graph, eager):
        c.append(k[:, :, :50], v[:, :, :50])
    for t in range(50, 400):
        _step(graph, k, v, t)
        eager.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert graph.ring_tokens > graph.ring, "the ring must have wrapped"
    for a, b in zip(graph.store.k.parts() + graph.store.v.parts(),
                    eager.store.k.parts() + eager.store.v.parts()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec", KEYS)
def test_appends_after_device_writes_continue_them(spec) -> None:
    """Prefill, write_at steps, an eager chunk that starts inside a block the device
    wrote, more steps, then a reset and a new prompt: eager appends of the same tokens."""
    k, v = _data(300, seed=3)
    graph, eager = FullCache(spec, capacity=300), FullCache(spec, capacity=300)
    plan = [("append", 0, 90), ("steps", 90, 130), ("append", 130, 171), ("steps", 171, 260)]
    for kind, lo, hi in plan:
        if kind == "append":
            graph.append(k[:, :, lo:hi], v[:, :, lo:hi])
        else:
            for t in range(lo, hi):
                _step(graph, k, v, t)
        for t0 in (range(lo, hi) if kind == "steps" else [lo]):
            t1 = t0 + 1 if kind == "steps" else hi
            eager.append(k[:, :, t0:t1], v[:, :, t0:t1])
        _assert_same_storage(graph, eager, f"{spec} after {kind} to {hi}")
    ring = graph.blocks.buf.data_ptr()
    graph.reset()
    eager.reset()
    k2, v2 = _data(150, seed=4)
    graph.append(k2[:, :, :40], v2[:, :, :40])
    eager.append(k2[:, :, :40], v2[:, :, :40])
    for t in range(40, 150):
        _step(graph, k2, v2, t)
        eager.append(k2[:, :, t:t + 1], v2[:, :, t:t + 1])
    _assert_same_storage(graph, eager, f"{spec} after a reset")
    assert graph.blocks.buf.data_ptr() == ring, "a captured graph writes the same ring"


@pytest.mark.parametrize("spec", ["k4-c64v4-g32", "k3-c64v4-g32+hk"])
@pytest.mark.parametrize("drop", [1, 37, 64, 100, HISTORY])
def test_trim_after_device_writes(spec, drop) -> None:
    """A `kvtax recall`-style trim after graph steps (question + answer dropped, `drop` tokens,
    up to the staged history) leaves the storage of a cache that never saw them, and
    the graph steps after it continue that cache."""
    n, more = 200 + HISTORY, 70
    k, v = _data(n + more, seed=drop)
    graph = FullCache(spec, capacity=n + more)
    graph.append(k[:, :, :150], v[:, :, :150])
    for t in range(150, n):
        _step(graph, k, v, t)
    assert graph.trim(drop) == drop
    keep = n - drop
    # chunked as the graph cache was (+hk: a rotation's rounding may depend on the rows)
    eager = _fill(FullCache(spec, capacity=n + more), k[:, :, :keep], v[:, :, :keep],
                  [150] + [1] * (keep - 150))
    _assert_same_storage(graph, eager, f"{spec} right after trimming {drop}")
    for i in range(more):  # the answer to the next question, at the trimmed positions
        graph.write_at(k[:, :, n + i:n + i + 1], v[:, :, n + i:n + i + 1],
                       torch.tensor([keep + i]))
        graph.advance(1)
        eager.append(k[:, :, n + i:n + i + 1], v[:, :, n + i:n + i + 1])
    _assert_same_storage(graph, eager, f"{spec} decoding on after trimming {drop}")


def test_trim_deeper_than_the_history_refuses_after_device_writes() -> None:
    """A warm-up write (no advance) may replace the oldest staged row: a trim that would
    need it refuses, one line, and changes nothing."""
    k, v = _data(600, seed=9)
    cache = FullCache("k4-c64v4-g32", capacity=600)
    cache.append(k[:, :, :100], v[:, :, :100])
    for t in range(100, 512):
        _step(cache, k, v, t)
    rows = cache.blocks.rows
    assert (512 - rows) % 64 == 0, "the oldest staged row starts a block"
    cache.write_at(k[:, :, 512:513], v[:, :, 512:513], torch.tensor([512]))  # warm-up
    before = [p.clone() for p in cache.store.k.parts()]
    with pytest.raises(CapacityError, match="re-quantize the last block"):
        cache.trim(HISTORY + 1)  # its last block starts at 512 - rows, the row replaced
    assert len(cache) == 512
    # bitwise: slots past the last block are torch.empty, and garbage may read as NaN
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(before, cache.store.k.parts()))
    assert cache.trim(HISTORY) == HISTORY


def test_write_at_refuses_before_storage_and_several_tokens() -> None:
    cache = FullCache("k4-c64v4-g32", capacity=128)
    k, v = _data(3)
    with pytest.raises(RuntimeError, match="append a prompt first"):
        cache.write_at(k[:, :, :1], v[:, :, :1], torch.tensor([0]))
    cache.append(k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="one token"):
        cache.write_at(k[:, :, 1:3], v[:, :, 1:3], torch.tensor([1]))
