"""The one map from dtype names (command lines, cells, config files) to torch dtypes.

    >>> torch_dtype("bf16"), torch_dtype("float32")
    (torch.bfloat16, torch.float32)
    >>> kv_name(torch.bfloat16)   # the unquantized KV format of a model in that dtype
    'bf16'
"""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_KV_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of `name` (case-insensitive); ValueError naming the choices."""
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use float32, float16 or bfloat16") from None


def kv_name(dtype: torch.dtype, default: str = "fp16") -> str:
    """The unquantized KV format name stored in `dtype` ("fp32", "fp16", "bf16")."""
    return _KV_NAMES.get(dtype, default)
