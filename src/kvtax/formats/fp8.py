"""fp8 (e4m3) codes with one scale per token per head.

`x ≈ scale * e4m3(x / scale)` with `scale = amax / 448`, so the largest element of each
row lands on e4m3's largest finite value. Codes are `float8_e4m3fn`; the scale is in the
model dtype (2 bytes for fp16/bf16 models), making 130 bytes per 128-dim row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtax.formats.base import KVFormat, QTensor

E4M3_MAX = 448.0


@dataclass(frozen=True)
class FP8Format(KVFormat):
    """fp8 e4m3 with a per-token-per-head scale.

    Example: `FP8Format().quantize(k)` with `k` `[B, H, T, D]` gives codes
    `[B, H, T, D]` float8_e4m3fn and scales `[B, H, T, 1]` in `k.dtype`.
    """

    @property
    def name(self) -> str:
        return "fp8"

    @property
    def bits(self) -> int:
        return 8

    def code_width(self, head_dim: int) -> int:
        return head_dim

    def scale_width(self, head_dim: int) -> int:
        return 1

    def bias_width(self, head_dim: int) -> int:
        return 0

    def code_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.float8_e4m3fn

    def quantize(self, x: torch.Tensor) -> QTensor:
        self.check(x.shape[-1])
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / E4M3_MAX).to(x.dtype)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        codes = (xf / scale.float()).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return QTensor(codes.contiguous(), scale.contiguous(), None)

    def dequantize(self, q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        assert q.scales is not None
        return (q.codes.to(torch.float32) * q.scales.float()).to(dtype)
