"""What attention reads from a cache: quantized storage plus the map from slots to positions.

Attention never needs a dequantized or reordered copy of the cache. It scans physical
slots `[0, num_slots)` and derives each slot's logical position from three integers:

- slots `[0, sinks)` hold positions `[0, sinks)` (attention sinks, never evicted);
- with `ring == 0` (a full cache) slot `i` holds position `i`;
- with `ring > 0` slots `[sinks, sinks + ring)` form a ring: ring token `t` (position
  `sinks + t`) lives in slot `sinks + t % ring`, so after wrap-around a slot holds the
  newest `t` congruent to its index.

Softmax is invariant to the order keys are visited in, so this is all a kernel needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvtax.formats import KVSpec, QTensor


@dataclass(frozen=True)
class CacheView:
    """A read-only window onto one layer's cache storage.

    k, v:     QTensor storage, each part `[B, H_kv, capacity, width]` (see kvtax.formats).
    spec:     the K and V formats.
    head_dim: D, the unpacked row length.
    length:   tokens seen so far; the logical positions are `0 .. length-1`.
    sinks:    leading positions kept forever in slots `[0, sinks)`.
    ring:     0 for a full cache, else the ring size of a sliding-window cache.
    window:   sliding window W (a query at p sees keys k with p - k < W, plus sinks), or None.
    dtype:    the model dtype the cache was fed with.
    length_t: optional int32 device tensor `[B]` holding `length` per row, for CUDA-graph
              decode: dispatch passes it to the kernels as `lengths`, which they read at
              run time (the host `length` is frozen at capture). The reference ignores it.
    """

    k: QTensor
    v: QTensor
    spec: KVSpec
    head_dim: int
    length: int
    sinks: int = 0
    ring: int = 0
    window: int | None = None
    dtype: torch.dtype = torch.float16
    length_t: torch.Tensor | None = None

    def at_length(self, length: int, length_t: torch.Tensor | None) -> "CacheView":
        """This view at host `length`, the kernels reading `length_t` (CUDA-graph decode)."""
        return dataclasses.replace(self, length=length, length_t=length_t)

    @property
    def batch(self) -> int:
        return self.k.codes.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.codes.shape[1]

    @property
    def device(self) -> torch.device:
        return self.k.codes.device

    @property
    def ring_tokens(self) -> int:
        """Tokens written to the ring so far (not all may still be held)."""
        return max(self.length - self.sinks, 0) if self.ring else 0

    @property
    def num_slots(self) -> int:
        """Physical slots holding valid tokens; attention scans `[0, num_slots)`."""
        if not self.ring:
            return self.length
        return min(self.length, self.sinks) + min(self.ring_tokens, self.ring)

    def slot_positions(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Logical position of each slot in `[start, end)`, int64 on the cache's device."""
        end = self.num_slots if end is None else end
        slots = torch.arange(start, end, device=self.device, dtype=torch.int64)
        if not self.ring:
            return slots
        n = self.ring_tokens
        t = (n - 1) - torch.remainder((n - 1) - (slots - self.sinks), self.ring)
        return torch.where(slots < self.sinks, slots, self.sinks + t)

    def logical_order(self) -> torch.Tensor:
        """Slot indices sorted by position: `index_tokens(view.logical_order())` is in order."""
        return torch.argsort(self.slot_positions())
