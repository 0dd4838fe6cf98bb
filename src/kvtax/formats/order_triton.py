"""Entry point of the device-side choice of int4w-c64's channel order at block 0
(`kernels/widest_order.py`): one launch that returns at once past block 0, where torch
recomputes the order every decode step (kvtax.cache.blocks.KeyBlocks.write_at).

    >>> from kvtax.formats import order_triton
    >>> order_triton.unsupported_reason(buf, pos_t, order)   # None: it can run
    >>> order_triton.choose_order(buf, pos_t, order)          # writes order [B, H, D] in place

Writes what `torch.where(pos_t < 64, channel_order(block 0), order)` gives
(tests/formats/test_order_kernel.py). On CPU it runs only under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton

from kvtax.formats.kernels.widest_order import block0_order_kernel
from kvtax.formats.mutating_op import mutating_op


def _interpreting() -> bool:
    return type(block0_order_kernel).__name__ == "InterpretedFunction"


def unsupported_reason(buf: torch.Tensor, pos_t: torch.Tensor, order: torch.Tensor
                       ) -> str | None:
    """None when `choose_order` can serve these tensors, else why not."""
    if not (buf.is_cuda or _interpreting()):
        return "tensors are not on a CUDA device (on CPU the kernel runs only interpreted)"
    if buf.dim() != 4 or buf.shape[2] < 64 or buf.stride(-1) != 1:
        return f"staged keys {tuple(buf.shape)} are not [B, H, >= 64 rows, D] with contiguous rows"
    if tuple(order.shape) != (buf.shape[0], buf.shape[1], buf.shape[3]) \
            or order.dtype != torch.int64 or order.stride(-1) != 1:
        return f"order {tuple(order.shape)} {order.dtype} is not [B, H, D] int64"
    if pos_t.numel() != 1 or pos_t.device != buf.device:
        return "the position must be one element on the keys' device"
    return None


def choose_order(buf: torch.Tensor, pos_t: torch.Tensor, order: torch.Tensor) -> None:
    """Staged keys `buf` `[B, H, rows, D]` (row p holds position p while p < rows), device
    position `pos_t` `[1]`: where pos_t < 64, `order` `[B, H, D]` int64 becomes
    `channel_order` of positions 0 .. pos (the block padded with pos); else unchanged.
    Unchecked: callers run `unsupported_reason` first."""
    if torch.compiler.is_compiling():
        _order_op(buf, pos_t, order)
        return
    _launch(buf, pos_t, order)


def _launch(buf: torch.Tensor, pos_t: torch.Tensor, order: torch.Tensor) -> None:
    b, h, rows, d = buf.shape
    d_p = triton.next_power_of_2(d)
    block0_order_kernel[(b * h,)](
        pos_t, rows, h, buf, *buf.stride()[:3], order, *order.stride()[:2],
        HEAD_DIM=d, D_P=d_p, CH=min(32, d_p), num_warps=4,
    )


# torch.compile sees the choice as one opaque op that writes `order`
# (kvtax.formats.mutating_op says why).
_order_op = mutating_op("block0_order(Tensor buf, Tensor pos_t, Tensor(a2!) order) -> ()",
                        _launch)
