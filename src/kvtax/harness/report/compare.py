"""Two runs side by side (two machines, two commits, two engines): same cells, ratio B / A.

Cells are matched by (arm, context); a cell measured in only one run is counted, not
compared. Ratios above 1 mean B is larger (slower, or more memory) than A. Every arm of
both runs is also listed in one table keyed by (engine, arm) (`side_by_side`), so arms
that cannot match — llama.cpp's q8_0/fa against kvtax's int8/fused on the same GGUF —
are read against each other at the contexts both runs measured.

    >>> rows = compare_table(gather(run_a), gather(run_b))
    >>> [r for r in rows if r["metric"] == "decode_ms_per_token"][0]["ratio"]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtax.harness.report.markdown import num, size, table
from kvtax.harness.report.verdict import sentences

# (metric, where in the bench analysis, how to read a cell, is it bytes)
METRICS = (
    ("decode_ms_per_token", "decode_points", lambda p: p["median"], False),
    ("ttft_s", "ttft_points", lambda p: p["median"], False),
    ("prefill_tok_s", "prefill_tok_s", lambda v: v, False),
    ("prefill_peak_bytes", ("peaks", "prefill"), lambda v: v, True),
    ("decode_peak_bytes", ("peaks", "decode"), lambda v: v, True),
    ("cache_bytes", "cache_bytes", lambda v: v, True),
)


def _lookup(a: Mapping[str, Any], where: Any) -> Mapping[str, Any]:
    if isinstance(where, tuple):
        out: Any = a
        for k in where:
            out = out.get(k, {})
        return out
    return a.get(where, {})


def compare_table(da: Mapping[str, Any], db: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One dict per (metric, arm, context) measured in both runs: a, b, ratio = b / a."""
    out: list[dict[str, Any]] = []
    ba, bb = da.get("bench", {}), db.get("bench", {})
    for metric, where, read, _ in METRICS:
        ta, tb = _lookup(ba, where), _lookup(bb, where)
        for arm in sorted(set(ta) & set(tb)):
            for ctx in sorted(set(ta[arm]) & set(tb[arm])):
                va, vb = read(ta[arm][ctx]), read(tb[arm][ctx])
                ratio = vb / va if va not in (None, 0) and vb is not None else None
                out.append({"metric": metric, "arm": arm, "context": ctx, "a": va, "b": vb,
                            "ratio": ratio})
    ga, gb = da.get("recall", {}).get("grid", {}), db.get("recall", {}).get("grid", {})
    for arm in sorted(set(ga) & set(gb)):
        for ctx in sorted(set(ga[arm]) & set(gb[arm])):
            (ca, na), (cb, nb) = ga[arm][ctx], gb[arm][ctx]
            va, vb = ca / na if na else None, cb / nb if nb else None
            out.append({"metric": "recall_accuracy", "arm": arm, "context": ctx, "a": va,
                        "b": vb, "ratio": (vb / va) if va and vb is not None else None,
                        "a_text": f"{ca}/{na}", "b_text": f"{cb}/{nb}"})
    return out


def _cells(d: Mapping[str, Any]) -> set[tuple[str, int]]:
    b = d.get("bench", {})
    cells = {(arm, int(c)) for arm, per in b.get("decode_points", {}).items() for c in per}
    cells |= {(arm, int(c)) for arm, per in b.get("ttft_points", {}).items() for c in per}
    cells |= {(arm, int(c)) for arm, per in d.get("recall", {}).get("grid", {}).items()
              for c in per}
    return cells


def section_compare(da: Mapping[str, Any], db: Mapping[str, Any], rows: list[dict[str, Any]],
                    figs: Mapping[str, str]) -> list[str]:
    ea, eb = da.get("env", {}), db.get("env", {})
    out = [f"# kvtax comparison: A = {da['run_id']}, B = {db['run_id']}", "",
           "Same cells (arm, context) in both runs; ratio = B / A (above 1: B larger).", ""]
    keys = ("device", "torch", "triton", "transformers", "git_commit", "timestamp")
    out += table(["", "A", "B"],
                 [["model", ", ".join(da.get("models", [])), ", ".join(db.get("models", []))],
                  *[[k, ea.get(k, "-"), eb.get(k, "-")] for k in keys],
                  ["command", da.get("command") or "-", db.get("command") or "-"]])
    for name, d in (("A", da), ("B", db)):
        v = d.get("verdict")
        if v and v.get("baseline"):
            out += [f"- **{name}** (best fp16 arm {v['baseline']}): {sentences(v)[0]}"]
    if any(d.get("verdict") for d in (da, db)):
        out += [""]
    only_a, only_b = _cells(da) - _cells(db), _cells(db) - _cells(da)
    if only_a or only_b:
        out += [f"Cells only in A: {len(only_a)}; only in B: {len(only_b)} (not compared).", ""]
    fa, fb = da.get("bench", {}).get("fits", {}), db.get("bench", {}).get("fits", {})
    sa, sb = (da.get("bench", {}).get("slope_ratios", {}),
              db.get("bench", {}).get("slope_ratios", {}))
    common = sorted(set(fa) & set(fb))
    if common:
        out += ["## Decode fits", ""]
        out += table(
            ["arm", "t0 A (ms)", "t0 B (ms)", "m A (ms/1k ctx)", "m B (ms/1k ctx)", "m B/A",
             "slope ratio A", "slope ratio B"],
            [[arm, num(fa[arm]["t0"]), num(fb[arm]["t0"]), num(fa[arm]["m"] * 1e3),
              num(fb[arm]["m"] * 1e3),
              num(fb[arm]["m"] / fa[arm]["m"]) if fa[arm]["m"] else "-",
              num(sa.get(arm, {}).get("measured")), num(sb.get(arm, {}).get("measured"))]
             for arm in common])
    is_bytes = {m: b for m, _, _, b in METRICS}
    for metric in [m for m, *_ in METRICS] + ["recall_accuracy"]:
        mine = [r for r in rows if r["metric"] == metric]
        if not mine:
            continue
        fmt = size if is_bytes.get(metric) else num
        ctxs = sorted({r["context"] for r in mine})
        cells: dict[str, dict[int, str]] = {}
        for r in mine:
            a_txt, b_txt = r.get("a_text") or fmt(r["a"]), r.get("b_text") or fmt(r["b"])
            text = f"{num(r['ratio'])} ({a_txt} → {b_txt})"
            cells.setdefault(r["arm"], {})[r["context"]] = text
        out += [f"## {metric}", "", "Each cell: B / A (A → B).", ""]
        out += table(["arm", *[str(c) for c in ctxs]],
                     [[arm, *[per.get(c, "-") for c in ctxs]] for arm, per in cells.items()])
        if metric in figs:
            out += [f"![{metric} B/A]({figs[metric]})", ""]
    out += section_side_by_side(da, db)
    if not rows:
        out += ["The two runs share no measured cell.", ""]
    return out


def side_by_side(da: Mapping[str, Any], db: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One dict per (run, engine, arm) of both runs: decode ms/token and TTFT medians per
    context both runs measured, the decode fit's slope, KV bytes per token (the engine's
    own) and the slope ratio against that run's own baseline arm."""
    ctxs = set.intersection(*[{int(c) for per in d.get("bench", {}).get("decode_points", {})
                               .values() for c in per} for d in (da, db)])
    out = []
    for run, d in (("A", da), ("B", db)):
        b = d.get("bench", {})
        for arm in sorted(b.get("decode_points", {})):
            dec, ttft = b["decode_points"][arm], b.get("ttft_points", {}).get(arm, {})
            fit = b.get("fits", {}).get(arm)
            out.append({
                "run": run, "engine": b.get("engines", {}).get(arm, {}).get("engine", "kvtax"),
                "version": b.get("engines", {}).get(arm, {}).get("version"), "arm": arm,
                "baseline": arm == b.get("baseline"),
                "decode_ms": {c: dec[c]["median"] for c in sorted(ctxs) if c in dec},
                "ttft_s": {c: ttft[c]["median"] for c in sorted(ctxs) if c in ttft},
                "slope_ms_per_1k": fit["m"] * 1e3 if fit else None,
                "bytes_per_token": b.get("bytes_per_token", {}).get(arm),
                "slope_ratio": b.get("slope_ratios", {}).get(arm, {}).get("measured"),
                "predicted": b.get("slope_ratios", {}).get(arm, {}).get("predicted"),
            })
    return out


def section_side_by_side(da: Mapping[str, Any], db: Mapping[str, Any]) -> list[str]:
    """Markdown: every (engine, arm) of both runs in one table (see `side_by_side`)."""
    rows = side_by_side(da, db)
    ctxs = sorted({c for r in rows for c in r["decode_ms"]})
    if not rows or not ctxs:
        return []
    out = ["## Engines and arms side by side", "",
           "Decode ms/token (median) at the contexts both runs measured; slope ratio against "
           "each run's own baseline arm (marked *), next to the ratio its engine's bytes per "
           "token predict.", ""]
    out += table(
        ["run", "engine", "arm", *[f"{c} ms/tok" for c in ctxs], f"TTFT {ctxs[-1]} (s)",
         "m (ms/1k ctx)", "KV bytes/token", "slope ratio", "bytes predict"],
        [[r["run"], r["engine"] + (f" ({r['version']})" if r["version"] else ""),
          r["arm"] + (" *" if r["baseline"] else ""),
          *[num(r["decode_ms"].get(c)) for c in ctxs], num(r["ttft_s"].get(ctxs[-1])),
          num(r["slope_ms_per_1k"]),
          "-" if r["bytes_per_token"] is None else f"{r['bytes_per_token']:.0f}",
          num(r["slope_ratio"]), num(r["predicted"])]
         for r in rows])
    return out
