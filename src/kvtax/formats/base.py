"""The contract every KV storage format follows.

A format turns K or V vectors `[..., head_dim]` into a `QTensor`: codes plus optional
per-group scales and biases, each stored in its own array so that a kernel reads
contiguous, 16-byte-aligned code rows (see ARCHITECTURE.md: an odd row pitch made a
peer's decode 1.7x slower).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvtax.errors import FormatError, NonFiniteError

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class QTensor(NamedTuple):
    """Quantized storage of K or V.

    codes:  `[..., code_width]` (uint8 for int formats, float8_e4m3fn for fp8, the float
            dtype itself for fp16/bf16/fp32).
    scales: `[..., n_scales]` in the model dtype, or None.
    biases: `[..., n_groups]` in the model dtype, or None.
    """

    codes: torch.Tensor
    scales: torch.Tensor | None = None
    biases: torch.Tensor | None = None

    def parts(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in self if t is not None)

    def slice_tokens(self, start: int, end: int) -> "QTensor":
        """Token slice along dim -2 (storage is `[B, H, T, width]`)."""
        return QTensor(*(None if t is None else t[..., start:end, :] for t in self))

    def index_tokens(self, index: torch.Tensor) -> "QTensor":
        """Gather tokens along dim -2 by a 1-D index tensor."""
        return QTensor(*(None if t is None else t.index_select(-2, index) for t in self))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())


@dataclass(frozen=True)
class KVFormat(ABC):
    """One storage format for K or V. Subclasses are frozen dataclasses (hashable, comparable)."""

    @property
    @abstractmethod
    def name(self) -> str:
        """User-facing name, e.g. `int4` or `int4-g32`; `parse_format(name)` gives it back."""

    @property
    @abstractmethod
    def bits(self) -> int:
        """Bits per stored code (16, 8 or 4)."""

    @property
    def is_quantized(self) -> bool:
        return self.bits < 16

    @abstractmethod
    def code_width(self, head_dim: int) -> int:
        """Elements per token row in `codes`."""

    @abstractmethod
    def scale_width(self, head_dim: int) -> int:
        """Elements per token row in `scales` (0 when there are none)."""

    @abstractmethod
    def bias_width(self, head_dim: int) -> int:
        """Elements per token row in `biases` (0 when there are none)."""

    @abstractmethod
    def code_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """dtype of the `codes` array."""

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> QTensor:
        """Encode `x` `[..., head_dim]` (fp16/bf16/fp32); scales take `x.dtype`."""

    @abstractmethod
    def dequantize(self, q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode a `QTensor` back to `[..., head_dim]` in `dtype`."""

    def read(self, q: QTensor, start: int, end: int,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored tokens `[start, end)` (dim -2) decoded: `[..., end - start, head_dim]`.
        Readers go through this (not `dequantize(q.slice_tokens(...))`) so a format whose
        metadata spans several token rows (kvtax.formats.channel) can read its blocks."""
        return self.dequantize(q.slice_tokens(start, end), dtype)

    def read_index(self, q: QTensor, index: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored tokens at `index` (1-D, along dim -2) decoded: `[..., len(index), D]`."""
        return self.dequantize(q.index_tokens(index), dtype)

    def check(self, head_dim: int) -> None:
        """Raise FormatError when this format cannot store rows of `head_dim`."""
        if head_dim <= 0:
            raise FormatError(f"head_dim must be positive, got {head_dim}")

    def bytes_per_token(self, head_dim: int, model_dtype: torch.dtype = torch.float16) -> int:
        """Exact resident bytes for one token of one KV head: codes + scales + biases."""
        return sum(self.part_bytes(head_dim, model_dtype))

    def part_bytes(
        self, head_dim: int, model_dtype: torch.dtype = torch.float16
    ) -> tuple[int, int, int]:
        """(codes, scales, biases) bytes of one token of one KV head; scales and biases
        are stored in the model dtype (`parse_format("int8").part_bytes(128)`: (128, 4, 4))."""
        self.check(head_dim)
        meta = _itemsize(model_dtype)
        return (self.code_width(head_dim) * _itemsize(self.code_dtype(model_dtype)),
                self.scale_width(head_dim) * meta, self.bias_width(head_dim) * meta)

    def allocate(
        self,
        prefix: tuple[int, ...],
        head_dim: int,
        model_dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> QTensor:
        """Uninitialised storage `[*prefix, width]` for each part of this format."""
        self.check(head_dim)
        codes = torch.empty(
            *prefix, self.code_width(head_dim), dtype=self.code_dtype(model_dtype), device=device
        )
        sw, bw = self.scale_width(head_dim), self.bias_width(head_dim)
        scales = torch.empty(*prefix, sw, dtype=model_dtype, device=device) if sw else None
        biases = torch.empty(*prefix, bw, dtype=model_dtype, device=device) if bw else None
        return QTensor(codes, scales, biases)

    def __str__(self) -> str:
        return self.name


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_input(x: torch.Tensor, fmt: KVFormat, *, check_finite: bool = True) -> None:
    """Validate a K/V tensor before quantizing: dtype, head_dim, finiteness."""
    if x.dtype not in MODEL_DTYPES:
        raise FormatError(
            f"{fmt.name}: K/V must be float16, bfloat16 or float32, got {x.dtype}; "
            "cast the tensor first"
        )
    fmt.check(x.shape[-1])
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteError(
            f"{fmt.name}: K/V holds {bad} NaN/Inf value(s) of {x.numel()}; quantizing them "
            "would poison the scales of their whole group. Find where the model overflowed "
            "(often fp16 activations: try bfloat16)"
        )
