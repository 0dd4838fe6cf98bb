"""Key staging for formats quantized over token blocks (int4-c64, kvtax.formats.channel).

Such a format writes a block's codes and metadata together, so a cache keeps the keys of
the open (partial) block, and a short history before it, in the model dtype. Every append
re-quantizes the blocks it touches from those keys (the partial one padded to 64 rows by
repeating its last valid token, which leaves each channel's min/max unchanged). Block b's
codes are thus a pure function of the tokens it holds, however the prompt was chunked, and
the storage is valid after every append.

The staged keys live in a ring of `rows` rows allocated once (position p at row p % rows),
so the same buffer serves eager appends (host positions) and `write_at` (a device
position, inside a CUDA graph): the graph writes its token's row and re-quantizes the open
block from the ring, and the host only counts the tokens (`advance`). Trims and later
appends then read the keys the graph wrote, with no copy back.

int4w-c64 keys (kvtax.formats.widest) also keep the sequence's channel order, chosen from
block 0: each re-quantization of block 0 chooses it afresh (so a trim into block 0 forgets
the dropped tokens' influence), every later block is quantized in it.

Within one prefill chunk a query may see a key of the open block whose scales already
include later tokens of that chunk. A hybrid cache with >= 63 recent fp16 tokens (q4 keeps
128) never reads the open block from the body, so there every key read is final and
causal; a plain int4-c64 cache accepts that small look-ahead in its open block.

    >>> staged = KeyBlocks(ChannelBlockFormat())
    >>> first, q = staged.extend(k, p0=0)      # k [B, H, 100, D] → q covers 128 rows at 0
    >>> pos, q = staged.write_at(k1, pos_t)    # k1 [B, H, 1, D] at device pos_t [1]
    >>> staged.advance(1)                      # outside the graph
"""

from __future__ import annotations

import torch

from kvtax.errors import CapacityError
from kvtax.formats import QTensor
from kvtax.formats.channel import ChannelBlockFormat
from kvtax.formats.widest import WidestBitFormat, channel_order

# Model-dtype keys kept behind the newest token: a trim re-quantizes the new last block
# exactly as if the dropped tokens never came, as long as it drops no more than this.
# 256 covers a recall question plus its answer; deeper trims raise CapacityError.
HISTORY = 256


class KeyBlocks:
    """The model-dtype keys of positions `[start, end)` in a ring `buf` of `rows` rows:
    `history` tokens and the open block behind the end."""

    def __init__(self, fmt: ChannelBlockFormat, history: int = HISTORY) -> None:
        self.fmt, self.history = fmt, history
        # history + a block, in whole blocks (a block's rows then never wrap): a trim of
        # `history` tokens still finds its new last block's first key, even where a
        # write_at at the end replaced the oldest row
        self.rows = -(-history // fmt.block) * fmt.block + fmt.block
        self.buf: torch.Tensor | None = None  # [B, H, rows, D], allocated once
        # int4w-c64: the channel order [B, H, D] int64, written in place (a graph reads it)
        self.order: torch.Tensor | None = None
        # write_at's order choice at block 0 on the device (kvtax.formats.order_triton):
        # None where the tensors are on CUDA, True forces it (the interpreter in tests)
        self.device_order: bool | None = None
        self.start = self.end = 0

    @property
    def block(self) -> int:
        return self.fmt.block

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.nbytes

    def extend(self, k: torch.Tensor, p0: int) -> tuple[int, QTensor]:
        """Append keys `k` `[B, H, n, D]` of positions `[p0, p0 + n)` (p0 = tokens held).

        Returns `(first, q)`: `q` holds the whole blocks covering `[first, p0 + n)`,
        `first = p0 // 64 * 64`, codes `[B, H, rows, D/2]` with rows a multiple of 64,
        ready to write over storage slots of positions `[first, first + rows)`."""
        if self.buf is None or p0 == 0:
            self._allocate(k)
            self.start = self.end = 0
        if p0 != self.end:
            raise RuntimeError(f"staged keys end at {self.end}, append starts at {p0}")
        first = p0 // self.block * self.block
        x = torch.cat([self._read(first, p0), k], dim=-2) if p0 > first else k
        q = self._quantize(x, first)
        n = k.shape[-2]
        keep = min(n, self.rows)  # a chunk longer than the ring leaves its last rows
        self._store(k[..., n - keep:, :], p0 + n - keep)
        self.advance(n)
        return first, q

    def write_at(self, k: torch.Tensor, pos_t: torch.Tensor) -> tuple[torch.Tensor, QTensor]:
        """Stage key `k` `[B, H, 1, D]` of the position in device tensor `pos_t` `[1]`
        (int64, = end) and re-quantize its block: graph-safe (no host read, no storage moves).

        Returns `(pos, q)`: the block's positions `[64]` int64 on the device and its codes
        `[B, H, 64, D/2]` (and metadata), rows past `pos_t` padded with `k` as `extend` pads.
        `end` is not moved: `advance(1)` counts the token outside the graph."""
        assert self.buf is not None, "write_at needs staged keys: extend first"
        # No host state changes here (a compiled step would guard on it); `trim` assumes
        # the row of position end - rows may be overwritten already.
        self.buf.index_copy_(2, torch.remainder(pos_t, self.rows), k)
        lanes = torch.arange(self.block, device=pos_t.device)
        first = pos_t - torch.remainder(pos_t, self.block)  # [1]
        # rows first .. pos, then pos repeated: _quantize's padding, same min/max per channel
        rows = torch.remainder(first + torch.minimum(lanes, pos_t - first), self.rows)
        x = self.buf.index_select(2, rows)
        if self.order is None:
            return first + lanes, self.fmt.quantize(x)
        # block 0 chooses the order afresh, any other block keeps it: no host branch
        if not self._choose_order_on_device(pos_t):
            self.order.copy_(torch.where(first == 0, channel_order(x), self.order))
        return first + lanes, self.fmt.quantize(x, self.order)

    def _choose_order_on_device(self, pos_t: torch.Tensor) -> bool:
        """write_at's order choice by one kernel that does nothing past block 0 (torch
        computes it every step); False where it does not apply."""
        assert self.buf is not None and self.order is not None
        if self.device_order is False or (self.device_order is None and not self.buf.is_cuda):
            return False
        try:
            from kvtax.formats import order_triton
        except ImportError:  # no (working) Triton: torch serves
            return False
        if order_triton.unsupported_reason(self.buf, pos_t, self.order) is not None:
            return False
        order_triton.choose_order(self.buf, pos_t, self.order)
        return True

    def advance(self, n: int) -> None:
        """Count `n` tokens staged at `[end, end + n)` (by `extend` or `write_at`)."""
        self.end += n
        self.start = max(self.start, self.end - self.rows)

    def trim(self, length: int) -> tuple[int, QTensor] | None:
        """Forget positions `>= length`. Returns `(first, q)` re-quantizing the new last
        block (None when `length` ends a block); CapacityError when the history no longer
        holds that block's first token (nothing changed then)."""
        first = length // self.block * self.block
        if self.buf is None or length >= self.end:
            return None
        # a write_at at `end` (a graph's warm-up, say) may have replaced position end - rows
        if first < max(self.start, self.end + 1 - self.rows):
            if length != first:
                raise CapacityError(
                    f"cannot drop {self.end - length} tokens: int4-c64 keys keep "
                    f"{self.history} model-dtype keys to re-quantize the last block after a "
                    "trim. Re-run the prompt")
            self.start = self.end = length  # a whole-block cut: nothing to re-quantize
            return None
        self.end = length
        if length == first:
            return None
        return first, self._quantize(self._read(first, length), first)

    def reset(self) -> None:
        self.start = self.end = 0  # the ring stays allocated: a captured graph writes it

    def _allocate(self, k: torch.Tensor) -> None:
        """The ring for keys like `k` `[B, H, n, D]`, kept when one already fits."""
        b, h, _, d = k.shape
        buf = self.buf
        if buf is None or buf.shape != (b, h, self.rows, d) or buf.dtype != k.dtype or \
                buf.device != k.device:
            self.buf = torch.zeros(b, h, self.rows, d, dtype=k.dtype, device=k.device)
        if isinstance(self.fmt, WidestBitFormat) and (
                self.order is None or self.order.shape != (b, h, d)
                or self.order.device != k.device):
            self.order = torch.arange(d, device=k.device).repeat(b, h, 1)

    def _positions(self, a: int, b: int) -> torch.Tensor:
        """Ring rows of positions `[a, b)`, int64 on the ring's device."""
        assert self.buf is not None
        return torch.arange(a, b, device=self.buf.device) % self.rows

    def _read(self, a: int, b: int) -> torch.Tensor:
        """Staged keys of positions `[a, b)` (start <= a, b <= end): `[B, H, b - a, D]`."""
        assert self.buf is not None
        return self.buf.index_select(2, self._positions(a, b))

    def _store(self, k: torch.Tensor, p0: int) -> None:
        """Keys `[B, H, n <= rows, D]` of positions `[p0, p0 + n)` into their ring rows."""
        assert self.buf is not None
        self.buf.index_copy_(2, self._positions(p0, p0 + k.shape[-2]), k)

    def _quantize(self, x: torch.Tensor, first: int) -> QTensor:
        """Keys `[..., n, D]` from position `first` (a block start) → whole blocks, the last
        padded with its last valid token (same per-channel min/max, so the same scales)."""
        pad = -x.shape[-2] % self.block
        if pad:
            x = torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], pad, x.shape[-1])], dim=-2)
        if self.order is None:
            return self.fmt.quantize(x)
        if first == 0 and x.shape[-2]:  # an empty append (transformers' warm-up) keeps it
            self.order.copy_(channel_order(x[..., :self.block, :]))
        return self.fmt.quantize(x, self.order)
