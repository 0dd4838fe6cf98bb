"""A benchmark script run as a user runs it: `python benchmarks/<script> args...`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python benchmarks/<script> args...` on this tree's kvtax, one intra-op thread;
    stdout / stderr captured as text."""
    path = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, env=env, timeout=timeout)
