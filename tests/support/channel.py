"""int4-c64 / int3-c64 / int4w-c64 key caches built by hand for the kernel tests: K
quantized per channel over 64-token blocks into block-aligned storage (slots rounded up to
64, the tail rows random but past `length`), V in any per-token format, and the queries.
The widest key channels include the last ones, so int4w-c64 stores its channels in an
order that is not the identity (a kernel ignoring it fails the reference check)."""

from __future__ import annotations

import torch

from kvtax.attention.view import CacheView
from kvtax.formats import ChannelBlockFormat, KVSpec, parse_format
from tests.support.device import DEVICE


def channel_view(
    value: str = "int4-g32",
    *,
    d: int,
    h_kv: int,
    group: int,
    ctx: int,
    n_q: int,
    batch: int = 1,
    dtype: torch.dtype = torch.float16,
    window: int | None = None,
    seed: int = 0,
    key: str = "int4-c64",
) -> tuple[torch.Tensor, CacheView]:
    """Fresh random q `[batch, h_kv * group, n_q, d]` and a full-cache view of `ctx`
    tokens whose keys are `key` (int4-c64, int3-c64 or int4w-c64) and values `value` (a
    per-token format name)."""
    gen = torch.Generator().manual_seed(seed)
    slots = -(-ctx // 64) * 64
    k = torch.randn(batch, h_kv, slots, d, generator=gen)
    k[..., :2] *= 6.0  # outlier channels, as real keys have
    k[..., -3:] *= 3.0  # wide ones at the end too: int4w-c64 stores them among its first
    k[..., 5] += 3.0   # and a channel with an offset, so biases matter
    v = torch.randn(batch, h_kv, slots, d, generator=gen)
    k, v = k.to(DEVICE, dtype), v.to(DEVICE, dtype)
    key_fmt, value_fmt = parse_format(key), parse_format(value)
    assert isinstance(key_fmt, ChannelBlockFormat), key
    spec = KVSpec(key_fmt, value_fmt)
    view = CacheView(k=key_fmt.quantize(k), v=value_fmt.quantize(v), spec=spec, head_dim=d,
                     length=ctx, window=window, dtype=dtype)
    q = torch.randn(batch, h_kv * group, n_q, d, generator=gen).to(DEVICE, dtype)
    return q, view
