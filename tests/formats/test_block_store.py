"""A hybrid body's decode write for block-quantized keys (kvtax.formats.block_store_triton)
against the torch path (`KeyBlocks.write_at` + the value's quantize and copy): after every
decode step the staging ring, the values and every key block but the open one are equal,
byte for byte; at the step that fills a block (and for int4w-c64, the channel order from
block 0's end on) everything is.

Two caches of one spec take the same prompt and the same decode tokens, one through each
path. Steps start inside block 0 (int4w-c64 chooses its channel order when it fills), cross
into later blocks and, in a sliding ring, wrap it. On CPU the kernel runs through Triton's
interpreter (tests/conftest.py); with CUDA compiled, against torch on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kvtax.cache import FullCache, SlidingCache
from kvtax.formats import block_store_triton as bst
from kvtax.formats import KVSpec
from tests.support.device import DEVICE

pytestmark = pytest.mark.kernels


def _keys(b: int, h: int, t: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """K-like rows `[b, h, t, d]`: outlier channels, a constant channel, exact ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, d, generator=gen) * torch.rand(b, t, h, 1, generator=gen) * 3
    x[..., 1] *= 15.0
    x[..., 3] = 0.5                                   # a constant channel: scale 1
    x[..., 5] = torch.remainder(torch.arange(t), 4).view(1, t, 1) * 0.125  # level ties
    return x.to(dtype).to(DEVICE).transpose(1, 2)     # as a decoder hands them over


def _parts(cache) -> list[torch.Tensor]:
    """Every tensor the write may touch (key codes, scales, biases first), as bytes."""
    parts = [t for q in (cache.store.k, cache.store.v) for t in q if t is not None]
    parts.append(cache.blocks.buf)
    if cache.blocks.order is not None:
        parts.append(cache.blocks.order)
    return [p.view(torch.uint8) if p.dtype != torch.int64 else p for p in parts]


def _storage(cache, open_slots: torch.Tensor | None) -> list[torch.Tensor]:
    """`_parts` with the key slots open_slots (the open block's) zeroed and the channel
    order left out with them (the torch path re-chooses it while block 0 is open)."""
    parts = [p.clone() for p in _parts(cache)]
    if open_slots is None:
        return parts
    d = cache.store.head_dim
    n_key = sum(t is not None for t in cache.store.k)
    parts[0][:, :, open_slots] = 0
    for m in parts[1:n_key]:  # block layout: a block's metadata spans its 64 rows
        m.view(*m.shape[:2], -1, 64 * m.shape[-1])[:, :, open_slots[0] // 64] = 0
    return parts[:-1] if cache.blocks.order is not None else parts


def _pair(spec: str, window: int | None):
    def make():
        if window is None:
            return FullCache(spec, capacity=256)
        return SlidingCache(spec, window=window, max_chunk=128)
    torch_path, fused = make(), make()
    torch_path.fused_store, fused.fused_store = False, True
    fused.open_block_read = False  # as a hybrid body
    return torch_path, fused


@pytest.mark.parametrize("spec, d, dtype, window, prompt, steps", [
    ("k4w-c64v4", 128, torch.float16, None, 3, 70),    # q4's body: order chosen, then kept
    ("k4w-c64v4", 256, torch.bfloat16, None, 60, 8),   # Gemma-3's head_dim across block 0's end
    ("k4w-c64v4", 64, torch.float32, None, 1, 66),
    ("k4-c64v4", 128, torch.bfloat16, None, 62, 5),
    ("k4-c64v8", 64, torch.float16, None, 127, 3),
    ("k4-c64v4", 128, torch.float16, 64, 250, 12),     # a sliding ring (256 slots) wraps
    ("k4w-c64v4", 192, torch.float16, 64, 5, 60),      # head_dim not a power of two
])
def test_fused_block_write_equals_torch(spec, d, dtype, window, prompt, steps):
    b, h = 2, 2
    k = _keys(b, h, prompt + steps, d, dtype, seed=d + prompt)
    v = _keys(b, h, prompt + steps, d, dtype, seed=d + prompt + 1)
    torch_path, fused = _pair(spec, window)
    for c in (torch_path, fused):
        for p in range(0, prompt, 128):
            c.append(k[:, :, p:min(p + 128, prompt)], v[:, :, p:min(p + 128, prompt)])
    for want, got in zip(_parts(torch_path), _parts(fused)):
        got.copy_(want)  # the same prompt; slots never written start equal too
    if window is not None:
        assert fused._ring_layout() == (0, 256)

    def no_torch_path(*args):
        raise AssertionError("the fused cache took the torch path")
    fused.blocks.write_at = no_torch_path
    assert bst.unsupported_reason(
        k[:, :, :1], v[:, :, :1], fused.blocks.buf, fused.blocks.order, fused.store.k,
        fused.store.v, fused.spec, sinks=fused._ring_layout()[0],
        ring=fused._ring_layout()[1]) is None
    for t in range(prompt, prompt + steps):
        pos_t = torch.tensor([t], device=DEVICE)
        for c in (torch_path, fused):
            c.write_at(k[:, :, t:t + 1], v[:, :, t:t + 1], pos_t)
            c.advance(1)
        first = t - t % 64
        filled = t % 64 == 63
        open_slots = None if filled else fused._slot_of(torch.arange(first, first + 64,
                                                                     device=DEVICE))
        if not filled and torch_path.blocks.order is not None and first > 0:
            assert torch.equal(torch_path.blocks.order, fused.blocks.order)
        for n, (want, got) in enumerate(zip(_storage(torch_path, open_slots),
                                            _storage(fused, open_slots))):
            assert torch.equal(want, got), f"{spec} d={d} step {t}: part {n} differs"


def test_reasons_name_what_the_kernel_does_not_take():
    k = torch.zeros(1, 1, 1, 128, device=DEVICE)
    full = FullCache("k3-c64v4", capacity=64)
    full.append(torch.zeros(1, 1, 4, 128, device=DEVICE), torch.zeros(1, 1, 4, 128, device=DEVICE))
    assert not bst.serves(full.spec)  # int3-c64 keys: the torch path
    assert "not int4-c64" in bst.unsupported_reason(
        k, k, full.blocks.buf, None, full.store.k, full.store.v, full.spec)
    assert bst.serves(KVSpec.parse("k4w-c64v4")) and not bst.serves(KVSpec.parse("int4"))
    c = FullCache("k4w-c64v4", capacity=64)
    c.append(torch.zeros(1, 1, 4, 128, device=DEVICE), torch.zeros(1, 1, 4, 128, device=DEVICE))
    two = torch.zeros(1, 1, 2, 128, device=DEVICE)
    assert "one [B, H, 1, D] token" in bst.unsupported_reason(
        two, two, c.blocks.buf, c.blocks.order, c.store.k, c.store.v, c.spec)
    assert "channel order" in bst.unsupported_reason(
        k, k, c.blocks.buf, None, c.store.k, c.store.v, c.spec)
