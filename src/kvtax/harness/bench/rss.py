"""This process's resident set and its peak (Linux /proc), without torch.

Writing "5" to `/proc/self/clear_refs` resets the peak resident set (VmHWM) to the current
RSS, so VmHWM at a phase's end is that phase's peak. Kept apart from `memory` (which needs
torch for CUDA) so that an engine running where torch must not be imported can count too.

    >>> reset_peak_rss(); run_phase(); peak_rss_bytes()
"""

from __future__ import annotations

import os

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kb(field: str) -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Current resident set size of this process (Linux), else None."""
    return _status_kb("VmRSS")


def peak_rss_bytes() -> int | None:
    """Peak RSS since process start or the last `reset_peak_rss()` (Linux), else None."""
    return _status_kb("VmHWM")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    # Some kernels accept the write but ignore it: trust it only if HWM now equals RSS.
    hwm, rss = peak_rss_bytes(), rss_bytes()
    return hwm is not None and rss is not None and hwm <= rss + (1 << 20)


def cpu_peak_supported() -> bool:
    """Whether per-phase CPU peaks can be measured here (Linux with clear_refs)."""
    return os.path.exists(_CLEAR_REFS) and reset_peak_rss()
