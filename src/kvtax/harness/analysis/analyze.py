"""Everything statistics can say about a run's bench rows, as one JSON-ready dict.

    >>> summary = summarize(read_rows(run_dir), cv_threshold=0.10, claims=cfg["claims"])
    >>> summary["slope_ratios"]["int4/fused"]["measured"], summary["flagged"]

Keys: baseline (the best fp16 arm measured, `stats.BASELINE_RULE`; every comparison is
against it), baseline_rule, baseline_candidates (unquantized arm → ms/token it was judged
by), arms, fits (per arm t0/m/r2/contexts/excluded), slope_ratios,
decode_points / ttft_points (per arm → context → median, cv, n, flagged, reason),
flagged (list of noisy points), prefill_penalty, break_even, peaks (prefill/decode per
arm → context → median peak bytes), bytes_per_token (each engine's own, from its rows),
engines (arm → engine and version), failures (non-ok rows), claims.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from kvtax.harness.analysis import claims as claims_mod
from kvtax.harness.analysis import stats


def _point_table(pts: list[stats.Point]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for p in pts:
        out[p.arm][p.context] = {
            "median": p.median, "cv": p.cv, "n": p.n, "flagged": p.flagged, "reason": p.reason,
        }
    return dict(out)


def arm_engines(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """arm -> {"engine", "version"}: which stack measured each arm (kvtax for rows made
    before engines), and its version where a row recorded one."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        e = out.setdefault(str(r["arm"]), {"engine": r.get("engine") or "kvtax",
                                           "version": None})
        e["version"] = e["version"] or r.get("engine_version")
    return out


def engine_notes(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What engines said about how their arms ran: each distinct string under an
    `engine_info` key ending in "_note" (e.g. mlx-lm's "no fused SDPA on this device"),
    with the engine and the arms whose rows said it."""
    notes: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        for key, text in (r.get("engine_info") or {}).items():
            if key.endswith("_note") and isinstance(text, str) and text:
                notes.setdefault((str(r.get("engine")), text), set()).add(str(r["arm"]))
    return [{"engine": e, "note": n, "arms": sorted(a)} for (e, n), a in sorted(notes.items())]


def summarize(
    rows: Iterable[Mapping[str, Any]],
    *,
    cv_threshold: float = stats.DEFAULT_CV,
    claims: list[Mapping[str, Any]] | None = None,
    baseline: str | None = None,
) -> dict[str, Any]:
    rows = [r for r in rows if r.get("kind") == "bench"]
    dec = stats.points(rows, "decode_ms_per_token", cv_threshold=cv_threshold)
    ttft = stats.points(rows, "ttft_s", cv_threshold=cv_threshold)
    arms = sorted({r["arm"] for r in rows})
    fits = stats.fit_arms(dec)
    best, judged = stats.best_baseline(dec, fits)
    base = baseline or best or stats.baseline_arm(arms)
    bpt: dict[str, float] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("bytes_per_token"):
            bpt[r["arm"]] = float(r["bytes_per_token"])
    peaks: dict[str, dict[str, dict[int, float]]] = {}
    for phase in ("prefill", "decode"):
        pp = stats.points(rows, f"{phase}_peak_bytes", cv_threshold=float("inf"))
        peaks[phase] = {a: {c: p["median"] for c, p in t.items()}
                        for a, t in _point_table(pp).items()}
    flagged = [
        {"arm": p.arm, "context": p.context, "metric": p.metric, "cv": p.cv, "reason": p.reason,
         "median": p.median, "n": p.n}
        for p in dec + ttft if p.flagged
    ]
    failures = [
        {k: r.get(k) for k in ("cell_id", "arm", "context", "rep", "status", "phase", "error")}
        for r in rows if r.get("status") != "ok"
    ]
    out: dict[str, Any] = {
        "baseline": base,
        "baseline_rule": "given" if baseline else stats.BASELINE_RULE,
        "baseline_candidates": judged,
        "arms": arms,
        "cv_threshold": cv_threshold,
        "fits": {a: {"t0": f.t0, "m": f.m, "r2": f.r2, "n": f.n, "contexts": f.contexts,
                     "excluded": f.excluded} for a, f in fits.items()},
        "slope_ratios": stats.slope_ratios(fits, base, bpt) if base else {},
        "decode_points": _point_table(dec),
        "ttft_points": _point_table(ttft),
        "flagged": flagged,
        "prefill_penalty": stats.prefill_penalty(ttft, base) if base else {},
        "break_even": stats.break_even(ttft, dec, base) if base else {},
        "peaks": peaks,
        "bytes_per_token": bpt,
        "engines": arm_engines(rows),
        "engine_notes": engine_notes(rows),
        "failures": failures,
        "decode_growth": sorted({(r["arm"], r["context"]) for r in rows
                                 if r.get("status") == "ok" and r.get("decode_growth")}),
    }
    out["claims"] = claims_mod.evaluate_all(list(claims or []), out)
    return out
