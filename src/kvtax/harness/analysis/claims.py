"""Predictions stated before a run, judged against its rows: held, failed, not measurable.

A claim is a small dict in the sweep config (`--claims FILE`, JSON list). The arm may be
written as a bare format ("int8" means "int8/fused"). Supported metrics:

    {"metric": "slope_ratio", "arm": "int8", "range": [1.8, 2.1]}
    {"metric": "r2", "arm": "int4", "min": 0.98}
    {"metric": "prefill_peak_le_fp16", "arm": "int4"}      # at every measured context
    {"metric": "decode_peak_le_fp16", "arm": "int4"}
    {"metric": "prefill_penalty", "arm": "int4", "context": 65536, "range": [1.5, 2.5]}
    {"metric": "break_even", "arm": "int4", "context": 65536, "range": [0, 5000]}
    {"metric": "decode_ms_per_token", "arm": "int8", "context": 4096, "range": [0, 20]}

Every verdict carries the numbers it rests on, so a report can show why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtax.harness.analysis import stats

HELD, FAILED, NOT_MEASURABLE = "held", "failed", "not measurable"


def _arm(name: str) -> str:
    return name if "/" in name else f"{name}/fused"


def _in(value: float, rng: list[float]) -> bool:
    lo, hi = rng
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def describe(claim: Mapping[str, Any]) -> str:
    """A one-line statement of the claim, for reports."""
    if claim.get("text"):
        return str(claim["text"])
    m, arm = claim.get("metric"), _arm(str(claim.get("arm", "?")))
    where = f" at context {claim['context']}" if "context" in claim else ""
    if "range" in claim:
        lo, hi = claim["range"]
        return f"{arm} {m}{where} in [{lo}, {hi}]"
    if "min" in claim:
        return f"{arm} {m}{where} >= {claim['min']}"
    if m in ("prefill_peak_le_fp16", "decode_peak_le_fp16"):
        phase = m.split("_")[0]
        return f"{arm} {phase} peak <= fp16 {phase} peak at every context"
    return f"{arm} {m}{where}"


def _verdict(claim: Mapping[str, Any], verdict: str, numbers: Any, why: str) -> dict[str, Any]:
    return {
        "claim": describe(claim),
        "spec": dict(claim),
        "verdict": verdict,
        "numbers": numbers,
        "why": why,
    }


def evaluate(
    claim: Mapping[str, Any], analysis: Mapping[str, Any]
) -> dict[str, Any]:
    """Judge one claim against `analysis.summarize(...)`'s output."""
    metric = claim.get("metric")
    arm = _arm(str(claim.get("arm", "")))
    base = analysis.get("baseline")
    try:
        if metric == "slope_ratio":
            r = analysis["slope_ratios"].get(arm, {}).get("measured")
            if r is None:
                return _verdict(claim, NOT_MEASURABLE, None, f"no slope ratio for {arm} "
                                f"against {base} (too few usable contexts?)")
            ok = _in(r, claim["range"])
            pred = analysis["slope_ratios"][arm].get("predicted")
            return _verdict(claim, HELD if ok else FAILED, {"measured": r, "predicted": pred},
                            f"measured {r:.3f}" + (f" (bytes predict {pred:.3f})" if pred else ""))
        if metric == "r2":
            fit = analysis["fits"].get(arm)
            if fit is None or fit.get("r2") is None:
                return _verdict(claim, NOT_MEASURABLE, None, f"no fit for {arm}")
            ok = fit["r2"] >= float(claim["min"])
            return _verdict(claim, HELD if ok else FAILED, {"r2": fit["r2"]},
                            f"R² {fit['r2']:.4f}")
        if metric in ("prefill_peak_le_fp16", "decode_peak_le_fp16"):
            phase = metric.split("_")[0]
            peaks = analysis["peaks"][phase]
            mine, ref = peaks.get(arm, {}), peaks.get(base or "", {})
            common = sorted(set(mine) & set(ref))
            if not common:
                return _verdict(claim, NOT_MEASURABLE, None,
                                f"no context where both {arm} and {base} have a {phase} peak")
            table = {c: {"arm": mine[c], "fp16": ref[c]} for c in common}
            worse = [c for c in common if mine[c] > ref[c]]
            why = (f"{phase} peak above {base} at contexts {worse}" if worse
                   else f"{phase} peak <= {base} at all {len(common)} contexts")
            return _verdict(claim, FAILED if worse else HELD, table, why)
        if metric in ("prefill_penalty", "break_even", "decode_ms_per_token"):
            ctx = int(claim["context"])
            if metric == "prefill_penalty":
                v = analysis["prefill_penalty"].get(arm, {}).get(ctx, {}).get("ratio")
            elif metric == "break_even":
                v = analysis["break_even"].get(arm, {}).get(ctx)
            else:
                p = analysis["decode_points"].get(arm, {}).get(ctx)
                v = None if p is None else p["median"]
            if v is None:
                return _verdict(claim, NOT_MEASURABLE, None, f"{arm} has no {metric} at {ctx}")
            if v == stats.NEVER:
                hi = claim["range"][1]
                ok = hi is None
                return _verdict(claim, HELD if ok else FAILED, {"value": v}, "never pays back")
            ok = _in(float(v), claim["range"])
            return _verdict(claim, HELD if ok else FAILED, {"value": v}, f"measured {v}")
    except (KeyError, TypeError, ValueError) as exc:
        return _verdict(claim, NOT_MEASURABLE, None, f"malformed claim or missing data: {exc!r}")
    return _verdict(claim, NOT_MEASURABLE, None, f"unknown metric {metric!r}")


def evaluate_all(
    claims: list[Mapping[str, Any]], analysis: Mapping[str, Any]
) -> list[dict[str, Any]]:
    return [evaluate(c, analysis) for c in claims]
