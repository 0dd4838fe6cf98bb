"""Statistics over bench rows: robust per-cell summaries, linear fits, slope ratios,
prefill penalty and break-even.

A published lesson is built in: in a sweep of Qwen3-8B-4bit on an M5 Pro with mlx-lm, one
noisy cell in an eight-point fit produced a confident, wrong conclusion (a 4-bit slope ratio
of 2.25x instead of 3.21x). So every point carries a
robust coefficient of variation, `1.4826 * MAD / median`; points above the threshold
(default 0.10) are flagged, excluded from fits, and named by `Point.reason`.

    >>> pts = points(rows, "decode_ms_per_token")
    >>> fits = fit_arms(pts)                       # arm -> Fit(t0, m, r2, ...)
    >>> slope_ratios(fits, baseline="fp16/fused", bytes_per_token=bpt)
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CV = 0.10
MAD_TO_SIGMA = 1.4826  # MAD of a normal sample x this = its standard deviation
NEVER = "never"


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if not n:
        raise ValueError("median of no values")
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def mad(xs: Sequence[float]) -> float:
    """Median absolute deviation from the median."""
    m = median(xs)
    return median([abs(x - m) for x in xs])


def robust_cv(xs: Sequence[float]) -> float | None:
    """1.4826 * MAD / median; None for fewer than 2 values or a zero median."""
    if len(xs) < 2:
        return None
    m = median(xs)
    if m == 0:
        return None
    return MAD_TO_SIGMA * mad(xs) / abs(m)


@dataclass
class Point:
    """One (model, arm, context) over its repetitions, for one metric."""

    model: str
    arm: str
    context: int
    metric: str
    values: list[float]
    median: float
    cv: float | None
    flagged: bool = False
    reason: str | None = None

    @property
    def n(self) -> int:
        return len(self.values)


def usable(row: Mapping[str, Any], kind: str = "bench") -> bool:
    """A row statistics may use: the right kind, status ok, not a warm-up."""
    return row.get("kind") == kind and row.get("status") == "ok" and not row.get("warmup")


def points(
    rows: Iterable[Mapping[str, Any]],
    metric: str = "decode_ms_per_token",
    *,
    cv_threshold: float = DEFAULT_CV,
    kind: str = "bench",
) -> list[Point]:
    """Median and robust CV of `metric` per (model, arm, context); noisy points flagged.

    A point is flagged when any of its rows did not run as its arm asked (an engine's
    `engine_info.arm_as_requested` false: e.g. llama.cpp turned flash attention off),
    when its CV exceeds `cv_threshold`, or when any of its rows saw the device clock
    drop during the cell (throttling).
    """
    from kvtax.harness.bench.devinfo import throttled

    groups: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    hot: dict[tuple[str, str, int], int] = defaultdict(int)
    other: dict[tuple[str, str, int], str] = {}
    for r in rows:
        if not usable(r, kind) or r.get(metric) is None:
            continue
        key = (str(r["model"]), str(r["arm"]), int(r["context"]))
        groups[key].append(float(r[metric]))
        if throttled(r.get("clocks_start"), r.get("clocks_end")):
            hot[key] += 1
        info = r.get("engine_info") or {}
        if info.get("arm_as_requested") is False:
            other[key] = str(info.get("arm_note") or "the engine ran another setting")
    out = []
    for (model, arm, ctx), vals in sorted(groups.items()):
        cv = robust_cv(vals)
        p = Point(model, arm, ctx, metric, vals, median(vals), cv)
        if (model, arm, ctx) in other:
            p.flagged, p.reason = True, f"not run as asked: {other[(model, arm, ctx)]}"
        elif cv is not None and cv > cv_threshold:
            p.flagged, p.reason = True, f"robust CV {cv:.3f} > {cv_threshold:.2f}"
        elif hot[(model, arm, ctx)]:
            p.flagged, p.reason = True, f"clock dropped during {hot[(model, arm, ctx)]} rep(s)"
        out.append(p)
    return out


@dataclass
class Fit:
    """`metric = t0 + m * context` by least squares over one arm's unflagged points."""

    arm: str
    t0: float
    m: float
    r2: float | None
    n: int
    contexts: list[int]
    excluded: list[int] = field(default_factory=list)

    def predict(self, context: float) -> float:
        return self.t0 + self.m * context


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float | None]:
    """Ordinary least squares y = t0 + m x; returns (t0, m, R²). Needs two distinct x."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError(f"a line needs at least two points, got {n}")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a line needs at least two distinct contexts")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    m = sxy / sxx
    t0 = my - m * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (t0 + m * x)) ** 2 for x, y in zip(xs, ys))
    r2 = None if ss_tot == 0 else 1.0 - ss_res / ss_tot
    return t0, m, r2


def fit_arms(pts: Iterable[Point], *, exclude_flagged: bool = True) -> dict[str, Fit]:
    """One Fit per arm with at least two usable contexts (flagged points left out)."""
    by_arm: dict[str, list[Point]] = defaultdict(list)
    for p in pts:
        by_arm[p.arm].append(p)
    fits = {}
    for arm, ps in sorted(by_arm.items()):
        keep = [p for p in ps if not (exclude_flagged and p.flagged)]
        dropped = sorted(p.context for p in ps if exclude_flagged and p.flagged)
        if len({p.context for p in keep}) < 2:
            continue
        t0, m, r2 = fit_line([p.context for p in keep], [p.median for p in keep])
        fits[arm] = Fit(arm, t0, m, r2, len(keep), sorted(p.context for p in keep), dropped)
    return fits


UNQUANTIZED = ("fp16", "bf16", "fp32", "f16", "f32", "float16", "bfloat16", "float32")


def is_unquantized(arm: str) -> bool:
    """Whether an arm stores K/V unquantized: its format ("fp16" in "fp16/fp16", "f16/fa")
    is a float type. Any path or engine counts: stock SDPA, kvtax's kernel, llama.cpp..."""
    return arm.split("/")[0].lower() in UNQUANTIZED


BASELINE_RULE = ("the unquantized arm with the lowest fitted decode ms/token at the "
                 "largest context of the sweep (its median there when it has no fit or a "
                 "fit that falls with context)")


def baseline_arm(arms: Iterable[str]) -> str | None:
    """A fallback reference when nothing was measured: kvtax's fp16 arm, else stock SDPA,
    else any unquantized arm (alphabetically first)."""
    arms = set(arms)
    for cand in ("fp16/fused", "fp16/fp16", "bf16/fused"):
        if cand in arms:
            return cand
    return min((a for a in arms if is_unquantized(a)), default=None)


def best_baseline(
    decode_pts: Iterable[Point], fits: Mapping[str, Fit] | None = None
) -> tuple[str | None, dict[str, float]]:
    """The best fp16 arm measured, one arm for the whole run (BASELINE_RULE).

    Every comparison (slope ratio, penalty, break-even, capacity) is made against it, so a
    quantized arm is never credited for beating a slow fp16 path. Judged at the largest
    context any unquantized arm reached: fit t0 + m * context where the arm has a fit (an
    arm capped below that context is extrapolated along its own line), else its median at
    that context. Returns (arm, {candidate: ms/token judged}); (None, {}) without one.
    """
    table = by_arm_context(p for p in decode_pts if is_unquantized(p.arm))
    if not table:
        return None, {}
    fits = fits if fits is not None else fit_arms(p for per in table.values()
                                                  for p in per.values())
    ctx = max(c for per in table.values() for c in per)
    judged: dict[str, float] = {}
    for arm, per in table.items():
        if arm in fits and (fits[arm].m > 0 or ctx not in per):  # a noisy fall: its median
            judged[arm] = fits[arm].predict(ctx)
        elif ctx in per:
            judged[arm] = per[ctx].median
    if not judged:  # no arm has a fit or reached the top context: its own largest median
        judged = {arm: per[max(per)].median for arm, per in table.items()}
    return min(sorted(judged), key=lambda a: judged[a]), judged


def slope_ratios(
    fits: Mapping[str, Fit],
    baseline: str,
    bytes_per_token: Mapping[str, float] | None = None,
) -> dict[str, dict[str, float | None]]:
    """Per arm: measured `m_baseline / m_arm` next to the bytes-predicted ratio.

    `predicted` is `bytes_per_token[baseline] / bytes_per_token[arm]` (the KV-read
    hypothesis: the slope is the cache's bytes). `naive` is 16 / bits of the K format
    (what "8-bit halves it" assumes, ignoring scales).
    """
    from kvtax.formats import KVSpec

    out: dict[str, dict[str, float | None]] = {}
    base = fits.get(baseline)
    if base is None:
        return out
    bpt = bytes_per_token or {}
    for arm, fit in fits.items():
        measured = base.m / fit.m if fit.m > 0 and base.m > 0 else None
        predicted = None
        if bpt.get(baseline) and bpt.get(arm):
            predicted = float(bpt[baseline]) / float(bpt[arm])
        naive = None
        try:
            spec = KVSpec.parse(arm.split("/")[0])
            naive = 32.0 / (spec.key.bits + spec.value.bits)
        except Exception:  # an arm name that is not a format (hf-quantized variants)
            pass
        out[arm] = {
            "measured": measured,
            "predicted": predicted,
            "naive": naive,
            "vs_predicted": None if not (measured and predicted) else measured / predicted,
            "intercept_ms": fit.t0,
            "slope": fit.m,
            "r2": fit.r2,
        }
    return out


def by_arm_context(pts: Iterable[Point]) -> dict[str, dict[int, Point]]:
    out: dict[str, dict[int, Point]] = defaultdict(dict)
    for p in pts:
        out[p.arm][p.context] = p
    return out


def prefill_penalty(
    ttft_pts: Iterable[Point], baseline: str
) -> dict[str, dict[int, dict[str, float]]]:
    """Per arm and context: TTFT ratio to the baseline and the extra seconds."""
    table = by_arm_context(ttft_pts)
    base = table.get(baseline, {})
    out: dict[str, dict[int, dict[str, float]]] = {}
    for arm, per in table.items():
        for ctx, p in per.items():
            b = base.get(ctx)
            if b is None or b.median <= 0:
                continue
            out.setdefault(arm, {})[ctx] = {
                "ratio": p.median / b.median,
                "extra_s": p.median - b.median,
                "ttft_s": p.median,
                "baseline_ttft_s": b.median,
            }
    return out


def break_even_tokens(
    ttft_q: float, ms_q: float, ttft_base: float, ms_base: float
) -> int | str:
    """Generated tokens after which the quantized arm's total time is no longer worse.

    Total time T(n) = TTFT + n * ms_per_token / 1000. Returns 0 when the arm is never
    slower (prefill and decode both no slower), the ceiling of the crossing point when a
    slower prefill is paid back by faster decode, and "never" when decode is not faster
    (a faster prefill alone only wins short generations, so it never pays back for long
    ones).
    """
    if ttft_q <= ttft_base and ms_q <= ms_base:
        return 0
    if ms_q >= ms_base:
        return NEVER
    n = (ttft_q - ttft_base) / ((ms_base - ms_q) / 1000.0)
    return max(0, math.ceil(n - 1e-9))


def break_even(
    ttft_pts: Iterable[Point], decode_pts: Iterable[Point], baseline: str
) -> dict[str, dict[int, int | str]]:
    """break_even_tokens per arm and context, wherever both metrics were measured."""
    tt, dd = by_arm_context(ttft_pts), by_arm_context(decode_pts)
    out: dict[str, dict[int, int | str]] = {}
    if baseline not in tt or baseline not in dd:  # e.g. every baseline cell unavailable
        return out
    for arm in tt:
        if arm == baseline or arm not in dd:
            continue
        for ctx in sorted(tt[arm]):
            try:
                tq, dq = tt[arm][ctx].median, dd[arm][ctx].median
                tb, db = tt[baseline][ctx].median, dd[baseline][ctx].median
            except KeyError:
                continue
            out.setdefault(arm, {})[ctx] = break_even_tokens(tq, dq, tb, db)
    return out
