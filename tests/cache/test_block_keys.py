"""Caches holding int4-c64 keys (per channel over 64-token blocks; int4w-c64's too): storage
is a pure function of the tokens held, whatever the chunking or trimming; exact bytes;
refusals."""

from __future__ import annotations

import pytest
import torch

from kvtax.cache import FullCache, SlidingCache
from kvtax.cache.blocks import HISTORY
from kvtax.cache.hybrid import HybridCache
from kvtax.errors import CapacityError, FormatError
from kvtax.formats import ChannelBlockFormat, KVSpec, WidestBitFormat
from tests.support.tensors import rand_kv

SPEC = "k4-c64v4-g32"


def _blocks(k: torch.Tensor, fmt=ChannelBlockFormat()):
    """Keys `[B, H, n, D]` quantized the direct way: whole blocks, the last padded with its
    last token."""
    pad = -k.shape[2] % 64
    x = torch.cat([k, k[:, :, -1:].expand(-1, -1, pad, -1)], dim=2) if pad else k
    return fmt.quantize(x)


def _fill(cache, k, v, chunks):
    start = 0
    for t in chunks:
        cache.append(k[:, :, start:start + t], v[:, :, start:start + t])
        start += t
    assert start == k.shape[2]
    return cache


def _chunks(n: int, size: int) -> list[int]:
    return [min(size, n - s) for s in range(0, n, size)]


def _rows(cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Key parts over the blocks written and value parts over the slots held."""
    s, held = cache.store, cache.view().num_slots
    kb = -(-held // 64) * 64
    return ([p[:, :, :kb] for p in s.k.parts()], [p[:, :, :held] for p in s.v.parts()])


def _assert_same_storage(a, b, what: str) -> None:
    (ka, va), (kb, vb) = _rows(a), _rows(b)
    for x, y in zip(ka + va, kb + vb):
        assert torch.equal(x, y), what


@pytest.mark.parametrize("spec", [SPEC, "k4w-c64v4-g32"])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_full_cache_equals_direct_block_quantization_for_any_chunking(spec, n, d) -> None:
    """1-token appends, one append and odd chunks (7, 100, 130) store the same bytes, and
    those are the direct quantization of the whole sequence (int4w-c64: every block in the
    channel order of the whole block 0, chosen afresh while block 0 fills)."""
    gen = torch.Generator().manual_seed(n + d)
    k = rand_kv((2, 3, n, d), outliers=3, gen=gen)
    v = rand_kv((2, 3, n, d), gen=gen)
    ref = _fill(FullCache(spec), k, v, [n])
    want = _blocks(k, KVSpec.parse(spec).key)
    for got, exp in zip(ref.store.k.parts(), want.parts()):
        assert torch.equal(got[:, :, :exp.shape[2]], exp)
    vq = KVSpec.parse(spec).value.quantize(v)
    for got, exp in zip(ref.store.v.parts(), vq.parts()):
        assert torch.equal(got[:, :, :n], exp)
    for size in (1, 7, 100, 130):
        other = _fill(FullCache(spec), k, v, _chunks(n, size))
        _assert_same_storage(other, ref, f"chunks of {size}")


@pytest.mark.parametrize("spec", [SPEC, "k4w-c64v4-g32"])
def test_an_empty_first_append_changes_nothing(spec) -> None:
    """transformers appends zero tokens before the prompt (a warm-up); int4w-c64 then had
    no block 0 to choose its channel order from and raised."""
    gen = torch.Generator().manual_seed(8)
    k = rand_kv((1, 2, 150, 64), outliers=3, gen=gen)
    v = rand_kv((1, 2, 150, 64), gen=gen)
    cache = FullCache(spec)
    cache.append(k[:, :, :0], v[:, :, :0])
    assert len(cache) == 0
    _assert_same_storage(_fill(cache, k, v, [150]), _fill(FullCache(spec), k, v, [150]),
                         "after an empty first append")


def test_widest_trim_into_block_0_chooses_its_channels_again() -> None:
    """int4w-c64's channel order comes from block 0: a trim into block 0 then other tokens
    store what a cache fed only the kept and new tokens stores, later blocks included."""
    gen = torch.Generator().manual_seed(9)
    k = rand_kv((1, 2, 300, 64), outliers=3, gen=gen)
    v = rand_kv((1, 2, 300, 64), gen=gen)
    spec = "k4w-c64v4-g32"
    cache = _fill(FullCache(spec), k[:, :, :60], v[:, :, :60], [60])
    assert cache.trim(20) == 20
    k2, v2 = k[:, :, 100:300], v[:, :, 100:300]
    cache.append(k2, v2)
    keep = torch.cat([torch.arange(40), torch.arange(100, 300)])
    fresh = _fill(FullCache(spec), k[:, :, keep], v[:, :, keep], [240])
    _assert_same_storage(cache, fresh, "after a trim into block 0")
    fmt = WidestBitFormat()
    assert not torch.equal(fmt.order_of(cache.store.k),
                           fmt.order_of(_fill(FullCache(spec), k[:, :, :64], v[:, :, :64],
                                              [64]).store.k))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_and_growth_keep_blocks(dtype) -> None:
    """Scales stored in the model dtype; growth (256 → 512 slots) copies the open block."""
    gen = torch.Generator().manual_seed(3)
    k = rand_kv((1, 2, 400, 64), outliers=2, gen=gen, dtype=dtype)
    v = rand_kv((1, 2, 400, 64), gen=gen, dtype=dtype)
    grown = _fill(FullCache(SPEC), k, v, [250, 1, 1, 148])
    assert grown.growth_events == 1 and grown.store.k.scales.dtype == dtype
    fixed = _fill(FullCache(SPEC, capacity=400), k, v, [400])
    _assert_same_storage(grown, fixed, "grown vs preallocated")


def test_trim_requantizes_the_last_block_as_if_never_appended() -> None:
    """Trimming a question + answer leaves exactly the storage of a cache that never saw
    them, and the next appends continue it; a trim deeper than the staged history raises,
    one line, and changes nothing."""
    gen = torch.Generator().manual_seed(5)
    n, extra = 400, 41
    k = rand_kv((1, 2, n + 2 * extra, 64), outliers=3, gen=gen)
    v = rand_kv((1, 2, n + 2 * extra, 64), gen=gen)
    keep = torch.cat([torch.arange(n), torch.arange(n + extra, n + 2 * extra)])
    trimmed = _fill(FullCache(SPEC), k[:, :, :n + extra], v[:, :, :n + extra], [100, 130, 170, 41])
    assert trimmed.trim(extra) == extra and len(trimmed) == n
    _assert_same_storage(trimmed, _fill(FullCache(SPEC), k[:, :, :n], v[:, :, :n], [n]),
                         "right after the trim")
    for t in range(n + extra, n + 2 * extra):
        trimmed.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
    fresh = _fill(FullCache(SPEC), k[:, :, keep], v[:, :, keep], [n + extra])
    _assert_same_storage(trimmed, fresh, "decoding on after the trim")
    before = [p.clone() for p in _rows(trimmed)[0]]
    with pytest.raises(CapacityError, match="re-quantize the last block"):
        trimmed.trim(HISTORY + 64)
    assert len(trimmed) == n + extra
    assert all(torch.equal(a, b) for a, b in zip(before, _rows(trimmed)[0]))
    assert trimmed.trim(HISTORY) == HISTORY  # the staged history reaches this far
    cut = 64  # below the staged keys, but a whole-block cut needs no re-quantization
    assert trimmed.blocks.start > cut
    assert trimmed.trim(len(trimmed) - cut) and len(trimmed) == cut
    trimmed.append(k[:, :, cut:cut + 70], v[:, :, cut:cut + 70])
    _assert_same_storage(trimmed, _fill(FullCache(SPEC), k[:, :, :cut + 70],
                                        v[:, :, :cut + 70], [cut + 70]), "after a block cut")
    assert trimmed.trim(len(trimmed)) and len(trimmed) == 0


@pytest.mark.parametrize("window,max_chunk,chunks", [
    pytest.param(100, 1, [1] * 260, id="W100-decode"),
    pytest.param(100, 130, [130, 7, 100, 1, 64, 130, 41], id="W100-odd-chunks"),
    pytest.param(512, 64, [64] * 12, id="W512-gemma"),
])
def test_sliding_ring_of_blocks_wraps_whole(window, max_chunk, chunks) -> None:
    """A ring of whole blocks: every held token reads back as the direct block
    quantization of the last blocks, after wrapping, for any chunking."""
    n = sum(chunks)
    gen = torch.Generator().manual_seed(n)
    k = rand_kv((1, 2, n, 64), outliers=3, gen=gen)
    v = rand_kv((1, 2, n, 64), gen=gen)
    cache = _fill(SlidingCache(SPEC, window=window, max_chunk=max_chunk), k, v, chunks)
    assert cache.ring % 64 == 0 and cache.ring >= window - 1 + max_chunk + 63
    assert cache.ring_tokens > cache.ring, "the ring must have wrapped"
    view = cache.view()
    pos = view.slot_positions()
    visible = pos > n - 1 - window
    got = view.spec.key.read_index(view.k, torch.arange(pos.numel()))[:, :, visible]
    want = ChannelBlockFormat().dequantize(_blocks(k))[:, :, pos[visible]]
    assert torch.equal(got, want)
    one = _fill(SlidingCache(SPEC, window=window, max_chunk=max_chunk), k, v, [1] * n)
    _assert_same_storage(cache, one, "chunked vs one token at a time")


def test_sliding_ring_growth_moves_whole_blocks() -> None:
    """A growable ring re-laid out for a longer chunk keeps each block's codes with its
    metadata: the keys read back equal a ring fixed large enough from the start."""
    gen = torch.Generator().manual_seed(8)
    chunks = [70, 1, 1, 90, 200, 1, 150]
    n = sum(chunks)
    k = rand_kv((1, 1, n, 128), outliers=2, gen=gen)
    v = rand_kv((1, 1, n, 128), gen=gen)
    grown = SlidingCache(SPEC, window=120)
    start = 0
    for t in chunks:
        grown.append(k[:, :, start:start + t], v[:, :, start:start + t])
        start += t
        ring = grown.view()
        pos = ring.slot_positions()
        seen = pos > start - 1 - 120
        got = ring.spec.key.read_index(ring.k, torch.arange(pos.numel()))[:, :, seen]
        want = ChannelBlockFormat().dequantize(_blocks(k[:, :, :start]))[:, :, pos[seen]]
        assert torch.equal(got, want), f"after {start} tokens"
    assert grown.growth_events >= 2


def test_bytes_are_exact_and_staging_counted() -> None:
    gen = torch.Generator().manual_seed(4)
    k, v = rand_kv((2, 3, 1000, 128), gen=gen), rand_kv((2, 3, 1000, 128), gen=gen)
    spec = KVSpec.parse(SPEC)
    cache = _fill(FullCache(SPEC, capacity=1000), k, v, [999, 1])
    per = spec.bytes_per_token(128, torch.float32)
    assert cache.used_nbytes == per * 6 * 1000
    assert cache.store.slots == 1024  # whole blocks, not ALIGN's 16
    staged = cache.blocks.buf.nbytes  # a ring of the history and one block, fixed
    assert staged == (HISTORY + 64) * 6 * 128 * 4
    assert cache.nbytes == per * 6 * 1024 + staged
    hybrid = _fill(HybridCache(f"{SPEC}@s4r128"), k, v, [1000])
    fp16_tokens = 4 + 128
    assert hybrid.used_nbytes == 6 * (1000 * per + fp16_tokens * 128 * 2 * 2)


def test_no_fused_store_kernel(monkeypatch) -> None:
    """int4-c64 keys never reach the fused store kernel (it has no such format), even
    when asked for it, on append or on a write at a device position."""
    from kvtax.formats import store_triton

    def boom(*a, **kw):
        raise AssertionError("the fused store kernel was called for int4-c64 keys")

    monkeypatch.setattr(store_triton, "quantize_store", boom)
    monkeypatch.setattr(store_triton, "unsupported_reason", lambda *a, **kw: None)
    cache = FullCache(SPEC, capacity=128)
    cache.fused_store = True
    k = rand_kv((1, 1, 70, 64))
    cache.append(k, k)
    assert torch.equal(cache.store.k.codes[:, :, :128], _blocks(k).codes)
    assert cache.device_write_blocker() is None
    one = rand_kv((1, 1, 1, 64))
    cache.write_at(one, one, torch.tensor([70]))
    cache.advance(1)
    assert torch.equal(cache.store.k.codes[:, :, :128],
                       _blocks(torch.cat([k, one], dim=2)).codes)


def test_refusals() -> None:
    k = rand_kv((1, 1, 10, 64))
    with pytest.raises(FormatError, match="key format"):
        FullCache("int4-c64").append(k, k)  # values per channel: refused
    with pytest.raises(FormatError, match="sinks must be a multiple"):
        SlidingCache(SPEC, window=100, sinks=4)
    with pytest.raises(FormatError, match="not a multiple of 64"):
        FullCache(SPEC).append(rand_kv((1, 1, 10, 96)), rand_kv((1, 1, 10, 96)))
    assert SlidingCache(SPEC, window=100, sinks=64).ring % 64 == 0
