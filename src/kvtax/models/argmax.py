"""Greedy token choice on the GPU: the argmax of each logits row in one kernel launch.

    >>> from kvtax.models.argmax import argmax_rows
    >>> tok = argmax_rows(logits)          # logits [B, V] -> int64 [B, 1], torch.argmax's
    >>> argmax_rows(logits, out=tokens, advance=(pos, lengths))  # greedy graph step

The kernel (`kernels/argmax.py`) replaces torch's single-block reduction (27 µs per
128,256-wide row on the H200; 3.6 µs here, decode.py's profile). It
keeps a zeroed counter per row between calls (the last program of a row sets it back),
one set per device and stream, so calls on one stream never share it with calls on
another. On CPU the kernel runs only when
Triton's interpreter built it (the tests); `sampling.sample` uses it where `runs_on`.
Triton is imported on first use, so a CPU install without it still decodes (torch.argmax).
"""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import Any

import torch

BLOCK = 1024  # columns per program per loop step (8 per lane at 4 warps)
CHUNK = 2048  # columns per program: ~63 programs for Llama-3's 128,256
MAX_PROGRAMS = 1024  # per row; wider rows take larger chunks
_WORK: dict[tuple, tuple[torch.Tensor, ...]] = {}
_KERNEL_MODULE = "kvtax.models.kernels.argmax"


@lru_cache(maxsize=1)
def _kernel() -> Any | None:
    """The Triton kernel, or None where Triton cannot be imported (a CPU-only install)."""
    try:
        from kvtax.models.kernels.argmax import argmax_kernel
    except ImportError:
        return None
    return argmax_kernel


def _interpreting() -> bool:
    return type(_kernel()).__name__ == "InterpretedFunction"


def runs_on(device: torch.device) -> bool:
    """Whether the kernel can run on tensors of `device` (CUDA, or CPU when interpreted);
    False everywhere when Triton is not installed."""
    if device.type != "cuda" and _KERNEL_MODULE not in sys.modules:
        return False  # CPU: only a kernel the interpreter built already runs (no import)
    if _kernel() is None:
        return False
    return device.type == "cuda" or _interpreting()


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """torch's answer: `[B, V]` → int64 `[B, 1]`."""
    return logits.argmax(dim=-1, keepdim=True)


def argmax_rows(
    logits: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    advance: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The first index of each row's maximum (a NaN counts as the largest), `logits`
    `[B, V]` float16 / bfloat16 / float32 → int64 `[B, 1]` (written into `out`, a
    contiguous int64 tensor of B elements, when given). advance: (pos int64 `[1]`,
    lengths int32 `[B]`) on logits' device, each raised by one in the same launch once the
    row's token is written (greedy decode in a CUDA graph: the step's next write position
    and lengths). Raises ValueError for other shapes, dtypes or devices."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.shape[0] == 0:
        raise ValueError(f"argmax_rows takes [B, V] logits with B, V >= 1, got "
                         f"{tuple(logits.shape)}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"argmax_rows takes float logits, got {logits.dtype}")
    if _kernel() is None:
        raise ValueError("argmax_rows needs Triton (pip install triton); torch.argmax serves "
                         "without it")
    if not runs_on(logits.device):
        raise ValueError("argmax_rows runs on CUDA tensors (on CPU only interpreted)")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    dev = logits.device
    if out is not None and (out.dtype != torch.int64 or out.numel() != b
                            or not out.is_contiguous() or out.device != dev):
        raise ValueError(f"out must be a contiguous int64 tensor of {b} elements on {dev}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if advance is not None:
        pos, lengths = advance
        if (pos.dtype != torch.int64 or pos.numel() != 1 or lengths.dtype != torch.int32
                or lengths.numel() != b or not lengths.is_contiguous()
                or pos.device != dev or lengths.device != dev):
            raise ValueError(f"advance must be (int64 [1], contiguous int32 [{b}]) on {dev}, "
                             f"got {pos.dtype} {tuple(pos.shape)}, {lengths.dtype} "
                             f"{tuple(lengths.shape)}")
    chunk = max(CHUNK, _cdiv(_cdiv(v, MAX_PROGRAMS), BLOCK) * BLOCK)
    n_prog = _cdiv(v, chunk)
    part_v, part_i, part_n, count = _workspace(logits.device, b, n_prog)
    if out is None:
        out = torch.empty(b, dtype=torch.int64, device=dev)
    pos, lengths = advance if advance is not None else (out, out)  # placeholders: unread
    _kernel()[(n_prog, b)](
        logits, part_v, part_i, part_n, count, out, pos, lengths, v, chunk, logits.stride(0),
        n_prog, BLOCK=BLOCK, P_BLOCK=max(16, 1 << (n_prog - 1).bit_length()),
        ADVANCE=advance is not None, num_warps=4,
    )
    return out.view(b, 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _workspace(device: torch.device, rows: int, n_prog: int) -> tuple[torch.Tensor, ...]:
    """Partials and the zeroed per-row counters for (device, stream, shape), kept."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, rows, n_prog)
    work = _WORK.get(key)
    if work is None:  # never dropped: a captured CUDA graph may still point at it
        work = (torch.empty(rows, n_prog, dtype=torch.float32, device=device),
                torch.empty(rows, n_prog, dtype=torch.int32, device=device),
                torch.empty(rows, n_prog, dtype=torch.int32, device=device),
                torch.zeros(rows, dtype=torch.int32, device=device))
        _WORK[key] = work
    return work
