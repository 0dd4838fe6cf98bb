"""Print the headline of an analysis: fits, slope ratios, flagged cells, failures, claims."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def _num(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else (x if isinstance(x, str) else format(x, fmt))


def print_summary(a: Mapping[str, Any], say: Callable[[str], None] = print) -> None:
    base = a.get("baseline")
    say("")
    say(f"decode ms/token = t0 + m * context   (baseline {base}: the best fp16 arm measured)")
    judged = a.get("baseline_candidates") or {}
    if len(judged) > 1:
        say("  fp16 arms judged by decode ms/token at the largest context: "
            + ", ".join(f"{arm} {ms:.3f}" for arm, ms in sorted(judged.items(),
                                                                  key=lambda kv: kv[1])))
    fits = a.get("fits", {})
    # the arm column fits its longest name (a hybrid one, k4-c64v4@s4r128/fused, is 21)
    named = (*fits, *a.get("decode_points", {}), *a.get("break_even", {}))
    w = max([18, *(len(arm) + 2 for arm in named)])
    say(f"{'arm':<{w}}{'t0 ms':>10}{'m ms/1k ctx':>13}{'R2':>8}{'n':>4}{'slope ratio':>13}"
        f"{'bytes predict':>15}  excluded (flagged)")
    for arm, fit in fits.items():
        sr = a.get("slope_ratios", {}).get(arm, {})
        say(f"{arm:<{w}}{fit['t0']:>10.3f}{fit['m'] * 1e3:>13.4f}{_num(fit['r2'], '.4f'):>8}"
            f"{fit['n']:>4}{_num(sr.get('measured')):>13}{_num(sr.get('predicted')):>15}  "
            f"{fit['excluded'] or ''}")
    for arm in a.get("decode_points", {}):
        if arm not in fits:
            say(f"{arm:<{w}}  no fit: fewer than two unflagged contexts")
    be = a.get("break_even", {})
    if be:
        say("break-even generated tokens vs baseline (0: never slower; never: never pays back)")
        for arm, per in be.items():
            say(f"  {arm:<{w}}" + "  ".join(f"{c}: {v}" for c, v in sorted(per.items())))
    flagged = a.get("flagged", [])
    if flagged:
        say(f"flagged (excluded from fits), robust CV > {a.get('cv_threshold')}:")
        for f in flagged:
            say(f"  {f['arm']} ctx={f['context']} {f['metric']}: {f['reason']}")
    for n in a.get("engine_notes", []):
        say(f"{n['engine']} note ({len(n['arms'])} arm(s)): {n['note']}")
    if a.get("decode_growth"):
        say("cache grew inside the decode window at: "
            + ", ".join(f"{arm}@{ctx}" for arm, ctx in a["decode_growth"]))
    fails = [f for f in a.get("failures", []) if f["status"] not in ("unavailable", "skipped")]
    unavailable: dict[str, str] = {}
    skipped: dict[tuple[str, str], list[int]] = {}
    for f in a.get("failures", []):
        why = (f.get("error") or "").splitlines()[0][:160] if f.get("error") else ""
        if f["status"] == "unavailable":
            unavailable.setdefault(f["arm"], why)
        elif f["status"] == "skipped":
            skipped.setdefault((f["arm"], why), []).append(int(f["context"]))
    for arm, why in unavailable.items():
        say(f"unavailable arm {arm}: {why}")
    for (arm, why), ctxs in skipped.items():
        say(f"skipped {arm} at {sorted(set(ctxs))}: {why}")
    if fails:
        say(f"{len(fails)} cell(s) did not complete:")
        for f in fails[:20]:
            err = (f.get("error") or "").splitlines()[-1:] or [""]
            say(f"  {f['arm']} ctx={f['context']} rep={f['rep']}: {f['status']} "
                f"in {f['phase']}: {err[0][:120]}")
    for c in a.get("claims", []):
        say(f"claim: {c['claim']}: {c['verdict'].upper()} ({c['why']})")
