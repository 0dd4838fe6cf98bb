"""The GPU timer warms up by wall time before timing (a slow window follows heavy work)."""

import time

import torch

from kvtax.harness.bench import gpu_timer
from kvtax.harness.bench.gpu_timer import Timer


class _Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        time.sleep(0.001)


def _timer(warmup_ms: float) -> Timer:
    t = Timer.__new__(Timer)  # no CUDA flush buffer: evict is stubbed below
    t.reps, t.dry, t.mode, t.dry_calls, t.warmup_ms = 5, False, "write", 3, warmup_ms
    t.evict = lambda: None
    return t


def test_warmup_replays_for_the_requested_time(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    g = _Graph()
    t0 = time.perf_counter()
    _timer(30.0)._warm(g)
    assert (time.perf_counter() - t0) * 1e3 >= 30.0
    assert g.replays >= 8


def test_no_warmup_when_zero(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    g = _Graph()
    _timer(0.0)._warm(g)
    assert g.replays == 0


def test_default_is_at_least_do_bench_s():
    assert gpu_timer.WARMUP_MS >= 25  # triton.testing.do_bench warms up 25 ms
