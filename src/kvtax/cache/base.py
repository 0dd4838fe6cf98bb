"""The one small interface every cache kind shares (mlx-lm's `_BaseCache` in spirit).

A cache is created empty and learns batch, KV heads, head_dim, dtype and device from
its first `append`. Appending quantizes only the new tokens; `view()` hands attention
the quantized storage as is.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod

import torch

from kvtax.attention.view import CacheView
from kvtax.cache.blocks import KeyBlocks
from kvtax.cache.storage import Storage, round_up
from kvtax.errors import CapacityError, FormatError, ShapeError
from kvtax.formats import KVSpec, QTensor, check_input, fit_head_dim, rotate
from kvtax.formats.channel import ChannelBlockFormat

_warned: set[str] = set()  # fallback reasons already reported


class BaseCache(ABC):
    """Shared state and checks; subclasses decide where tokens go.

    Attributes: `spec` (K/V formats), `length` (tokens seen), `nbytes` (allocated bytes
    of codes + scales + biases), `used_nbytes` (bytes of the tokens a later query can read:
    a sliding cache's sinks and window, not the older rows a prefill chunk left), and
    `growth_events` (storage reallocations so far; the harness records whether one fell
    inside a timed window).

    `fused_store`: None (default) quantizes and writes new tokens with one fused Triton
    launch on CUDA (`kvtax.formats.store_triton`), in torch elsewhere; False always uses
    torch; True also tries the kernel on CPU (tests, under Triton's interpreter).

    Keys in a block format (`int4-c64`) take the torch path: `blocks`
    (kvtax.cache.blocks) stages them in the model dtype and re-quantizes each block an
    append or `write_at` touches; `nbytes` counts that staging too. Where `open_block_read`
    is False (a hybrid body), `write_at` on CUDA takes one fused launch instead and writes
    a block at the step that fills it.
    """

    fused_store: bool | None = None
    # Whether attention may read the open (partial) key block of a block-quantized key
    # format. A hybrid body with >= 63 recent fp16 tokens never does (kvtax.cache.hybrid),
    # so its decode step writes a block once, when it fills (kvtax.formats.block_store_triton).
    open_block_read: bool = True

    def __init__(
        self,
        spec: str | KVSpec = "fp16",
        *,
        capacity: int | None = None,
        growable: bool | None = None,
        check_finite: bool = True,
        center_keys: bool | None = None,
    ) -> None:
        self.spec = KVSpec.parse(spec)
        # a name without `-g<N>` takes a group size dividing head_dim at the first append
        self._fit_name = spec if isinstance(spec, str) else None
        # `+ck` specs store keys minus `key_shift` (key_mean below). center_keys None
        # follows the spec; False lets an owner that shifts once for several caches
        # (HybridCache) hand this one keys that are already centered.
        self.center_keys = self.spec.center_keys if center_keys is None else center_keys
        self.key_shift: torch.Tensor | None = None  # [B, H_kv, 1, D], with the storage
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._capacity_hint = capacity
        self._growable = capacity is None if growable is None else growable
        self.check_finite = check_finite
        self.length = 0
        self.store: Storage | None = None
        self.blocks: KeyBlocks | None = None

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        staged = 0 if self.blocks is None else self.blocks.nbytes
        return staged + (0 if self.store is None else self.store.nbytes)

    @property
    def used_nbytes(self) -> int:
        if self.store is None:
            return 0
        s = self.store
        per = self.spec.bytes_per_token(s.head_dim, s.dtype)
        return per * s.batch * s.num_kv_heads * self.held_tokens

    @property
    def growth_events(self) -> int:
        return 0 if self.store is None else self.store.growth_events

    @property
    def capacity(self) -> int:
        return 0 if self.store is None else self.store.capacity

    @property
    def held_tokens(self) -> int:
        """Tokens physically held (a sliding cache holds fewer than it has seen)."""
        return self.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and store new tokens. `k`, `v`: `[B, H_kv, T, D]`, same dtype/device.

        The first append fixes head_dim: a format named without a group size ("int8+hk+ck")
        then takes one that divides it (`kvtax.formats.fit_head_dim`; `spec` says which)."""
        if self.store is None and self._fit_name is not None:
            self.spec = fit_head_dim(self._fit_name, k.shape[-1])
        self._check(k, v)
        if self.store is None:
            self.store = self._allocate(k)
            if isinstance(self.spec.key, ChannelBlockFormat):
                self.blocks = KeyBlocks(self.spec.key)
        if self.center_keys:
            if self.key_shift is None:
                b, h, _, d = k.shape
                self.key_shift = torch.zeros(b, h, 1, d, dtype=k.dtype, device=k.device)
            if self.length == 0 and k.shape[2]:
                self.key_shift.copy_(key_mean(k))  # in place: a captured graph reads it
            k = center(k, self.key_shift)
        self._append(k, v)

    @abstractmethod
    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def write_at(self, k: torch.Tensor, v: torch.Tensor, pos_t: torch.Tensor) -> None:
        """Store ONE token `[B, H_kv, 1, D]` at the position held in device tensor `pos_t` `[1]`.

        Graph-safe (no host read of `pos_t`, storage never moves), so a CUDA graph captured
        once writes every decode step. The host `length` is NOT changed: call `advance(1)`
        after the write (outside the graph). The caller checks capacity beforehand:
        `pos_t` must be the current `length`, and storage must already be allocated.
        """
        if self.store is None:
            raise RuntimeError("write_at needs allocated storage: append a prompt first")
        why = self.device_write_blocker()
        if why is not None:
            raise RuntimeError(f"write_at: {why}; use append")
        if k.shape[2] != 1:
            raise ValueError(f"write_at takes one token, got {k.shape[2]}")
        # Shape checks only: a finiteness check reads the device back, which a graph forbids.
        finite, self.check_finite = self.check_finite, False
        try:
            self._check(k, v)
        finally:
            self.check_finite = finite
        if self.center_keys:
            k = center(k, self.key_shift)
        if self.blocks is not None:
            self._write_at_blocked(k, v, pos_t)
        elif not self._store_fused(k, v, pos_t):
            qk, qv = self._quantize(k, v)
            self.store.write_index(self._slot_of(pos_t), qk, qv)

    def device_write_blocker(self) -> str | None:
        """Why `write_at` (a write at a device-held position) cannot serve this cache, or
        None. Every cache kind can; subclasses with other storage say why not."""
        return None

    def _write_at_blocked(self, k: torch.Tensor, v: torch.Tensor, pos_t: torch.Tensor) -> None:
        """`write_at` for block-quantized keys: the key's whole block re-quantized on the
        device from the staged ring (`KeyBlocks.write_at`) over the block's 64 slots, the
        value per token at its slot, as `_write_blocked` stores them."""
        assert self.store is not None and self.blocks is not None
        if not self.open_block_read and self._block_store_fused(k, v, pos_t):
            return
        pos, qk = self.blocks.write_at(rotate(k) if self.spec.rotate_keys else k, pos_t)
        qv = self.spec.value.quantize(rotate(v) if self.spec.rotate_values else v)
        self.store.write_index(self._slot_of(pos), qk, None)
        self.store.write_index(self._slot_of(pos_t), None, qv)

    def _block_store_fused(self, k: torch.Tensor, v: torch.Tensor, pos_t: torch.Tensor) -> bool:
        """`_write_at_blocked`'s writes in one launch that writes the key's block only at the
        step that fills it (kvtax.formats.block_store_triton; for a cache whose open block
        nobody reads); False when the kernel does not apply (use torch)."""
        if self.fused_store is False or (self.fused_store is None and not k.is_cuda):
            return False
        try:
            from kvtax.formats import block_store_triton
        except ImportError:  # no (working) Triton: the torch path serves
            return False
        assert self.store is not None and self.blocks is not None
        blocks, s, (sinks, ring) = self.blocks, self.store, self._ring_layout()
        if blocks.buf is None or not block_store_triton.serves(self.spec):
            return False  # int3-c64 keys, rotations: the torch path, as documented
        reason = block_store_triton.unsupported_reason(
            k, v, blocks.buf, blocks.order, s.k, s.v, self.spec, sinks=sinks, ring=ring)
        if reason is not None:
            if k.is_cuda and reason not in _warned:
                _warned.add(reason)
                warnings.warn(f"kvtax: block key writes use torch, not the fused kernel: {reason}")
            return False
        block_store_triton.block_store(k, v, pos_t, blocks.buf, blocks.order, s.k, s.v,
                                       self.spec, sinks=sinks, ring=ring)
        return True

    def _write_blocked(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens at positions `[length, length + T)` for block-quantized keys: the
        values per token, the keys as the whole blocks they touch (`KeyBlocks.extend`)."""
        assert self.store is not None and self.blocks is not None
        p0 = self.length
        first, qk = self.blocks.extend(rotate(k) if self.spec.rotate_keys else k, p0)
        qv = self.spec.value.quantize(rotate(v) if self.spec.rotate_values else v)
        self._write_range(first, qk, None)
        self._write_range(p0, None, qv)

    def _trim_blocks(self, length: int) -> None:
        """Re-quantize the new last key block for a trim to `length` tokens (block keys
        only); CapacityError, nothing changed, where the staged keys no longer reach it."""
        if self.blocks is None:
            return
        redo = self.blocks.trim(length)
        if redo is not None:
            self._write_range(redo[0], redo[1], None)

    def _write_range(self, first: int, k: QTensor | None, v: QTensor | None) -> None:
        """Write K and/or V rows of positions `[first, first + rows)` to their slots (a
        full cache: the same indices; padded key rows fit, slots being whole blocks)."""
        assert self.store is not None
        self.store.write(first, k, v)

    def _store_fused(self, k: torch.Tensor, v: torch.Tensor, pos: int | torch.Tensor) -> bool:
        """Quantize and write tokens at positions `pos + t` in one fused launch (`pos`: host
        int or device `[1]` tensor); False when the kernel does not apply (use torch)."""
        if self.fused_store is False or (self.fused_store is None and not k.is_cuda):
            return False
        try:
            from kvtax.formats import store_triton
        except ImportError:  # no (working) Triton: the torch path serves
            return False
        assert self.store is not None
        s, (sinks, ring) = self.store, self._ring_layout()
        reason = store_triton.unsupported_reason(
            k, v, s.k, s.v, self.spec, pos=pos, sinks=sinks, ring=ring
        )
        if reason is not None:
            if k.is_cuda and reason not in _warned:
                _warned.add(reason)
                warnings.warn(f"kvtax: cache writes use torch, not the fused kernel: {reason}")
            return False
        store_triton.quantize_store(
            k, v, s.k, s.v, self.spec, pos, sinks=sinks, ring=ring, check=False
        )
        return True

    def _ring_layout(self) -> tuple[int, int]:
        """(sinks, ring) of the slot map; a full cache has no ring: (0, 0)."""
        return 0, 0

    def _slot_of(self, pos_t: torch.Tensor) -> torch.Tensor:
        """Storage slot of the (device) positions `pos_t`; a full cache stores position p at p."""
        return pos_t

    def advance(self, n: int = 1) -> None:
        """Count `n` tokens written by `write_at` (host bookkeeping only)."""
        self.length += n
        if self.store is not None and self.held_tokens > self.store.capacity:
            self.length -= n
            raise CapacityError(
                f"advancing by {n} would exceed the cache capacity of {self.store.capacity}"
            )
        if self.blocks is not None:
            self.blocks.advance(n)

    @abstractmethod
    def view(self) -> CacheView:
        """The storage and slot→position map attention reads."""

    @abstractmethod
    def trim(self, n: int) -> int:
        """Drop the newest `n` tokens; returns how many were dropped."""

    def reset(self) -> None:
        """Forget every token; storage stays allocated so a new prompt reuses it."""
        self.length = 0
        if self.blocks is not None:
            self.blocks.reset()

    def _initial_capacity(self, first: int) -> int:
        if self._capacity_hint is not None:
            return max(self._capacity_hint, first) if self._growable else self._capacity_hint
        return round_up(first)

    def _allocate(self, k: torch.Tensor) -> Storage:
        b, h, t, d = k.shape
        return Storage(
            self.spec, b, h, d, k.dtype, k.device, self._initial_capacity(t), self._growable
        )

    def _quantize(self, k: torch.Tensor, v: torch.Tensor) -> tuple[QTensor, QTensor]:
        # Rotated specs store kH / vH; attention rotates q and un-rotates the output.
        k = rotate(k) if self.spec.rotate_keys else k
        v = rotate(v) if self.spec.rotate_values else v
        return self.spec.key.quantize(k), self.spec.value.quantize(v)

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4:
            raise ShapeError(
                f"append takes k, v of shape [batch, kv_heads, tokens, head_dim]; got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.shape != v.shape:
            raise ShapeError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
        if k.dtype != v.dtype or k.device != v.device:
            raise ShapeError("k and v must share dtype and device")
        check_input(k, self.spec.key, check_finite=self.check_finite)
        check_input(v, self.spec.value, check_finite=self.check_finite)
        if isinstance(self.spec.value, ChannelBlockFormat):
            raise FormatError(f"{self.spec.value.name} is a key format (per channel over "
                              "token blocks); store values per token, e.g. k4-c64v4-g32")
        s = self.store
        if s is not None:
            want = (s.batch, s.num_kv_heads, s.head_dim)
            got = (k.shape[0], k.shape[1], k.shape[3])
            if want != got:
                raise ShapeError(
                    f"this cache holds (batch, kv_heads, head_dim) = {want}, got {got}; "
                    "use one cache per layer and reset() it for a new batch shape"
                )
            if k.dtype != s.dtype or k.device != s.device:
                raise ShapeError(
                    f"this cache holds {s.dtype} on {s.device}, got {k.dtype} on {k.device}"
                )


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """The shift a `+ck` cache subtracts from every key: the mean over the first chunk's
    tokens, `[B, H_kv, T, D]` → `[B, H_kv, 1, D]` in k.dtype.

    Any vector fixed per (sequence, KV head) is exact: each score of a query moves by the
    same q·m and softmax cancels it. The mean removes what a model adds to every key
    (Qwen2.5's k_proj bias, the slow RoPE channels it lands in), which would otherwise
    set each token's quantization range: on Qwen2.5-Coder-0.5B layer 0 it cut int8's
    attention error from 52% to 18% (docs/QUALITY.md).
    """
    return k.float().mean(2, keepdim=True).to(k.dtype)


def center(k: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """`k - shift` (shift in k.dtype): one elementwise launch on the decode path; torch
    subtracts half-precision operands in float32 and rounds once, and the difference is
    smaller than k, so this rounding is below the one k already had."""
    assert shift is not None, "a centering cache allocates its shift with the storage"
    return k - shift
