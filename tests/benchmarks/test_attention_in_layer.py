"""Decode timed in a layer (benchmarks/attention.py's in_layer): replays cut
apart at the L2 eviction's kernels, attention charged on the critical path from the store's
end as `decode.py --profile` charges a model layer's, and the report's table and aims."""

from __future__ import annotations

import sys

import pytest

from kvtax.harness.bench.gpu_timer import split_replays
from kvtax.harness.bench.step_profile import attention_critical_us
from tests.support.scripts import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402

FLUSH = "void at::native::reduce_kernel<512, 1>"


def _replay(t0: float, early: bool) -> list[tuple[str, float, float]]:
    """One replay: the store (3 µs), the split kernel (launched early under PDL: it starts
    inside the store, else 2 µs after it), the reduce 1 µs after the split."""
    split_start = t0 + 1.0 if early else t0 + 5.0
    return [("_quantize_store_kernel", t0, t0 + 3.0),
            ("decode_swap_gluon_kernel", split_start, t0 + 30.0),
            ("_decode_attn_reduce_kernel", t0 + 31.0, t0 + 33.0)]


def test_split_replays_drops_the_eviction_and_keeps_each_replay():
    spans = []
    for i in range(3):
        t = 100.0 * i
        spans += [(FLUSH, t, t + 60.0), *_replay(t + 61.0, early=True)]
    spans.reverse()  # the profiler's order is not the start order
    runs = split_replays(spans, {FLUSH})
    assert len(runs) == 3
    assert all([n for n, _, _ in r] == [n for n, _, _ in _replay(0.0, True)] for r in runs)


@pytest.mark.parametrize("early, want", [
    (True, 29.0),   # from the store's end (3) to the reduce's end (33), 1 µs idle between
    (False, 27.0),  # launched after the store: the 2 µs gap is idle, not attention
])
def test_attention_is_charged_from_the_store_end(early, want):
    assert attention_critical_us([_replay(0.0, early), _replay(500.0, early)]) == [want, want]


def _row(arm: str, ms: float, behind: float | None, frac: float | None, ctx: int = 131072) -> dict:
    row = dict(arm=arm, phase="decode", ctx=ctx, rows=1, status="ok", median_ms=ms, tbps=1.0,
               tflops=0.0, transient_mib=0.0, frac_ceiling=frac)
    if behind is not None:
        row.update(in_layer="layer", in_layer_ms=behind)
    return row


CONFIG = dict(device="H200", torch="2", triton="3", date="d", git="g", command="c")


def test_report_table_and_ceiling_aims():
    rows = [_row("kvtax-int4", 0.050, 0.0475, 0.76), _row("kvtax-int8", 0.0725, 0.0720, 0.86),
            _row("sdpa-cudnn", 0.1276, None, 0.91), _row("kvtax-fp16", 0.1274, 0.1270, 0.91),
            _row("kvtax-int4", 0.030, 0.028, 0.80, ctx=65536),
            _row("kvtax-int8", 0.041, 0.040, 0.75, ctx=65536)]
    text = report.markdown_summary(rows, CONFIG)
    lines = text.splitlines()
    int4 = next(x for x in lines if x.startswith("| kvtax-int4 | ") and "first" in x)
    assert "47.5 (first 50.0) · 80%" in int4 and "28.0 (first 30.0) · 86%" in int4
    assert not any(x.startswith("| sdpa-cudnn |") and "first" in x for x in lines)
    aim8 = next(x for x in lines if x.startswith("- kvtax-int8 decode, fraction"))
    aim4 = next(x for x in lines if x.startswith("- kvtax-int4 decode, fraction"))
    assert aim8.endswith("MISSED") and "64k 75%" in aim8 and "(target >= 85%)" in aim8
    assert aim4.endswith("held") and "(target >= 75%)" in aim4
    fp16 = next(x for x in lines if x.startswith("- kvtax-fp16 at least sdpa-cudnn's"))
    assert "128k 0.998" in fp16
