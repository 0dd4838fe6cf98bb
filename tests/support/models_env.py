"""Shared fixture of the model/runner tests: one intra-op thread.

Tiny shapes gain nothing from intra-op threads, and on a busy 2-core runner two threads
per op ran ~15x slower than one (measured: 863 vs 55 ms per tiny-gemma3 decode step).
Import `one_thread` into a test module; it is autouse and restores the setting after.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
