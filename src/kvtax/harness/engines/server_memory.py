"""Memory of a local server process: its pid found from its listening port, its RSS,
or its GPU memory through NVML.

- `ServerRSS(pid)`: the process's resident bytes and per-phase peak (kind "server_rss").
- `pid_for_port(8001)`: the process listening on TCP port 8001 of this machine, found
  the way `ss -p` does: the socket's inode in /proc/net/tcp{,6}, then the process whose
  /proc/PID/fd holds `socket:[inode]` (None when not visible, e.g. another user's).
- `NvmlCounter(pid)`: GPU memory the pid holds (all GPUs), sampled by a thread, when
  pynvml is installed; `kind` "nvml_process".
"""

from __future__ import annotations

import os
import threading

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


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


class ServerRSS:
    """Resident bytes of process `pid`, peak per phase: its VmHWM after a reset through
    /proc/PID/clear_refs, or, where the kernel does not allow that (another user's
    process), the highest of VmRSS samples taken every `interval_s` by a thread (a lower
    bound; `kind` "server_rss_sampled")."""

    def __init__(self, pid: int, interval_s: float = 0.005) -> None:
        self.pid = int(pid)
        self.interval_s = interval_s
        self.hwm_ok = _reset_hwm(self.pid)
        self.kind = "server_rss" if self.hwm_ok else "server_rss_sampled"
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


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    local, state, inode = cols[1], cols[3], cols[9]
                    if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                        inodes.add(inode)
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return inodes


def pid_for_port(port: int) -> int | None:
    """The pid listening on `port` here, or None."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port) if i != "0"}
    if not inodes:
        return None
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
            except OSError:
                continue
    return None


class NvmlCounter:
    """GPU bytes used by process `pid` on every GPU (NVML), peak by sampling."""

    kind = "nvml_process"

    def __init__(self, pid: int, interval_s: float = 0.01) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.pid, self.interval_s = pynvml, int(pid), interval_s
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]
        self._peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current(self) -> int | None:
        """Bytes the pid holds now across GPUs (None: NVML hides per-process use)."""
        total, seen = 0, False
        for h in self.handles:
            for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(h):
                if proc.pid == self.pid and proc.usedGpuMemory is not None:
                    total, seen = total + int(proc.usedGpuMemory), True
        return total if seen else None

    def reset(self) -> None:
        self.close()
        self._peak = self.current()
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def peak(self) -> int | None:
        now = self.current()
        if now is not None:
            self._peak = max(self._peak or 0, now)
        return self._peak

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
