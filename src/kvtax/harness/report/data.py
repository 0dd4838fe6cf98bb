"""What a report shows, gathered from one run folder into one JSON-ready dict.

The bench statistics come from `analysis.summarize` (fits, slope ratios, flagged cells,
prefill penalty, break-even, per-phase peaks, claims); this module adds what the report
needs beyond them: resident cache bytes, prefill tokens/s, decode-window growth, the
recall grid (overall and by depth), roofline rows, cost per million generated tokens,
failures of every kind, and the run's config and environment.

    >>> data = gather(Path("runs/20260101T000000Z-sweep"), price_per_hour=2.5)
    >>> data["bench"]["slope_ratios"]["int8/fused"]["measured"]
"""

from __future__ import annotations

import json
import shlex
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtax.harness.analysis import stats
from kvtax.harness.analysis.analyze import summarize
from kvtax.harness.quality.tables import quality_rows
from kvtax.harness.store import CONFIG, ENV, read_rows
from kvtax.harness.analysis.verdict import verdict


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def command_of(config: Mapping[str, Any], env: Mapping[str, Any]) -> str | None:
    """The command that produced the run: config's `command`, else env.json's argv."""
    if config.get("command"):
        return str(config["command"])
    argv = env.get("argv")
    if isinstance(argv, list) and argv:
        args = [str(a) for a in argv]
        if Path(args[0]).name in ("kvtax", "__main__.py", "-m"):
            args = ["kvtax", *args[1:]]
        return shlex.join(args)
    return None


def medians(rows: list[Mapping[str, Any]], metric: str) -> dict[str, dict[int, float]]:
    """arm -> context -> median of `metric` over usable bench rows (no flagging)."""
    pts = stats.points(rows, metric, cv_threshold=float("inf"))
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for p in pts:
        out[p.arm][p.context] = p.median
    return dict(out)


def decode_modes(rows: list[Mapping[str, Any]]) -> dict[str, str]:
    """arm -> "captured" (CUDA graph replay), "eager", or "mixed", from the rows' cuda_graph."""
    seen: dict[str, set[bool]] = defaultdict(set)
    for r in rows:
        if stats.usable(r) and r.get("cuda_graph") is not None:
            seen[str(r["arm"])].add(bool(r["cuda_graph"]))
    return {arm: "mixed" if len(v) > 1 else ("captured" if True in v else "eager")
            for arm, v in sorted(seen.items())}


def recall_tables(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Recall accuracy: arm -> context -> [correct, asked]; arm -> fact -> [c, n] (a fact
    sits at the same planned depth at every context) with each fact's mean measured depth;
    the wrong answers. Arms in run order (the unquantized baseline runs first)."""
    grid: dict[str, dict[int, list[int]]] = {}
    by_fact: dict[str, dict[int, list[int]]] = {}
    depth_sum: dict[int, list[float]] = defaultdict(list)
    wrong: list[dict[str, Any]] = []
    for r in rows:
        if r.get("kind") != "recall" or r.get("status") != "ok" or r.get("warmup"):
            continue
        arm, ctx, ok = str(r["arm"]), int(r["context"]), bool(r.get("correct"))
        fact = int(r.get("fact_index", 0))
        for table, key in ((grid, ctx), (by_fact, fact)):
            cell = table.setdefault(arm, {}).setdefault(key, [0, 0])
            cell[0] += ok
            cell[1] += 1
        depth_sum[fact].append(float(r.get("depth", 0.0)))
        if not ok:
            wrong.append({k: r.get(k) for k in ("arm", "context", "fact_index", "depth",
                                                 "expected", "answer")})
    return {
        "grid": {a: dict(sorted(per.items())) for a, per in grid.items()},
        "by_fact": {a: dict(sorted(per.items())) for a, per in by_fact.items()},
        "fact_depths": {f: sum(d) / len(d) for f, d in sorted(depth_sum.items())},
        "wrong": wrong,
    }


def cost_per_million(decode_points: Mapping[str, Mapping[int, Mapping[str, Any]]],
                     price_per_hour: float) -> dict[str, dict[int, float]]:
    """USD per million generated tokens from decode time alone: price x s/token x 1e6 / 3600."""
    return {
        arm: {ctx: price_per_hour * (p["median"] / 1000.0) * 1e6 / 3600.0
              for ctx, p in sorted(per.items())}
        for arm, per in decode_points.items()
    }


def failures(rows: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every row that is not ok (any kind), one per cell."""
    seen: set[str] = set()
    out = []
    for r in rows:
        if r.get("status") == "ok" or r.get("cell_id") in seen:
            continue
        seen.add(str(r.get("cell_id")))
        out.append({k: r.get(k) for k in ("kind", "arm", "context", "rep", "fact_index",
                                          "status", "phase", "error", "warmup")})
    return out


def roofline_rows(rows: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    keys = ("op", "arm", "context", "time_s", "achieved_gbs", "peak_gbs", "bandwidth_fraction",
            "achieved_tflops", "compute_headroom")
    return [{k: r.get(k) for k in keys} for r in rows
            if r.get("kind") == "roofline" and r.get("status") == "ok" and not r.get("warmup")]


def linked_rows(links: Sequence[Path]) -> list[dict[str, Any]]:
    """Quality and recall rows of linked run folders (`kvtax report RUN --quality Q
    --recall R`), for the verdict's quality columns."""
    out: list[dict[str, Any]] = []
    for link in links:
        out += [r for r in read_rows(Path(link)) if r.get("kind") in ("quality", "recall")]
    return out


def gather(run_dir: Path, price_per_hour: float | None = None,
           links: Sequence[Path] = ()) -> dict[str, Any]:
    """Everything the report shows for `run_dir` (plus the quality / recall rows of
    `links`), as a JSON-ready dict."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir) + linked_rows(links)
    config, env = _json(run_dir / CONFIG), _json(run_dir / ENV)
    bench = [r for r in rows if r.get("kind") == "bench"]
    cv = float(config.get("cv_threshold", stats.DEFAULT_CV))
    data: dict[str, Any] = {
        "run_dir": str(run_dir),
        "run_id": config.get("run_id", run_dir.name),
        "config": config,
        "env": env,
        "command": command_of(config, env),
        "models": sorted({str(r.get("model")) for r in rows if r.get("model")}),
        "counts": _counts(rows),
        "failures": failures(rows),
        "recall": recall_tables(rows),
        "roofline": roofline_rows(rows),
        "price_per_hour": price_per_hour,
    }
    if bench:
        a = summarize(bench, cv_threshold=cv, claims=config.get("claims") or [])
        a["cache_bytes"] = medians(bench, "cache_bytes")
        a["cache_used_bytes"] = medians(bench, "cache_used_bytes")
        a["decode_mode"] = decode_modes(bench)
        a["meta"] = {"model": ", ".join(data["models"]), "device": env.get("device"),
                     "date": str(env.get("timestamp", ""))[:10] or None,
                     "memory_kind": next((r["memory_kind"] for r in bench
                                          if r.get("memory_kind")), None)}
        a["prefill_tok_s"] = medians(bench, "prefill_tok_s")
        if a["flagged"] and a["baseline"]:
            # What the flagged cells would have done to the conclusion.
            dec = stats.points(bench, "decode_ms_per_token", cv_threshold=cv)
            fits = stats.fit_arms(dec, exclude_flagged=False)
            a["slope_ratios_with_flagged"] = {
                arm: r["measured"]
                for arm, r in stats.slope_ratios(fits, a["baseline"], a["bytes_per_token"]).items()
            }
        if price_per_hour is not None:
            a["cost_per_mtok"] = cost_per_million(a["decode_points"], price_per_hour)
        data["bench"] = a
        data["verdict"] = verdict(
            a, env, weight_bytes=max((int(r["weight_bytes"]) for r in bench
                                      if r.get("weight_bytes")), default=None),
            model=", ".join(data["models"]) or "the model",
            quality_rows=quality_rows(rows), recall_grid=data["recall"]["grid"])
    return data


def _counts(rows: list[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        kind = str(r.get("kind"))
        out[kind]["warmup" if r.get("warmup") else str(r.get("status"))] += 1
    return {k: dict(v) for k, v in out.items()}
