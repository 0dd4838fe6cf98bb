"""A sliding-window (rotating) cache that quantizes, with optional attention sinks.

mlx-lm's RotatingKVCache raises NotImplementedError when asked to quantize; here the
ring simply stores quantized rows. The first `sinks` positions sit in fixed slots; the
rest go round a ring of `ring` slots (see kvtax.attention.view for the slot map).

A chunk of L queries needs the W - 1 keys before its first query as well as its own L,
so the ring holds `W - 1 + L_max` slots, where L_max is the longest chunk appended
(decode alone needs just W). The ring grows, re-laid-out, when a longer chunk arrives,
unless `max_chunk` fixed it up front.

Keys in a block format (int4-c64) are written a whole 64-token block at a time, so the
ring is a multiple of 64 slots (blocks then map to aligned slot ranges and wrap whole),
sinks must be a multiple of 64 too (a hybrid cache's sliding body has none), and the ring
keeps 63 more slots: rewriting the open block never overwrites a block still in view.
"""

from __future__ import annotations

import torch

from kvtax.attention.view import CacheView
from kvtax.cache.base import BaseCache
from kvtax.cache.storage import Storage, raw, round_up
from kvtax.errors import CapacityError, FormatError
from kvtax.formats import KVSpec, QTensor
from kvtax.formats.channel import ChannelBlockFormat


class SlidingCache(BaseCache):
    """Keeps the first `sinks` tokens and the last `window` (+ one chunk) tokens.

    Example:
        cache = SlidingCache("int8", window=512, sinks=4)
        cache.append(k, v)      # any number of tokens, [B, H_kv, T, D]
        attention(q, cache.view())   # masks keys outside the window
    """

    def __init__(
        self,
        spec: str | KVSpec = "fp16",
        *,
        window: int,
        sinks: int = 0,
        max_chunk: int | None = None,
        check_finite: bool = True,
        center_keys: bool | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        fixed = max_chunk is not None
        super().__init__(spec, growable=not fixed, check_finite=check_finite,
                         center_keys=center_keys)
        self.window, self.sinks = window, sinks
        self.block = self.spec.key.block if isinstance(self.spec.key, ChannelBlockFormat) else 1
        if sinks % self.block:
            raise FormatError(f"{self.spec.key.name} keys are written in blocks of "
                              f"{self.block} slots: sinks must be a multiple of it, got {sinks}")
        self.ring = self._ring_for(max_chunk if fixed else 1)

    def _ring_for(self, chunk: int) -> int:
        """Ring slots that serve chunks of `chunk` tokens: the window's W - 1 keys before a
        chunk plus the chunk; for block keys also the rest of the open block, in blocks."""
        need = self.window - 1 + chunk
        return need if self.block == 1 else round_up(need + self.block - 1, self.block)

    @property
    def ring_tokens(self) -> int:
        return max(self.length - self.sinks, 0)

    @property
    def held_tokens(self) -> int:
        return min(self.length, self.sinks) + min(self.ring_tokens, self.ring)

    @property
    def used_nbytes(self) -> int:
        """Bytes of the tokens a later query can read: the sinks and the last `window`. Ring
        slots beyond the window hold a prefill chunk's older rows, working space that
        `nbytes` counts; so a decode-time cache of any chunking reports the same bytes, as
        HybridCache and `kvtax capacity` count them."""
        if self.store is None:
            return 0
        s = self.store
        per = self.spec.bytes_per_token(s.head_dim, s.dtype)
        tokens = min(self.length, self.sinks) + min(self.ring_tokens, self.window)
        return per * s.batch * s.num_kv_heads * tokens

    def _allocate(self, k: torch.Tensor) -> Storage:
        b, h, t, d = k.shape
        if self._growable:
            self.ring = max(self.ring, self._ring_for(t))
        return Storage(
            self.spec, b, h, d, k.dtype, k.device, self.sinks + self.ring, self._growable
        )

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self.store is not None
        n_new = k.shape[2]
        p0 = self.length
        n_sink = max(0, min(self.sinks - p0, n_new))
        n_ring = n_new - n_sink
        if n_ring and self._ring_for(n_ring) > self.ring:
            self._grow_ring(self._ring_for(n_ring))
        if self.blocks is not None:
            self._write_blocked(k, v)
            self.length += n_new
            return
        if self._store_fused(k, v, p0):
            self.length += n_new
            return
        qk, qv = self._quantize(k, v)
        if n_sink:
            self.store.write(p0, qk.slice_tokens(0, n_sink), qv.slice_tokens(0, n_sink))
        if n_ring:
            t0 = p0 + n_sink - self.sinks
            slots = self.sinks + torch.remainder(
                torch.arange(t0, t0 + n_ring, device=k.device), self.ring
            )
            self.store.write_index(
                slots, qk.slice_tokens(n_sink, n_new), qv.slice_tokens(n_sink, n_new)
            )
        self.length += n_new

    def _ring_layout(self) -> tuple[int, int]:
        return self.sinks, self.ring

    def _write_range(self, first: int, k: QTensor | None, v: QTensor | None) -> None:
        assert self.store is not None
        rows = (k if k is not None else v).codes.shape[-2]  # type: ignore[union-attr]
        pos = torch.arange(first, first + rows, device=self.store.device)
        self.store.write_index(self._slot_of(pos), k, v)

    def _slot_of(self, pos_t: torch.Tensor) -> torch.Tensor:
        return torch.where(
            pos_t < self.sinks, pos_t, self.sinks + torch.remainder(pos_t - self.sinks, self.ring)
        )

    def _grow_ring(self, ring: int) -> None:
        assert self.store is not None
        if not self._growable:
            raise CapacityError(
                f"sliding cache was fixed for chunks of <= {self.ring - self.window + 1} "
                f"tokens (max_chunk); a chunk needs a ring of {ring}. Raise max_chunk"
            )
        s = self.store
        src, new_slots = self._moves(ring)
        parts_k, parts_v = [], []
        for parts, q in ((parts_k, s.k), (parts_v, s.v)):
            for t in q:
                if t is None:
                    parts.append(None)
                    continue
                new = torch.empty(
                    *t.shape[:2], self.sinks + ring, t.shape[3], dtype=t.dtype, device=t.device
                )
                raw(new).index_copy_(2, new_slots, raw(t).index_select(2, src))
                parts.append(new)
        s.replace(QTensor(*parts_k), QTensor(*parts_v), self.sinks + ring)
        self.ring = ring

    def _moves(self, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(old slots, new slots) that keep every held token at sinks + t % ring. Block keys
        move whole blocks, each to where its first position goes (a block's metadata
        spans its rows; the open block's slots past the length are its padding)."""
        held = self.view().slot_positions()
        src = torch.arange(held.numel(), device=held.device)
        if self.block > 1:
            start = held[:: self.block]  # positions at block-aligned slots
            src = (src[:: self.block, None] + torch.arange(self.block, device=src.device))
            held = (start[:, None] + torch.arange(self.block, device=src.device))
            src, held = src.flatten(), held.flatten()
        new = torch.where(held < self.sinks, held,
                          self.sinks + torch.remainder(held - self.sinks, ring))
        return src, new

    def view(self) -> CacheView:
        if self.store is None:
            raise RuntimeError("the cache is empty: append K/V before reading it")
        s = self.store
        return CacheView(
            s.k,
            s.v,
            self.spec,
            s.head_dim,
            self.length,
            sinks=self.sinks,
            ring=self.ring,
            window=self.window,
            dtype=s.dtype,
        )

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.length))
        if self.ring_tokens > self.ring and n:
            raise CapacityError(
                "cannot trim a sliding cache after its ring wrapped: the tokens the trimmed "
                "ones overwrote are gone. Re-run the prompt instead"
            )
        self._trim_blocks(self.length - n)
        self.length -= n
        return n
