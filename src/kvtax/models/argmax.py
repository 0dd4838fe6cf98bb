"""Greedy token choice on the GPU: the argmax of each logits row in one kernel launch.

    >>> from kvtax.models.argmax import argmax_rows
    >>> tok = argmax_rows(logits)          # logits [B, V] -> int64 [B, 1], torch.argmax's

The kernel (`kernels/argmax.py`) replaces torch's single-block reduction (27 µs per
128,256-wide row on the H200; 3.6 µs here, decode.py's profile, session 13 call 3). It
keeps a zeroed counter per row between calls (the last program of a row sets it back),
one set per device and stream, so calls on one stream never share it with calls on
another. On CPU the kernel runs only when
Triton's interpreter built it (the tests); `sampling.sample` uses it where `runs_on`.
"""

from __future__ import annotations

import torch
import triton

from kvtax.models.kernels.argmax import _argmax_kernel

BLOCK = 1024  # columns per program per loop step (8 per lane at 4 warps)
CHUNK = 2048  # columns per program: ~63 programs for Llama-3's 128,256
MAX_PROGRAMS = 1024  # per row; wider rows take larger chunks
_WORK: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _interpreting() -> bool:
    return type(_argmax_kernel).__name__ == "InterpretedFunction"


def runs_on(device: torch.device) -> bool:
    """Whether the kernel can run on tensors of `device` (CUDA, or CPU when interpreted)."""
    return device.type == "cuda" or _interpreting()


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """torch's answer: `[B, V]` → int64 `[B, 1]`."""
    return logits.argmax(dim=-1, keepdim=True)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum (a NaN counts as the largest), `logits`
    `[B, V]` float16 / bfloat16 / float32 with unit column stride → int64 `[B, 1]`.
    Raises ValueError for other shapes and dtypes."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.shape[0] == 0:
        raise ValueError(f"argmax_rows takes [B, V] logits with B, V >= 1, got "
                         f"{tuple(logits.shape)}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"argmax_rows takes float logits, got {logits.dtype}")
    if not runs_on(logits.device):
        raise ValueError("argmax_rows runs on CUDA tensors (on CPU only interpreted)")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    chunk = max(CHUNK, triton.cdiv(triton.cdiv(v, MAX_PROGRAMS), BLOCK) * BLOCK)
    n_prog = triton.cdiv(v, chunk)
    part_v, part_i, part_n, count = _workspace(logits.device, b, n_prog)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    _argmax_kernel[(n_prog, b)](
        logits, part_v, part_i, part_n, count, out, v, chunk, logits.stride(0), n_prog,
        BLOCK=BLOCK, P_BLOCK=max(16, triton.next_power_of_2(n_prog)), num_warps=4,
    )
    return out.view(b, 1)


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
