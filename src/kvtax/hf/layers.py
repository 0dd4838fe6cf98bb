"""One transformers cache layer backed by a kvtax cache, and the handle its `update()` returns.

transformers calls `cache.update(k, v, layer_idx)` and hands whatever comes back, untouched,
to the registered attention function as its `key` and `value`. A kvtax layer returns a
`KVHandle` there instead of dequantized tensors: the attention function (kvtax.hf.attention)
takes the layer from it and runs `kvtax.attention.attention(q, layer's view)` on the
quantized storage. The new tokens' K/V are held as *pending* until that call, so a long
prefill on a sliding-window layer can be appended and attended chunk by chunk: its ring
then holds `window - 1 + chunk` slots instead of `window - 1 + prompt`.

A preallocated layer (`max_cache_len`) decodes one token at a time through device-side
positions wherever the fused kernels serve the call (kvtax.hf.positions), so transformers'
compiled decode step has static shapes and can be captured as a CUDA graph.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvtax.attention import attention
from kvtax.cache import BaseCache, SlidingCache
from kvtax.cache.hybrid import HybridCache
from kvtax.errors import ShapeError
from kvtax.hf.positions import DevicePositions

_NOT_INSTALLED = (
    "this is a kvtax cache handle, not a K/V tensor: a KVTaxCache must be read by the kvtax "
    "attention. Call `kvtax.hf.install(model)` (or use `with kvtax.hf.installed(model):`) "
    "before running the model with a KVTaxCache"
)


class KVHandle:
    """What `KVTaxCache.update()` returns in place of the key and value tensors.

    It carries the layer whose pending tokens and quantized storage the kvtax attention
    function reads. Any other attention function that treats it as a tensor gets an
    error that says how to install the kvtax one.
    """

    __slots__ = ("layer",)

    def __init__(self, layer: KVTaxLayer) -> None:
        self.layer = layer

    def __getattr__(self, name: str):
        raise AttributeError(f"{_NOT_INSTALLED} (asked for `.{name}`)")

    def __repr__(self) -> str:
        return f"KVHandle({self.layer!r})"


class KVTaxLayer(CacheLayerMixin):
    """A transformers cache layer whose K/V live in a kvtax `FullCache`, `SlidingCache` or
    `HybridCache` (fp16 sinks / recent tokens beside a quantized body: eager only).

    cache:         the kvtax cache (its spec decides the format of this layer).
    chunk:         attend a multi-token update in chunks of this many queries (sliding
                   layers: bounds the ring to `window - 1 + chunk`); None = one call.
    check_finite:  True, False, or "prefill" (check chunks of more than one token only: a
                   per-decode-step check would stall the GPU on a device sync).
    max_cache_len: the fixed capacity the storage was preallocated with, or None when it
                   grows; when set the layer is `is_compileable` (static generation).
    graph_decode:  with `max_cache_len`, decode through device-side positions where the
                   fused kernels serve the call (kvtax.hf.positions).
    """

    supports_early_init = True

    def __init__(
        self,
        cache: BaseCache,
        *,
        chunk: int | None = None,
        check_finite: bool | str = "prefill",
        max_cache_len: int | None = None,
        graph_decode: bool = True,
    ) -> None:
        super().__init__()
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1 or None, got {chunk}")
        if check_finite not in (True, False, "prefill"):
            raise ValueError(f"check_finite must be True, False or 'prefill', got {check_finite!r}")
        self.cache = cache
        self.chunk = chunk
        self.check_finite = check_finite
        self.max_cache_len = max_cache_len
        # A hybrid layer (fp16 sinks / recent beside a quantized body) runs eagerly: its
        # device-position decode (kvtax.hf.positions) is not written yet.
        self.hybrid = isinstance(cache, HybridCache)
        self.is_compileable = max_cache_len is not None and not self.hybrid
        self.graph_decode = graph_decode and self.is_compileable
        self.window: int | None = (cache.window if isinstance(cache, (SlidingCache, HybridCache))
                                   else None)
        self.is_sliding = self.window is not None
        self.positions: DevicePositions | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def __repr__(self) -> str:
        kind = f"sliding W={self.window}" if self.is_sliding else "full"
        return f"KVTaxLayer({self.cache.spec.name}, {kind}, tokens={self.seen})"

    @property
    def seen(self) -> int:
        """Tokens this layer has been given: stored plus pending (host count)."""
        if self.positions is not None:
            self.positions.reconcile()
        pending = 0 if self._pending is None else self._pending[0].shape[-2]
        return self.cache.length + pending

    # transformers' layer API -------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate storage from the first K/V's batch, heads, head_dim, dtype and device."""
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size = key_states.shape[0]
        self.cache.append(key_states[:, :, :0], value_states[:, :, :0])
        if self.graph_decode:
            self.positions = DevicePositions(self.cache, self.batch_size)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[KVHandle, KVHandle]:
        """Queue `[B, H_kv, T, D]` new K/V; the kvtax attention appends and reads them."""
        if self._pending is not None:
            self._flush()  # an earlier update that no attention consumed
        if self.max_cache_len is None and self.is_initialized and self.seen == 0:
            if key_states.shape[0] != self.batch_size:  # reset, then a new batch size
                for part in self._parts():
                    part.store = None
                self.is_initialized = False
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._pending = (key_states, value_states)
        handle = KVHandle(self)
        return handle, handle

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens seen: a host int, or the device count `[]` (as transformers' StaticLayer
        returns) inside a compiled region and while compiled decode steps have run ahead of
        the host count. generate asks every step (eagerly, for the mask): reading the
        device count back there would stall the GPU, and a host int that changes between
        steps, read inside the compiled step, would make dynamo recompile it."""
        if self.positions is not None and (
            torch.compiler.is_compiling() or self.positions.behind
        ):
            return self.positions.pos_t[0]
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) as transformers' dynamic layers report them; a layer that
        decodes through device positions reports its fixed slot count and 0, as StaticLayer
        does, reading no token count (see `get_seq_length`). The kvtax mask function uses
        neither: the cache view applies causality and windows."""
        if self.positions is not None:
            return self.cache.capacity, 0
        seen = self.seen
        if not self.is_sliding:
            return seen + query_length, 0
        assert self.window is not None
        offset = max(seen - self.window + 1, 0)
        if seen >= self.window:
            return self.window - 1 + query_length, offset
        return seen + query_length, offset

    def get_max_length(self) -> int:
        if self.is_sliding:
            return self.window  # type: ignore[return-value]
        return -1 if self.max_cache_len is None else self.max_cache_len

    def reset(self) -> None:
        """Forget every token; storage stays allocated (and at the same address)."""
        self.cache.reset()
        self._pending = None
        self._host_changed()

    @property
    def is_croppable(self) -> bool:
        """Full layers always; a sliding layer until its ring overwrote a token."""
        if not self.is_sliding:
            return True
        self.seen  # noqa: B018  (brings the host count up to date)
        c = self.cache.body if self.hybrid else self.cache  # a hybrid's fp16 ring trims itself
        return c is None or c.ring_tokens <= c.ring  # type: ignore[attr-defined,union-attr]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest `-tokens_to_remove` tokens (a positive value is the size to keep)."""
        self._flush()
        seen = self.seen
        drop = seen - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        self.cache.trim(max(drop, 0))
        self._host_changed()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: permute the batch rows of the stored codes, scales and biases."""
        self._flush()
        if self.seen == 0:
            return
        for cache in self._parts():
            store = cache.store
            if store is None:
                continue
            idx = beam_idx.to(store.device)
            for part in (*store.k.parts(), *store.v.parts()):
                part.copy_(part.index_select(0, idx))  # in place: the storage never moves

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse_batch_change("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse_batch_change("batch_select_indices")

    def offload(self) -> None:
        raise NotImplementedError("KVTaxCache does not offload layers to the CPU")

    def prefetch(self) -> None:
        raise NotImplementedError("KVTaxCache does not offload layers to the CPU")

    # what the kvtax attention function calls ----------------------------------------------

    def attend(
        self,
        q: torch.Tensor,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        kv_start: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append the pending K/V and attend `q` `[B, H_q, T, D]` → `[B, H_q, T, D]`.

        The T queries are the T pending tokens. With `chunk` set, each chunk's K/V are
        appended just before its queries attend, which is exact: a query never needs a
        key newer than itself, and the ring keeps the `window - 1` older ones.
        """
        if self._pending is None:
            raise RuntimeError(
                "kvtax attention ran for a layer with no pending update: call "
                "`cache.update(k, v, layer_idx)` before the attention of each forward"
            )
        k, v = self._pending
        self._pending = None
        if self.hybrid and kv_start is not None:
            raise ShapeError(
                f"{self.cache.spec.name}: hybrid formats take no left-padded batch yet; run "
                "the prompts one at a time, or use a plain format (int8+hk+ck, int4+hk)")
        n = k.shape[-2]
        if q.shape[-2] != n:
            raise ShapeError(
                f"{q.shape[-2]} queries but {n} new K/V tokens; the kvtax attention serves "
                "self-attention whose queries are the tokens just added to the cache"
            )
        q = q.contiguous()
        if n == 1 and self.positions is not None and self.positions.serve(q, kv_start):
            return self.positions.decode(q, k, v, scale=scale, softcap=softcap, kv_start=kv_start)
        step = self.chunk or n
        outs = []
        for s in range(0, n, step):
            self._append(k[:, :, s : s + step], v[:, :, s : s + step])
            view = self.cache.view()
            outs.append(
                attention(
                    q[:, :, s : s + step], view, scale=scale, softcap=softcap, kv_start=kv_start
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @property
    def used_nbytes(self) -> int:
        self.seen  # noqa: B018  (brings the host count up to date)
        return self.cache.used_nbytes

    # internals -------------------------------------------------------------------------------

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.positions is not None and self.positions.behind:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    "kvtax: a multi-token update inside a compiled region after compiled "
                    "single-token decode steps is not supported (the host length is behind "
                    "the device); run it eagerly"
                )
            self.positions.reconcile()
        check = self.check_finite
        if check == "prefill":
            check = k.shape[-2] > 1
        # A data-dependent check cannot live inside a compiled graph.
        for part in self._parts():
            part.check_finite = bool(check) and not torch.compiler.is_compiling()
        self.cache.append(k, v)
        self._host_changed()

    def _parts(self) -> list[BaseCache]:
        """The kvtax caches holding this layer's storage (a hybrid layer's fp16 ring and body)."""
        return self.cache.parts if self.hybrid else [self.cache]  # type: ignore[union-attr]

    def _host_changed(self) -> None:
        if self.positions is not None:
            self.positions.sync()

    def _flush(self) -> None:
        """Store pending tokens that no attention consumed (chunked, as attend would)."""
        if self._pending is None:
            return
        k, v = self._pending
        self._pending = None
        step = self.chunk or k.shape[-2]
        for s in range(0, k.shape[-2], step):
            self._append(k[:, :, s : s + step], v[:, :, s : s + step])

    def _refuse_batch_change(self, what: str) -> None:
        if self.seen:
            raise NotImplementedError(
                f"KVTaxCache cannot {what}: its storage is allocated for a fixed batch. "
                "Use greedy/sampling/beam search generation, or a DynamicCache for this mode"
            )
