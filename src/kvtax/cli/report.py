"""`kvtax report RUN_DIR [RUN_DIR_B]`: markdown and PNG figures from a run folder's rows.

One run: RUN_DIR/report.md opens with the verdict (does quantized KV pay off here, against
the best fp16 arm measured: from which context, by how much, the prefill penalty, break-even
tokens, tokens fitting the device's memory, quality when --quality / --recall runs are
given; then which arm answers first per context x 64 / 512 / 4096 generated tokens), then
decode ms/token vs context per arm and its fitted lines
(t0 + m * context, R², slope ratio against fp16 next to the bytes-predicted ratio), noisy
cells flagged and named, TTFT, prefill penalty and break-even generated tokens, peak
memory per phase, the recall grid, failed cells, claims, and the environment and command;
figures go to RUN_DIR/figures/, the numbers to RUN_DIR/analysis.json.

Two runs: RUN_DIR/compare-<B>.md puts the cells both measured side by side, ratio B / A
(e.g. two machines, or two commits on one machine).

The report is written whatever the rows hold; the exit status is 1 when RUN_DIR has no
measured row (every cell failed), so a script cannot mistake a failure table for results.

Examples:
  kvtax report runs/20260101T000000Z-sweep
  kvtax report runs/20260101T000000Z-sweep --price-per-hour 2.49
  kvtax report runs/20260101T000000Z-sweep --quality runs/Q --recall runs/R
  kvtax report runs/A runs/B
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtax.errors import OptionError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="markdown + PNG report of a run folder (or two runs compared)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="run folder (holds rows.jsonl, config.json, env.json)")
    p.add_argument("compare", nargs="?", default=None,
                   help="second run folder: compare its cells with RUN_DIR's (ratio B / A)")
    p.add_argument("--price-per-hour", type=float, default=None, metavar="USD",
                   help="device price in USD per hour: adds cost per million generated tokens "
                        "per arm and context (decode time only)")
    p.add_argument("--quality", action="append", default=[], metavar="RUN_DIR",
                   help="a `kvtax quality` run folder whose KL per format fills the verdict's "
                        "quality column (repeatable; default: the run's own quality rows)")
    p.add_argument("--recall", action="append", default=[], metavar="RUN_DIR",
                   help="a `kvtax recall` run folder whose accuracy per arm fills the "
                        "verdict's recall column (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtax.cli.outcome import ALL_FAILED, OK, report_outcome
    from kvtax.harness.report.write import write_report
    from kvtax.harness.store import read_rows

    for d in filter(None, (args.run_dir, args.compare, *args.quality, *args.recall)):
        if not (Path(d) / "rows.jsonl").exists():
            raise OptionError(f"{d} is not a run folder (no rows.jsonl); pass the folder "
                              "`kvtax bench`, `recall`, `quality` or `roofline` printed")
    if args.price_per_hour is not None and args.price_per_hour < 0:
        raise OptionError("--price-per-hour must be >= 0")
    out = write_report(Path(args.run_dir), Path(args.compare) if args.compare else None,
                       args.price_per_hour,
                       links=[Path(d) for d in (*args.quality, *args.recall)])
    print(f"report: {out}")
    code = report_outcome(read_rows(args.run_dir), f"kvtax report: {args.run_dir}", "rows")
    return ALL_FAILED if code == ALL_FAILED else OK
