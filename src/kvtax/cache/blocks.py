"""Key staging for formats quantized over token blocks (int4-c64, kvtax.formats.channel).

Such a format writes a block's codes and metadata together, so a cache keeps the keys of
the open (partial) block, and a short history before it, in the model dtype. Every append
re-quantizes the blocks it touches from those keys (the partial one padded to 64 rows by
repeating its last valid token, which leaves each channel's min/max unchanged). Block b's
codes are thus a pure function of the tokens it holds, however the prompt was chunked, and
the storage is valid after every append.

Within one prefill chunk a query may see a key of the open block whose scales already
include later tokens of that chunk. A hybrid cache with >= 63 recent fp16 tokens (q4 keeps
128) never reads the open block from the body, so there every key read is final and
causal; a plain int4-c64 cache accepts that small look-ahead in its open block.

    >>> staged = KeyBlocks(ChannelBlockFormat())
    >>> first, q = staged.extend(k, p0=0)      # k [B, H, 100, D] → q covers 128 rows at 0
"""

from __future__ import annotations

import torch

from kvtax.errors import CapacityError
from kvtax.formats import QTensor
from kvtax.formats.channel import ChannelBlockFormat

# Model-dtype keys kept behind the newest token: a trim re-quantizes the new last block
# exactly as if the dropped tokens never came, as long as it drops no more than this.
# 256 covers a recall question plus its answer; deeper trims raise CapacityError.
HISTORY = 256


class KeyBlocks:
    """The model-dtype keys of positions `[start, end)`: the open block and >= `history`
    tokens before the end, `start` a multiple of the block size."""

    def __init__(self, fmt: ChannelBlockFormat, history: int = HISTORY) -> None:
        self.fmt, self.history = fmt, history
        self.keys: torch.Tensor | None = None  # [B, H, end - start, D]
        self.start = 0

    @property
    def block(self) -> int:
        return self.fmt.block

    @property
    def end(self) -> int:
        return self.start + (0 if self.keys is None else self.keys.shape[-2])

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes

    def extend(self, k: torch.Tensor, p0: int) -> tuple[int, QTensor]:
        """Append keys `k` `[B, H, n, D]` of positions `[p0, p0 + n)` (p0 = tokens held).

        Returns `(first, q)`: `q` holds the whole blocks covering `[first, p0 + n)`,
        `first = p0 // 64 * 64`, codes `[B, H, rows, D/2]` with rows a multiple of 64,
        ready to write over storage slots of positions `[first, first + rows)`."""
        if self.keys is None or p0 == 0:
            self.keys, self.start = k[..., :0, :], 0
        if p0 != self.end:
            raise RuntimeError(f"staged keys end at {self.end}, append starts at {p0}")
        self.keys = torch.cat([self.keys, k], dim=-2)
        first = p0 // self.block * self.block
        q = self._quantize(self.keys[..., first - self.start:, :])
        self._drop_old()
        return first, q

    def trim(self, length: int) -> tuple[int, QTensor] | None:
        """Forget positions `>= length`. Returns `(first, q)` re-quantizing the new last
        block (None when `length` ends a block); CapacityError when the history no longer
        holds that block's first token (nothing changed then)."""
        first = length // self.block * self.block
        if self.keys is None or length >= self.end:
            return None
        if first < self.start:
            if length != first:
                raise CapacityError(
                    f"cannot drop {self.end - length} tokens: int4-c64 keys keep "
                    f"{self.history} model-dtype keys to re-quantize the last block after a "
                    "trim. Re-run the prompt")
            self.keys, self.start = self.keys[..., :0, :], length  # a whole-block cut
            return None
        self.keys = self.keys[..., : length - self.start, :]
        if length == first:
            return None
        return first, self._quantize(self.keys[..., first - self.start:, :])

    def reset(self) -> None:
        self.keys, self.start = None, 0

    def _quantize(self, x: torch.Tensor) -> QTensor:
        """Keys `[..., n, D]` from a block start → whole blocks, the last padded with its
        last valid token (same per-channel min/max, so the same scales)."""
        pad = -x.shape[-2] % self.block
        if pad:
            x = torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], pad, x.shape[-1])], dim=-2)
        return self.fmt.quantize(x)

    def _drop_old(self) -> None:
        """Keep whole blocks from the one holding position `end - history` on."""
        assert self.keys is not None
        keep = max(0, (self.end - self.history) // self.block * self.block)
        if keep > self.start:
            self.keys = self.keys[..., keep - self.start:, :].clone()
            self.start = keep
