"""A cache with fp16 attention sinks and recent window, and a quantized body.

Every token is quantized into the body on append; the first `sinks` tokens and a ring of
the most recent ones are also kept in fp16. Attention (kvtax.attention.hybrid) reads, for
a query at position p:
  - fp16 part: keys k < sinks, and keys with p - k < recent;
  - body:      keys k >= sinks with p - k >= recent (what aged out of the recent window).
The two sets are disjoint and cover every key the layer may see, so the merged result is
exactly attention over the per-query concatenation "sinks fp16 | body dequantized |
recent fp16", independent of how the prompt was chunked. Tokens thus move into the
quantized body as they age past `recent`; the body holding their codes from the start
costs `sinks + recent` quantized rows of duplication and removes any migration step.

A body with int4-c64 or int4w-c64 keys (q4: `k4w-c64v4@s4r128`) is written a 64-token
block at a time (kvtax.cache.blocks); with recent >= 63 a query reads from the body only
blocks whose 64 tokens it has all seen, so chunking changes nothing there either, and a
decode step on CUDA writes a block once, at the step that fills it (one fused launch,
kvtax.formats.block_store_triton).

`write_at` / `advance` (a write at a device-held position, then the host count) go to
every part, so a CUDA graph captures a hybrid layer's decode step as a plain one's.

For a sliding-window layer (window W) the model has no sinks, the recent part keeps
min(recent, W) tokens, and the body is a quantized sliding ring read at distances
`[recent, W)`.

    >>> cache = HybridCache("int4+hk@s4r128")
    >>> cache.append(k, v)                        # [B, H_kv, T, D]
    >>> out = attention(q, cache.view())          # [B, H_q, L, D], kvtax.attention
"""

from __future__ import annotations

import dataclasses

import torch

from kvtax.attention.hybrid import HybridPart, HybridView
from kvtax.cache.base import BaseCache, center, key_mean
from kvtax.cache.full import FullCache
from kvtax.cache.sliding import SlidingCache
from kvtax.errors import CapacityError
from kvtax.formats.hybrid import HybridSpec, parse_kv


class HybridCache:
    """The shared cache interface (append, write_at, advance, view, length, nbytes,
    used_nbytes, trim, reset) over an fp16 sink/recent part and a quantized body.

    spec:   a HybridSpec or its name (`int4+hk@s4r128`).
    window: None for a full-attention layer, else the layer's sliding window.
    capacity: preallocate the body to this many tokens (full layers).
    max_chunk: fix the rings for prefill chunks of at most this many tokens.
    """

    def __init__(
        self,
        spec: "str | HybridSpec",
        *,
        window: int | None = None,
        capacity: int | None = None,
        max_chunk: int | None = None,
        check_finite: bool = True,
    ) -> None:
        hs = parse_kv(spec)
        if not isinstance(hs, HybridSpec):
            raise ValueError(f"{spec!r} is not a hybrid spec (<spec>@s<S>r<R>)")
        self.spec, self.window = hs, window
        self.sinks = hs.sinks if window is None else 0  # a sliding layer never sees sinks
        # A `+ck` body: the fp16 part and the body must see keys moved by the same vector
        # (their scores meet in one softmax), so this cache centers once for both.
        self.center_keys = hs.base.center_keys
        self.key_shift: torch.Tensor | None = None
        self.recent = hs.recent if window is None else min(hs.recent, window)
        self.fp: SlidingCache | None = None
        if self.sinks or self.recent:
            # A ring of >= recent slots; window 1 when only sinks are kept (the masks below
            # then expose the sinks alone). By name, so an `i8` part's int8 takes a group
            # size dividing head_dim at the first append, as any plain name does.
            self.fp = SlidingCache(hs.exempt.name, window=max(self.recent, 1), sinks=self.sinks,
                                   max_chunk=max_chunk, check_finite=check_finite,
                                   center_keys=False)
        # The body by name too: a group wider than the row (q4's sliding form names values
        # in groups of 128) or none at all fits head_dim at the first append.
        self.body: BaseCache | None = None
        if window is None:
            self.body = FullCache(hs.base.name, capacity=capacity, check_finite=check_finite,
                                  center_keys=False)
        elif self.recent < window:  # else every visible key is recent: no body needed
            self.body = SlidingCache(hs.base.name, window=window, max_chunk=max_chunk,
                                     check_finite=check_finite, center_keys=False)
        if self.body is not None:
            # a query reads from the body only keys >= recent behind it, never the open
            # 64-token key block: a decode step may write a block once it fills
            self.body.open_block_read = self.recent < 63

    @property
    def parts(self) -> list[BaseCache]:
        return [c for c in (self.fp, self.body) if c is not None]

    @property
    def length(self) -> int:
        return self.parts[0].length

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.parts)

    @property
    def used_nbytes(self) -> int:
        """Bytes a decode-time cache needs: the body's tokens (the last `window` of a
        sliding layer) plus `sinks + recent` fp16 (`i8`: int8) tokens. A prefill chunk's extra ring
        slots are working space and not counted."""
        if self.length == 0:
            return 0
        store = self.parts[0].store
        assert store is not None
        rows = store.batch * store.num_kv_heads
        body = 0
        if self.body is not None:
            held = self.length if self.window is None else min(self.length, self.window)
            body = held * self.spec.base.bytes_per_token(store.head_dim, store.dtype)
        exempt = min(self.length, self.sinks) + min(max(self.length - self.sinks, 0),
                                                    self.recent)
        fp_bytes = self.fp.spec.bytes_per_token(store.head_dim, store.dtype) if self.fp else 0
        return rows * (body + exempt * fp_bytes)

    @property
    def growth_events(self) -> int:
        return sum(c.growth_events for c in self.parts)

    @property
    def capacity(self) -> int:
        return self.parts[-1].capacity

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens `[B, H_kv, T, D]` in both parts (fp16 ring, quantized body)."""
        if self.center_keys and k.shape[2]:
            if self.length == 0 or self.key_shift is None:
                mean = key_mean(k)
                if self.key_shift is not None and self.key_shift.shape == mean.shape:
                    self.key_shift.copy_(mean)  # in place: a captured graph reads it
                else:
                    self.key_shift = mean
            k = center(k, self.key_shift)
        first = self.length == 0
        for c in self.parts:
            c.append(k, v)
        if first and self.body is not None and self.body.spec != self.spec.base:
            # the body fitted its group size to head_dim at its first append: name what
            # it stores (q4's sliding form at head_dim 64: k4-c64v4@r64i8)
            self.spec = dataclasses.replace(self.spec, base=self.body.spec)

    def write_at(self, k: torch.Tensor, v: torch.Tensor, pos_t: torch.Tensor) -> None:
        """Store ONE token `[B, H_kv, 1, D]` at the position in device tensor `pos_t` `[1]`
        in every part, graph-safe (`BaseCache.write_at`); `advance(1)` counts it after."""
        if self.center_keys:
            if self.key_shift is None:
                raise RuntimeError("write_at needs allocated storage: append a prompt first")
            k = center(k, self.key_shift)
        for c in self.parts:
            c.write_at(k, v, pos_t)

    def advance(self, n: int = 1) -> None:
        """Count `n` tokens written by `write_at` in every part (host bookkeeping only)."""
        # the body first: a full body past its capacity raises before any part moved
        for c in reversed(self.parts):
            c.advance(n)

    def device_write_blocker(self) -> str | None:
        """Why `write_at` cannot serve this cache (a part's reason), or None."""
        for c in self.parts:
            why = c.device_write_blocker()
            if why is not None:
                return why
        return None

    def view(self) -> HybridView:
        parts = []
        if self.fp is not None:
            # The ring may hold more than `recent` tokens (a chunk's worth): mask to recent.
            fp_view = dataclasses.replace(self.fp.view(), window=self.recent)
            parts.append(HybridPart(fp_view))
        if self.body is not None:
            parts.append(HybridPart(self.body.view(), min_distance=self.recent,
                                    min_key=self.sinks))
        return HybridView(tuple(parts), self.length)

    def trim(self, n: int) -> int:
        """Drop the newest `n` tokens; returns how many were dropped.

        Works after the fp16 ring wrapped as long as it still holds the `recent` tokens
        before the cut (n + recent - 1 <= ring slots), so a recall session can drop a question
        and its answer and keep the document; else CapacityError (prefill again).
        """
        n = max(0, min(n, self.length))
        if self.body is not None:
            self.body.trim(n)  # a wrapped sliding body raises here, before anything changed
        if self.fp is not None:
            _trim_ring(self.fp, n, self.recent)
        return n


    def reset(self) -> None:
        for c in self.parts:
            c.reset()


def _trim_ring(fp: SlidingCache, n: int, recent: int) -> None:
    """Drop `n` tokens from an fp16 ring that only ever serves the last `recent` positions.

    A wrapped ring holds the last `ring` positions. After the cut the next query needs
    the `recent - 1` positions before the new end, still held iff n + recent - 1 <= ring.
    The slots of dropped tokens are read by the slot map as positions `ring` earlier, at
    distance >= ring - n + 1 >= recent from any later query: never visible, and
    overwritten by new appends.
    """
    if fp.ring_tokens <= fp.ring:
        fp.trim(n)
        return
    if n + recent - 1 > fp.ring:
        raise CapacityError(
            f"cannot drop {n} tokens: the fp16 ring ({fp.ring} slots) no longer holds the "
            f"{recent} recent tokens before the cut. Re-run the prompt instead"
        )
    fp.length -= n

