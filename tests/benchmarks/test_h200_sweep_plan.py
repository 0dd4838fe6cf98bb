"""benchmarks/h200_sweep.sh --plan: the sweep of record's grid, counted before it runs, in
calls of the default budget; bad arguments exit 2."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "h200_sweep.sh"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(SCRIPT.parents[1] / "src"))
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_plan_counts_the_grid_of_record():
    res = _run("--plan")
    assert res.returncode == 0, res.stderr
    m = re.search(r"planned: (\d+) cells to do \((\d+) to run, (\d+) skipped", res.stdout)
    assert m, res.stdout
    total, run, skipped = map(int, m.groups())
    # 11 arms x (5 contexts x 3 reps + 1 warm-up); only fp8's two baselines are left out.
    assert total == 11 * 16 and run + skipped == total
    assert run == 9 * 16 and skipped == 2 * 16
    assert "fp16/fp16" in res.stdout and "4 call(s) of 470 s" in res.stdout


def test_bad_argument_exits_2():
    res = _run("--nope")
    assert res.returncode == 2 and "unknown argument" in res.stderr
