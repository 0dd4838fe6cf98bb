"""Shared pieces of the model/runner tests: one intra-op thread; a benchmark run as a script.

Tiny shapes gain nothing from intra-op threads, and on a busy 2-core runner two threads
per op ran ~15x slower than one (measured: 863 vs 55 ms per tiny-gemma3 decode step).
Import `one_thread` into a test module; it is autouse and restores the setting after.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python benchmarks/<script> args...` on this tree's kvtax, one intra-op thread;
    stdout / stderr captured as text."""
    path = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
