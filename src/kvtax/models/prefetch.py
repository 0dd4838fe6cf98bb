"""Which lines of the next GEMV's weight a decode GEMV pulls into L2 as it ends.

A batch-1 decode step streams each weight matrix in its own short kernel (Llama-3.1-8B:
four per layer, 7-57 µs each); at every boundary the memory system idles through the
tail of one kernel, the launch and the ramp of the next (the H200 profile, session 10:
each GEMV ~3.5 µs over its bytes at the read ceiling). Weights depend on nothing the
step computes, so the last wave of one GEMV's programs can pull the start of the next
weight's rows into L2 before it exits (`kernels/gemv.py`, PREFETCH), and DRAM works
through the gap. This module decides the region and who fetches it; it is pure
arithmetic, tested on CPU.

    >>> plan = prefetch_plan((28672, 4096), 2, gated=True, programs=768, num_sms=132)
    >>> plan.rows_per_half, plan.lines    # the first rows of gate and up, 1 KiB of each
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import triton

BUDGET_BYTES = 8 << 20  # default bytes per boundary (see prefetch_plan); 0 turns it off
ROWS_PER_HALF = 4096  # the rows the next kernel's first wave reads first, at most
LINE_BYTES = 128  # one L2 line per prefetch instruction
MAX_PER_PROGRAM = 512  # lines one program fetches at most (a register tile of pointers)
WAVE_PER_SM = 4  # programs of the issuing kernel's last wave, per SM


@dataclasses.dataclass(frozen=True)
class PrefetchPlan:
    """Programs `first`..end of the issuing launch each fetch `rows_per_program` rows x
    `lines` lines (`line` elements each, from column 0) of the region: `rows` rows,
    `rows_per_half` from each half (row r of the region is weight row
    r % rows_per_half + (r // rows_per_half) * half_offset; half_offset 0 unless gated)."""

    first: int
    rows: int
    rows_per_half: int
    half_offset: int
    rows_per_program: int
    lines: int
    line: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.lines * LINE_BYTES


def prefetch_plan(
    next_shape: tuple[int, int], elem_bytes: int, *, gated: bool, programs: int, num_sms: int,
    budget: int | None = None, rows_per_half: int | None = None,
) -> PrefetchPlan | None:
    """The region of a next weight `[N, K]` (gated: gate rows then up rows, read in pairs)
    that a launch of `programs` programs prefetches, or None (no budget, or rows shorter
    than a line). Up to `budget` bytes (BUDGET_BYTES): the first `rows_per_half` rows
    (ROWS_PER_HALF) of each half — the rows the next kernel's first programs stream —
    and of each row the first power-of-two number of lines that fits; fewer rows when
    one line per row would already pass the budget. Fetched by the last
    WAVE_PER_SM x num_sms programs (the last wave: earlier prefetches would sit in L2
    through the rest of the launch)."""
    return _plan(tuple(next_shape), elem_bytes, gated, programs, num_sms,
                 BUDGET_BYTES if budget is None else budget,
                 ROWS_PER_HALF if rows_per_half is None else rows_per_half, WAVE_PER_SM)


@lru_cache(maxsize=256)
def _plan(next_shape: tuple[int, int], elem_bytes: int, gated: bool, programs: int,
          num_sms: int, budget: int, cap: int, wave_per_sm: int) -> PrefetchPlan | None:
    n, k = next_shape
    halves = 2 if gated else 1
    line = LINE_BYTES // elem_bytes
    if budget < halves * LINE_BYTES or k < line or n < halves or programs < 1:
        return None
    half = n // halves
    rows_half = min(half, cap, budget // (halves * LINE_BYTES))
    lines = min(budget // (rows_half * halves * LINE_BYTES), k // line)
    lines = 1 << (lines.bit_length() - 1)
    issuers = min(programs, wave_per_sm * num_sms)
    # a program's fetches are one register tile: shrink the region rather than the tile
    rows_half = max(1, min(rows_half, MAX_PER_PROGRAM // lines * issuers // halves))
    rows = rows_half * halves
    per_program = triton.next_power_of_2(triton.cdiv(rows, issuers))
    while per_program * lines > MAX_PER_PROGRAM and lines > 1:  # the power-of-two rounding
        lines //= 2
    return PrefetchPlan(first=programs - issuers, rows=rows, rows_per_half=rows_half,
                        half_offset=half if gated else 0, rows_per_program=per_program,
                        lines=lines, line=line)
