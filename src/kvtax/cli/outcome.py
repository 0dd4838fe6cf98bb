"""Exit codes every kvtax command shares, and the one line that says how the work went.

A command's rows are tallied by status: "ok" is measured; "error", "oom" and "timeout" are
failed; "skipped" (a budget choice) and "unavailable" (an arm this machine cannot run) are
neither. Exit 0 when nothing failed, 3 when some work failed, 1 when nothing was measured.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

OK = 0
ALL_FAILED = 1      # the work ran and nothing was measured
BAD_INPUT = 2       # bad options, a kvtax error, an OS error (unwritable --out, missing file)
SOME_FAILED = 3     # some rows measured, some failed
UNEXPECTED = 4      # an error kvtax did not anticipate (a bug): --debug shows the traceback
INTERRUPTED = 130   # Ctrl-C

FAILED_STATUSES = ("error", "oom", "timeout")

EPILOG = """exit status:
  0    every cell/question/point measured (skipped or unavailable arms do not count)
  1    nothing measured: all the work failed, or was skipped (the line on stderr gives
       the counts and the most common error)
  2    bad input: an invalid option, model, format or run folder, or an OS error
       (e.g. an unwritable --out); nothing was run
  3    some work failed and some was measured (the counts are on stderr)
  4    unexpected internal error (run `kvtax --debug ...` for the traceback)
  130  interrupted"""


@dataclass(frozen=True)
class Tally:
    """How the rows of one run came out: counts and the most common failure's text."""

    measured: int
    failed: int
    total: int
    top_error: str = ""
    top_count: int = 0
    not_run: int = 0        # skipped or unavailable rows: neither measured nor failed

    @property
    def exit_code(self) -> int:
        """ALL_FAILED when nothing was measured (no rows, or only failed, skipped or
        unavailable ones), SOME_FAILED when a row failed, else OK."""
        if self.measured == 0:
            return ALL_FAILED
        return SOME_FAILED if self.failed else OK

    def line(self, prog: str, unit: str) -> str:
        """"kvtax bench: 0 of 130 cells measured; 130 failed: error in setup: ..." """
        text = f"{prog}: {self.measured} of {self.total} {unit} measured"
        if self.failed:
            text += f"; {self.failed} failed"
            if self.top_error:
                more = "" if self.top_count == self.failed else f" ({self.top_count} of them)"
                text += f": {self.top_error}{more}"
        if self.not_run:
            text += f"; {self.not_run} skipped or unavailable"
        return text


def _error_text(row: Mapping[str, Any]) -> str:
    """A failure as one short line: status, phase and the error's last line."""
    lines = [x for x in str(row.get("error") or "").splitlines() if x.strip()]
    last = lines[-1].strip() if lines else "no error text"
    phase = row.get("phase")
    return f"{row.get('status')}{f' in {phase}' if phase else ''}: {last[:200]}"


def tally(rows: Iterable[Mapping[str, Any]]) -> Tally:
    """Count measured and failed rows (warm-up rows count like any other)."""
    measured = failed = total = not_run = 0
    errors: Counter[str] = Counter()
    for r in rows:
        total += 1
        status = r.get("status")
        if status == "ok":
            measured += 1
        elif status in FAILED_STATUSES:
            failed += 1
            errors[_error_text(r)] += 1
        else:
            not_run += 1
    top, count = errors.most_common(1)[0] if errors else ("", 0)
    return Tally(measured, failed, total, top, count, not_run)


def report_outcome(rows: Iterable[Mapping[str, Any]], prog: str, unit: str) -> int:
    """Print the tally's line (stderr when anything failed, else stdout); return its code."""
    import sys

    t = tally(rows)
    print(t.line(prog, unit), file=sys.stderr if t.exit_code else sys.stdout, flush=True)
    return t.exit_code
