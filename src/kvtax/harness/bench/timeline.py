"""A cell's timeline — setup, prefill, decode — shared by every cell kind.

kvtax's own cells (`harness.bench.cells`), transformers' QuantizedCache cell
(`harness.bench.hf_quantized`) and other engines' cells (`harness.bench.engine_cell`)
enter the same phases, each with its own peak, and time decode the same way.

    >>> tl = Timeline(device, hook, cell)
    >>> tl.start("decode"); samples = decode_loop(step, 64, device); tl.stop("decode")
    >>> finish_decode(tl.out, samples)   # decode_ms_per_token, _median, _samples
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvtax.harness.bench import devinfo
from kvtax.harness.bench.memory import PhaseMeter

PhaseHook = Callable[[str], None]
# An untimed prompt this long (and one decode step) runs before the measured phases, so
# one-off costs (kernel compilation, library initialisation) land outside every window.
WARMUP_TOKENS = 256


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (CUDA); a no-op elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timeline:
    """Phase bookkeeping shared by every cell: hook, peak meter, clocks, timings."""

    def __init__(self, device: torch.device, hook: PhaseHook | None, cell: dict[str, Any],
                 out: dict[str, Any] | None = None, meter: Any = None):
        self.device, self.hook, self.cell = device, hook or (lambda _p: None), cell
        # `meter`: anything with PhaseMeter's kind/start/stop/peaks/baselines (an engine's).
        self.meter = meter if meter is not None else PhaseMeter(device)
        # Filled as phases finish, so a later phase's failure keeps the earlier numbers.
        self.out: dict[str, Any] = {} if out is None else out
        self.out["memory_kind"] = self.meter.kind
        self.current = "setup"

    def enter(self, phase: str) -> None:
        """Announce a phase (the parent records it for crash rows) and apply forced faults."""
        self.current = phase
        self.hook(phase)
        force = self.cell.get("force_oom")
        if force == phase:
            raise torch.OutOfMemoryError(
                f"forced out-of-memory in phase {phase!r} (KVTAX_FORCE_OOM / --force-oom)"
            )

    def start(self, phase: str) -> None:
        """Enter `phase` and open its window: device idle, clocks read, peak counter reset."""
        self.enter(phase)
        sync(self.device)
        self.out.setdefault("clocks_start", devinfo.clocks(self.device))
        self.meter.start(phase)

    def stop(self, phase: str) -> None:
        """Close `phase`'s window: its peak and baseline bytes go into `out`."""
        sync(self.device)
        self.meter.stop(phase)
        self.out[f"{phase}_peak_bytes"] = self.meter.peaks.get(phase)
        self.out[f"{phase}_base_bytes"] = self.meter.baselines.get(phase)
        self.out["clocks_end"] = devinfo.clocks(self.device)


def decode_loop(step: Callable[[], None], n: int, device: torch.device) -> list[float]:
    """Per-token wall times in ms of `n` calls of `step`, synchronizing after every one."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return samples


def finish_decode(out: dict[str, Any], samples: list[float]) -> None:
    """The decode fields of a row from per-token times in ms."""
    out["decode_ms_samples"] = [round(s, 4) for s in samples]
    # Mean, not median: a resize spike inside the window is part of what a user pays.
    out["decode_ms_per_token"] = sum(samples) / len(samples) if samples else None
    out["decode_ms_median"] = sorted(samples)[len(samples) // 2] if samples else None
