"""fp8 (e4m3) codes: `fp8` with one scale per token per head, `fp8-pt` with one per tensor.

`fp8`: `x ≈ scale * e4m3(x / scale)` with `scale = amax / 448`, so the largest element of
each row lands on e4m3's largest finite value. Codes are `float8_e4m3fn`; the scale is in
the model dtype (2 bytes for fp16/bf16 models), making 130 bytes per 128-dim row.
`fp8-pt`: vLLM's default fp8 KV cache, one scale (1.0) per tensor: 128 bytes per row.
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


@dataclass(frozen=True)
class FP8TensorFormat(FP8Format):
    """fp8 e4m3 with one scale per tensor, fixed at 1.0: vLLM's default `fp8` / `fp8_e4m3`
    kv_cache_dtype when no calibrated k_scale / v_scale is loaded. Exactly one byte per
    element, no scale array: `x ≈ e4m3(clamp(x, ±448))`.

    Why 1.0 and not a scale from the first chunk's absmax: e4m3's relative precision is the
    same at every normal magnitude (2^-6 .. 448), so a scale buys accuracy only for values
    outside that range, while a scale fixed by the prompt clips any later, larger token;
    1.0 is also what a vLLM user gets, which is the comparison this format exists for.

    Example: `FP8TensorFormat().quantize(k)` with `k` `[B, H, T, D]` gives codes
    `[B, H, T, D]` float8_e4m3fn and no scales; `bytes_per_token(128)` is 128.
    """

    @property
    def name(self) -> str:
        return "fp8-pt"

    def scale_width(self, head_dim: int) -> int:
        return 0

    def quantize(self, x: torch.Tensor) -> QTensor:
        self.check(x.shape[-1])
        codes = x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return QTensor(codes.contiguous(), None, None)

    def dequantize(self, q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return q.codes.to(dtype)
