"""Run one cell in a fresh process with a deadline; always come back with a row.

Two ways to get a fresh process:
- `ForkserverExecutor` (default): a server process (`kvtax.harness.bench.forkserver`) imports
  torch and kvtax once, and forks a new child per cell. The child starts clean — no
  allocator state, no CUDA context (the server never initialises CUDA), no tensors from
  an earlier cell — without paying torch's import (seconds) per cell.
- `SubprocessExecutor`: `python -m kvtax.harness.bench.worker` per cell; the fully independent
  interpreter, at the cost of one import per cell.

The parent kills a child that overruns `timeout_s` (row status "timeout"), and a child
that dies without a row (segfault, the kernel's OOM killer) still yields an "error" row
that names the last phase it announced.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from kvtax.harness.lifeline import die_with_parent
from kvtax.harness.schema import base_row, utc_now
from kvtax.harness.bench.worker import PHASE_MARK

def failure_row(cell: dict[str, Any], status: str, phase: str | None, error: str) -> dict[str, Any]:
    row = base_row(
        cell,
        run_id=cell.get("run_id", ""),
        device=cell.get("device_name", cell.get("device", "")),
        git_commit=cell.get("git_commit"),
    )
    row.update(status=status, phase=phase, error=error, timestamp=utc_now())
    return row


def _death_text(code: int | None) -> str:
    if code is None:
        return "worker ended without a result"
    if code < 0:
        sig = -code
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        hint = " (SIGKILL from outside: often the kernel's OOM killer)" if sig == 9 else ""
        return f"worker died from signal {name}{hint} before returning a row"
    return f"worker exited with code {code} before returning a row"


class ForkserverExecutor:
    """Cells in children forked from a preloaded `kvtax.harness.bench.forkserver` process."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.buf = b""

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtax.harness.bench.forkserver"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=dict(os.environ),
            )
            self.buf = b""
        return self.proc

    def _read(self, deadline: float | None) -> dict[str, Any] | None:
        """Next protocol message, None at the deadline; EOFError when the server is gone."""
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError("fork server exited")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, cell: dict[str, Any]) -> dict[str, Any]:
        proc = self._start()
        assert proc.stdin is not None
        try:
            proc.stdin.write((json.dumps(cell, default=str) + "\n").encode())
            proc.stdin.flush()
        except BrokenPipeError:
            self.proc = None
            return self.run(cell)
        phase: str | None = None
        row: dict[str, Any] | None = None
        pid: int | None = None
        deadline = time.monotonic() + self.timeout_s
        timed_out = False
        try:
            while True:
                msg = self._read(None if timed_out else deadline)
                if msg is None:  # deadline passed: kill the child, then collect its exit
                    timed_out = True
                    if pid is not None:
                        kill_group(pid)
                    continue
                if "pid" in msg:
                    pid = msg["pid"]
                elif "phase" in msg:
                    phase = msg["phase"]
                elif "row" in msg:
                    row = msg["row"]
                elif "exit" in msg:
                    status = int(msg["exit"])
                    break
        except EOFError:
            self.proc = None
            return failure_row(cell, "error", phase, "the fork server died during this cell")
        if timed_out:
            return failure_row(
                cell, "timeout", phase, f"cell exceeded its {self.timeout_s:g} s limit"
            )
        if row is not None:
            return row
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return failure_row(cell, "error", phase, _death_text(code))

    def close(self) -> None:
        if self.proc is not None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
            self.proc = None


def kill_group(pid: int) -> None:
    """SIGKILL a cell's process group (the cell leads its own), else the process alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
        return
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class SubprocessExecutor:
    """Cells in `python -m kvtax.harness.bench.worker` subprocesses."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def run(self, cell: dict[str, Any]) -> dict[str, Any]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtax.harness.bench.worker", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
            preexec_fn=die_with_parent,
            start_new_session=True,  # its own group: a timeout kills what it started too
        )
        state: dict[str, Any] = {"phase": None, "tail": []}

        def read_err() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                if line.startswith(PHASE_MARK):
                    state["phase"] = line.split(maxsplit=1)[1].strip()
                else:
                    state["tail"] = (state["tail"] + [line])[-20:]

        reader = threading.Thread(target=read_err, daemon=True)
        reader.start()
        try:
            out, _ = proc.communicate(json.dumps(cell), timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.communicate()
            return failure_row(
                cell, "timeout", state["phase"], f"cell exceeded its {self.timeout_s:g} s limit"
            )
        reader.join(5)
        lines = [ln for ln in out.splitlines() if ln.strip()]
        if lines:
            try:
                return json.loads(lines[-1])
            except json.JSONDecodeError:
                pass
        tail = "".join(state["tail"]).strip()[-1500:]
        return failure_row(
            cell, "error", state["phase"],
            _death_text(proc.returncode) + (f"; stderr: {tail}" if tail else ""),
        )

    def close(self) -> None:
        pass


def make_executor(kind: str, timeout_s: float) -> ForkserverExecutor | SubprocessExecutor:
    if kind == "forkserver":
        return ForkserverExecutor(timeout_s)
    if kind == "subprocess":
        return SubprocessExecutor(timeout_s)
    raise ValueError(f"unknown worker kind {kind!r}; use forkserver or subprocess")
