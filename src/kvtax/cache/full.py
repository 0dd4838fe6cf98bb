"""A cache that keeps every token: slot i holds position i."""

from __future__ import annotations

import torch

from kvtax.attention.view import CacheView
from kvtax.cache.base import BaseCache


class FullCache(BaseCache):
    """Every token kept, quantized on append.

    With `capacity` set the storage is preallocated once (prompt + max new tokens) and
    never moves — what CUDA-graph decode needs — and appending past it raises
    CapacityError. Without it storage starts at 256 tokens and doubles when full.

    Example:
        cache = FullCache("int4")
        cache.append(k, v)                 # k, v [B, H_kv, T, D]
        out = attention(q, cache.view())   # q [B, H_q, T_q, D]
    """

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self.store is not None
        n = k.shape[2]
        self.store.ensure(self.length + n, keep=self.length)
        if self.blocks is not None:
            self._write_blocked(k, v)
        elif not self._store_fused(k, v, self.length):
            qk, qv = self._quantize(k, v)
            self.store.write(self.length, qk, qv)
        self.length += n

    def view(self) -> CacheView:
        if self.store is None:
            raise RuntimeError("the cache is empty: append K/V before reading it")
        s = self.store
        return CacheView(
            s.k, s.v, self.spec, s.head_dim, self.length, dtype=s.dtype
        )

    def trim(self, n: int) -> int:
        n = max(0, min(n, self.length))
        self._trim_blocks(self.length - n)
        self.length -= n
        return n
