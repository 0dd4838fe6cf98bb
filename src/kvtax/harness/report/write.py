"""`write_report(run_dir)`: report.md, figures and analysis.json from a run folder's rows.

The report is rebuilt from `rows.jsonl`, `config.json` and `env.json` alone, so it can be
regenerated at any time (and for a run still in progress). With `compare=B` it writes
`compare-<B's run id>.md` instead: the two runs side by side, ratio B / A per cell.

    >>> write_report(Path("runs/20260101T000000Z-sweep"), price_per_hour=2.49)
    PosixPath('runs/20260101T000000Z-sweep/report.md')
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvtax.harness.report import plots
from kvtax.harness.quality.tables import section_quality
from kvtax.harness.report.compare import METRICS, compare_table, section_compare
from kvtax.harness.report.data import gather
from kvtax.harness.report.markdown import (
    section_arms,
    section_claims,
    section_cost,
    section_decode,
    section_engine_notes,
    section_environment,
    section_failures,
    section_flagged,
    section_header,
    section_memory,
    section_prefill,
    section_recall,
    section_roofline,
)
from kvtax.harness.report.verdict import section_verdict, sentences
from kvtax.harness.store import read_rows

FIGURES = "figures"


def _figures(data: dict, out: Path, prefix: str = "") -> tuple[dict[str, str], str | None]:
    """Draw the run's figures into out/figures; returns {key: relative path}, and why not."""
    why = plots.plotting_unavailable()
    if why:
        return {}, why
    (out / FIGURES).mkdir(exist_ok=True)
    bench = data.get("bench", {})
    made: dict[str, str] = {}
    jobs = [
        ("decode", lambda p: plots.decode_plot(bench, p)),
        ("memory", lambda p: plots.memory_plot(bench, p)),
        ("ttft", lambda p: plots.ttft_plot(bench, p)),
        ("break_even", lambda p: plots.break_even_plot(data.get("verdict") or {}, bench, p)),
        ("recall", lambda p: plots.recall_plot(data.get("recall", {}).get("grid", {}), p, bench)),
    ]
    for key, draw in jobs:
        path = out / FIGURES / f"{prefix}{key}.png"
        if draw(path) is not None:
            made[key] = f"{FIGURES}/{path.name}"
    return made, None


def write_report(
    run_dir: Path,
    compare: Path | None = None,
    price_per_hour: float | None = None,
    links: Sequence[Path] = (),
) -> Path:
    """Write the report for `run_dir` (or its comparison with `compare`); return its path.
    `links`: run folders whose quality / recall rows feed the verdict's quality columns."""
    run_dir = Path(run_dir)
    if not (run_dir / "rows.jsonl").exists() and not (run_dir / "config.json").exists():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no rows.jsonl or config.json)")
    data = gather(run_dir, price_per_hour, links)
    if compare is not None:
        return _write_compare(run_dir, data, Path(compare), price_per_hour)
    figs, why = _figures(data, run_dir)
    bench = data.get("bench", {})
    lines = section_header(data)
    if why:
        lines += [f"> {why}", ""]
    if data.get("verdict"):
        data["verdict"]["sentences"] = sentences(data["verdict"])
    lines += section_verdict(data.get("verdict"), figs)
    if (data.get("config") or {}).get("engine", "kvtax") == "kvtax":
        lines += section_arms(sorted(bench.get("decode_points", {})))
    lines += section_engine_notes(bench)
    lines += section_decode(bench, figs)
    lines += section_flagged(bench)
    lines += section_prefill(bench, figs)
    lines += section_memory(bench, figs)
    lines += section_cost(bench, price_per_hour)
    lines += section_recall(data["recall"], figs, data["config"])
    lines += section_quality(read_rows(run_dir))
    lines += section_roofline(data["roofline"])
    lines += section_failures(data["failures"])
    lines += section_claims(bench)
    lines += section_environment(data)
    out = run_dir / "report.md"
    out.write_text("\n".join(lines).rstrip() + "\n")
    (run_dir / "analysis.json").write_text(json.dumps(analysis_json(data), indent=1, default=str)
                                           + "\n")
    return out


def analysis_json(data: dict) -> dict:
    """analysis.json: the bench summary's keys at the top (as `kvtax bench` writes them
    without a report), plus what the report adds (recall, roofline, failures of any kind)."""
    out = dict(data.get("bench", {}))
    for key in ("run_id", "command", "models", "counts", "recall", "roofline",
                "price_per_hour", "verdict"):
        out[key] = data.get(key)
    out["failures_all_kinds"] = data.get("failures", [])
    return out


def _write_compare(run_a: Path, da: dict, run_b: Path, price: float | None) -> Path:
    db = gather(run_b, price)
    rows = compare_table(da, db)
    figs: dict[str, str] = {}
    why = plots.plotting_unavailable()
    prefix = f"compare-{db['run_id']}-"
    names = tuple(f"{d['run_id']} ({d.get('env', {}).get('device', '-')})" for d in (da, db))
    if not why:
        (run_a / FIGURES).mkdir(exist_ok=True)
        for metric in [m for m, *_ in METRICS] + ["recall_accuracy"]:
            path = run_a / FIGURES / f"{prefix}{metric}.png"
            if plots.compare_plot(rows, metric, path, names) is not None:
                figs[metric] = f"{FIGURES}/{path.name}"
    lines = section_compare(da, db, rows, figs)
    if why:
        lines += [f"> {why}", ""]
    out = run_a / f"compare-{db['run_id']}.md"
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out
