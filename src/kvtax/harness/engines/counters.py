"""Memory counters an in-process engine can hand the harness (see base.MemoryCounter).

- `RssCounter`: this process's resident set (Linux: VmRSS; the peak is VmHWM, reset
  through /proc/self/clear_refs). What llama.cpp or any CPU engine in process allocates
  shows up here, weights included; None where the kernel cannot reset the peak.
- `CudaCounter`: bytes torch's caching allocator handed out on one CUDA device.

    >>> c = RssCounter(); c.reset(); run_phase(); c.peak()
"""

from __future__ import annotations

from kvtax.harness.bench import rss


class RssCounter:
    """Process RSS and its per-phase peak (bytes); None where it cannot be measured."""

    kind = "cpu_rss"

    def __init__(self) -> None:
        self.ok = rss.cpu_peak_supported()

    def reset(self) -> None:
        self.ok = self.ok and rss.reset_peak_rss()

    def current(self) -> int | None:
        return rss.rss_bytes() if self.ok else None

    def peak(self) -> int | None:
        return rss.peak_rss_bytes() if self.ok else None


class CudaCounter:
    """torch's allocated bytes on `device` and their peak since `reset`."""

    kind = "cuda_allocated"

    def __init__(self, device: str = "cuda") -> None:
        import torch

        self.torch, self.device = torch, torch.device(device)

    def reset(self) -> None:
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.reset_peak_memory_stats(self.device)

    def current(self) -> int | None:
        return int(self.torch.cuda.memory_allocated(self.device))

    def peak(self) -> int | None:
        self.torch.cuda.synchronize(self.device)
        return int(self.torch.cuda.max_memory_allocated(self.device))
