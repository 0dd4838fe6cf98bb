"""kvtax.models.prefetch: the region of the next weight a decode GEMV pulls into L2.

The kernel (`kernels/gemv.py`, `_prefetch_next`) maps program q = pid - plan.first to
region rows min(q * rows_per_program + i, rows - 1) and weight row
r % rows_per_half + (r // rows_per_half) * half_offset; `_fetched` replays that mapping
here, so the plan's promises (the first rows of each half, whole, in bounds, within the
budget and the per-program tile) are checked over real and odd shapes.
"""

from __future__ import annotations

import pytest

from kvtax.models import prefetch as pf
from kvtax.models.prefetch import prefetch_plan


def _fetched(plan, programs: int) -> set[int]:
    """Weight rows the programs of a launch fetch, as the kernel computes them."""
    rows = set()
    for pid in range(programs):
        q = pid - plan.first
        if q < 0:
            continue
        for i in range(plan.rows_per_program):
            r = min(q * plan.rows_per_program + i, plan.rows - 1)
            rows.add(r % plan.rows_per_half + (r // plan.rows_per_half) * plan.half_offset)
    return rows


CASES = [  # (next weight [N, K], elem bytes, gated, programs, SMs, budget)
    ((28672, 4096), 2, True, 1024, 132, None),    # o → gate/up (Llama-3.1-8B)
    ((4096, 14336), 2, False, 3584, 132, None),   # gate/up → down
    ((6144, 4096), 2, False, 1024, 132, None),    # down → next qkv
    ((128256, 4096), 2, False, 1024, 132, None),  # last down → LM head
    ((6144, 4096), 2, False, 1024, 132, 3 << 20),  # a budget that is no power of two
    ((2 * 37, 200), 2, True, 3, 2, None),         # odd, few programs
    ((77, 320), 4, False, 1, 132, None),          # fp32, one program
    ((1000, 64), 2, False, 5, 4, 1 << 10),        # a budget below one line per row
]


@pytest.mark.parametrize("shape, elem, gated, programs, sms, budget", CASES)
def test_plan_fetches_the_first_rows_of_each_half(shape, elem, gated, programs, sms, budget):
    plan = prefetch_plan(shape, elem, gated=gated, programs=programs, num_sms=sms,
                         budget=budget)
    assert plan is not None
    n, k = shape
    half = n // 2 if gated else n
    want = set(range(plan.rows_per_half))
    if gated:
        want |= {half + r for r in range(plan.rows_per_half)}
    assert _fetched(plan, programs) == want
    assert plan.rows_per_half <= min(half, pf.ROWS_PER_HALF)
    assert plan.lines * plan.line <= k  # columns from 0: in bounds
    assert plan.lines & (plan.lines - 1) == 0 and plan.line * elem == pf.LINE_BYTES
    assert plan.nbytes <= (pf.BUDGET_BYTES if budget is None else budget)
    assert plan.rows_per_program * plan.lines <= pf.MAX_PER_PROGRAM
    assert 0 <= plan.first < programs
    assert programs - plan.first == min(programs, pf.WAVE_PER_SM * sms)  # the last wave


def test_llama_boundaries_fetch_the_budget():
    """At Llama-3.1-8B's shapes the whole default budget is used: 4096 rows per half of
    the next weight, 1 KiB (o → gate/up: 512 B of both halves) per row."""
    o_gu = prefetch_plan((28672, 4096), 2, gated=True, programs=1024, num_sms=132)
    assert (o_gu.rows, o_gu.lines, o_gu.nbytes) == (8192, 8, 8 << 20)
    down_qkv = prefetch_plan((6144, 4096), 2, gated=False, programs=1024, num_sms=132)
    assert (down_qkv.rows, down_qkv.lines, down_qkv.nbytes) == (4096, 16, 8 << 20)


@pytest.mark.parametrize("shape, elem, gated, budget", [
    ((4096, 4096), 2, False, 0),     # switched off
    ((4096, 32), 2, False, None),    # rows shorter than a line
    ((1, 4096), 2, True, None),      # no up half
    ((4096, 4096), 2, True, 128),    # a budget below one line of each half
])
def test_no_plan(shape, elem, gated, budget):
    assert prefetch_plan(shape, elem, gated=gated, programs=64, num_sms=132,
                         budget=budget) is None


def test_module_defaults_are_read_at_call_time(monkeypatch):
    """benchmarks/variants.py sweeps the budget by patching the module's constants."""
    base = prefetch_plan((6144, 4096), 2, gated=False, programs=1024, num_sms=132)
    monkeypatch.setattr(pf, "BUDGET_BYTES", 2 << 20)
    monkeypatch.setattr(pf, "WAVE_PER_SM", 2)
    small = prefetch_plan((6144, 4096), 2, gated=False, programs=1024, num_sms=132)
    assert small.nbytes == 2 << 20 < base.nbytes
    assert small.first == 1024 - 2 * 132
