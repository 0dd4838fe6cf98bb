"""Unquantized storage: fp16, bf16 and fp32 rows stored as they are."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtax.formats.base import KVFormat, QTensor

_FLOAT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class FloatFormat(KVFormat):
    """K/V kept in a float dtype: the baseline every quantized format is measured against.

    Example: `FloatFormat("bf16").quantize(k)` casts `k` `[..., D]` to bfloat16 codes.
    """

    kind: str = "fp16"

    def __post_init__(self) -> None:
        if self.kind not in _FLOAT_DTYPES:
            raise ValueError(f"unknown float format {self.kind!r}")

    @property
    def name(self) -> str:
        return self.kind

    @property
    def dtype(self) -> torch.dtype:
        return _FLOAT_DTYPES[self.kind]

    @property
    def bits(self) -> int:
        return self.dtype.itemsize * 8

    def code_width(self, head_dim: int) -> int:
        return head_dim

    def scale_width(self, head_dim: int) -> int:
        return 0

    def bias_width(self, head_dim: int) -> int:
        return 0

    def code_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.dtype

    def quantize(self, x: torch.Tensor) -> QTensor:
        return QTensor(x.to(self.dtype))

    def dequantize(self, q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return q.codes.to(dtype)
