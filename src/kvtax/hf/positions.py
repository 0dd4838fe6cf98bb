"""Device-side positions of one preallocated kvtax cache: decode steps a CUDA graph can capture.

transformers' compiled decode (`torch.compile(mode="reduce-overhead")`) replays a CUDA
graph, so nothing in a decode step may depend on a host integer that changes per token:
Python int arithmetic inside a compiled region becomes a symbolic graph input, and a
graph with symbolic inputs is re-recorded (or run without CUDA graphs). So one decode
token is written at the position held in the device tensor `pos_t`, the fused kernels
read each row's length from `len_t` (`CacheView.length_t`; the host `length` handed to
them is pinned to the storage capacity), and inside a compiled region the host length is
left alone: it is brought up to date from the device (`reconcile`, one read) the next
time eager code asks for it.

Only the kernels honour `length_t` — the reference reads the host length — so a step goes
this way only where `kvtax.attention.dispatch.uses_kernels` says the kernels serve it.
"""

from __future__ import annotations

import dataclasses

import torch

from kvtax.attention import attention
from kvtax.attention.dispatch import uses_kernels
from kvtax.attention.view import CacheView
from kvtax.cache import BaseCache, SlidingCache
from kvtax.errors import CapacityError


class DevicePositions:
    """`pos_t` (int64 `[1]`: next write position) and `len_t` (int32 `[B]`) of one cache.

    cache: a kvtax cache whose storage is allocated and fixed (preallocated FullCache, or
           a SlidingCache with `max_chunk`). batch: rows of that storage.
    """

    def __init__(self, cache: BaseCache, batch: int) -> None:
        if cache.store is None:
            raise RuntimeError("DevicePositions needs allocated storage")
        self.cache = cache
        device = cache.store.device
        self.pos_t = torch.zeros(1, dtype=torch.int64, device=device)
        self.len_t = torch.zeros(batch, dtype=torch.int32, device=device)
        self.behind = False  # True after compiled steps advanced only the device counters
        self.view: CacheView | None = None  # what the kernels read in a decode step (`sync`)
        self.sync()
        if not torch.compiler.is_compiling():
            # Fixed addresses let a CUDA graph mutate them in place (as StaticLayer does).
            for t in self.static_tensors():
                torch._dynamo.mark_static_address(t)

    def sync(self) -> None:
        """Host → device: after the host length changed (append, trim, reset).

        Also rebuilds `view`, the decode view whose host length is pinned to the capacity:
        a compiled step then reads no host count, so dynamo guards on none and the graph
        is never recompiled as the host count moves (storage changes only on append)."""
        c = self.cache
        self.pos_t.fill_(c.length)
        self.len_t.fill_(c.length)
        self.behind = False
        self.view = dataclasses.replace(c.view(), length=c.capacity, length_t=self.len_t)

    def reconcile(self) -> None:
        """Device → host: count the tokens compiled steps wrote (eager code only)."""
        if self.behind and not torch.compiler.is_compiling():
            self.cache.advance(int(self.pos_t) - self.cache.length)
            self.behind = False

    def serve(self, q: torch.Tensor, kv_start: torch.Tensor | None) -> bool:
        """Whether the kernels, which read `len_t`, would run this call."""
        assert self.view is not None
        # int4-c64 keys append: their staging ring is no static tensor of this path yet
        if self.cache.device_write_blocker() is not None or self.cache.blocks is not None:
            return False
        return uses_kernels(q, self.view, kv_start=kv_start)

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        kv_start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store one token (`k`, `v` `[B, H_kv, 1, D]`) and attend `q` `[B, H_q, 1, D]`."""
        c = self.cache
        compiling = torch.compiler.is_compiling()
        if not compiling:
            self.reconcile()
            if not isinstance(c, SlidingCache) and c.length + 1 > c.capacity:
                raise CapacityError(
                    f"the KVTaxCache was preallocated for {c.capacity} tokens (max_cache_len) "
                    "and is full; create it with a larger max_cache_len"
                )
        c.check_finite = False  # a one-token step is not checked: that would read the device
        c.write_at(k, v, self.pos_t)
        self.pos_t.add_(1)
        self.len_t.add_(1)
        if compiling:
            self.behind = True  # a host int changed here would become a graph input
        else:
            c.advance(1)
        assert self.view is not None
        return attention(q, self.view, scale=scale, softcap=softcap, kv_start=kv_start)

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor a decode step mutates or reads from the cache: storage parts and the
        two counters (all marked static, so a CUDA graph may mutate them in place)."""
        store = self.cache.store
        assert store is not None
        return [*store.k.parts(), *store.v.parts(), self.pos_t, self.len_t]
