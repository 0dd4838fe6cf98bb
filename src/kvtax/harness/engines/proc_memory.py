"""A process's resident memory as an engine's MemoryCounter (Linux /proc).

For engines that allocate outside torch (llama.cpp's ggml buffers, a server process):
the peak of a phase is the process's VmHWM after writing "5" to its `clear_refs` (which
resets VmHWM to the current RSS). Where the kernel does not honour that reset (another
user's process, no permission), a background thread samples VmRSS every `interval_s`
instead: a lower bound on the true peak, said by `kind` ending in "_sampled".

    >>> counter = ProcRSS()              # this process; ProcRSS(pid) for a server
    >>> counter.reset(); run_phase(); counter.peak()   # bytes
"""

from __future__ import annotations

import os
import threading


def _status_bytes(pid: int | str, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _reset_hwm(pid: int | str) -> bool:
    """Reset VmHWM to VmRSS; True only if the kernel really did it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm, rss = _status_bytes(pid, "VmHWM"), _status_bytes(pid, "VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + (1 << 20)


class ProcRSS:
    """Resident bytes of process `pid` (default: this one), peak per phase.

    `kind` is "cpu_rss" for this process, "server_rss" for another; "_sampled" is
    appended when the peak comes from polling rather than the kernel's VmHWM.
    """

    def __init__(self, pid: int | None = None, interval_s: float = 0.005) -> None:
        self.pid: int | str = "self" if pid is None else int(pid)
        self.interval_s = interval_s
        base = "cpu_rss" if pid is None or pid == os.getpid() else "server_rss"
        self.hwm_ok = _reset_hwm(self.pid)
        self.kind = base if self.hwm_ok else base + "_sampled"
        self._sampled: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> int | None:
        """VmRSS now, bytes (None: the process is gone or /proc is absent)."""
        return _status_bytes(self.pid, "VmRSS")

    def reset(self) -> None:
        """Start a phase: the peak becomes the current level."""
        self._halt()
        if self.hwm_ok and _reset_hwm(self.pid):
            return
        self.hwm_ok = False
        self._sampled = self.current()
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def peak(self) -> int | None:
        """Peak bytes since the last reset (VmHWM, or the highest sample)."""
        if self.hwm_ok:
            return _status_bytes(self.pid, "VmHWM")
        now = self.current()
        if now is not None:
            self._sampled = max(self._sampled or 0, now)
        return self._sampled

    def close(self) -> None:
        """Stop the sampling thread, if one runs."""
        self._halt()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = self.current()
            if now is not None:
                self._sampled = max(self._sampled or 0, now)

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
