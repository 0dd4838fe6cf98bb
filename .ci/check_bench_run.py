"""Fail unless a `kvtax bench` run folder holds measured rows, report.md and its PNG plots.

Usage: python3 .ci/check_bench_run.py RUN_DIR   (exit 1 with one line saying what is missing)
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def problems(run: Path) -> list[str]:
    """What the run folder lacks; empty when it holds ok rows, a report and its plots."""
    rows_path = run / "rows.jsonl"
    if not rows_path.is_file():
        return [f"no rows.jsonl in {run}"]
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    status = Counter(r.get("status") for r in rows)
    out = []
    if not status["ok"]:
        errors = Counter(r.get("error") for r in rows if r.get("status") != "ok")
        out.append(f"0 of {len(rows)} rows measured (status {dict(status)}; most common error: "
                   f"{errors.most_common(1)[0][0] if errors else None})")
    if not (run / "report.md").is_file():
        out.append("no report.md")
    pngs = sorted(run.rglob("*.png"))
    if not pngs:
        out.append("no PNG plots")
    report = (run / "report.md").read_text() if (run / "report.md").is_file() else ""
    missing = [p.name for p in pngs if p.name not in report]
    if missing:
        out.append(f"report.md does not show {', '.join(missing)}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(f"check_bench_run: expected one run folder, got {argv}", file=sys.stderr)
        return 1
    run = Path(argv[0])
    found = problems(run)
    if found:
        print(f"check_bench_run: {run}: " + "; ".join(found), file=sys.stderr)
        return 1
    rows = (run / "rows.jsonl").read_text().splitlines()
    ok = sum(json.loads(r).get("status") == "ok" for r in rows if r.strip())
    print(f"check_bench_run: {run}: {ok} of {len(rows)} rows measured, report.md and "
          f"{len(list(run.rglob('*.png')))} plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
