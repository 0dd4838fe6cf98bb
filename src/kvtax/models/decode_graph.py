"""The CUDA graph of one decode step: capture, replay, and when capture is safe.

A captured step reads its token, write position and cache lengths from static device
tensors (`decode_step_fn`), so one graph serves every step of a generation; the runner
(kvtax.models.runner) captures one per cache set and replays it per token. A hybrid
cache (kvtax.cache.hybrid: fp16 sinks + recent ring beside a quantized body) is several
caches in one layer: the checks below go over each of its parts (`leaves`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from kvtax.attention import attention
from kvtax.attention.hybrid import HybridView
from kvtax.cache import BaseCache
from kvtax.cache.hybrid import HybridCache
from kvtax.models import argmax
from kvtax.models.decoder import DecoderModel


class DecodeGraph:
    """One captured decode step for one cache set: static tokens/pos/length → logits, or
    (greedy) → the next tokens, written back into `tokens` with pos and length advanced."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.key: tuple = ()
        self.list_id = 0
        self.first: weakref.ref | None = None
        self.n: int | None = None  # greedy: the cache length pos / length stand for

    @classmethod
    def capture(
        cls, model: DecoderModel, caches: Sequence[BaseCache], compile: bool | str = False,
        greedy: bool = False,
    ) -> "DecodeGraph":
        """Warm up and capture `model`'s decode step over `caches` (filled, fixed storage)
        at their current length; `compile` / `greedy` as for decode_step_fn."""
        self = cls()
        dev = model.embed.weight.device
        batch = caches[0].view().batch
        n = caches[0].length
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.pos = torch.full((1,), n, dtype=torch.long, device=dev)
        self.length = torch.full((batch,), n + 1, dtype=torch.int32, device=dev)
        step = decode_step_fn(model, caches, self.tokens, self.pos, self.length, compile,
                              greedy=greedy)

        # Warm-up on a side stream compiles kernels and sizes workspaces outside capture
        # (the argmax's are per stream: the capture runs on the same one). It writes slot
        # `n`, which the first real replay overwrites; for a ring that slot's previous
        # token is already outside every future query's window.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.pos.fill_(n)  # the greedy step moves them on
                self.length.fill_(n + 1)
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        with torch.cuda.graph(self.graph, stream=side):
            self.logits = step()
        self.key = cache_key(caches)
        self.list_id, self.first = id(caches), weakref.ref(caches[0])
        return self

    def serves(self, caches: Sequence[BaseCache]) -> bool:
        """Whether this graph was captured over `caches`' storage (same list, or same key)."""
        if self.first is not None and id(caches) == self.list_id and self.first() is caches[0]:
            return True
        return cache_key(caches) == self.key

    def step(self, tok: torch.Tensor, n: int, caches: Sequence[BaseCache]) -> torch.Tensor:
        """Replay at cache length `n` with tokens `tok` `[B, 1]`; logits `[B, vocab]` fp32
        (a copy), the caches advanced by one."""
        self.tokens.copy_(tok)
        self.pos.fill_(n)
        self.length.fill_(n + 1)
        self.graph.replay()
        for c in caches:
            c.advance(1)
        return self.logits.clone()

    def step_greedy(self, tok: torch.Tensor, n: int, caches: Sequence[BaseCache]) -> torch.Tensor:
        """Replay the greedy step at cache length `n`; returns `tokens` (the next ids). The
        device counters are set from the host only when they do not already say `n`, and
        `tok` is copied in only when it is not `tokens` itself."""
        if tok.data_ptr() != self.tokens.data_ptr():
            self.tokens.copy_(tok)
        if self.n != n:
            self.pos.fill_(n)
            self.length.fill_(n + 1)
        self.graph.replay()
        for c in caches:
            c.advance(1)
        self.n = n + 1
        return self.tokens


def decode_step_fn(
    model: DecoderModel,
    caches: Sequence[BaseCache],
    tokens: torch.Tensor,
    pos: torch.Tensor,
    length: torch.Tensor,
    compile: bool | str = False,
    greedy: bool = False,
) -> Callable[[], torch.Tensor]:
    """The decode step a graph captures: reads `tokens` `[B, 1]`, `pos` `[1]` (the slot to
    write) and `length` int32 `[B]` (tokens after the write) from device tensors, writes
    K/V at `pos`, returns logits `[B, vocab]` float32. Host cache lengths are not advanced.
    greedy: instead the logits' argmax (kvtax.models.argmax) is written into `tokens`,
    `pos` and `length` go up by one, and `tokens` is returned (one launch for all three).

    compile: torch.compile the model call (True: inductor; a string names the backend).
    Its guards are checked only while warming up and capturing, all at the same step, so
    the compiled code is traced once; replays of the captured graph skip Python entirely.
    """
    layers = list(caches)
    fwd: Callable = model
    if compile:
        backend = "inductor" if compile is True else compile
        fwd = torch.compile(model, backend=backend, dynamic=False)

    def step() -> torch.Tensor:
        out = fwd(tokens, layers, pos, write_pos=pos, length_t=length)
        if greedy:
            return argmax.argmax_rows(out[:, -1], out=tokens, advance=(pos, length))
        return out[:, -1].float()

    return step


def leaves(cache: BaseCache | HybridCache) -> list[BaseCache]:
    """The caches holding one layer's storage: a hybrid cache's parts, else the cache."""
    return cache.parts if isinstance(cache, HybridCache) else [cache]


def cache_key(caches: Sequence[BaseCache]) -> tuple:
    """Everything a captured graph baked in: storage addresses (the key staging ring and
    a hybrid cache's key shift too), ring geometry, formats."""
    key = []
    for c in caches:
        for part in leaves(c):
            s = part.store
            if s is None:
                return ()
            ptrs = [t.data_ptr() for t in s.k.parts() + s.v.parts()]
            if part.blocks is not None and part.blocks.buf is not None:
                ptrs.append(part.blocks.buf.data_ptr())
            key.append((type(part), part.spec, s.capacity, getattr(part, "ring", 0),
                        getattr(part, "sinks", 0), s.batch, tuple(ptrs)))
        shift = getattr(c, "key_shift", None)
        key.append((type(c), None if shift is None else shift.data_ptr()))
    return tuple(key)


def graph_blocker(model: DecoderModel, caches: Sequence[BaseCache]) -> str | None:
    """None when a decode step over `caches` can be captured safely, else why not."""
    parts = [p for c in caches for p in leaves(c)]
    if any(p.store is None for p in parts):
        return "the caches are empty (prefill first)"
    for c in caches:
        why = c.device_write_blocker()
        if why is not None:
            return why
    if any(p.store.growable for p in parts):  # type: ignore[union-attr]
        return ("a cache may grow (storage would move under the graph); make caches with "
                "capacity = prompt + max new tokens")
    for layer, c in zip(model.layers, caches):
        view = c.view()
        lens = torch.zeros(view.batch, dtype=torch.int32, device=view.device)
        view = view.at_length(view.length, lens)
        q = torch.empty(view.batch, model.config.num_heads, 1, view.head_dim, dtype=view.dtype,
                        device=view.device)
        reason = attention_blocker(layer.attn.attn_fn, q, view)
        if reason is not None:
            return reason
    return None


def attention_blocker(fn: Callable, q: torch.Tensor, view: object) -> str | None:
    """Why a captured step cannot call `fn(q, view)` with device lengths (None: it can).

    kvtax's `attention` needs its Triton kernels (the reference reads the host length),
    for a HybridView on every part and with decode rows (its fused decode,
    `dispatch.hybrid_decode`); a swapped-in function (the harness's baselines) is
    graph-safe only where it says so with `fn.graph_blocker(q, view) -> str | None`, and
    reads no hybrid cache."""
    name = getattr(fn, "__name__", type(fn).__name__)
    if fn is not attention:
        check = getattr(fn, "graph_blocker", None)
        if check is None:
            return f"the attention function {name} reads the cache length on the host"
        if isinstance(view, HybridView):
            return f"the attention function {name} does not read hybrid caches"
        return check(q, view)
    try:
        from kvtax.attention import triton_api
        from kvtax.attention.launch_table import decode_rows
    except ImportError as exc:
        return f"the Triton kernels are unavailable ({exc}); the reference is not graph-safe"
    if isinstance(view, HybridView):
        for part in view.parts:
            reason = triton_api.unsupported_reason(q, part.view)
            if reason is not None:
                return f"the kernels cannot serve a hybrid layer's part ({reason})"
            if not decode_rows(q, part.view):  # else the per-part path: never captured
                return "a hybrid layer's decode rows take the prefill kernel"
        return None
    reason = triton_api.unsupported_reason(q, view)
    return None if reason is None else f"the kernels cannot serve a layer ({reason})"


def clear_unwritten(model: DecoderModel, caches: Sequence[BaseCache]) -> None:
    """Zero the never-written slots of layers whose attention is not kvtax's: those (the
    baselines) read every slot behind a mask, and `torch.empty` storage may hold NaN, which
    a mask does not cancel (NaN · 0). Slots the graph writes later are overwritten then."""
    for layer, c in zip(model.layers, caches):
        if layer.attn.attn_fn is attention:
            continue
        for part in leaves(c):
            if part.store is None:
                continue
            held = part.view().num_slots
            for t in part.store.k.parts() + part.store.v.parts():
                t[:, :, held:].zero_()
