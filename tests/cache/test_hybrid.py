"""Hybrid caches (fp16 sinks + recent window, quantized body): exact against the per-query
dequantized concatenation, whatever the chunking; LSE attention and merge on their own."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvtax.attention import attention
from kvtax.attention.reference import attention_naive
from kvtax.attention.lse import attention_lse, merge_lse
from kvtax.cache import FullCache, make_caches
from kvtax.cache.hybrid import HybridCache
from kvtax.errors import CapacityError, FormatError
from kvtax.formats import KVSpec, rotate
from kvtax.formats.hybrid import HybridSpec, parse_kv
from tests.support.tensors import assert_close, rand_kv


def _roundtrip(x: torch.Tensor, fmt, rotated: bool) -> torch.Tensor:
    """What attention reads for a stored row, back in the model's (un-rotated) domain."""
    y = rotate(x) if rotated else x
    y = fmt.dequantize(fmt.quantize(y))
    return rotate(y) if rotated else y


def _expected(q, k, v, spec: HybridSpec, window, softcap=None) -> torch.Tensor:
    """Per query: keys fp16 where exempt (sink / recent), dequantized body elsewhere;
    float64 softmax over exactly the keys the layer may see."""
    b, hq, n_q, d = q.shape
    n, hkv = k.shape[2], k.shape[1]
    base = spec.base
    kq = _roundtrip(k, base.key, base.rotate_keys).double()
    vq = _roundtrip(v, base.value, base.rotate_values).double()
    ex = spec.exempt  # fp16, or int8 under an `i8` suffix
    if ex.is_quantized:
        k16 = _roundtrip(k, ex.key, ex.rotate_keys).double()
        v16 = _roundtrip(v, ex.value, ex.rotate_values).double()
    else:
        k16, v16 = k.half().double(), v.half().double()
    sinks = spec.sinks if window is None else 0
    recent = spec.recent if window is None else min(spec.recent, window)
    out = torch.zeros(b, hq, n_q, d, dtype=torch.float64)
    for i in range(n_q):
        p = n - n_q + i
        kpos = torch.arange(n)
        seen = kpos <= p
        if window is not None:
            seen &= p - kpos < window
        exempt = (kpos < sinks) | (p - kpos < recent)
        kk = torch.where(exempt[None, None, :, None], k16, kq)[:, :, seen]
        vv = torch.where(exempt[None, None, :, None], v16, vq)[:, :, seen]
        kk = kk.repeat_interleave(hq // hkv, dim=1)
        vv = vv.repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("bhd,bhtd->bht", q[:, :, i].double(), kk) / math.sqrt(d)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[:, :, i] = torch.einsum("bht,bhtd->bhd", torch.softmax(s, -1), vv)
    return out


CASES = [
    pytest.param("int4+hk@s4r16", None, [97], id="int4+hk-s4r16-full-1chunk"),
    pytest.param("int4@s4r16", None, [5, 40, 1, 51], id="int4-s4r16-full-chunked"),
    pytest.param("int4+hkv@r33", None, [64, 36, 1], id="int4+hkv-r33-full"),
    pytest.param("k8v4@s7", None, [30, 70], id="k8v4-sinks-only"),
    pytest.param("int4-g32@s2r8", 24, [60, 1, 40], id="int4g32-s2r8-window24"),
    pytest.param("int4@r40", 24, [50, 50], id="int4-recent-past-window"),
    pytest.param("int4+hk@s4r16i8", None, [5, 40, 1, 51], id="int4+hk-s4r16-int8-exempt"),
    pytest.param("int4-g32@r8i8", 24, [60, 1, 40], id="int4g32-r8-int8-exempt-window24"),
]


@pytest.mark.parametrize("name,window,chunks", CASES)
def test_hybrid_matches_per_query_concatenation(name, window, chunks) -> None:
    gen = torch.Generator().manual_seed(sum(chunks))
    n, d = sum(chunks), 64
    k = rand_kv((1, 2, n, d), outliers=3, gen=gen)
    v = rand_kv((1, 2, n, d), gen=gen)
    q = rand_kv((1, 6, n, d), gen=gen)
    spec = parse_kv(name)
    cache = HybridCache(spec, window=window)
    start = 0
    for t in chunks:  # every chunk's queries, right after its K/V were appended
        cache.append(k[:, :, start:start + t], v[:, :, start:start + t])
        start += t
        got = attention(q[:, :, start - t:start], cache.view())
        want = _expected(q[:, :, :start], k[:, :, :start], v[:, :, :start], spec, window)
        assert_close(got, want[:, :, start - t:start].float(), atol=2e-5, rel_rms=2e-6,
                     what=f"{name} after {start} tokens")
    assert cache.length == n


def test_softcap_and_limits_against_plain_caches() -> None:
    """No exempt tokens = the plain quantized cache; an all-covering recent window = fp16."""
    gen = torch.Generator().manual_seed(11)
    k, v = rand_kv((2, 1, 80, 64), gen=gen), rand_kv((2, 1, 80, 64), gen=gen)
    q = rand_kv((2, 4, 9, 64), gen=gen)
    plain, fp16 = FullCache("int4"), FullCache("fp16")
    wide = HybridCache("int4@r80")
    for c in (plain, fp16, wide):
        c.append(k, v)
    want_wide = attention_naive(q, fp16.view(), softcap=5.0)
    assert_close(attention(q, wide.view(), softcap=5.0), want_wide, atol=1e-5,
                 rel_rms=1e-6, what="recent covers everything")
    got, lse = attention_lse(q, plain.view(), softcap=5.0)
    assert_close(got, attention_naive(q, plain.view(), softcap=5.0), atol=1e-5, rel_rms=1e-6)
    assert torch.isfinite(lse).all()
    spec = parse_kv("int4@s3r5")
    cache = HybridCache(spec)
    cache.append(k, v)
    assert_close(attention(q, cache.view(), softcap=5.0),
                 _expected(q, k, v, spec, None, softcap=5.0).float(), atol=2e-5, rel_rms=2e-6)


def test_merge_lse_splits_exactly_and_handles_empty_parts() -> None:
    """Near keys (p - k < 10, a window) and far keys (min_distance 10) partition the keys:
    their merge is the whole attention, and the whole LSE is logsumexp of the scores."""
    gen = torch.Generator().manual_seed(5)
    k, v = rand_kv((1, 2, 70, 64), gen=gen), rand_kv((1, 2, 70, 64), gen=gen)
    q = rand_kv((1, 2, 3, 64), gen=gen)
    cache = FullCache("fp32")
    cache.append(k, v)
    whole, lse_whole = attention_lse(q, cache.view())
    near = attention_lse(q, dataclasses.replace(cache.view(), window=10))
    far = attention_lse(q, cache.view(), min_distance=10)
    none = attention_lse(q, cache.view(), min_key=70)  # no key at position >= 70
    assert torch.isinf(none[1]).all() and (none[0] == 0).all()
    out, lse = merge_lse([far, none, near])
    assert_close(out, whole, atol=1e-5, rel_rms=1e-6)
    assert torch.allclose(lse, lse_whole, atol=1e-5)
    scores = torch.einsum("bhld,bhtd->bhlt", q, k) / 8.0
    causal = torch.arange(70)[None, :] <= torch.arange(67, 70)[:, None]
    ref = torch.logsumexp(scores.masked_fill(~causal, -math.inf), -1)
    assert torch.allclose(lse_whole, ref, atol=1e-4)
    assert_close(whole, attention_naive(q, cache.view()), atol=1e-5, rel_rms=1e-6)
    with pytest.raises(ValueError):
        merge_lse([])


def test_bytes_trim_reset_and_layers() -> None:
    gen = torch.Generator().manual_seed(2)
    k, v = rand_kv((1, 3, 300, 64), gen=gen), rand_kv((1, 3, 300, 64), gen=gen)
    spec = parse_kv("int4@s4r32")
    cache = HybridCache(spec, max_chunk=300)
    cache.append(k, v)
    body = FullCache("int4")
    body.append(k, v)
    assert cache.used_nbytes == body.used_nbytes + 3 * 36 * 256  # + (4 + 32) fp16 tokens
    assert cache.nbytes > cache.used_nbytes  # the ring holds a prefill chunk's worth
    assert cache.nbytes >= cache.used_nbytes and len(cache) == 300
    assert spec.bytes_for(300, 64) // 3 > 0
    assert spec.bytes_for(300, 64) == 300 * spec.base.bytes_per_token(64) + 36 * 256
    caches = make_caches([None, 512, 16], "int4+hk@s4r64")
    assert caches[0].body is not None and caches[1].sinks == 0 and caches[2].body is None
    cache.reset()
    assert len(cache) == 0


def test_int8_exempt_fits_head_dim_96() -> None:
    """An `i8` part is int8 named without a group: at head_dim 96 it takes int8-g32, as
    the name "int8" does in a plain cache, and the spec still says `i8`."""
    spec = parse_kv("int4-g32@s2r8i8")
    spec.check(96)
    gen = torch.Generator().manual_seed(5)
    k, v, q = (rand_kv(s, gen=gen) for s in ((1, 2, 40, 96), (1, 2, 40, 96), (1, 4, 40, 96)))
    cache = HybridCache(spec)
    cache.append(k, v)
    assert cache.fp.spec.name == "int8-g32" and cache.spec.name == "int4-g32@s2r8i8"
    assert cache.used_nbytes == 2 * (40 * spec.base.bytes_per_token(96, torch.float32)
                                     + 10 * KVSpec.parse("int8-g32").bytes_per_token(
                                         96, torch.float32))
    want = _expected(q, k, v, dataclasses.replace(spec, exempt=cache.fp.spec), None)
    assert_close(attention(q, cache.view()), want.float(), atol=2e-5, rel_rms=2e-6)


def test_parse_errors() -> None:
    assert parse_kv("int4+HK@S4R128").name == "int4+hk@s4r128"
    assert parse_kv("int8").name == "int8"
    spec = parse_kv("int4+hk@S4R64I8")  # `i8`: sinks and recent tokens in int8, not fp16
    assert spec.name == "int4+hk@s4r64i8" and spec.exempt.name == "int8"
    assert parse_kv(spec.name) == spec and parse_kv("int4@s4r64").exempt.name == "fp16"
    assert spec.bytes_for(300, 64) == 300 * spec.base.bytes_per_token(64) + 68 * (
        parse_kv("int8").bytes_per_token(64))
    for bad in ("int4@", "int4@q5", "fp16@s4", "int2@s4", "int4@i8", "int4@s4i4", "fp16@r4i8"):
        with pytest.raises(FormatError):
            parse_kv(bad)
    with pytest.raises(ValueError):
        HybridCache("int4")


def test_trim_after_the_ring_wrapped_equals_a_fresh_cache() -> None:
    """A recall session drops a question + answer after the fp16 ring wrapped; the next
    tokens must see exactly what a cache that never held the dropped ones sees."""
    gen = torch.Generator().manual_seed(9)
    n, extra = 300, 32  # the most a 47-slot ring can drop: 32 + 16 recent - 1 = 47
    k, v = rand_kv((1, 2, n + 2 * extra, 64), gen=gen), rand_kv((1, 2, n + 2 * extra, 64), gen=gen)
    q = rand_kv((1, 4, extra, 64), gen=gen)
    keep = torch.cat([torch.arange(n), torch.arange(n + extra, n + 2 * extra)])
    kf, vf = k[:, :, keep], v[:, :, keep]
    trimmed = HybridCache("int4+hk@s4r16", max_chunk=32)
    fresh = HybridCache("int4+hk@s4r16")
    for s in range(0, n, 32):
        trimmed.append(k[:, :, s:min(s + 32, n)], v[:, :, s:min(s + 32, n)])
    trimmed.append(k[:, :, n:n + extra], v[:, :, n:n + extra])  # the question to drop
    assert trimmed.fp.ring_tokens > trimmed.fp.ring, "the ring must have wrapped"
    assert trimmed.trim(extra) == extra and len(trimmed) == n
    for t in range(extra):  # decode the next tokens one by one
        at = n + extra + t
        trimmed.append(k[:, :, at:at + 1], v[:, :, at:at + 1])
    fresh.append(kf, vf)
    got = attention(q, trimmed.view())
    assert_close(got, attention(q, fresh.view()), atol=1e-6, rel_rms=1e-6)
    with pytest.raises(CapacityError):
        trimmed.trim(33)  # 33 + 16 - 1 > 47 ring slots: the ring no longer holds them


def test_attention_routes_a_hybrid_view_by_type() -> None:
    """`attention(q, hybrid_view)` is the LSE merge of its parts (the plain-view entry point
    serves hybrid caches); impl="reference" is the same call, and what the merge cannot
    serve (non-causal, padding, forced kernels on CPU) is refused, not approximated."""
    gen = torch.Generator().manual_seed(7)
    k, v = rand_kv((1, 2, 90, 64), gen=gen), rand_kv((1, 2, 90, 64), gen=gen)
    q = rand_kv((1, 4, 3, 64), gen=gen)
    cache = HybridCache("int4+hk@s4r16")
    cache.append(k, v)
    view = cache.view()
    want = merge_lse([attention_lse(q, p.view, min_distance=p.min_distance,
                                    min_key=p.min_key) for p in view.parts])[0]
    assert_close(attention(q, view), want.to(q.dtype), atol=1e-6, rel_rms=1e-6)
    assert_close(attention(q, view, impl="reference"), want.to(q.dtype), atol=1e-6,
                 rel_rms=1e-6)
    with pytest.raises(ValueError, match="causal"):
        attention(q, view, causal=False)
    with pytest.raises(RuntimeError, match="cannot run"):
        attention(q, view, impl="triton")
