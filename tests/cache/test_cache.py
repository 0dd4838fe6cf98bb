"""Caches: growth, the seeds' resize boundaries, exact bytes, sliding windows, bad input."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvtax.attention.reference import attention_naive
from kvtax.cache import FullCache, SlidingCache, make_caches
from kvtax.errors import CapacityError, FormatError, NonFiniteError, ShapeError
from kvtax.formats import KVSpec
from tests.support.tensors import assert_close, rand_kv


def _stored(cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, K, V) of everything a cache holds, dequantized, in logical order."""
    view = cache.view()
    order = view.logical_order()
    k = view.spec.key.dequantize(view.k.index_tokens(order))
    v = view.spec.value.dequantize(view.v.index_tokens(order))
    return view.slot_positions()[order], k, v


def _round_trip(spec: KVSpec, k: torch.Tensor, v: torch.Tensor):
    return spec.key.dequantize(spec.key.quantize(k)), spec.value.dequantize(spec.value.quantize(v))


@pytest.mark.parametrize("prompt", [255, 256, 257, 8191, 8192, 8193])
@pytest.mark.parametrize("spec", ["fp16", "int4"])
def test_seed_boundaries_prefill_then_decode(prompt: int, spec: str) -> None:
    """Prompts around the 256/8192 growth boundaries, then a decode window crossing one.

    mlx-lm grew by 256 per resize; the seeds' decode peaks moved with whether the decode
    window straddled a boundary. Contents must equal the per-token round trip, and the
    growth counter must say whether a growth happened inside the window.
    """
    cache = FullCache(spec)
    chunk, decode = 2048, 300
    k, v = rand_kv((1, 2, prompt + decode, 64)), rand_kv((1, 2, prompt + decode, 64))
    k, v = k.half(), v.half()
    for s in range(0, prompt, chunk):
        e = min(prompt, s + chunk)
        cache.append(k[:, :, s:e], v[:, :, s:e])
    cap_before, grow_before = cache.capacity, cache.growth_events
    for t in range(prompt, prompt + decode):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    crossed = prompt + decode > cap_before
    assert (cache.growth_events > grow_before) == crossed
    assert cache.growth_events <= math.ceil(math.log2((prompt + decode) / 256)) + 1
    pos, k_hat, v_hat = _stored(cache)
    k_ref, v_ref = _round_trip(cache.spec, k, v)
    assert torch.equal(pos, torch.arange(prompt + decode))
    assert torch.equal(k_hat, k_ref) and torch.equal(v_hat, v_ref)


def test_geometric_growth_is_logarithmic() -> None:
    cache = FullCache("int8")
    x = torch.randn(1, 1, 64, 64)
    for _ in range(1024):  # 65536 tokens in 64-token chunks
        cache.append(x, x)
    assert cache.length == 65536
    assert cache.growth_events == 8  # 256 → 512 → … → 65536


def test_presized_cache_never_moves_and_refuses_overflow() -> None:
    cache = FullCache("int4", capacity=300)
    x = torch.randn(2, 2, 100, 64)
    for _ in range(3):
        cache.append(x, x)
    ptr = cache.view().k.codes.data_ptr()
    assert cache.growth_events == 0 and cache.capacity == 300
    with pytest.raises(CapacityError, match="fixed at 300 tokens"):
        cache.append(x[:, :, :1], x[:, :, :1])
    assert cache.length == 300 and cache.view().k.codes.data_ptr() == ptr


@pytest.mark.parametrize("spec", ["fp16", "int8", "int4-g32", "fp8", "k8v4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_nbytes_is_exact(spec: str, dtype: torch.dtype) -> None:
    """nbytes counts the slots allocated: capacity rounded up to storage.ALIGN (1000 →
    1008), so every per-head stride of the scale tensors divides by 16 (wide kernel loads);
    capacity, what the cache accepts, stays as asked."""
    from kvtax.cache.storage import ALIGN, round_up

    cache = FullCache(spec, capacity=1000)
    x = torch.randn(3, 4, 777, 128).to(dtype)
    cache.append(x, x)
    per = KVSpec.parse(spec).bytes_per_token(128, dtype)
    assert cache.capacity == 1000 and round_up(1000, ALIGN) == 1008
    assert cache.nbytes == 3 * 4 * 1008 * per
    for t in cache.view().k.parts() + cache.view().v.parts():
        assert all(s % 16 == 0 for s in t.stride()[:2])
    assert cache.used_nbytes == 3 * 4 * 777 * per
    view = cache.view()
    assert view.k.nbytes + view.v.nbytes == cache.nbytes


def test_trim_and_reset() -> None:
    cache = FullCache("int8")
    k, v = torch.randn(1, 2, 50, 64), torch.randn(1, 2, 50, 64)
    cache.append(k, v)
    assert cache.trim(20) == 20 and len(cache) == 30
    cache.append(k[:, :, 30:], v[:, :, 30:])
    _, k_hat, _ = _stored(cache)
    assert torch.equal(k_hat, _round_trip(cache.spec, k, v)[0])
    assert cache.trim(1000) == 50 and len(cache) == 0
    cache.append(k, v)
    cache.reset()
    assert len(cache) == 0 and cache.nbytes > 0  # storage kept for the next prompt


@pytest.mark.parametrize("spec", ["fp16", "int8", "int4", "fp8"])
@pytest.mark.parametrize(
    "window,sinks,chunks",
    [(16, 0, [1] * 40), (16, 4, [7] * 10), (32, 2, [50, 1, 1, 30, 1]), (5, 3, [2, 2, 9, 1, 1])],
    ids=["decode-wrap", "chunks7-sinks4", "big-chunk-regrow", "tiny-window"],
)
def test_sliding_holds_the_window_in_order(spec, window, sinks, chunks) -> None:
    """After wrap-around the view yields the sinks then the newest tokens, in order."""
    total = sum(chunks)
    k, v = rand_kv((2, 2, total, 64)), rand_kv((2, 2, total, 64))
    cache = SlidingCache(spec, window=window, sinks=sinks)
    p = 0
    for n in chunks:
        cache.append(k[:, :, p : p + n], v[:, :, p : p + n])
        p += n
        pos, k_hat, _ = _stored(cache)
        expected = [i for i in range(min(p, sinks))]
        expected += list(range(max(sinks, p - (cache.ring)), p))
        assert pos.tolist() == expected
        k_ref, _ = _round_trip(cache.spec, k[:, :, pos], v[:, :, pos])
        assert torch.equal(k_hat, k_ref)
        # The last chunk's queries all see their full window.
        assert cache.ring >= window - 1 + n


@pytest.mark.parametrize("spec", ["fp16", "int4"])
def test_sliding_attention_equals_windowed_full_cache(spec: str) -> None:
    """Chunked prefill + decode through a quantized ring ≡ a full cache with a window mask."""
    window, sinks, total = 24, 2, 120
    k, v = rand_kv((1, 2, total, 64)), rand_kv((1, 2, total, 64))
    q = rand_kv((1, 4, total, 64))
    ring, full = SlidingCache(spec, window=window, sinks=sinks), FullCache(spec)
    p = 0
    for n in [33, 40, 1, 1, 1, 20, 24]:
        ring.append(k[:, :, p : p + n], v[:, :, p : p + n])
        full.append(k[:, :, p : p + n], v[:, :, p : p + n])
        p += n
        full_view = dataclasses.replace(full.view(), window=window, sinks=sinks)
        qc = q[:, :, p - n : p]
        assert_close(
            attention_naive(qc, ring.view()), attention_naive(qc, full_view),
            atol=1e-5, rel_rms=1e-6, what=f"after {p} tokens",
        )


def test_sliding_fixed_chunk_and_trim_rules() -> None:
    cache = SlidingCache("int8", window=8, max_chunk=4)
    x = torch.randn(1, 1, 5, 64)
    with pytest.raises(CapacityError, match="max_chunk"):
        cache.append(x, x)
    cache.append(x[:, :, :4], x[:, :, :4])
    assert cache.trim(2) == 2  # not wrapped yet: allowed
    for _ in range(4):
        cache.append(x[:, :, :4], x[:, :, :4])
    with pytest.raises(CapacityError, match="after its ring wrapped"):
        cache.trim(1)


def test_make_caches_per_layer_formats() -> None:
    caches = make_caches(
        [512, 512, None, 512, None], "int4", sliding_spec="fp16", overrides={4: "int8"}
    )
    kinds = [(type(c).__name__, c.spec.name) for c in caches]
    assert kinds == [
        ("SlidingCache", "fp16"),
        ("SlidingCache", "fp16"),
        ("FullCache", "int4"),
        ("SlidingCache", "fp16"),
        ("FullCache", "int8"),
    ]
    assert caches[0].window == 512
    with pytest.raises(FormatError, match="outside"):  # bad input: the CLI's one line, exit 2
        make_caches([None], "int8", overrides={3: "fp16"})


def test_append_rejects_bad_input() -> None:
    cache = FullCache("int8")
    with pytest.raises(ShapeError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        cache.append(torch.randn(2, 10, 64), torch.randn(2, 10, 64))
    with pytest.raises(ShapeError, match="differ"):
        cache.append(torch.randn(1, 2, 10, 64), torch.randn(1, 2, 11, 64))
    cache.append(torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64))
    with pytest.raises(ShapeError, match="kv_heads"):
        cache.append(torch.randn(1, 4, 1, 64), torch.randn(1, 4, 1, 64))
    with pytest.raises(ShapeError, match="holds torch.float32"):
        cache.append(torch.randn(1, 2, 1, 64).half(), torch.randn(1, 2, 1, 64).half())
    bad = torch.randn(1, 2, 3, 64)
    bad[0, 1, 2, 5] = math.nan
    with pytest.raises(NonFiniteError):
        cache.append(bad, bad)
    assert len(cache) == 10, "a rejected append must not change the cache"
    with pytest.raises(RuntimeError, match="empty"):
        FullCache("fp16").view()
    with pytest.raises(ValueError):
        FullCache("int8", capacity=0)
    with pytest.raises(ValueError):
        SlidingCache("int8", window=0)
