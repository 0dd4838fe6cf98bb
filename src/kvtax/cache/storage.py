"""Preallocated K/V storage in one format pair, grown geometrically when allowed.

Growth doubles capacity (rounded up to `STEP` tokens), so a prefill of n tokens in
chunks copies O(log n) times instead of once per chunk (mlx-lm grows by 256 each time,
which the seeds measured as a resize churn confound).
"""

from __future__ import annotations

import math

import torch

from kvtax.errors import CapacityError
from kvtax.formats import KVSpec, QTensor

STEP = 256
# Slots allocated are a multiple of this (capacity, the logical size, stays as asked): then
# every per-head stride of the scale/bias tensors is divisible by 16 elements, which Triton
# needs to load their tiles with wide cp.async. At capacity 131,124 (a 128k prompt + 52
# new tokens) the unaligned stride left them scalar loads and the int8 decode kernel took
# 121 us per layer inside the model against 84 us standalone (H200).
ALIGN = 16


def slot_align(spec: KVSpec) -> int:
    """Slots are allocated in multiples of this: ALIGN, or a key format's token block
    (int4-c64 keys write whole 64-row blocks, their metadata spread over the rows)."""
    block = getattr(spec.key, "block", 1)
    return ALIGN * block // math.gcd(ALIGN, block)


def round_up(n: int, step: int = STEP) -> int:
    return max(step, -(-n // step) * step)


class Storage:
    """K and V storage `[B, H_kv, capacity, width]` per part; `ensure()` grows it."""

    def __init__(
        self,
        spec: KVSpec,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int,
        growable: bool,
    ) -> None:
        spec.check(head_dim)
        self.spec, self.head_dim, self.dtype, self.device = spec, head_dim, dtype, device
        self.batch, self.num_kv_heads = batch, num_kv_heads
        self.growable = growable
        self.growth_events = 0
        self.capacity = capacity
        self.align = slot_align(spec)
        slots = round_up(capacity, self.align)
        self.k = spec.key.allocate((batch, num_kv_heads, slots), head_dim, dtype, device)
        self.v = spec.value.allocate((batch, num_kv_heads, slots), head_dim, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def slots(self) -> int:
        """Physical slots allocated (capacity rounded up to `align`)."""
        return self.k.codes.shape[2]

    def ensure(self, needed: int, keep: int) -> None:
        """Make room for `needed` slots, copying the first `keep` slots if storage moves."""
        if needed <= self.capacity:
            return
        if not self.growable:
            raise CapacityError(
                f"cache capacity is fixed at {self.capacity} tokens but {needed} are needed; "
                "create the cache with a larger capacity (prompt + max new tokens) or leave "
                "capacity unset so it grows"
            )
        new_cap = round_up(max(needed, 2 * self.capacity))
        # a block-quantized key's last block is copied whole (its metadata spans its rows)
        self.k = _regrow(self.k, new_cap, min(round_up(keep, self.align), self.slots))
        self.v = _regrow(self.v, new_cap, keep)
        self.capacity = new_cap
        self.growth_events += 1

    def write(self, start: int, k: QTensor | None, v: QTensor | None) -> None:
        """Write quantized tokens into slots `[start, start + T)`; None skips K or V
        (block-quantized keys span other slots than the new values)."""
        for dst, src in _pairs(self, k, v):
            n = src.shape[-2]
            dst[:, :, start : start + n].copy_(src)

    def write_index(self, slots: torch.Tensor, k: QTensor | None, v: QTensor | None) -> None:
        """Write quantized tokens into arbitrary slots (a ring that wraps); None skips."""
        for dst, src in _pairs(self, k, v):
            raw(dst).index_copy_(2, slots, raw(src))

    def replace(self, k: QTensor, v: QTensor, capacity: int) -> None:
        """Swap in re-laid-out storage (a ring resized to a larger modulus)."""
        self.k, self.v, self.capacity = k, v, capacity
        self.growth_events += 1


def _pairs(store: Storage, k: QTensor | None, v: QTensor | None):
    """(destination, source) part pairs of the K and V given."""
    for dst, src in ((store.k, k), (store.v, v)):
        if src is not None:
            yield from zip(dst.parts(), src.parts())


def raw(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret fp8 codes as bytes: index_copy_ has no float8 CPU kernel."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _regrow(q: QTensor, capacity: int, keep: int) -> QTensor:
    parts = []
    for t in q:
        if t is None:
            parts.append(None)
            continue
        new = torch.empty(*t.shape[:2], capacity, t.shape[3], dtype=t.dtype, device=t.device)
        new[:, :, :keep].copy_(t[:, :, :keep])
        parts.append(new)
    return QTensor(*parts)
