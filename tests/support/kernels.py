"""Attention kernel test cases: random q and a cache view (`build`), a NaN-poisoned launch
checked against the float32 reference (`check`), the per-dtype tolerances and the online
softmax's rescaling cases. Kernels run interpreted on CPU (tests/conftest.py builds them).
"""

from __future__ import annotations

import torch

from kvtax.attention import attention_blockwise
from kvtax.attention.triton_api import triton_attention
from kvtax.attention.view import CacheView
from kvtax.cache import FullCache, SlidingCache
from tests.support.device import DEVICE, HAS_CUDA  # noqa: F401 (kernel tests read ke.HAS_CUDA)
from tests.support.tensors import assert_close


# (atol, rel RMS) against the float32 reference, by query dtype. fp16/bf16: the kernels
# round dequantized K/V tiles and the softmax weights P to the model dtype before each
# tl.dot (as every flash kernel does); bf16 keeps 8 mantissa bits, hence ~8x looser.
TOLERANCE = {
    torch.float16: (2e-2, 4e-3),
    torch.bfloat16: (8e-2, 2.5e-2),
    torch.float32: (2e-3, 5e-4),  # Triton's interpreter and GPU dot accumulate differently
}


def build(
    spec: str,
    *,
    d: int,
    h_kv: int,
    group: int,
    ctx: int,
    n_q: int,
    batch: int = 1,
    dtype: torch.dtype = torch.float16,
    window: int | None = None,
    sinks: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, CacheView]:
    """Fresh random q `[batch, h_kv*group, n_q, d]` and a cache view of `ctx` tokens.

    With `window` the cache is a SlidingCache fed in chunks of `n_q` (so its ring wraps
    once ctx exceeds sinks + window - 1 + n_q); the last chunk holds the queries' tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, h_kv, ctx, d, generator=gen)
    k[..., :2] *= 6.0  # outlier channels, as real keys have
    v = torch.randn(batch, h_kv, ctx, d, generator=gen)
    k, v = k.to(DEVICE, dtype), v.to(DEVICE, dtype)
    if window is None:
        cache = FullCache(spec)
        cache.append(k, v)
    else:
        cache = SlidingCache(spec, window=window, sinks=sinks, max_chunk=n_q)
        start = 0
        first = (ctx - n_q) % n_q or n_q  # chunks of n_q, the last one the queries'
        for end in [first, *range(first + n_q, ctx + 1, n_q)]:
            if end > start:
                cache.append(k[:, :, start:end], v[:, :, start:end])
            start = end
    q = torch.randn(batch, h_kv * group, n_q, d, generator=gen).to(DEVICE, dtype)
    return q, cache.view()


def check(
    q: torch.Tensor,
    view: CacheView,
    *,
    what: str,
    scale: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> torch.Tensor:
    """Run the kernels into a NaN-poisoned buffer and compare with the float32 reference."""
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    got = triton_attention(q, view, scale=scale, softcap=softcap, out=out, **kwargs)
    assert got.data_ptr() == out.data_ptr()
    ref = attention_blockwise(q.float(), view, scale=scale, softcap=softcap)
    atol, rel = TOLERANCE[q.dtype]
    assert_close(got.float(), ref, atol=atol, rel_rms=rel, what=what)
    return got


def rescale_case(grow: str, spec: str, *, ctx: int, d: int, seed: int = 7):
    """q [1, 4, 1, d] fp16 and a one-head FullCache view whose online softmax must rescale
    along the context (the decode kernels' rescaling tests):
    "scores": later keys align with q, so a row's max climbs far past 2^8;
    "values": V 1000x larger after slot 64 while the early keys score ln(1000) higher,
    so both parts carry a similar weight;
    "values-flat": V 1e5x larger after slot 64 under flat scores (P * s / t_v passes
    fp16's 65504 unless the V-scale reference follows)."""
    gen = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0.0, 1.0, ctx)[None, None, :, None]
    k = torch.randn(1, 1, ctx, d, generator=gen)
    v = torch.randn(1, 1, ctx, d, generator=gen)
    q = torch.randn(1, 4, 1, d, generator=gen)
    early = (torch.arange(ctx) < 64)[None, None, :, None]
    if grow == "scores":
        k, q = k + 4.0 * ramp, q * 0.1 + 0.7
    elif grow == "values":  # q . k / sqrt(d) = ln(1000) for the early keys
        v = v * torch.where(early, 1e-3, 1.0)
        k = 0.1 * k + torch.where(early, 2.0 * 6.907755 / d**0.5, 0.0)
        q = torch.full_like(q, 0.5)
    else:
        v = v * torch.where(early, 1e-5, 1.0)
        k, q = 0.01 * k, torch.full_like(q, 0.5)
    cache = FullCache(spec)
    cache.append(k.to(DEVICE, torch.float16), v.to(DEVICE, torch.float16))
    return q.to(DEVICE, torch.float16), cache.view()
