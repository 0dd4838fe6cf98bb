"""The staging launch: quantized slots dequantized into a plain fp16 / bf16 buffer.

`staged.staged_launch` reads a long prefix through these buffers (and the fused kernel's
plain-format path) instead of dequantizing every key tile once per query tile.
"""

from __future__ import annotations

import torch

from kvtax.attention.kernels.stage import stage_slots_kernel
from kvtax.attention.launch import storage_parts
from kvtax.attention.support import format_code, half_width
from kvtax.errors import ShapeError
from kvtax.formats import KVFormat

STAGE_TILE = 64  # slots per stage_slots_kernel program (inside one int4-c64 block)


def launch_stage(qt, fmt: KVFormat, start: int, n: int, out: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Dequantize slots `[start, start + n)` of QTensor `qt` (storage `[B, H_kv, slots,
    width]` in `fmt`) into rows `[0, n)` of `out` `[B, H_kv, n_pad, D]` (fp16 / bf16 /
    float32, last stride 1, n_pad a multiple of STAGE_TILE >= n; rows past n get finite
    filler). The kernels' own dequantization (kernels/stage.py). Returns out."""
    code = format_code(fmt)
    b, h, n_pad, d = out.shape
    if code is None or n_pad % STAGE_TILE or n_pad < n or out.stride(-1) != 1:
        raise ShapeError(f"cannot stage {n} slots of {fmt.name} into {tuple(out.shape)}")
    if code[0] in (4, 5, 7) and start % 64:
        raise ShapeError(f"{fmt.name} stages from a 64-slot block boundary, not {start}")
    kc, ks, kb = storage_parts(qt)
    stage_slots_kernel[(n_pad // STAGE_TILE, b * h)](
        kc, ks, kb, out, start, n, h, *kc.stride()[:3], *ks.stride()[:3], *out.stride()[:3],
        HEAD_DIM=d, HALF=half_width(d), BLOCK_N=STAGE_TILE, FMT=code[0], GS=max(code[1], 1),
        num_warps=4,
    )
    return out
