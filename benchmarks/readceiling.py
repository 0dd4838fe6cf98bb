"""Streaming-read ceiling of this GPU: the best of a few read-only kernels.

Each reads a 2 GiB fp16 buffer once and writes a negligible partial sum. The best
achieved TB/s is the ceiling the attention benchmark's TB/s are compared against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def stream_read_kernel(X, Out, n, BLOCK: tl.constexpr):
    """Grid-stride read of X [n] fp16 (n a multiple of BLOCK); one partial per program."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, step):
        acc += tl.load(X + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(Out + pid, tl.sum(acc, 0))


def read_ceiling(timer, nbytes: int = 2 << 30) -> tuple[float, list[dict]]:
    """(best TB/s, per-variant rows). `timer(fn) -> (median_ms, p20, p80)`."""
    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.float16)
    n = x.numel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    variants = []
    for block, warps, waves in ((4096, 8, 4), (8192, 8, 8), (2048, 4, 16)):
        grid = sms * waves
        part = torch.empty(grid, device="cuda", dtype=torch.float32)

        def run(block=block, warps=warps, grid=grid, part=part):
            stream_read_kernel[(grid,)](x, part, n, BLOCK=block, num_warps=warps)

        variants.append((f"triton-read-b{block}-w{warps}-g{grid}", run))
    variants.append(("torch-sum", lambda: x.sum(dtype=torch.float32)))
    best = 0.0
    for name, fn in variants:
        ms, p20, p80 = timer(fn)
        tbps = nbytes / (ms * 1e-3) / 1e12
        best = max(best, tbps)
        rows.append(dict(kernel=name, median_ms=ms, p20_ms=p20, p80_ms=p80, tbps=tbps))
    return best, rows
