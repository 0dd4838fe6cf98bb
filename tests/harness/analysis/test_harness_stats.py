"""Statistics on synthetic data with known answers (the noisy-cell story of a published mlx-lm sweep included)."""

from __future__ import annotations

import random

import pytest

from kvtax.harness.analysis import stats
from kvtax.harness.analysis.analyze import summarize

CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]


def _rows(arm: str, ctx: int, values: list[float], ttft: float = 1.0, **extra) -> list[dict]:
    kv, path = arm.split("/")
    return [
        {
            "kind": "bench", "status": "ok", "warmup": False, "model": "m", "arm": arm,
            "kv": kv, "path": path, "context": ctx, "rep": i, "decode_ms_per_token": v,
            "ttft_s": ttft, **extra,
        }
        for i, v in enumerate(values)
    ]


def _quiet(center: float, rng: random.Random, n: int = 7, sd: float = 0.01) -> list[float]:
    return [center * (1 + rng.gauss(0, sd)) for _ in range(n)]


def test_robust_cv_known_values():
    assert stats.median([3, 1, 2]) == 2
    assert stats.median([4, 1, 2, 3]) == 2.5
    assert stats.mad([1, 2, 3, 4, 100]) == 1  # the outlier does not move it
    assert stats.robust_cv([10, 10, 10]) == 0
    assert stats.robust_cv([9, 10, 11]) == pytest.approx(1.4826 * 1 / 10)
    assert stats.robust_cv([5.0]) is None


def test_fit_recovers_planted_slope_exactly():
    xs = [512, 2048, 8192, 32768]
    t0, m, r2 = stats.fit_line(xs, [18.0 + 0.00125 * x for x in xs])
    assert t0 == pytest.approx(18.0)
    assert m == pytest.approx(0.00125)
    assert r2 == pytest.approx(1.0)
    with pytest.raises(ValueError):
        stats.fit_line([1, 1], [2, 3])


def test_fit_recovers_slope_through_noise_and_ignores_warmups_and_failures():
    rng = random.Random(1)
    rows = []
    for ctx in CONTEXTS:
        rows += _rows("fp16/fused", ctx, _quiet(18 + 0.00125 * ctx, rng))
    # A warm-up row and a failed row, wildly off, must not move anything.
    rows += [dict(rows[0], warmup=True, decode_ms_per_token=1e6)]
    rows += [dict(rows[0], status="oom", decode_ms_per_token=1e6)]
    fit = stats.fit_arms(stats.points(rows))["fp16/fused"]
    assert fit.m == pytest.approx(0.00125, rel=0.02)
    assert fit.t0 == pytest.approx(18, rel=0.05)
    assert fit.r2 > 0.999


def _noisy_cell_rows() -> list[dict]:
    """fp16 slope m, int4 slope m/3.2; the int4 cell at 65,536 is noisy (CV ~0.37) and
    its median sits high enough that a fit through it reads a 2.25x ratio."""
    rng = random.Random(0)
    m16, m4 = 0.00125, 0.00125 / 3.2
    rows = []
    for ctx in CONTEXTS:
        rows += _rows("fp16/fused", ctx, _quiet(18.0 + m16 * ctx, rng))
        if ctx != 65536:
            rows += _rows("int4/fused", ctx, _quiet(18.58 + m4 * ctx, rng))
    mean = sum(CONTEXTS) / len(CONTEXTS)
    sxx = sum((x - mean) ** 2 for x in CONTEXTS)
    delta = (m16 / 2.25 - m4) * sxx / (65536 - mean)  # moves the OLS slope to m16/2.25
    center = 18.58 + m4 * 65536 + delta
    spread = [-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5]
    rows += _rows("int4/fused", 65536, [center * (1 + 0.25 * z) for z in spread])
    return rows


def test_one_noisy_cell_flagged_and_excluded_changes_conclusion_back():
    rows = _noisy_cell_rows()
    pts = stats.points(rows, cv_threshold=0.10)
    flagged = [(p.arm, p.context) for p in pts if p.flagged]
    assert flagged == [("int4/fused", 65536)]

    naive = stats.slope_ratios(stats.fit_arms(pts, exclude_flagged=False), "fp16/fused")
    robust = stats.slope_ratios(stats.fit_arms(pts), "fp16/fused")
    assert naive["int4/fused"]["measured"] == pytest.approx(2.25, abs=0.08)
    assert robust["int4/fused"]["measured"] == pytest.approx(3.2, abs=0.1)
    fit = stats.fit_arms(pts)["int4/fused"]
    assert fit.excluded == [65536] and fit.n == 7 and fit.r2 > 0.99

    summary = summarize(rows, cv_threshold=0.10)
    assert summary["baseline"] == "fp16/fused"
    assert summary["slope_ratios"]["int4/fused"]["measured"] == pytest.approx(3.2, abs=0.1)
    assert [(f["arm"], f["context"]) for f in summary["flagged"]] == [("int4/fused", 65536)]
    # With a looser threshold nothing is flagged and the wrong conclusion comes back.
    loose = summarize(rows, cv_threshold=0.5)
    assert loose["slope_ratios"]["int4/fused"]["measured"] == pytest.approx(2.25, abs=0.08)


def test_slope_ratio_prediction_from_bytes_per_token():
    fits = {
        "fp16/fused": stats.Fit("fp16/fused", 18, 0.002, 1.0, 3, [1, 2, 3]),
        "int8/fused": stats.Fit("int8/fused", 18, 0.001, 1.0, 3, [1, 2, 3]),
    }
    out = stats.slope_ratios(fits, "fp16/fused", {"fp16/fused": 512, "int8/fused": 272})
    assert out["int8/fused"]["measured"] == pytest.approx(2.0)
    assert out["int8/fused"]["predicted"] == pytest.approx(512 / 272)
    assert out["int8/fused"]["naive"] == pytest.approx(2.0)


def test_throttled_cell_is_flagged():
    rows = _rows("fp16/fused", 512, [10, 10, 10], clocks_start={"sm_clock_mhz": 1980},
                 clocks_end={"sm_clock_mhz": 1980})
    rows[1]["clocks_end"] = {"sm_clock_mhz": 1200}
    (p,) = stats.points(rows)
    assert p.flagged and "clock" in p.reason


@pytest.mark.parametrize(
    "ttft_q, ms_q, ttft_b, ms_b, expected",
    [
        (1.0, 10.0, 1.0, 10.0, 0),            # identical: never slower
        (0.9, 9.0, 1.0, 10.0, 0),             # faster at both
        (2.0, 12.0, 1.0, 10.0, "never"),      # slower at both (a published mlx-lm sweep at 16k)
        (0.5, 12.0, 1.0, 10.0, "never"),      # faster prefill, slower decode: loses long runs
        (2.0, 10.0, 1.0, 10.0, "never"),      # slower prefill, equal decode
        (264.7, 64.6, 117.3, 100.0, 4164),    # a published mlx-lm sweep at 64k: ~4,166 tokens
        (1.5, 9.0, 1.0, 10.0, 500),           # exactly 500 tokens to pay back 0.5 s at 1 ms
    ],
)
def test_break_even_tokens(ttft_q, ms_q, ttft_b, ms_b, expected):
    assert stats.break_even_tokens(ttft_q, ms_q, ttft_b, ms_b) == expected


def test_break_even_total_time_is_equal_at_crossing():
    n = stats.break_even_tokens(264.7, 64.6, 117.3, 100.0)
    total = lambda ttft, ms, k: ttft + k * ms / 1000  # noqa: E731
    assert total(264.7, 64.6, n) <= total(117.3, 100.0, n)
    assert total(264.7, 64.6, n - 1) > total(117.3, 100.0, n - 1)


def test_prefill_penalty_and_break_even_tables():
    rows = (
        _rows("fp16/fused", 1024, [10.0] * 3, ttft=1.0)
        + _rows("int4/fused", 1024, [9.0] * 3, ttft=1.5)
        + _rows("fp16/fused", 2048, [12.0] * 3, ttft=2.0)
        + _rows("int4/fused", 2048, [13.0] * 3, ttft=3.0)
    )
    a = summarize(rows)
    assert a["prefill_penalty"]["int4/fused"][1024]["ratio"] == pytest.approx(1.5)
    assert a["prefill_penalty"]["int4/fused"][2048]["extra_s"] == pytest.approx(1.0)
    assert a["break_even"]["int4/fused"] == {1024: 500, 2048: "never"}


def test_break_even_without_baseline_points_is_empty():
    """Regression: a sweep whose baseline arm never ran (every cell of dynamic/compiled
    unavailable) crashed `summarize` with "dictionary changed size during iteration"."""
    rows = _rows("int4/fused", 1024, [9.0] * 3, ttft=1.5)
    assert summarize(rows, baseline="fp16/fused")["break_even"] == {}


def test_engine_notes_reach_the_summary_once_per_note():
    rows = _rows("fp16/default", 1024, [10.0] * 2, ttft=1.0) + _rows("q4/default", 1024,
                                                                      [9.0] * 2, ttft=1.0)
    for r in rows:
        r.update(engine="mlx-lm", engine_info={"sdpa_note": "no fused SDPA here",
                                               "sdpa": "fast", "other_note": None})
    notes = summarize(rows)["engine_notes"]
    assert notes == [{"engine": "mlx-lm", "note": "no fused SDPA here",
                      "arms": ["fp16/default", "q4/default"]}]
