"""int4w-c64's channel order chosen on the device (kvtax.formats.order_triton) against
`channel_order` in torch: equal orders at block 0, untouched past it, and equal caches
after decode steps through block 0 and beyond. On CPU the kernel runs through Triton's
interpreter (tests/conftest.py); with CUDA compiled.
"""

from __future__ import annotations

import pytest
import torch

from kvtax.cache import FullCache
from kvtax.formats import order_triton
from kvtax.formats.widest import channel_order
from tests.support.device import DEVICE

pytestmark = pytest.mark.kernels


def _staged(b: int, h: int, rows: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Staged keys with shared ranges (ties), a constant channel and a NaN."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (b, h, rows, d), generator=gen).float()
    x = x * torch.randint(1, 4, (d,), generator=gen).float()
    x[..., 2] = 0.5
    x[..., : d // 4] += torch.randn(b, h, rows, d // 4, generator=gen)
    x[0, 0, 3, 9] = float("nan")
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("d, dtype", [(64, torch.float32), (128, torch.float16),
                                      (192, torch.bfloat16), (256, torch.bfloat16)])
@pytest.mark.parametrize("pos", [0, 5, 63, 64, 200])
def test_order_equals_channel_order_at_block_zero_only(d, dtype, pos):
    buf = _staged(2, 3, 320, d, dtype, seed=d + pos)
    before = torch.stack([torch.randperm(d) for _ in range(6)]).view(2, 3, d).to(DEVICE)
    order = before.clone()
    pos_t = torch.tensor([pos], device=DEVICE)
    assert order_triton.unsupported_reason(buf, pos_t, order) is None
    order_triton.choose_order(buf, pos_t, order)
    if pos >= 64:
        assert torch.equal(order, before)
        return
    rows = torch.arange(64).clamp(max=pos).to(DEVICE)  # the block padded with pos
    assert torch.equal(order, channel_order(buf.index_select(2, rows)))


def test_decode_through_block_zero_matches_torch():
    """Two q4-body caches, a 3-token prompt, 70 decode steps: the device-side choice and
    torch's leave every byte of storage and the order equal."""
    b, h, d, n = 1, 2, 128, 73
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(b, h, n, d, generator=gen) * torch.linspace(0.2, 4, d)).half().to(DEVICE)
    v = torch.randn(b, h, n, d, generator=gen).half().to(DEVICE)
    caches = [FullCache("k4w-c64v4", capacity=128) for _ in range(2)]
    for c in caches:
        c.fused_store = False
        c.append(k[:, :, :3], v[:, :, :3])
    caches[0].blocks.device_order = False
    caches[1].blocks.device_order = True
    for t in range(3, n):
        for c in caches:
            c.write_at(k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([t], device=DEVICE))
            c.advance(1)
        want, got = caches[0], caches[1]
        assert torch.equal(want.blocks.order, got.blocks.order), t
        for a, g in zip(want.store.k, got.store.k):
            assert torch.equal(a[:, :, :(t // 64 + 1) * 64], g[:, :, :(t // 64 + 1) * 64]), t


def test_reasons():
    buf = torch.zeros(1, 2, 320, 128, device=DEVICE)
    pos = torch.tensor([0], device=DEVICE)
    assert "int64" in order_triton.unsupported_reason(buf, pos, torch.zeros(1, 2, 128))
    assert ">= 64 rows" in order_triton.unsupported_reason(
        buf[:, :, :10], pos, torch.zeros(1, 2, 128, dtype=torch.int64))
