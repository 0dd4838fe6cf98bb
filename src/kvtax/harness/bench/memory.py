"""Per-phase peak memory: each phase gets its own peak, never the whole run's.

The seeds' central memory mistake was one peak taken over prefill and decode together
(`mx.get_peak_memory()` over `stream_generate`), which blamed decode for prefill's
transient. Here every phase starts by resetting the counter:

- CUDA: `torch.cuda.reset_peak_memory_stats()` at phase start, `max_memory_allocated()`
  at phase end (bytes the caching allocator handed out, weights included).
- CPU (Linux): writing "5" to `/proc/self/clear_refs` resets the process's peak resident
  set (VmHWM) to its current RSS; VmHWM at phase end is the phase's peak.
- Elsewhere: None (no honest per-phase number exists), never a whole-run peak.

    >>> meter = PhaseMeter(torch.device("cpu"))
    >>> with meter.phase("prefill"): run_prefill()
    >>> meter.peaks["prefill"], meter.baselines["prefill"]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvtax.harness.bench.rss import (  # noqa: F401 - the CPU half, re-exported
    cpu_peak_supported,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)


class PhaseMeter:
    """Measures each phase's peak and its starting level, on one device.

    `peaks[name]` is the phase's peak bytes (CUDA: allocated; CPU: RSS) or None where it
    cannot be measured; `baselines[name]` the level at phase start, so `peak - baseline`
    is what the phase itself added on top of what was already resident.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.cpu_ok = not self.cuda and cpu_peak_supported()
        self.peaks: dict[str, int | None] = {}
        self.baselines: dict[str, int | None] = {}

    @property
    def kind(self) -> str | None:
        """What the numbers count: "cuda_allocated", "cpu_rss" or None."""
        if self.cuda:
            return "cuda_allocated"
        return "cpu_rss" if self.cpu_ok else None

    def start(self, name: str) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baselines[name] = torch.cuda.memory_allocated(self.device)
        elif self.cpu_ok:
            self.cpu_ok = reset_peak_rss()
            self.baselines[name] = rss_bytes() if self.cpu_ok else None
        else:
            self.baselines[name] = None

    def stop(self, name: str) -> int | None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak: int | None = torch.cuda.max_memory_allocated(self.device)
        elif self.cpu_ok:
            peak = peak_rss_bytes()
        else:
            peak = None
        self.peaks[name] = peak
        return peak

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)
