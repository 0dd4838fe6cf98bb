"""KV storage formats: fp16/bf16/fp32, int8/int4 (affine, group-wise), fp8 (e4m3: scale per
token `fp8`, per tensor `fp8-pt`), int4-c64 keys (per channel over 64-token blocks), int4w-c64
keys (int4-c64 plus a fifth bit on the widest 3/8 channels of each sequence's first
block).

    >>> from kvtax.formats import KVSpec, parse_format
    >>> fmt = parse_format("int4")
    >>> q = fmt.quantize(k)              # k [B, H, T, D] → QTensor(codes, scales, biases)
    >>> k_hat = fmt.dequantize(q)        # [B, H, T, D] float32
    >>> KVSpec.parse("k8v4").bytes_per_token(128)   # K int8 + V int4, one KV head
"""

from kvtax.formats.affine import GROUP_SIZES, AffineFormat
from kvtax.formats.base import KVFormat, QTensor, check_input
from kvtax.formats.channel import ChannelBlockFormat
from kvtax.formats.floats import FloatFormat
from kvtax.formats.fp8 import FP8Format, FP8TensorFormat
from kvtax.formats.rotation import hadamard, rotate
from kvtax.formats.widest import WidestBitFormat
from kvtax.formats.spec import (
    DEFAULT_KV,
    FORMAT_NAMES,
    KVSpec,
    default_kv,
    fit_head_dim,
    parse_format,
)

__all__ = [
    "DEFAULT_KV",
    "default_kv",
    "fit_head_dim",
    "AffineFormat",
    "ChannelBlockFormat",
    "FORMAT_NAMES",
    "FP8Format",
    "FP8TensorFormat",
    "FloatFormat",
    "GROUP_SIZES",
    "KVFormat",
    "KVSpec",
    "QTensor",
    "check_input",
    "hadamard",
    "rotate",
    "parse_format",
    "WidestBitFormat",
]
